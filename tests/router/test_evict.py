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


# -- eviction tiers: sleep at level 1, sleep at level 2 (or SGLang's release), stop ---------

VLLM = (1, 2)  # a vLLM with sleep = true, sleep_level = 1
SGLANG = (2,)  # SGLang's release (no weights kept in host RAM)


def test_a_vllm_victim_sleeps_at_level_1_while_the_host_ram_holds_its_weights() -> None:
    a = Candidate("a", footprint=6 * GB, last_used=1.0, levels=VLLM, wake_s=0.3)
    decided = plan("new", 6 * GB, 8 * GB, [a], host_headroom=20 * GB, now=11.0)
    assert [(s.name, s.action, s.level) for s in decided.steps] == [("a", "sleep", 1)]
    assert decided.steps[0].tier == "sleep at level 1"
    assert decided.steps[0].why == ("idle 10.0 s, wakes in 0.3 s; frees 6.0 GB, moves 6.0 GB "
                                    "to host RAM (20 GB free beyond the reserve)")


def test_too_little_host_ram_for_level_1_is_a_level_2_sleep_saying_why() -> None:
    a = Candidate("a", footprint=6 * GB, last_used=1.0, levels=VLLM)
    decided = plan("new", 6 * GB, 8 * GB, [a], host_headroom=2 * GB, now=1.0)
    assert [(s.action, s.level) for s in decided.steps] == [("sleep", 2)]
    assert decided.steps[0].why.endswith(
        "(level 1 would move 6.0 GB to host RAM, 2.0 GB free beyond the reserve)")
    # the host's headroom not known: no level-1 sleep either
    unknown = plan("new", 6 * GB, 8 * GB, [a], host_headroom=None)
    assert [(s.action, s.level) for s in unknown.steps] == [("sleep", 2)]


def test_an_engine_that_cannot_be_put_to_sleep_is_stopped() -> None:
    llama = Candidate("llama", footprint=6 * GB)  # (llama-server sleeps by itself only)
    decided = plan("new", 6 * GB, 8 * GB, [llama], host_headroom=20 * GB)
    assert [(s.name, s.action) for s in decided.steps] == [("llama", "stop")]
    assert decided.steps[0].why.endswith("frees 6.0 GB (it cannot be put to sleep)")


def test_a_sleeping_engine_counts_its_residual_and_is_stopped_when_the_room_needs_it() -> None:
    """A sleeping llama-server still holds 600 MB of its CUDA context: a new engine that
    needs the whole budget stops it; one that needs less leaves it asleep."""
    asleep = Candidate("asleep", footprint=600 * 10**6, asleep=True, levels=VLLM,
                       residual=600 * 10**6)
    assert plan("new", 7 * GB, 8 * GB, [asleep]).steps == ()
    decided = plan("new", 8 * GB, 8 * GB, [asleep], host_headroom=20 * GB)
    assert [(s.name, s.action) for s in decided.steps] == [("asleep", "stop")]
    assert "it sleeps already and still holds 600 MB" in decided.steps[0].why


def test_a_sleep_whose_residual_the_room_needs_becomes_a_stop() -> None:
    a = Candidate("a", footprint=6 * GB, levels=SGLANG, residual=2 * GB)
    assert plan("new", 4 * GB, 6 * GB, [a]).steps[0].action == "sleep"  # frees 4 GB: enough
    decided = plan("new", 6 * GB, 6 * GB, [a])
    assert [(s.action, s.level) for s in decided.steps] == [("stop", None)]
    assert "asleep it would still hold 2.0 GB, which the room needs" in decided.steps[0].why


def test_a_model_that_comes_back_fast_goes_first() -> None:
    """Both idle 10 s: the one that wakes in 0.3 s goes before the one that loads in 30 s,
    even though the slow one was used longer ago."""
    fast = Candidate("fast", footprint=6 * GB, last_used=5.0, levels=VLLM, wake_s=0.3)
    slow = Candidate("slow", footprint=6 * GB, last_used=1.0, load_s=30.0)
    decided = plan("new", 6 * GB, 12 * GB, [fast, slow], host_headroom=20 * GB, now=15.0)
    assert decided.victims == ("fast",)
    assert [c.name for c in victim_order([slow, fast], 15.0)] == ["fast", "slow"]


def test_priority_comes_before_the_score() -> None:
    fast = Candidate("fast", priority=5, footprint=6 * GB, levels=VLLM, wake_s=0.1)
    slow = Candidate("slow", priority=0, footprint=6 * GB, load_s=60.0)
    assert plan("new", 6 * GB, 12 * GB, [fast, slow], host_headroom=20 * GB,
                now=100.0).victims == ("slow",)


def test_a_pinned_engine_is_never_a_victim() -> None:
    pinned = Candidate("pinned", footprint=6 * GB, pin=True, levels=VLLM)
    other = Candidate("other", footprint=2 * GB)
    assert plan("new", 2 * GB, 8 * GB, [pinned, other]).victims == ("other",)
    stuck = plan("new", 6 * GB, 8 * GB, [pinned, other], host_headroom=20 * GB)
    assert stuck.victims == () and stuck.reason == (
        "new needs 6.0 GB; 2.0 GB of the 8.0 GB budget can be made free (pinned pinned)")


