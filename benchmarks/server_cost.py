"""Scenario "server_cost": what nvpair's HTTP server itself costs, beside hypercorn's.

The same bare ASGI app answers the same bytes (a ``/v1/models`` of 1,024 engines, 190 KB,
and one engine's status, 1 KB) once through ``hypercorn.trio.serve`` and once through
``nvpair.http.server.serve`` (hypercorn's HTTP with nvpair's connection handling: deadlines,
the cap, closing what clients closed, one keep-alive timer task per connection). Each is a
process of its own (:mod:`benchmarks.floor` ``--server``), under 8 back-to-back clients
(:mod:`benchmarks.pollers`) for ``window`` seconds, alternating, ``rounds`` times (this
machine is shared: what counts is the ratio within a round).

``python -m benchmarks.server_cost [--quick]`` runs it alone and prints the numbers.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchmarks.config import BenchConfig, run_alone
from benchmarks.procs import PY, Procs, free_port, wait_http

SERVERS = ("hypercorn", "nvpair")


def _bodies(workdir: Path) -> list[str]:
    models = {"object": "list", "data": [
        {"id": f"model-{i:04d}", "object": "model", "created": 0, "owned_by": "sglang",
         "nvpair": {"engine": f"e{i:04d}", "node": "node-1", "state": "ready",
                    "checked_age_s": 1.25}} for i in range(1024)]}
    status = {"name": "e0000", "state": "ready", "note": "x" * 900}
    routes = []
    for path, doc in (("/v1/models", models), ("/v1/engines/e0000", status)):
        file = workdir / f"server-cost{path.replace('/', '_')}.json"
        file.write_bytes(json.dumps(doc).encode())
        routes += ["--route", f"{path}={file}"]
    return routes


def _load(url: str, window_s: float) -> dict[str, Any]:
    out = subprocess.run(
        [PY, "-m", "benchmarks.pollers", "--target", f"x={url}#e0000", "--clients", "8",
         "--poll", "", "--duration", str(window_s), "--timeout", "10"],
        capture_output=True, text=True, check=True, timeout=window_s + 60).stdout
    models = json.loads(out.strip().splitlines()[-1])["targets"]["x"]["models"]
    return {"requests_per_s": round(2 * models["ok"] / window_s),
            "p50_ms": models["p50_ms"], "p99_ms": models["p99_ms"]}


def run(cfg: BenchConfig, workdir: Path) -> dict[str, Any]:
    """The scenario (``workdir``: the bodies and the servers' logs)."""
    window_s, rounds = (2.0, 1) if cfg.quick else (8.0, 3)
    routes = _bodies(workdir)
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in SERVERS}
    with Procs(workdir) as procs:
        for r in range(rounds):
            for server in SERVERS:
                port = free_port()
                proc = procs.start(f"server-{server}-{r}", [
                    PY, "-m", "benchmarks.floor", "--listen", f"127.0.0.1:{port}",
                    "--server", server, *routes])
                url = f"http://127.0.0.1:{port}"
                wait_http(f"{url}/healthz", proc)
                runs[server].append(_load(url, window_s))
                procs.items.remove(proc)
                proc.stop()
    ratio = [round(n["requests_per_s"] / h["requests_per_s"], 3)
             for h, n in zip(runs["hypercorn"], runs["nvpair"], strict=True)]
    return {"window_s": window_s, "rounds": rounds, "runs": runs,
            "nvpair_over_hypercorn_requests": ratio,
            "median_ratio": statistics.median(ratio)}


def main(argv: list[str] | None = None) -> int:
    return run_alone("python -m benchmarks.server_cost", run, argv)


if __name__ == "__main__":
    sys.exit(main())
