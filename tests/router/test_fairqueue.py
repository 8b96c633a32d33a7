"""The order of an engine's waiting requests (``nvpair.router.fairqueue``), without I/O:
priority first, ageing so none starves (the documented bound, as a property), round-robin
across keys of equal level, first come first served within a key."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import count

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nvpair.router.fairqueue import FairQueue, level

_ids = count()


@dataclass(eq=False)
class Req:
    key: str | None
    priority: int
    at: float
    id: int = field(default_factory=lambda: next(_ids))


def test_two_equal_keys_with_10_and_100_waiting_take_turns() -> None:
    """Even when one key's requests have waited much longer (ageing stops at the top
    priority waiting, so equals never outrank each other by age)."""
    q: FairQueue[Req] = FairQueue(age_s=10.0)
    for _ in range(100):
        q.add(Req("big", 0, 0.0))
    for _ in range(10):
        q.add(Req("small", 0, 45.0))
    served = [q.pop(50.0).key for _ in range(110)]
    assert served[:20] == ["big", "small"] * 10
    assert served[20:] == ["big"] * 90


def test_a_higher_priority_goes_first_and_a_low_one_rises_with_age() -> None:
    q: FairQueue[Req] = FairQueue(age_s=5.0)
    low = Req("batch", -1, 0.0)
    q.add(low)
    q.add(Req("ops", 1, 3.0))
    q.add(Req("ops", 1, 3.0))
    assert q.pop(4.0).key == "ops"  # low's level: -1 + 0; ops: 1
    # at 10 s low has waited 2 * age_s: level min(-1 + 2, 1) = 1, ops at 1, low's turn
    # (ops was served last: it went to the back)
    assert q.pop(10.0) is low
    assert level(low, 10.0, 5.0, 1) == 1 and level(low, 100.0, 5.0, 1) == 1  # (capped)


def test_anonymous_requests_are_one_key_and_leaving_works() -> None:
    q: FairQueue[Req] = FairQueue(age_s=1.0)
    a, b, c = Req(None, 0, 0.0), Req(None, 0, 0.0), Req("k", 0, 0.0)
    for r in (a, b, c):
        q.add(r)
    assert q.count(None) == 2 and len(q) == 3 and b in q
    assert q.remove(b) and not q.remove(b) and b not in q
    assert q.oldest() is a
    assert [r.key for r in q.order(0.0, 10)] == [None, "k"]
    assert q.peek(0.0) is a and q.pop(0.0) is a and q.pop(0.0) is c and not q
    with pytest.raises(IndexError):
        q.pop(0.0)
    with pytest.raises(ValueError):
        FairQueue(age_s=0)


KEYS = {"a": 0, "b": 0, "c": -2, "d": 3, None: 0}

# One step of a run: ("add", key) or ("pop",), each after a time step.
steps = st.lists(st.tuples(st.sampled_from(["add", "add", "pop", "leave"]),
                           st.sampled_from(sorted(KEYS, key=str)),
                           st.floats(min_value=0, max_value=4, allow_nan=False),
                           st.integers(min_value=0, max_value=50)),
                 max_size=250)


@settings(max_examples=300, deadline=None)
@given(steps, st.sampled_from([0.5, 2.0, 7.0]))
def test_each_pop_takes_a_best_first_in_line_and_keeps_each_keys_order(
        run: list[tuple[str, str | None, float, int]], age_s: float) -> None:
    q: FairQueue[Req] = FairQueue(age_s)
    now = 0.0
    waiting: list[Req] = []
    popped: dict[str | None, list[int]] = {}
    for op, key, dt, pick in run:
        now += dt
        if op == "add":
            r = Req(key, KEYS[key], now)
            q.add(r)
            waiting.append(r)
        elif op == "leave" and waiting:
            r = waiting.pop(pick % len(waiting))
            assert q.remove(r)
        elif op == "pop" and waiting:
            top = max(r.priority for r in waiting)
            firsts = {}
            for r in waiting:  # (arrival order: the first of each key)
                firsts.setdefault(r.key, r)
            best = max(level(r, now, age_s, top) for r in firsts.values())
            predicted = q.order(now, 1)[0]
            assert q.peek(now) is predicted
            r = q.pop(now)
            assert r is predicted
            assert firsts[r.key] is r  # first come first served within its key
            assert level(r, now, age_s, top) == best
            waiting.remove(r)
            popped.setdefault(r.key, []).append(r.id)
        assert len(q) == len(waiting)
        assert sorted(x.id for x in q) == sorted(x.id for x in waiting)
    for ids in popped.values():
        assert ids == sorted(ids)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["a", "b", "c", "d"]),
                          st.integers(min_value=1, max_value=30)), min_size=1, max_size=12))
def test_keys_of_equal_priority_take_turns(batches: list[tuple[str, int]]) -> None:
    """Any number of requests of each of four keys, all of one priority, added in batches
    in any order: served in rounds, no key a turn ahead of another that still waits."""
    q: FairQueue[Req] = FairQueue(age_s=1000.0)
    left: dict[str, int] = {}
    for key, n in batches:
        for _ in range(n):
            q.add(Req(key, 0, 0.0))
        left[key] = left.get(key, 0) + n
    served = dict.fromkeys(left, 0)
    while q:
        r = q.pop(1.0)
        assert r.key is not None
        served[r.key] += 1
        left[r.key] -= 1
        still = [k for k in left if left[k] > 0 or k == r.key]
        assert max(served[k] for k in still) - min(served[k] for k in still) <= 1


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.lists(st.sampled_from(sorted(KEYS, key=str)), max_size=3),
                          st.floats(min_value=0, max_value=2, allow_nan=False),
                          st.integers(min_value=0, max_value=2)), max_size=200),
       st.sampled_from([0.5, 2.0]))
def test_ageing_bound_under_a_stream_of_higher_priorities(
        run: list[tuple[list[str | None], float, int]], age_s: float) -> None:
    """The documented bound: once a request of priority p has waited (P - p) * age_s (P
    the highest priority of any key), it goes within K * (m + 1) turns, K the number of
    keys, m the requests of its own key ahead of it then. Up to three arrive at each step
    and at most two go, so queues grow and requests wait long."""
    q: FairQueue[Req] = FairQueue(age_s)
    P, K = max(KEYS.values()), len(KEYS)
    now = 0.0
    #: for each request that reached the bound's wait: the turns it may still take
    allowance: dict[int, int] = {}
    for keys, dt, pops in run:
        now += dt
        for key in keys:
            q.add(Req(key, KEYS[key], now))
        for _ in range(pops):
            if not q:
                break
            for line in q.lines.values():
                for m, r in enumerate(line):
                    if r.id not in allowance and now - r.at >= (P - r.priority) * age_s:
                        allowance[r.id] = K * (m + 1)
            r = q.pop(now)
            if r.id in allowance:
                assert allowance.pop(r.id) >= 1, "served later than the ageing bound"
            for rid in allowance:
                allowance[rid] -= 1
            assert all(n >= 1 for n in allowance.values()), "a request passed its bound"


def test_the_bound_in_numbers() -> None:
    """A priority -1 request under a steady stream of priority 1 requests from two keys (one
    new every turn): with age_s 5 it goes once it waited 10 s, within K * (m + 1) = 3
    turns; without ageing it would never go."""
    q: FairQueue[Req] = FairQueue(age_s=5.0)
    low = Req("batch", -1, 0.0)
    q.add(low)
    now = 0.0
    for turn in range(1000):
        q.add(Req("ops" if turn % 2 else "web", 1, now))
        r = q.pop(now)
        if r is low:
            break
        now += 1.0
    else:
        pytest.fail("the low-priority request starved")
    assert math.isclose(now, 10.0)  # (it reached the top at 10 s; its turn came at once)
