"""Scenario "listing_cost": the CPU one ``/v1/models`` rebuild takes, in this process.

A board of ``listing_engines`` engines with one model each (SGLang-like, K = 1,024), and
one of 10 engines with ``models_per_engine`` models each (Ollama-like), are built in
memory; then, timed with the thread's CPU clock (``time.thread_time``):

* ``one_changed``: one engine's listed fields change, the ages stay (the rebuild a
  probe result that moved the listing costs between two age buckets);
* ``ages_moved``: nothing changes but the moment the ages are read at (every 0.5 s);
* ``catalog``: the model items alone brought up to date after one engine changed.

Each is the median over ``listing_rebuilds`` rebuilds, in ms, and per engine in µs.
``python -m benchmarks.listing_cost [--quick]`` runs it alone and prints the numbers.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import msgspec
import trio
import trio.testing

from benchmarks.config import BenchConfig, run_alone
from nvpair.state.listing import ModelsBody, catalog
from nvpair.state.snapshot import Board, EngineState, Model


def _board(engines: int, models: int) -> Board:
    names = [f"e{i:04d}" for i in range(engines)]
    board = Board(tuple(EngineState(name=n, kind="sglang", url="http://127.0.0.1:1",
                                    managed=False, overdue_after_s=30.0) for n in names))
    for i, n in enumerate(names):
        listed = tuple(Model(f"org/model-{i}-{j}") for j in range(models))
        board.update(n, lambda e, listed=listed: msgspec.structs.replace(
            e, state="ready", models=listed, checked_at=trio.current_time()))
    return board


def _flip(board: Board, j: int) -> None:
    name = board.current.engines[(j * 7) % len(board.current.engines)].name
    board.update(name, lambda e: msgspec.structs.replace(e, models_stale=not e.models_stale))


def _median_ms(times: list[float]) -> float:
    return round(statistics.median(times) * 1000, 3)


async def _measure(engines: int, models: int, rebuilds: int) -> dict[str, Any]:
    board = _board(engines, models)
    body = ModelsBody("node")
    now = trio.current_time()
    body.parts(board, now, ages_at=now)
    runs: dict[str, list[float]] = {"one_changed": [], "ages_moved": [], "catalog": []}
    for j in range(rebuilds):
        _flip(board, j)
        started = time.thread_time()
        body.parts(board, now, ages_at=now)
        runs["one_changed"].append(time.thread_time() - started)
        started = time.thread_time()
        body.parts(board, now, ages_at=now + 0.5 * (j + 1))
        runs["ages_moved"].append(time.thread_time() - started)
        _flip(board, j + rebuilds)
        started = time.thread_time()
        catalog(board, now)
        runs["catalog"].append(time.thread_time() - started)
    out: dict[str, Any] = {"engines": engines, "models_per_engine": models}
    for way, times in runs.items():
        ms = _median_ms(times)
        out[f"{way}_ms"] = ms
        out[f"{way}_us_per_engine"] = round(ms * 1000 / engines, 3)
    return out


def run(cfg: BenchConfig, workdir: Path) -> dict[str, Any]:
    def measure(engines: int, models: int) -> dict[str, Any]:
        result: dict[str, Any] = trio.run(_measure, engines, models, cfg.listing_rebuilds,
                                          clock=trio.testing.MockClock())
        return result

    return {"sglang_like": measure(cfg.listing_engines, 1),
            "ollama_like": measure(10, cfg.models_per_engine)}


def main(argv: list[str] | None = None) -> int:
    return run_alone("python -m benchmarks.listing_cost", run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
