"""The order in which requests waiting for one engine go to it: priority with ageing, and
round-robin across keys within a priority. Pure: no trio, no I/O, time is an argument.

The rule (docs/on-demand.md, "Who goes next"):

* Each key (an API key's name; requests without a key are one key, ``None``) has its own
  line, first come first served. Only the first of each line competes.
* A waiting request's **level** is its key's ``priority`` plus one for every ``age_s`` it
  has waited, capped at the highest priority of any request waiting now:
  ``min(priority + floor(wait / age_s), top)``. The lines whose first request has the
  highest level compete; among them the turn goes round-robin: the line that was served
  longest ago (or that joined last, at the back) goes next, then moves to the back.
* Why the cap: without it, two busy keys of equal priority would be served by who came
  first (the older line ages more), not in turns. With it, once a low-priority request has
  risen to the top, it takes turns with the others, and equal keys below the top keep
  taking turns among themselves when nothing outranks them.

**The bound.** Let ``P`` be the highest priority of any key, a request ``X`` of priority
``p``, with ``m`` requests of its own key ahead of it, and ``K`` keys with requests
waiting. Once ``X`` has waited ``(P - p) * age_s`` its level is the top one; from then on
at most ``K - 1`` other keys are served before each request of its own line (each line
ahead of it in the turn order is served at most once before it, and then goes behind it;
a line that joins later joins behind it). So ``X`` goes within ``K * (m + 1)`` turns of
the engine after ``(P - p) * age_s`` of waiting, whatever stream of higher-priority
requests keeps coming (``tests/router/test_fairqueue.py`` checks the bound as a
property).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator
from typing import Generic, Protocol, TypeVar


class Waiter(Protocol):
    @property
    def key(self) -> str | None: ...

    @property
    def priority(self) -> int: ...

    @property
    def at(self) -> float: ...


W = TypeVar("W", bound=Waiter)


def level(w: Waiter, now: float, age_s: float, top: int) -> int:
    """``w``'s priority with its age: one more every ``age_s`` waited, at most ``top``."""
    aged = w.priority + math.floor(max(now - w.at, 0.0) / age_s)
    return min(aged, top)


class FairQueue(Generic[W]):
    """The requests waiting for one engine, a line per key (module docstring)."""

    def __init__(self, age_s: float) -> None:
        if age_s <= 0:
            raise ValueError("age_s must be above 0")
        self.age_s = age_s
        #: each key's line, in turn order: the next to be served among equals first
        self.lines: dict[str | None, deque[W]] = {}
        self._size = 0
        #: how many wait at each priority (the cap of the ageing is the highest)
        self._priorities: dict[int, int] = {}

    def __len__(self) -> int:
        return self._size

    def __bool__(self) -> bool:
        return self._size > 0

    def __contains__(self, w: object) -> bool:
        line = self.lines.get(getattr(w, "key", None))
        return line is not None and w in line

    def __iter__(self) -> Iterator[W]:
        """Every waiting request, line by line (not the order they go in: ``order``)."""
        for line in self.lines.values():
            yield from line

    def add(self, w: W) -> None:
        """``w`` waits at the end of its key's line (a new line joins at the back)."""
        line = self.lines.get(w.key)
        if line is None:
            line = self.lines[w.key] = deque()
        line.append(w)
        self._size += 1
        _count(self._priorities, w.priority, 1)

    def remove(self, w: W) -> bool:
        """``w`` leaves (its client went, its wait ran out); False: it was not waiting."""
        line = self.lines.get(w.key)
        if line is None or w not in line:
            return False
        line.remove(w)
        self._size -= 1
        _count(self._priorities, w.priority, -1)
        if not line:
            del self.lines[w.key]
        return True

    def count(self, key: str | None) -> int:
        line = self.lines.get(key)
        return 0 if line is None else len(line)

    def oldest(self) -> W | None:
        """The request that has waited longest (each line's first is its oldest)."""
        firsts = [line[0] for line in self.lines.values()]
        return min(firsts, key=lambda w: w.at) if firsts else None

    def top(self) -> int:
        """The highest priority of any waiting request: the cap of the ageing."""
        return max(self._priorities)

    def _choose(self, lines: dict[str | None, deque[W]], now: float, top: int
                ) -> str | None:
        best: tuple[int, str | None] | None = None
        for key, line in lines.items():  # (turn order: the first of the best level wins)
            lv = level(line[0], now, self.age_s, top)
            if best is None or lv > best[0]:
                best = (lv, key)
        assert best is not None
        return best[1]

    def peek(self, now: float) -> W | None:
        """The request that would go next, without taking it."""
        if not self._size:
            return None
        return self.lines[self._choose(self.lines, now, self.top())][0]

    def pop(self, now: float) -> W:
        """Take the request whose turn it is at ``now``; its line goes to the back."""
        if not self._size:
            raise IndexError("pop from an empty FairQueue")
        key = self._choose(self.lines, now, self.top())
        line = self.lines.pop(key)
        w = line.popleft()
        self._size -= 1
        _count(self._priorities, w.priority, -1)
        if line:
            self.lines[key] = line  # (to the back of the turn order)
        return w

    def order(self, now: float, limit: int) -> list[W]:
        """The first ``limit`` requests in the order they would go if all went at ``now``
        (positions for ``GET /v1/queue``): ``limit`` turns, each over the lines."""
        lines = {k: deque(line) for k, line in self.lines.items()}
        out: list[W] = []
        if not lines:
            return out
        priorities = dict(self._priorities)
        while lines and len(out) < limit:
            key = self._choose(lines, now, max(priorities))
            line = lines.pop(key)
            w = line.popleft()
            out.append(w)
            _count(priorities, w.priority, -1)
            if line:
                lines[key] = line
        return out


def _count(counts: dict[int, int], priority: int, by: int) -> None:
    n = counts.get(priority, 0) + by
    if n:
        counts[priority] = n
    else:
        del counts[priority]
