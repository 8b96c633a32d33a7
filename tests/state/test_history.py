"""The dashboard's history: buckets of probe latency and memory, bounded, from the board."""

from __future__ import annotations

import itertools
import sys
from types import SimpleNamespace

import msgspec
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from nvpair.state.history import History, memory_bytes
from nvpair.state.snapshot import Board, EngineState, ProbeStats

#: the memory watch (docs/memory.md) gives engines a ``memory``; without it, none is charted
WATCHED = "memory" in EngineState.__struct_fields__


def engine(name: str = "e", **kw: object) -> EngineState:
    return EngineState(name=name, kind="vllm", url="http://127.0.0.1:1", managed=False,
                       **kw)  # type: ignore[arg-type]


def probed(e: EngineState, probe: str, latency: float, at: float) -> EngineState:
    stats = ProbeStats(path="/health", ok=True, latency_ms=latency, at=at)
    others = tuple(p for p in e.probes if p[0] != probe)
    return msgspec.structs.replace(e, probes=(*others, (probe, stats)))


def wire(doc: dict) -> dict:
    """What the API sends of it (NaN, no value, is null)."""
    return msgspec.json.decode(msgspec.json.encode(doc))  # type: ignore[no-any-return]


def result(board: Board, history: History, latency: float, at: float,
           name: str = "e", probe: str = "health") -> None:
    board.update(name, lambda e: probed(e, probe, latency, at))
    history.observe(board.current, at)


def test_results_in_one_bucket_give_its_mean_and_max_once_each() -> None:
    board = Board((engine(),))
    history = History(board, step_s=10)
    for at, latency in ((1.0, 2.0), (2.0, 4.0), (3.0, 9.0)):
        result(board, history, latency, at)
        history.observe(board.current, at + 0.5)  # the same result seen twice counts once
    history.observe(board.current, 12.0)  # the next bucket closes the first
    assert wire(history.doc(12.0))["engines"]["e"] == {
        "first_age_s": 7.0,  # from the bucket's middle (5 s)
        "latency_ms": [5.0], "latency_ms_max": [9.0], "memory_bytes": [None]}


def test_other_probes_do_not_count_and_the_open_bucket_is_last() -> None:
    board = Board((engine(),))
    history = History(board, step_s=10)
    result(board, history, 500.0, 1.0, probe="models")  # the model list is not charted
    assert wire(history.doc(1.0))["engines"]["e"]["latency_ms"] == []
    result(board, history, 3.0, 2.0, probe="ready")
    result(board, history, 4.0, 15.0)
    doc = wire(history.doc(16.0))["engines"]["e"]
    assert doc["latency_ms"] == [3.0, 4.0] and doc["first_age_s"] == 11.0


def test_buckets_without_results_are_gaps_and_each_next_point_is_one_step_later() -> None:
    board = Board((engine(),))
    history = History(board, step_s=10)
    result(board, history, 1.0, 5.0)   # bucket 0
    result(board, history, 2.0, 35.0)  # bucket 3: 1 and 2 had nothing
    result(board, history, 3.0, 45.0)  # bucket 4 (open)
    doc = wire(history.doc(45.0))["engines"]["e"]
    assert doc["latency_ms"] == [1.0, None, None, 2.0, 3.0]
    assert doc["first_age_s"] == 40.0
    assert wire(history.doc(45.0, last=2))["engines"]["e"]["latency_ms"] == [2.0, 3.0]
    history.observe(board.current, 75.0)  # a new bucket with nothing yet: 4 closes
    doc = wire(history.doc(75.0, last=3))["engines"]["e"]
    assert doc["latency_ms"] == [None, 2.0, 3.0] and doc["first_age_s"] == 50.0
    result(board, history, 4.0, 101.0)  # bucket 10, open, five empty ones before it
    assert wire(history.doc(101.0))["engines"]["e"]["latency_ms"] == [
        1.0, None, None, 2.0, 3.0, None, None, None, None, None, 4.0]
    doc = wire(history.doc(101.0, last=3))["engines"]["e"]
    assert doc["latency_ms"] == [None, None, 4.0] and doc["first_age_s"] == 16.0
    doc = wire(history.doc(101.0, last=7))["engines"]["e"]
    assert doc["latency_ms"] == [3.0, None, None, None, None, None, 4.0]
    assert doc["first_age_s"] == 56.0


def test_each_engine_keeps_at_most_its_points() -> None:
    board = Board((engine("a"), engine("b")))
    history = History(board, step_s=1, points=5)
    for t in range(100):
        for name in ("a", "b"):
            board.update(name, lambda e, t=t: probed(e, "health", float(t), float(t)))
        history.observe(board.current, float(t))
    doc = wire(history.doc(99.5))["engines"]
    assert doc["a"]["latency_ms"] == [95.0, 96.0, 97.0, 98.0, 99.0]  # the open one last
    assert doc["b"]["latency_ms"] == doc["a"]["latency_ms"]
    assert len(history.engines["a"].mean) == 5


def test_an_hour_of_points_stays_small() -> None:
    board = Board((engine(),))
    history = History(board)
    for t in range(0, 7200, 2):
        result(board, history, 2.5, float(t))
    series = history.engines["e"]
    assert len(series.mean) == 360
    size = sum(sys.getsizeof(c) for c in (series.mean, series.max, series.memory))
    assert size < 12_000, size


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
    assert wire(history.doc(1.0))["engines"]["a"]["memory_bytes"] == [120]
    assert wire(history.doc(1.0, engine="b")) == {"step_s": 10, "engines": {"b": {
        "first_age_s": 0.0, "latency_ms": [], "latency_ms_max": [], "memory_bytes": []}}}
    board.publish((board.current.engines[0],))
    history.observe(board.current, 2.0)
    assert set(wire(history.doc(2.0))["engines"]) == {"a"}


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


#: one step of a node's life: a probe result, a memory reading, or an observation, at a
#: time that only moves forward (seconds since the last step)
_STEPS = st.lists(st.tuples(
    st.sampled_from(("result", "memory", "observe")),
    st.sampled_from(("a", "b", "c")),
    st.floats(0.0, 35.0),
    st.integers(0, 1_000),
), max_size=40)


@pytest.mark.skipif(not WATCHED, reason="no memory watch in this tree (EngineState.memory)")
@settings(max_examples=200, deadline=None)
@given(_STEPS)
def test_looking_at_changed_engines_only_charts_what_looking_at_all_of_them_does(
        steps: list[tuple[str, str, float, int]]) -> None:
    """An observation looks only at the engines changed since the last one; the charts
    are those of one that looks at every engine each time (an engine's memory unchanged
    stays in every bucket, gaps and all)."""
    boards = [Board(tuple(engine(n) for n in "abc")) for _ in range(2)]
    lazy, eager = (History(b, step_s=10, points=8) for b in boards)
    now = 0.0
    for kind, name, dt, value in steps:
        now += dt
        for board, history in zip(boards, (lazy, eager), strict=True):
            if kind == "result":
                board.update(name, lambda e, v=value, t=now: probed(e, "health", float(v), t))
            elif kind == "memory":
                board.update(name, lambda e, v=value: msgspec.structs.replace(
                    e, memory=None if v % 5 == 0 else SimpleNamespace(
                        rss_anon_bytes=v, swap_bytes=0)))
            else:
                if history is eager:
                    history._touched.everything = True  # (every engine looked at)
                history.observe(board.current, now)
    assert wire(lazy.doc(now)) == wire(eager.doc(now))
