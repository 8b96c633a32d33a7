"""Swap batching (``nvpair.router.swaps``), without I/O: when a loaded engine may be evicted
for another that requests wait for."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from nvpair.router.swaps import Resident, SwapPolicy, verdict

BATCH = SwapPolicy(swap_batch=8, min_residency_s=0, max_swap_wait_s=30)


def test_examples_say_why() -> None:
    busy = Resident("qwen", since=100.0, served=3, busy=True)
    held = verdict(BATCH, busy, "gemma", 2.0, 110.0)
    assert not held.evict and held.until == 138.0
    assert held.why == ("qwen keeps serving (served 3 of swap_batch 8); gemma waited 2.0 s "
                        "of max_swap_wait_s 30 s")
    done = Resident("qwen", since=100.0, served=8, busy=True)
    assert verdict(BATCH, done, "gemma", 2.0, 110.0).why == "served 8 of swap_batch 8"
    late = verdict(BATCH, busy, "gemma", 30.0, 110.0)
    assert late.evict and late.why == "gemma waited 30 s >= max_swap_wait_s 30 s (served 3)"
    idle = verdict(BATCH, Resident("qwen", 100.0, 1, busy=False), "gemma", 0.0, 101.0)
    assert idle.evict and idle.why == "qwen had nothing in flight or waiting (served 1)"
    off = verdict(SwapPolicy(), busy, "gemma", 0.0, 100.0)
    assert off.evict and "no swap batching" in off.why
    stay = SwapPolicy(swap_batch=0, min_residency_s=20, max_swap_wait_s=60)
    early = verdict(stay, busy, "gemma", 1.0, 105.0)
    assert not early.evict and early.until == 120.0  # (the residency ends it by itself)
    assert "loaded 5.0 s of min_residency_s 20 s" in early.why
    assert verdict(stay, busy, "gemma", 1.0, 120.0).evict


def eighths(lo: int, hi: int) -> st.SearchStrategy[float]:
    """Times in eighths of a second: binary fractions, so sums are exact."""
    return st.integers(lo, hi).map(lambda n: n / 8)


policies = st.builds(SwapPolicy, st.integers(0, 20), eighths(0, 1000), eighths(1, 3000))
residents = st.builds(Resident, st.just("a"), eighths(0, 10000), st.integers(0, 50),
                      st.booleans())


@settings(max_examples=500, deadline=None)
@given(policies, residents, eighths(0, 4000), eighths(0, 2000))
def test_the_rule(policy: SwapPolicy, victim: Resident, waited: float, later: float) -> None:
    now = victim.since + later
    v = verdict(policy, victim, "b", waited, now)
    kept = (policy.holds and victim.busy and waited < policy.max_swap_wait_s
            and (victim.served < policy.swap_batch
                 or now - victim.since < policy.min_residency_s))
    assert v.evict is not kept
    assert v.why
    if kept:
        # the hold ends by itself by ``until``: never past the longest wait
        assert v.until is not None and now < v.until <= now + policy.max_swap_wait_s - waited
        assert verdict(policy, victim, "b", waited + (v.until - now), v.until).evict
    # more served, or later (the waiter waiting as long more), never undoes an eviction
    if v.evict:
        more = Resident(victim.name, victim.since, victim.served + 1, victim.busy)
        assert verdict(policy, more, "b", waited, now).evict
        assert verdict(policy, victim, "b", waited + 5, now + 5).evict
