"""The dashboard's history: buckets of probe latency and memory, bounded, from the board."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import msgspec
import pytest
import trio

from nvpair.history import History, memory_bytes
from nvpair.snapshot import Board, EngineState, ProbeStats

#: the memory watch (docs/memory.md) gives engines a ``memory``; without it, none is charted
WATCHED = "memory" in EngineState.__struct_fields__


def engine(name: str = "e", **kw: object) -> EngineState:
    return EngineState(name=name, kind="vllm", url="http://127.0.0.1:1", managed=False,
                       **kw)  # type: ignore[arg-type]


def probed(e: EngineState, probe: str, latency: float, at: float) -> EngineState:
    stats = ProbeStats(path="/health", ok=True, latency_ms=latency, at=at)
    others = tuple(p for p in e.probes if p[0] != probe)
    return msgspec.structs.replace(e, probes=(*others, (probe, stats)))


def test_results_in_one_bucket_give_its_mean_and_max_once_each() -> None:
    board = Board((engine(),))
    history = History(board, step_s=10)
    for at, latency in ((1.0, 2.0), (2.0, 4.0), (3.0, 9.0)):
        board.update("e", lambda e, at=at, latency=latency: probed(e, "health", latency, at))
        history.observe(board.current, at)
        history.observe(board.current, at + 0.5)  # the same result seen twice counts once
    history.observe(board.current, 12.0)  # the next bucket closes the first
    (point,) = history.doc(12.0)["engines"]["e"]
    assert point == [7.0, 5.0, 9.0, None]  # aged from the bucket's middle (5 s)


def test_other_probes_do_not_count_and_the_open_bucket_is_last() -> None:
    board = Board((engine(),))
    history = History(board, step_s=10)
    board.update("e", lambda e: probed(e, "models", 500.0, 1.0))
    history.observe(board.current, 1.0)
    assert history.doc(1.0)["engines"]["e"] == []  # the model list is not charted
    board.update("e", lambda e: probed(e, "ready", 3.0, 2.0))
    history.observe(board.current, 2.0)
    assert history.doc(2.0)["engines"]["e"] == [[0.0, 3.0, 3.0, None]]


def test_each_engine_keeps_at_most_its_points() -> None:
    board = Board((engine("a"), engine("b")))
    history = History(board, step_s=1, points=5)
    for t in range(100):
        for name in ("a", "b"):
            board.update(name, lambda e, t=t: probed(e, "health", float(t), float(t)))
        history.observe(board.current, float(t))
    doc = history.doc(100.0)["engines"]
    assert len(doc["a"]) == 6 and len(doc["b"]) == 6  # 5 kept and the open one
    assert [p[1] for p in doc["a"]] == [94.0, 95.0, 96.0, 97.0, 98.0, 99.0]


def test_memory_is_anonymous_plus_swap_where_reported() -> None:
    def with_memory(memory: object) -> EngineState:
        return SimpleNamespace(memory=memory)  # type: ignore[return-value]

    assert memory_bytes(with_memory(SimpleNamespace(rss_anon_bytes=100, swap_bytes=20))) == 120
    assert memory_bytes(with_memory({"rss_anon_bytes": 100, "swap_bytes": None})) == 100
    assert memory_bytes(with_memory(SimpleNamespace(rss_anon_bytes=None))) is None
    assert memory_bytes(with_memory(None)) is None
    assert memory_bytes(engine()) is None


@pytest.mark.skipif(not WATCHED, reason="no memory watch in this tree (EngineState.memory)")
def test_memory_from_the_memory_watch_and_engines_gone_are_dropped() -> None:
    board = Board((engine("a"), engine("b")))
    history = History(board, step_s=10)
    board.update("a", lambda e: msgspec.structs.replace(
        e, memory=SimpleNamespace(rss_anon_bytes=100, swap_bytes=20)))
    history.observe(board.current, 1.0)
    assert history.doc(1.0)["engines"]["a"] == [[0.0, None, None, 120]]
    assert history.doc(1.0, engine="b") == {
        "step_s": 10, "columns": ["age_s", "latency_ms", "latency_ms_max", "memory_bytes"],
        "engines": {"b": []}}
    board.publish((board.current.engines[0],))
    history.observe(board.current, 2.0)
    assert set(history.doc(2.0)["engines"]) == {"a"}


async def test_run_observes_changes_at_most_once_a_second(autojump_clock) -> None:
    board = Board((engine(),))
    history = History(board, step_s=10)
    observed: list[float] = []
    real = history.observe

    def observe(snap, now):  # type: ignore[no-untyped-def]
        observed.append(now)
        real(snap, now)

    history.observe = observe  # type: ignore[method-assign]
    async with trio.open_nursery() as nursery:
        await nursery.start(history.run)
        for i in range(50):  # 50 results in 5 s
            board.update("e", lambda e, i=i: probed(e, "health", 1.0, i / 10))
            await trio.sleep(0.1)
        await trio.sleep(30)  # nothing changes: nothing observed
        nursery.cancel_scope.cancel()
    assert 5 <= len(observed) <= 7, observed
    assert all(b - a >= 1.0 for a, b in itertools.pairwise(observed))
    assert observed[-1] < 7
