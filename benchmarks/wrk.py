"""The load generator: wrk (Debian's ``wrk`` package) when installed, else a Python fallback.

``run_load(url, connections=16, duration=10)`` returns requests per second, latency
percentiles and errors. ``limit`` goes on until at least that many answers (wrk: consecutive
runs; the fallback: a per-process share). The fallback
(``python -m benchmarks.wrk``) runs back-to-back keep-alive clients on
:mod:`benchmarks.httpc` in two processes; it needs far more CPU per request than wrk, so
on a 2-core machine its absolute numbers are lower (its ratios still compare servers).
With ``--fresh`` it opens a connection per request (the soak's connection churn).
"""

from __future__ import annotations

import argparse
import re
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

import msgspec
import trio

from benchmarks.httpc import Connection, HttpError
from benchmarks.pollers import quantile
from benchmarks.procs import PY, ROOT, env


def wrk_path() -> str | None:
    return shutil.which("wrk")


def _seconds(text: str) -> float:
    m = re.fullmatch(r"([\d.]+)(us|ms|s|m)", text)
    if not m:
        return float("nan")
    return float(m[1]) * {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0}[m[2]]


def parse_wrk(text: str) -> dict[str, Any]:
    out: dict[str, Any] = {"tool": "wrk"}
    m = re.search(r"Requests/sec:\s+([\d.]+)", text)
    out["rps"] = float(m[1]) if m else 0.0
    m = re.search(r"(\d+) requests in ([\d.]+\w+)", text)
    out["requests"] = int(m[1]) if m else 0
    out["duration_s"] = _seconds(m[2]) if m else 0.0
    for pct in ("50", "99"):
        m = re.search(rf"^\s+{pct}%\s+([\d.]+\w+)", text, re.M)
        out[f"p{pct}_ms"] = round(_seconds(m[1]) * 1000, 3) if m else None
    m = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", text)
    socket_errors = sum(int(x) for x in m.groups()) if m else 0
    m = re.search(r"Non-2xx or 3xx responses: (\d+)", text)
    out["errors"] = socket_errors + (int(m[1]) if m else 0)
    return out


def run_wrk(url: str, connections: int, duration: float, limit: int | None = None
            ) -> dict[str, Any]:
    """One wrk run of ``duration``; with ``limit``, consecutive runs sized from the measured
    rate until at least ``limit`` requests were answered (wrk cannot stop on a count: a Lua
    ``thread:stop()`` leaves its main thread asleep for the whole duration)."""
    if limit is None:
        return _wrk_once(url, connections, duration)
    runs: list[dict[str, Any]] = []
    total = 0
    chunk = 2.0
    while total < limit:
        r = _wrk_once(url, connections, chunk)
        runs.append(r)
        total += r["requests"]
        if r["requests"] == 0:
            break
        rate = r["requests"] / max(r["duration_s"], 0.1)
        chunk = min(60.0, max(1.0, (limit - total) / rate * 1.05))
    wall = sum(r["duration_s"] for r in runs)
    lat = [r for r in runs if r["p99_ms"] is not None]
    return {
        "tool": "wrk", "runs": len(runs), "requests": total, "duration_s": round(wall, 3),
        "rps": round(total / wall, 1) if wall else 0.0,
        "p50_ms": statistics.median(r["p50_ms"] for r in lat) if lat else None,
        "p99_ms": max(r["p99_ms"] for r in lat) if lat else None,
        "errors": sum(r["errors"] for r in runs),
    }


def _wrk_once(url: str, connections: int, duration: float) -> dict[str, Any]:
    wrk = wrk_path()
    assert wrk is not None
    argv = [wrk, "-t1", f"-c{connections}", f"-d{max(1, round(duration))}s", "--latency",
            "--timeout", "10s", url]
    proc = subprocess.run(argv, capture_output=True, text=True, check=False,
                          timeout=duration + 120)
    result = parse_wrk(proc.stdout)
    if proc.returncode != 0:
        result["errors"] = result.get("errors", 0) + 1
        result["stderr"] = proc.stderr[-300:]
    return result


