"""Scenario "memwatch": what the memory watch costs per engine per tick, at K = 256.

256 real processes (``sleep``, each the leader of its own session, so each a managed
engine's process group of one) stand for 256 engines; a ``MemoryWatch`` over a board of
256 ready managed engines is driven tick by tick in-process. Measured per tick: the
worker thread's reads (``/proc/PID/status`` of each process, the node's files), the loop's
part (the trend of every engine and the node, one publish), and a tick with the membership
rescan (a ``/proc`` scan). The target (docs/memory.md): at most 0.5 ms per engine per tick.

``python -m benchmarks.memwatch [--quick]`` runs it alone and prints the numbers.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import trio

from benchmarks.config import BenchConfig, run_alone

K = 256
TARGET_US = 500.0
#: ticks this far apart: the detector's 1-s buckets close once in 40 ticks (at the
#: defaults, 10-min buckets and 15-s ticks, likewise)
SPACING_S = 0.025


def _settings(workdir: Path, k: int) -> Any:
    from nvpair.config.settings import load_settings

    text = "listen = '127.0.0.1:0'\n[memory]\ninterval_s = 0.01\nwindow_h = 0.01\n"
    for i in range(k):
        text += (f"[[engines]]\nname = 'e{i}'\nkind = 'vllm'\nport = {20000 + i}\n"
                 "managed = true\ncommand = ['x']\n")
    path = workdir / "memwatch.toml"
    path.write_text(text)
    return load_settings(str(path))


async def _measure(workdir: Path, pids: list[int], ticks: int) -> dict[str, Any]:
    from nvpair.state.snapshot import Board
    from nvpair.state.transitions import initial_state
    from nvpair.supervision import memproc
    from nvpair.supervision.memwatch import MemoryWatch, collect

    k = len(pids)
    settings = _settings(workdir, k)
    board = Board(tuple(initial_state(s) for s in settings.engines))
    for spec, pid in zip(settings.engines, pids, strict=True):
        board.update(spec.name, lambda e, pid=pid: msgspec.structs.replace(
            e, pid=pid, state="ready", checked_at=trio.current_time()))
    watch = MemoryWatch(settings.memory, board, settings.engines, rescan_s=1e9)
    t0 = time.perf_counter()
    await watch.tick()  # the first tick rescans
    first_s = time.perf_counter() - t0
    loop, thread, total = [], [], []
    for _ in range(ticks):
        plans = watch.plans(False)
        t0 = time.perf_counter()
        reads, node = collect(plans, False, memproc.PROC, None)
        t1 = time.perf_counter()
        watch.apply(reads, node, trio.current_time())
        t2 = time.perf_counter()
        thread.append(t1 - t0)
        loop.append(t2 - t1)
        total.append(t2 - t0)
        await trio.sleep(SPACING_S)  # a bucket closes every 40 ticks, as at the defaults
    t0 = time.perf_counter()
    entries = memproc.scan()
    scan_s = time.perf_counter() - t0
    errors = sum(1 for e in board.current.engines if e.memory is None or e.memory.error)

    def us(xs: list[float]) -> dict[str, float]:
        xs = sorted(xs)
        return {"median_us_per_engine": round(statistics.median(xs) / k * 1e6, 2),
                "p99_us_per_engine": round(xs[min(len(xs) - 1, int(len(xs) * 0.99))] / k * 1e6,
                                           2)}

    loop_doc = us(loop)
    return {"k": k, "ticks": ticks, "loop": loop_doc, "thread": us(thread),
            "total": us(total), "first_tick_with_rescan_ms": round(first_s * 1000, 2),
            "proc_scan_ms": round(scan_s * 1000, 2), "processes_scanned": len(entries),
            "engines_with_errors": errors, "target_us_per_engine": TARGET_US,
            "met": loop_doc["p99_us_per_engine"] <= TARGET_US
            and us(total)["median_us_per_engine"] <= TARGET_US}


def run(cfg: BenchConfig, workdir: Path) -> dict[str, Any]:
    """The scenario (``workdir``: where its config goes)."""
    ticks = 20 if cfg.quick else 200
    procs = [subprocess.Popen(["sleep", "600"], start_new_session=True) for _ in range(K)]
    try:
        return trio.run(_measure, workdir, [p.pid for p in procs], ticks)
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


def main(argv: list[str] | None = None) -> int:
    return run_alone("python -m benchmarks.memwatch", run, argv)


if __name__ == "__main__":
    sys.exit(main())
