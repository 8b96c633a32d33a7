"""Scenario "metrics": how long ``/metrics`` takes to render at K engines, and what counting
every API request costs.

In-process, no sockets: the render is pure work on the event loop (what a scrape holds it
for), measured on a snapshot of K engines with four probes each (failures and timeouts
counted, so every probe has its three series), router answers of three codes per engine, 8
peers and 40 API (route, code) pairs. The counting cost is ``Api.__call__`` (which counts)
against ``Api.route`` (which does not) for the same ``GET /healthz``.

``python -m benchmarks.metrics [K ...]`` prints the numbers for chosen engine counts.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import trio

from benchmarks.config import BenchConfig
from nvpair.base.histogram import SWEEP_BUCKETS_S, Histogram
from nvpair.http.api import Api
from nvpair.http.metrics import Metrics
from nvpair.state.snapshot import Board, EngineState, ProbeStats
from nvpair.state.traffic import Traffic

KS = (16, 256)
RENDERS = 200
CALLS = 20_000


class _Peers:
    version = 1

    def states(self, now: float) -> dict[str, str]:
        return {f"node-{i}": "fresh" for i in range(8)}


def build(k: int, now: float) -> Metrics:
    probes = tuple((p, ProbeStats(path=f"/{p}", requests=1000, failures=20, timeouts=5,
                                  latency_ms_total=2500.0))
                   for p in ("ready", "health", "identity", "models"))
    engines = tuple(EngineState(name=f"engine-{i:04d}", kind="vllm",
                                url=f"http://127.0.0.1:{20000 + i}", managed=False,
                                state="ready", checked_at=now - 1.0, probes=probes)
                    for i in range(k))
    traffic = Traffic()
    for i in range(k):
        for code in (200, 429, 502):
            traffic.answered(f"engine-{i:04d}", code, now - 0.5, now - 0.2)
    sweep = Histogram(SWEEP_BUCKETS_S)
    sweep.observe(0.3)
    m = Metrics(Board(engines), traffic, node="bench", peers=_Peers(), sweep=sweep)
    for i in range(20):
        m.api[(f"/route-{i}", 200)] = 1000
        m.api[(f"/route-{i}", 404)] = 10
    return m


def _ms(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    return {"p50_ms": round(statistics.median(xs) * 1000, 3),
            "p99_ms": round(xs[int(len(xs) * 0.99) - 1] * 1000, 3),
            "max_ms": round(xs[-1] * 1000, 3)}


async def _render(k: int) -> dict[str, Any]:
    now = trio.current_time()
    m = build(k, now)
    snap = m.board.current
    wall = time.time()  # the same moment as now, as in a scrape
    body = m.render(snap, now, wall)
    times, cold = [], []
    engines = snap.engines
    for i in range(RENDERS):
        # as in a real second: a quarter of the engines probed since the last render
        step = len(engines) // 4 or 1
        part = range((i * step) % len(engines), (i * step) % len(engines) + step)
        snap = msgspec.structs.replace(snap, engines=tuple(
            msgspec.structs.replace(e, restarts=i) if j in part else e
            for j, e in enumerate(engines)))
        t0 = time.perf_counter()
        m.render(snap, now, wall)
        times.append(time.perf_counter() - t0)
        m._frags = {}  # every engine changed (the first render, or a restart of all)
        t0 = time.perf_counter()
        m.render(snap, now, wall)
        cold.append(time.perf_counter() - t0)
    m.body()
    t0 = time.perf_counter()
    for _ in range(RENDERS):
        m.body()  # the cache: one render a second at most
    hit = (time.perf_counter() - t0) / RENDERS
    lines = body.count(b"\n")
    return {"k": k, "lines": lines, "bytes": len(body), **_ms(times),
            "all_changed": _ms(cold),
            "us_per_line": round(statistics.median(times) / lines * 1e6, 3),
            "cached_us": round(hit * 1e6, 3)}


async def _counting() -> dict[str, Any]:
    api = Api(Board(()), node="bench", metrics=Metrics(Board(()), node="bench"))
    scope = {"type": "http", "method": "GET", "path": "/healthz", "headers": [],
             "query_string": b""}

    async def receive() -> dict[str, Any]:
        return {"type": "http.disconnect"}

    async def send(message: Any) -> None:
        return None

    async def timed(call: Any) -> float:
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(CALLS // 5):
                await call(scope, receive, send)
            best = min(best, (time.perf_counter() - t0) / (CALLS // 5))
        return best

    bare, counted = await timed(api.route), await timed(api)
    return {"route_us": round(bare * 1e6, 3), "call_us": round(counted * 1e6, 3),
            "counting_us": round((counted - bare) * 1e6, 3),
            "counted": sum(api.requests.values())}


def measure(ks: tuple[int, ...] = KS) -> dict[str, Any]:
    async def main() -> dict[str, Any]:
        return {"by_k": [await _render(k) for k in ks], "api_counting": await _counting()}
    return trio.run(main)


def run(cfg: BenchConfig, workdir: Path) -> dict[str, Any]:
    """The scenario (same in the quick run: it takes well under a second)."""
    return measure()


if __name__ == "__main__":
    ks = tuple(int(a) for a in sys.argv[1:]) or KS
    for key, value in measure(ks).items():
        print(key, value)
