"""A restart of nvpair with managed engines: ``on_exit = "keep"`` against ``"stop"``.

``python -m benchmarks.restart [--quick]``

One ``nvpair serve`` manages ENGINES vLLM simulators, each loading its model for
``--load-s`` (LOAD_S; a stand-in for a real load: a 7-8B model takes vLLM tens of seconds
from disk, a large one minutes). Once every engine is ready, nvpair gets SIGTERM and a new
nvpair starts with the same config. Measured, for each of ``keep`` and ``stop``:

* **back**: seconds from the new nvpair's spawn until every engine reads ``ready`` in its
  status (and from its API's first answer, ``after_api_s``);
* **stall**: the longest read (``GET /v1/models``, ``GET /v1/engines``, in turn on one
  keep-alive connection) from its API's first answer until every engine is ready, and at
  least WINDOW_S (an adoption is over in milliseconds: the window holds the first probes
  and sweeps too); beside it the new nvpair's longest loop lag over that time (its
  ``NVPAIR_LOOP_LAG_FILE`` probe), which tells nvpair's own stalls from the machine's
  (16 simulators starting on a small machine take its cores);
* **adopted**: engines with the pid they had before the restart (keep: all of them).

``saved_s`` is what keep saves against stop: the engines' own load, and their process
start. Writes ``benchmarks/results/restart.json`` (``restart-quick.json`` with ``--quick``).
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.procs import PY, ROOT, Proc, Procs, free_port, get_json, machine, request

ENGINES = 16
#: reads go on at least this long after the new nvpair's API answers
WINDOW_S = 3.0
LOAD_S = 20.0
QUICK_LOAD_S = 5.0


def config(workdir: Path, on_exit: str, load_s: float, ports: list[int]) -> Path:
    text = (f"listen = '127.0.0.1:{free_port()}'\nnode = 'bench'\n"
            f"state_dir = '{workdir / on_exit / 'state'}'\n"
            f"log_dir = '{workdir / on_exit / 'logs'}'\non_exit = '{on_exit}'\n")
    for i, port in enumerate(ports):
        argv = [PY, "-m", "nvpair.sim", "vllm", "--model", f"m{i}", "--port", str(port),
                "--load-s", str(load_s), "--warmup-s", "0", "--no-control",
                "--log-level", "WARNING"]
        text += (f"[[engines]]\nname = 'e{i}'\nkind = 'vllm'\nport = {port}\nmodel = 'm{i}'\n"
                 f"managed = true\nstop_grace_s = 5\ncommand = {json.dumps(argv)}\n"
                 "[engines.probes.ready]\ninterval_s = 0.5\ntimeout_s = 0.5\n")
    path = workdir / f"{on_exit}.toml"
    path.write_text(text)
    return path


def url_of(path: Path) -> str:
    listen = path.read_text().split("listen = '")[1].split("'")[0]
    return f"http://{listen}"


def engines(url: str) -> list[dict[str, Any]]:
    doc: list[dict[str, Any]] = get_json(f"{url}/v1/engines")["engines"]
    return doc


def until_api(url: str, proc: Proc, within: float = 60.0) -> float:
    started = time.monotonic()
    while time.monotonic() - started < within:
        if not proc.alive():
            raise RuntimeError(f"nvpair exited:\n{proc.tail()}")
        with contextlib.suppress(OSError, http.client.HTTPException):
            if request("GET", f"{url}/healthz", timeout=1.0)[0] == 200:
                return time.monotonic()
        time.sleep(0.01)
    raise RuntimeError(f"nvpair did not answer within {within:g} s:\n{proc.tail()}")


def until_ready(url: str, within: float) -> tuple[float, dict[str, int]]:
    """When every engine is ready, and their pids."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        now = engines(url)
        if all(e["state"] == "ready" for e in now):
            return time.monotonic(), {e["name"]: e["pid"] for e in now}
        time.sleep(0.01)
    raise RuntimeError(f"not every engine was ready within {within:g} s")


class Reads:
    """Reads in a thread of their own until ``stop``: the longest one, and how many."""

    def __init__(self, url: str) -> None:
        host, port = url.removeprefix("http://").split(":")
        self.conn = http.client.HTTPConnection(host, int(port), timeout=30)
        self.longest = 0.0
        self.count = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        while not self.stop.is_set():
            for path in ("/v1/models", "/v1/engines"):
                started = time.monotonic()
                self.conn.request("GET", path)
                response = self.conn.getresponse()
                response.read()
                self.longest = max(self.longest, time.monotonic() - started)
                self.count += 1

    def __enter__(self) -> Reads:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(30)
        self.conn.close()


def one(procs: Procs, workdir: Path, on_exit: str, load_s: float) -> dict[str, Any]:
    ports = [free_port() for _ in range(ENGINES)]
    path = config(workdir, on_exit, load_s, ports)
    url = url_of(path)
    argv = [PY, "-m", "nvpair", "serve", "--config", str(path)]
    first = procs.start(f"nvpair-{on_exit}-1", argv)
    try:
        until_api(url, first)
        _at, before = until_ready(url, load_s * 4 + 60)
        first.stop(grace=30)  # SIGTERM: keep leaves the engines, stop stops them
        spawned = time.monotonic()
        lag = workdir / f"looplag-{on_exit}.jsonl"
        second = procs.start(f"nvpair-{on_exit}-2", argv,
                             extra_env={"NVPAIR_LOOP_LAG_FILE": str(lag)})
        api = until_api(url, second)
        with Reads(url) as reads:
            ready, after = until_ready(url, load_s * 4 + 60)
            time.sleep(max(0.0, api + WINDOW_S - time.monotonic()))
            time.sleep(1.1)  # (the loop-lag probe writes once a second)
        lags = [json.loads(line) for line in lag.read_text().splitlines()] \
            if lag.exists() else []
        return {"back_s": round(ready - spawned, 3), "after_api_s": round(ready - api, 3),
                "stall_ms": round(reads.longest * 1000, 2), "reads": reads.count,
                "loop_lag_ms": max((x["max_ms"] for x in lags), default=None),
                "adopted": sum(after[n] == before[n] for n in before)}
    finally:
        if on_exit == "keep":  # what SIGTERM left running (the nvpair that runs, or none)
            subprocess.run([PY, "-m", "nvpair", "stop-engines", "--config", str(path),
                            "--url", url], cwd=ROOT, capture_output=True, timeout=120,
                           check=False)


def run(quick: bool) -> dict[str, Any]:
    load_s = QUICK_LOAD_S if quick else LOAD_S
    with tempfile.TemporaryDirectory(prefix="nvpair-bench-restart-") as tmp, \
            Procs(Path(tmp)) as procs:
        keep = one(procs, Path(tmp), "keep", load_s)
        procs.close()
        stop = one(procs, Path(tmp), "stop", load_s)
    result: dict[str, Any] = {
        "machine": machine(), "quick": quick, "engines": ENGINES, "load_s": load_s,
        "keep": keep, "stop": stop, "saved_s": round(stop["back_s"] - keep["back_s"], 3)}
    result["targets"] = {
        "keep: every engine adopted (no reload)": keep["adopted"] == ENGINES,
        "keep: back before one load": keep["back_s"] < load_s,
        "keep: longest read under 100 ms": keep["stall_ms"] < 100,
    }
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    result = run(args.quick)
    out = ROOT / "benchmarks" / "results" / ("restart-quick.json" if args.quick
                                               else "restart.json")
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("keep", "stop", "saved_s")}, indent=1))
    for target, met in result["targets"].items():
        print(f"{target}: {'met' if met else 'NOT met'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
