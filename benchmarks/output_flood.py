"""Output flood: nvpair's read path while its managed engines write as fast as they can
(docs/lifecycle.md, "An engine that floods its output").

Two ``nvpair serve`` run side by side, each with two managed engines:

* the **quiet** node's engines sleep (they write nothing);
* the **flood** node's engines are ``yes`` (a 2-byte line, as fast as the pipe takes it)
  and a Python loop writing 64 KiB lines as fast as it can.

First the quiet node alone is read (``/healthz`` and ``/v1/models`` in turn, one
keep-alive connection, back to back) for ``flood_s``; then, once the flood node says it
drops lines, both are read for ``flood_s``, a request to one and then the same to the
other, so that both see the same machine. Reported: p50/p99/max of each path on each
node and phase, the flood node's CPU, its loop lag, what it dropped and its log files'
size. Target: the flood node's p99 within 2x of the quiet node's and under 20 ms, its
max under 50 ms.

``python -m benchmarks.output_flood [--quick]``, or ``python -m benchmarks --only
output_flood``.
"""

from __future__ import annotations

import http.client
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.config import BenchConfig, run_alone
from benchmarks.procs import PY, CpuMeter, Procs, free_port, get_json, start_nvpair
from benchmarks.scale import loop_lag

PATHS = ("/healthz", "/v1/models")
#: a Python loop writing 64 KiB lines as fast as the pipe takes them
WIDE_LINES = ("import sys\nline = b'x' * 65536 + b'\\n'\n"
              "while True: sys.stdout.buffer.write(line)")


def engine(name: str, port: int, command: list[str]) -> str:
    return (f"[[engines]]\nname = '{name}'\nkind = 'openai'\nmodel = '{name}'\n"
            f"port = {port}\nmanaged = true\nstartup_budget_s = 3600\n"
            f"command = {json.dumps(command)}\n")


class Reader:
    """One keep-alive connection to a node; each read's latency, by path."""

    def __init__(self, url: str) -> None:
        host, port = url.removeprefix("http://").split(":")
        self.conn = http.client.HTTPConnection(host, int(port), timeout=10)
        self.ms: dict[str, list[float]] = {p: [] for p in PATHS}

    def read(self, path: str) -> None:
        started = time.perf_counter()
        self.conn.request("GET", path)
        response = self.conn.getresponse()
        response.read()
        if response.status != 200:
            raise RuntimeError(f"GET {path}: {response.status}")
        self.ms[path].append((time.perf_counter() - started) * 1000)

    def summary(self) -> dict[str, Any]:
        return {path: _stats(ms) for path, ms in self.ms.items()}


def _stats(ms: list[float]) -> dict[str, Any]:
    ms = sorted(ms)
    return {"n": len(ms), "p50_ms": round(statistics.median(ms), 2),
            "p99_ms": round(ms[min(len(ms) - 1, int(len(ms) * 0.99))], 2),
            "max_ms": round(ms[-1], 2)}


def read_for(seconds: float, readers: list[Reader]) -> None:
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        for path in PATHS:
            for reader in readers:
                reader.read(path)


def run(cfg: BenchConfig, workdir: Path) -> dict[str, Any]:
    seconds = 8.0 if cfg.quick else 20.0
    with Procs(workdir) as procs:
        sleep = ["sleep", "100000"]
        _, quiet_url, _ = start_nvpair(procs, "nvpair-quiet", engine("q1", free_port(), sleep)
                                       + engine("q2", free_port(), sleep))
        quiet = Reader(quiet_url)
        read_for(1.0, [quiet])  # (warm-up: imports, first encodes)
        quiet = Reader(quiet_url)
        read_for(seconds, [quiet])
        alone = quiet.summary()

        lag = workdir / "looplag-flood.jsonl"
        flood_proc, flood_url, _ = start_nvpair(
            procs, "nvpair-flood", engine("yes", free_port(), ["yes", "{model}"])
            + engine("wide", free_port(), [PY, "-c", WIDE_LINES]), loop_lag=lag)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # until both engines' drops are said
            doc = get_json(f"{flood_url}/v1/engines")
            if all(e["log"]["dropping"] for e in doc["engines"]):
                break
            time.sleep(0.2)
        else:
            raise RuntimeError(f"the flood node never said it drops lines: {doc}")
        quiet, flood = Reader(quiet_url), Reader(flood_url)
        meter = CpuMeter(flood_proc.pid)
        since = time.time()
        read_for(seconds, [flood, quiet])
        until = time.time()
        cpu = meter.read()
        engines = {e["name"]: e["log"] for e in get_json(f"{flood_url}/v1/engines")["engines"]}
        logs = sum(p.stat().st_size for p in (workdir / "logs").glob("*.log*"))
        out: dict[str, Any] = {
            "seconds_each": seconds,
            "quiet_alone": alone,
            "quiet_during_flood": quiet.summary(),
            "flood": flood.summary(),
            "flood_node_cpu": cpu,
            "flood_node_loop_lag": loop_lag(lag, since, until),
            "flood_engines_log": engines,
            "log_files_bytes": logs,
        }
        out["ratios_p99"] = {path: round(out["flood"][path]["p99_ms"]
                                         / alone[path]["p99_ms"], 2) for path in PATHS}
        out["target_met"] = all(
            out["flood"][p]["p99_ms"] <= 2 * alone[p]["p99_ms"]
            and out["flood"][p]["p99_ms"] < 20 and out["flood"][p]["max_ms"] < 50
            for p in PATHS)
        return out


if __name__ == "__main__":
    sys.exit(run_alone("python -m benchmarks.output_flood", run))
