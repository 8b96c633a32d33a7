"""The eviction planner (nvpair.evict): pure, so tested without any I/O."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from nvpair.evict import Candidate, plan, victim_order

GB = 10**9


def test_an_idle_engine_goes_before_a_busy_one_of_the_same_priority() -> None:
    busy = Candidate("busy", priority=0, footprint=6 * GB, last_used=1.0, in_flight=2)
    idle = Candidate("idle", priority=0, footprint=6 * GB, last_used=5.0, in_flight=0)
    # the busy one was used longer ago, but it is generating: the idle one goes
    assert plan("new", 6 * GB, 14 * GB, [busy, idle]).victims == ("idle",)
    assert [c.name for c in victim_order([busy, idle])] == ["idle", "busy"]


def test_lower_priority_first_then_least_recently_used() -> None:
    keep = Candidate("keep", priority=5, footprint=4 * GB, last_used=0.0)
    old = Candidate("old", priority=0, footprint=4 * GB, last_used=1.0)
    recent = Candidate("recent", priority=0, footprint=4 * GB, last_used=9.0)
    assert plan("new", 4 * GB, 12 * GB, [keep, old, recent]).victims == ("old",)
    assert plan("new", 8 * GB, 12 * GB, [keep, old, recent]).victims == ("old", "recent")


def test_it_fits_without_victims_or_says_why_not_in_words() -> None:
    a = Candidate("a", footprint=4 * GB)
    assert plan("new", 4 * GB, 10 * GB, [a]).victims == ()
    too_big = plan("new", 12 * GB, 10 * GB, [a])
    assert too_big.victims == () and not too_big.fits
    assert too_big.reason == ("new needs 12 GB, more than the memory budget of 10 GB for "
                              "engines on demand")


def test_an_engine_starting_or_awaited_is_no_victim() -> None:
    starting = Candidate("starting", footprint=6 * GB, last_used=0.0, evictable=False)
    other = Candidate("other", footprint=2 * GB, last_used=9.0)
    assert plan("new", 4 * GB, 10 * GB, [starting, other]).victims == ("other",)
    stuck = plan("new", 6 * GB, 10 * GB, [starting, other])
    assert stuck.reason == ("new needs 6.0 GB; 4.0 GB of the 10 GB budget can be made free "
                            "(starting cannot be evicted now: starting or awaited)")


def test_an_unknown_footprint_counts_as_the_whole_budget() -> None:
    a = Candidate("a", footprint=None)
    b = Candidate("b", footprint=1 * GB)
    assert plan("new", 1 * GB, 10 * GB, [a, b]).victims == ("a",)
    assert set(plan("new", None, 10 * GB, [a, b]).victims) == {"a", "b"}


candidates = st.lists(
    st.builds(Candidate, name=st.text("abcdefgh", min_size=1, max_size=3),
              priority=st.integers(-2, 2),
              footprint=st.one_of(st.none(), st.integers(0, 20 * GB)),
              last_used=st.floats(0, 100), in_flight=st.integers(0, 3),
              evictable=st.booleans()),
    max_size=8, unique_by=lambda c: c.name)


@given(candidates, st.one_of(st.none(), st.integers(0, 20 * GB)), st.integers(1, 20 * GB))
def test_a_plan_fits_with_as_few_victims_as_the_order_allows(running, need, budget) -> None:
    decided = plan("new", need, budget, running)
    want = budget if need is None else need
    size = {c.name: budget if c.footprint is None else c.footprint for c in running}
    if not decided.fits:
        assert decided.victims == () and decided.reason
        kept = sum(size[c.name] for c in running if not c.evictable)
        assert want > budget or budget - kept < want  # even every victim would not do
        return
    left = sum(size.values()) - sum(size[v] for v in decided.victims)
    assert budget - left >= want  # it fits after the victims go
    order = [c.name for c in victim_order(running)]
    assert list(decided.victims) == order[:len(decided.victims)]  # a prefix of the order
    if decided.victims:  # one victim fewer would not have fitted
        fewer = left + size[decided.victims[-1]]
        assert budget - fewer < want