def test_idle_victims_take_every_tier_before_a_busy_one_is_touched() -> None:
    busy = Candidate("busy", footprint=6 * GB, levels=VLLM, in_flight=2, wake_s=0.1)
    idle = Candidate("idle", footprint=6 * GB)  # (stop only, 30 s to load)
    decided = plan("new", 6 * GB, 12 * GB, [busy, idle], host_headroom=20 * GB)
    assert [(s.name, s.action) for s in decided.steps] == [("idle", "stop")]


tier_candidates = st.lists(
    st.builds(Candidate, name=st.text("abcdefgh", min_size=1, max_size=3),
              priority=st.integers(-2, 2),
              footprint=st.one_of(st.none(), st.integers(0, 20 * GB)),
              last_used=st.floats(0, 100), in_flight=st.integers(0, 3),
              evictable=st.booleans(),
              levels=st.sampled_from([(), (1,), (2,), (1, 2)]), asleep=st.booleans(),
              residual=st.one_of(st.none(), st.integers(0, 2 * GB)),
              wake_s=st.one_of(st.none(), st.floats(0.01, 10)),
              load_s=st.one_of(st.none(), st.floats(0.1, 100)), pin=st.booleans()),
    max_size=8, unique_by=lambda c: c.name)


@given(tier_candidates, st.one_of(st.none(), st.integers(0, 20 * GB)),
       st.integers(1, 20 * GB), st.one_of(st.none(), st.integers(0, 40 * GB)))
def test_a_tiered_plan_fits_within_the_host_ram_with_no_step_it_does_not_need(
        running, need, budget, headroom) -> None:
    decided = plan("new", need, budget, running, host_headroom=headroom, now=100.0)
    want = budget if need is None else need
    size = {c.name: budget if c.footprint is None else c.footprint for c in running}
    by_name = {c.name: c for c in running}
    if not decided.fits:
        assert decided.steps == () and decided.reason
        kept = sum(size[c.name] for c in running if not c.evictable or c.pin)
        assert want > budget or budget - kept < want  # even stopping every victim would not do
        return

    def frees(step) -> int:  # type: ignore[no-untyped-def]
        c = by_name[step.name]
        return size[c.name] if step.action == "stop" else max(size[c.name] - (c.residual or 0), 0)

    used = sum(size.values())
    assert budget - used + sum(frees(s) for s in decided.steps) >= want  # it fits
    assert len(set(decided.victims)) == len(decided.victims)
    for s in decided.steps:
        c = by_name[s.name]
        assert c.evictable and not c.pin  # never a pinned, starting or awaited one
        if s.action == "sleep":  # a sleep only of an awake one, at a level it has
            assert not c.asleep and s.level in c.levels
        assert s.why
    moved = sum(size[s.name] for s in decided.steps if s.level == 1)
    assert moved <= (headroom or 0)  # level 1 only while the host RAM holds it
    if headroom is not None and headroom >= used:  # room for every weight in host RAM:
        assert not [s for s in decided.steps  # no level-2 sleep of a level-1 sleeper
                    if s.level == 2 and 1 in by_name[s.name].levels]
    busy = [i for i, s in enumerate(decided.steps) if by_name[s.name].in_flight]
    assert busy == list(range(len(decided.steps) - len(busy), len(decided.steps)))  # idle first
    if not decided.steps:
        return
    total = budget - used + sum(frees(t) for t in decided.steps)
    last = decided.steps[-1]  # one step fewer would not have fitted
    assert total - frees(last) < want or (
        last.action == "stop" and by_name[last.name].can_sleep
        and total - (by_name[last.name].residual or 0) < want)
    if busy:  # a busy victim drains: each idle step kept beside it is needed
        for s in decided.steps:
            if not by_name[s.name].in_flight:
                assert total - frees(s) < want or (
                    s.action == "stop" and by_name[s.name].can_sleep
                    and total - (by_name[s.name].residual or 0) < want)


def test_a_sleeping_engine_is_stopped_only_when_the_room_needs_it() -> None:
    """b sleeps holding nothing measured, c sleeps holding 1 GB and a is awake: making room
    for a 6 GB engine in 8 GB stops a; stopping b frees nothing and c's stop is not needed
    once a goes, so both stay asleep."""
    b = Candidate("b", footprint=0, asleep=True, levels=SGLANG, last_used=0.0)
    c = Candidate("c", footprint=1 * GB, asleep=True, levels=VLLM, last_used=0.0)
    a = Candidate("a", footprint=6 * GB, last_used=5.0)  # (stop only)
    decided = plan("new", 6 * GB, 8 * GB, [a, b, c], host_headroom=20 * GB, now=10.0)
    assert [(s.name, s.action) for s in decided.steps] == [("a", "stop")]
