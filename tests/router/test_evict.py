"""The eviction planner (nvpair.router.evict): pure, so tested without any I/O."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from nvpair.router.evict import Candidate, plan, victim_order

GB = 10**9


def test_an_idle_engine_goes_before_a_busy_one_of_the_same_priority() -> None:
    busy = Candidate("busy", priority=0, footprint=6 * GB, last_used=1.0, in_flight=2)
    idle = Candidate("idle", priority=0, footprint=6 * GB, last_used=5.0, in_flight=0)
    # the busy one was used longer ago, but it is generating: the idle one goes
    assert plan("new", 6 * GB, 14 * GB, [busy, idle]).victims == ("idle",)
    assert [c.name for c in victim_order([busy, idle])] == ["idle", "busy"]


def test_an_idle_engine_goes_before_a_busy_one_of_lower_priority() -> None:
    """A busy victim makes the requester wait for its answers: it is taken only when the
    idle ones together do not free enough."""
    busy = Candidate("busy", priority=-5, footprint=6 * GB, last_used=1.0, in_flight=1)
    idle = Candidate("idle", priority=5, footprint=6 * GB, last_used=5.0)
    assert plan("new", 6 * GB, 14 * GB, [busy, idle]).victims == ("idle",)
    assert [c.name for c in victim_order([busy, idle])] == ["idle", "busy"]


def test_a_busy_victim_keeps_the_idle_ones_it_makes_needless() -> None:
    """The idle ones (2 + 1 GB) cannot free 8 GB: the busy one must go, and with it gone
    neither idle one needs to."""
    small = Candidate("small", footprint=2 * GB, last_used=1.0)
    tiny = Candidate("tiny", footprint=1 * GB, last_used=2.0)
    busy = Candidate("busy", footprint=8 * GB, in_flight=3)
    assert plan("new", 8 * GB, 11 * GB, [small, tiny, busy]).victims == ("busy",)
    # 9 GB: the busy one and one idle one; the one used longest ago goes
    assert plan("new", 9 * GB, 11 * GB, [small, tiny, busy]).victims == ("small", "busy")


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
def test_a_plan_fits_idle_first_with_as_few_victims_as_it_can(running, need, budget) -> None:
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
    by_name = {c.name: c for c in running}
    assert all(by_name[v].evictable for v in decided.victims)
    idle = [c.name for c in victim_order(running) if c.in_flight == 0]
    busy = [c.name for c in victim_order(running) if c.in_flight > 0]
    chosen_idle = [v for v in decided.victims if v in idle]
    chosen_busy = [v for v in decided.victims if v in busy]
    assert list(decided.victims) == chosen_idle + chosen_busy  # idle ones drain first
    assert chosen_busy == busy[:len(chosen_busy)]  # busy ones in their order
    if chosen_busy:  # only when every idle one together would not do
        everything_idle = sum(size[c.name] for c in running) - sum(size[v] for v in idle)
        assert budget - everything_idle < want
        for v in chosen_idle:  # and each idle one kept beside them is needed
            assert budget - (left + size[v]) < want
        fewer = left + size[chosen_busy[-1]]
    else:
        assert chosen_idle == idle[:len(chosen_idle)]  # the fewest of the idle order
        fewer = left + size[chosen_idle[-1]] if chosen_idle else None
    if fewer is not None:  # one victim fewer would not have fitted
        assert budget - fewer < want