def run_python(url: str, connections: int, duration: float, limit: int | None = None,
               processes: int = 2) -> dict[str, Any]:
    per = [connections // processes + (1 if i < connections % processes else 0)
           for i in range(processes)]
    share = None if limit is None else -(-limit // processes)
    procs = []
    for n in per:
        argv = [PY, "-m", "benchmarks.wrk", "--url", url, "--connections", str(n),
                "--duration", str(duration)]
        if share is not None:
            argv += ["--limit", str(share)]
        procs.append(subprocess.Popen(argv, cwd=ROOT, env=env(), stdout=subprocess.PIPE,
                                      stderr=subprocess.DEVNULL))
    docs = []
    for p in procs:
        out, _ = p.communicate(timeout=duration + 600)
        docs.append(msgspec.json.decode(out.strip().splitlines()[-1]))
    wall = max(d["duration_s"] for d in docs)
    p50s = [d["p50_s"] for d in docs if d["p50_s"] is not None]
    p99s = [d["p99_s"] for d in docs if d["p99_s"] is not None]
    return {
        "tool": f"python ({processes} processes of benchmarks.httpc clients)",
        "requests": sum(d["requests"] for d in docs),
        "duration_s": round(wall, 3),
        "rps": round(sum(d["requests"] for d in docs) / wall, 1) if wall else 0.0,
        # per-process quantiles combined: the median of the medians, the worst p99
        "p50_ms": round(statistics.median(p50s) * 1000, 3) if p50s else None,
        "p99_ms": round(max(p99s) * 1000, 3) if p99s else None,
        "errors": sum(d["errors"] for d in docs),
    }


def run_load(url: str, connections: int = 16, duration: float = 10.0,
             limit: int | None = None) -> dict[str, Any]:
    if wrk_path():
        return run_wrk(url, connections, duration, limit)
    return run_python(url, connections, duration, limit)


# -- the fallback's worker process ---------------------------------------------------------


async def _worker(url: str, connections: int, duration: float, limit: int | None,
                  fresh: bool = False) -> dict[str, Any]:
    """``connections`` back-to-back clients; ``fresh``: each request on a new connection
    that the client closes once it has the answer (as a client without a session does)."""
    split = urlsplit(url)
    assert split.hostname and split.port
    path = split.path or "/"
    latencies: list[float] = []
    errors = 0
    count = 0
    start = trio.current_time()

    async def client(done: trio.CancelScope) -> None:
        nonlocal errors, count
        conn = Connection(split.hostname or "", split.port or 0)
        try:
            while True:
                t0 = trio.current_time()
                try:
                    status, _ = await conn.get(path)
                except HttpError:
                    errors += 1
                    continue
                latencies.append(trio.current_time() - t0)
                count += 1
                if fresh:
                    await conn.aclose()
                if status != 200:
                    errors += 1
                if limit is not None and count >= limit:
                    done.cancel()
        finally:
            with trio.CancelScope(shield=True):
                await conn.aclose()

    with trio.move_on_after(duration if limit is None else 3600):
        async with trio.open_nursery() as nursery:
            for _ in range(connections):
                nursery.start_soon(client, nursery.cancel_scope)
    ordered = sorted(latencies)
    # quantiles, not the samples: the output must stay small (a pipe holds 64 KB)
    return {"requests": count, "errors": errors, "duration_s": trio.current_time() - start,
            "p50_s": quantile(ordered, 0.5), "p99_s": quantile(ordered, 0.99)}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.wrk")
    p.add_argument("--url", required=True)
    p.add_argument("--connections", type=int, default=8)
    p.add_argument("--duration", type=float, default=10.0)
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--fresh", action="store_true", help="a new connection per request")
    args = p.parse_args(argv)
    t0 = time.monotonic()
    doc = trio.run(_worker, args.url, args.connections, args.duration, args.limit, args.fresh)
    doc["wall_s"] = time.monotonic() - t0
    sys.stdout.write(msgspec.json.encode(doc).decode() + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
