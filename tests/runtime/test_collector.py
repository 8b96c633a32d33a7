"""The collector policy: frozen after each automatic collection; a full one only when
memory grew."""

from __future__ import annotations

import gc
import sys
import warnings
import weakref
from collections.abc import Iterator

import pytest
import trio

from nvpair.runtime.collector import Collector, Policy, left_alone, resident_bytes

# A full run finds what earlier tests in this process left (an unclosed socket's cycle,
# say) and its finalizer warns here: other tests' leftovers, not this module's.
pytestmark = [pytest.mark.filterwarnings("ignore::ResourceWarning"),
              pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")]


@pytest.fixture(autouse=True)
def no_garbage_of_other_tests() -> Iterator[None]:
    """What earlier tests left for the collector (an unclosed socket's cycle, say) is
    collected before: a full run here would find it and warn in this test's name. The
    thresholds a collector sets are put back after."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gc.collect()
    thresholds = gc.get_threshold()
    yield
    gc.set_threshold(*thresholds)


class Cycle:
    def __init__(self) -> None:
        self.me = self


def test_resident_bytes_reads_this_process() -> None:
    rss = resident_bytes()
    assert rss is not None and 1 << 20 < rss < 1 << 40


async def test_frozen_at_start_and_after_each_automatic_collection(autojump_clock) -> None:
    """What the automatic collections found alive is frozen as they end: no collection
    of nvpair's own, and nothing frozen before a collection walked it."""
    collector = Collector(Policy(check_s=3600.0), rss=lambda: 100)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(collector.run)
            frozen = gc.get_freeze_count()
            assert frozen > 0 and gc.get_threshold() == collector.policy.thresholds
            kept = [[i] for i in range(100)]  # tracked, made after the first freeze
            assert gc.get_freeze_count() < frozen + 100
            # 50,000 more: the automatic collections of generation 1 come (one every
            # 10 of generation 0, each every 700 allocations) and freeze what they kept
            kept += [[i] for i in range(50_000)]
            assert gc.get_freeze_count() >= frozen + 30_000
            nursery.cancel_scope.cancel()
        assert collector._collected not in gc.callbacks  # (cancelled: no more freezing)
        assert collector.full_runs == 0 and kept
    finally:
        gc.unfreeze()


async def test_a_full_collection_only_when_memory_grew_and_it_frees_frozen_cycles(
        autojump_clock) -> None:
    rss = [100]
    collector = Collector(Policy(check_s=60.0, growth=1.25), rss=lambda: rss[0])
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(collector.run)
            cycle = Cycle()
            ref = weakref.ref(cycle)
            gc.collect(1)  # frozen while alive (as after an automatic collection)
            del cycle  # garbage now, a cycle among frozen objects: only a full run finds it
            gc.collect()
            assert ref() is not None
            rss[0] = 124  # grew, by less than a quarter
            # (read half-way between the collector's checks, every 60 s from its start,
            # never at the same instant as one: which of the two runs first is Trio's)
            await trio.sleep(90)
            assert collector.full_runs == 0 and ref() is not None
            rss[0] = 126
            await trio.sleep(60)
            assert collector.full_runs == 1 and ref() is None
            rss[0] = 140  # measured from the new settled size (126): no second run
            await trio.sleep(60)
            assert collector.full_runs == 1
            nursery.cancel_scope.cancel()
    finally:
        gc.unfreeze()


async def test_the_young_generation_is_held_to_its_limit_while_frozen_objects_die(
        autojump_clock) -> None:
    """Each frozen object that dies cancels a young allocation in CPython's count, so a
    node whose state turns over grows its young generation far past the threshold with
    no collection; the collector's look at its size collects it at the next look."""
    collector = Collector(Policy(check_s=3600.0, young_limit=2_000), rss=lambda: 100)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(collector.run)
            old = [[i] for i in range(30_000)]
            gc.collect(1)  # (frozen by the collector's callback, as after an automatic run)
            assert gc.get_freeze_count() >= 30_000
            young = []
            for i in range(20_000):  # state turning over: an old object dies, a young is born
                old.pop()
                young.append([i])
            assert len(gc.get_objects(0)) > 10_000  # no automatic collection came
            assert collector.trims == 0
            await trio.sleep(collector.policy.young_check_s[1] * 2)
            assert collector.trims == 1
            assert len(gc.get_objects(0)) + len(gc.get_objects(1)) < 1_000
            assert young and old
            nursery.cancel_scope.cancel()
    finally:
        gc.unfreeze()


def test_the_next_look_comes_when_the_young_will_hold_half_the_limit() -> None:
    collector = Collector(Policy(young_limit=2_000, young_check_s=(1 / 32, 1.0)))
    assert collector.next_look(1.0, 4_000) == 0.25  # (4,000 a second: 1,000 in 1/4 s)
    assert collector.next_look(0.5, 1_000) == 0.5
    assert collector.next_look(0.25, 3_000) == 0.25 / 3
    assert collector.next_look(1 / 32, 100_000) == 1 / 32  # (never sooner than 1/32 s)
    assert collector.next_look(1.0, 10) == 1.0  # (never later than a second)
    assert collector.next_look(1.0, 0) == 1.0


def test_a_young_generation_under_its_limit_is_left_to_the_automatic_runs() -> None:
    collector = Collector(Policy(young_limit=1_000_000))
    assert collector.trim() < 1_000_000 and collector.trims == 0


def test_the_tuning_is_for_cpython_before_3_14_only() -> None:
    """3.14's incremental collector has no generation 1 (the one every rule here is
    about): there, and on another interpreter, the collector is left alone, said why."""
    assert left_alone((3, 11), "cpython") is None
    assert left_alone((3, 13, 7), "cpython") is None
    newer = left_alone((3, 14), "cpython")
    assert newer is not None and "3.14" in newer and "generation 1" in newer
    assert left_alone((3, 15, 0), "cpython") is not None
    other = left_alone((3, 11), "pypy")
    assert other is not None and "pypy" in other
    here = sys.implementation.name == "cpython" and sys.version_info < (3, 14)
    assert (left_alone() is None) == here
