"""Which running on-demand engines make room for one more: a pure planner, no I/O.

The rules (docs/on-demand.md): the engines on demand share a memory budget. An engine's
footprint is what the memory watch measured, else its configured ``memory_bytes``; an
engine whose footprint is unknown counts as the whole budget (nothing is planned on a
guess). If the new engine does not fit, victims are taken among the running on-demand
engines (not those starting, or with requests waiting for them). Idle ones (nothing in
flight) come first, lowest ``priority`` first, then the least recently used; a busy one
(its victims wait for its requests to finish, however long) only when the idle ones
together do not free enough, and then the idle ones it makes needless are kept. When even
all of them would not make room, the plan says why in words and evicts nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Candidate:
    """A running on-demand engine, as eviction sees it."""

    name: str
    priority: int = 0
    footprint: int | None = None  # bytes; None: not known
    last_used: float = 0.0  # when a routed request last used it (or it became ready)
    in_flight: int = 0
    #: False: it counts against the budget but is no victim (it is starting, or requests
    #: wait for it)
    evictable: bool = True


@dataclass(frozen=True)
class Plan:
    """The victims, in the order to drain them; or why nothing can make room."""

    victims: tuple[str, ...] = ()
    reason: str | None = None

    @property
    def fits(self) -> bool:
        return self.reason is None


def gigabytes(n: int) -> str:
    """A size for a person: ``38 GB``, ``1.5 GB``, ``512 MB``."""
    if n >= 10**10:
        return f"{n / 1e9:.0f} GB"
    if n >= 10**9:
        return f"{n / 1e9:.1f} GB"
    return f"{n / 1e6:.0f} MB"


def victim_order(running: Sequence[Candidate]) -> list[Candidate]:
    """The evictable ones: idle before busy, then lowest priority first, then least
    recently used, then by name."""
    return sorted((c for c in running if c.evictable),
                  key=lambda c: (c.in_flight > 0, c.priority, c.last_used, c.name))


def plan(name: str, need: int | None, budget: int, running: Sequence[Candidate]) -> Plan:
    """Make room for engine ``name`` (footprint ``need``; None: not known, so the whole
    budget) among ``running`` within ``budget`` bytes."""
    others = [c for c in running if c.name != name]
    want = budget if need is None else need
    if want > budget:
        return Plan(reason=f"{name} needs {gigabytes(want)}, more than the memory budget of "
                           f"{gigabytes(budget)} for engines on demand")

    def size(c: Candidate) -> int:
        return budget if c.footprint is None else c.footprint

    used = sum(size(c) for c in others)
    victims: list[Candidate] = []
    for c in victim_order(others):
        if budget - used >= want:
            break
        victims.append(c)
        used -= size(c)
    if budget - used < want:  # what cannot be evicted (starting, awaited) leaves too little
        kept = ", ".join(c.name for c in others if not c.evictable)
        return Plan(reason=f"{name} needs {gigabytes(want)}; {gigabytes(max(budget - used, 0))} "
                           f"of the {gigabytes(budget)} budget can be made free"
                           + (f" ({kept} cannot be evicted now: starting or awaited)"
                              if kept else ""))
    if victims and victims[-1].in_flight > 0:
        # A busy one was needed: the idle ones that room no longer needs stay, those most
        # worth keeping (the last in the order) looked at first.
        for c in reversed([v for v in victims if v.in_flight == 0]):
            if budget - (used + size(c)) >= want:
                victims.remove(c)
                used += size(c)
    return Plan(victims=tuple(c.name for c in victims))
