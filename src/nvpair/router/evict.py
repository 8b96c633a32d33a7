"""Which on-demand engines make room for one more, and how: a pure planner, no I/O.

The rules (docs/on-demand.md): the engines on demand share a memory budget. An engine's
footprint is what the memory watch measured, else its configured ``memory_bytes``; an
engine whose footprint is unknown counts as the whole budget (nothing is planned on a
guess). A sleeping engine counts what it still holds asleep, as the memory watch read it
(``residual``: nothing until it was seen asleep).

If the new engine does not fit, victims are taken among the on-demand engines that hold
memory (not those starting, waking, with requests waiting for them, or pinned). Each
victim gets the cheapest of three tiers that the room still needs:

1. sleep at level 1 (vLLM): frees the budget and moves the weights to host RAM, so it is
   planned only while the host RAM left beyond the reserve (``host_headroom``) holds them
   (the victim's whole footprint: nvpair cannot see what part of it is weights);
2. sleep at level 2 (vLLM), or SGLang's release: frees the budget, keeps the process;
3. stop: frees everything, the residual of a sleeping engine too; the only tier of an
   engine that cannot be put to sleep (llama-server sleeps by itself only).

Victims are looked at in groups: idle before busy (a busy one drains: its requests finish
first, however long), lowest ``priority`` first. Every tier is tried on a group before the
next group is touched. Within a group the highest score goes first: the time it has been
idle over the time it takes to come back (its measured wake time if it will sleep, else its
measured load time; ``DEFAULT_WAKE_S`` and ``DEFAULT_LOAD_S`` until measured), so a model
that comes back fast goes first (Lemonade's rule). When a busy one was needed, the idle
ones' steps it makes needless are dropped, the last taken looked at first. When even
every victim stopped would not make room, the plan says why in words and evicts nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import groupby
from typing import Literal

from nvpair.base import words

#: the wake time a plan assumes until nvpair woke the engine once (vLLM level 1 wakes a
#: small model in 0.1-0.4 s, a 64 GiB one in about 3 s: landscape-3.md §6)
DEFAULT_WAKE_S = 1.0
#: the load time a plan assumes until nvpair started the engine once (a reload takes 30 to
#: 100+ s for the models vLLM's sleep was measured with)
DEFAULT_LOAD_S = 30.0

Action = Literal["sleep", "stop"]


@dataclass(frozen=True)
class Candidate:
    """An on-demand engine that holds memory, as eviction sees it."""

    name: str
    priority: int = 0
    #: bytes it holds of the budget now (asleep: what it still holds); None: not known
    footprint: int | None = None
    last_used: float = 0.0  # when a routed request last used it (or it became ready)
    in_flight: int = 0
    #: False: it counts against the budget but is no victim (it is starting or waking, or
    #: requests wait for it)
    evictable: bool = True
    #: the sleep levels nvpair can put it to sleep at: vLLM (1, 2), or (2,) with
    #: ``sleep_level = 2``; SGLang's release (2,); none: a stop is its only tier
    levels: tuple[int, ...] = ()
    #: it sleeps now (``footprint`` is what it holds asleep): only a stop frees more
    asleep: bool = False
    #: what it held of the budget when last seen asleep (the memory watch); None: never
    #: seen asleep, counted as nothing
    residual: int | None = None
    #: how long nvpair's last wake of it took, and its last load (start to ready)
    wake_s: float | None = None
    load_s: float | None = None
    #: never a victim (``pin = true``)
    pin: bool = False

    @property
    def can_sleep(self) -> bool:
        return bool(self.levels) and not self.asleep


@dataclass(frozen=True)
class Step:
    """What happens to one victim: a sleep at ``level`` or a stop, and why in words."""

    name: str
    action: Action
    level: int | None = None
    why: str = ""

    @property
    def tier(self) -> str:
        return "stop" if self.action == "stop" else f"sleep at level {self.level}"


@dataclass(frozen=True)
class Plan:
    """The victims' steps, in the order to drain them; or why nothing can make room."""

    steps: tuple[Step, ...] = ()
    reason: str | None = None

    @property
    def fits(self) -> bool:
        return self.reason is None

    @property
    def victims(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.steps)


def gigabytes(n: int) -> str:
    """A size for a person: ``10 TB``, ``38 GB``, ``1.5 GB``, ``512 MB``."""
    if n >= 10**12:
        return f"{n / 1e12:.0f} TB" if n >= 10**13 else f"{n / 1e12:.1f} TB"
    if n >= 10**10:
        return f"{n / 1e9:.0f} GB"
    if n >= 10**9:
        return f"{n / 1e9:.1f} GB"
    return f"{n / 1e6:.0f} MB"


def comeback_s(c: Candidate) -> float:
    """How long the engine takes to serve again once evicted: its wake if it can sleep,
    else its load (measured, else the defaults)."""
    if c.can_sleep:
        return c.wake_s if c.wake_s is not None else DEFAULT_WAKE_S
    return c.load_s if c.load_s is not None else DEFAULT_LOAD_S


def victim_order(running: Sequence[Candidate], now: float | None = None) -> list[Candidate]:
    """The evictable, unpinned ones in the order they are looked at: idle before busy,
    lowest priority first, then the highest idle time over come-back time (at ``now``;
    None: the latest ``last_used``), then least recently used, then by name."""
    able = [c for c in running if c.evictable and not c.pin]
    at = max((c.last_used for c in running), default=0.0) if now is None else now

    def score(c: Candidate) -> float:
        idle = 0.0 if c.in_flight else max(at - c.last_used, 0.0)
        return idle / max(comeback_s(c), 1e-3)

    return sorted(able, key=lambda c: (c.in_flight > 0, c.priority, -score(c), c.last_used,
                                       c.name))


@dataclass
class _Taken:
    """A step taken while planning: what it frees of the budget and costs of host RAM."""

    step: Step
    frees: int
    host: int = 0


def plan(name: str, need: int | None, budget: int, running: Sequence[Candidate], *,
         host_headroom: int | None = None, now: float | None = None) -> Plan:
    """Make room for engine ``name`` (footprint ``need``; None: not known, so the whole
    budget) among ``running`` within ``budget`` bytes. ``host_headroom``: the host RAM free
    beyond the reserve, what level-1 sleeps may move there (None: not known, so no level-1
    sleep); ``now``: the time idle times are counted to."""
    others = [c for c in running if c.name != name]
    want = budget if need is None else need
    if want > budget:
        return Plan(reason=f"{name} needs {gigabytes(want)}, more than the memory budget of "
                           f"{gigabytes(budget)} for engines on demand")

    def size(c: Candidate) -> int:
        return budget if c.footprint is None else c.footprint

    free = budget - sum(size(c) for c in others)
    if free >= want:
        return Plan()
    at = max((c.last_used for c in running), default=0.0) if now is None else now
    order = victim_order(others, at)
    taken: list[_Taken] = []
    chosen: dict[str, _Taken] = {}  # each victim's latest step
    host_left = host_headroom or 0

    def take(c: Candidate, step: Step, frees: int, host: int = 0) -> None:
        nonlocal free, host_left
        if frees <= 0 and (c.asleep or step.action == "sleep"):  # (it would free nothing)
            return
        entry = _Taken(step, frees, host)
        taken.append(entry)
        chosen[c.name] = entry
        free += frees
        host_left -= host

    def idle_words(c: Candidate) -> str:
        if c.in_flight:
            return f"{words.requests(c.in_flight)} in flight, drained first"
        return f"idle {words.duration(max(at - c.last_used, 0.0))}"

    def tiers(group: list[Candidate]) -> None:
        for c in group:  # 1: level-1 sleeps while the host RAM holds what they move
            if free >= want:
                return
            moves = size(c)
            if c.can_sleep and 1 in c.levels and moves <= host_left:
                kept = c.residual or 0
                take(c, Step(c.name, "sleep", 1, (
                    f"{idle_words(c)}, wakes in {words.duration(comeback_s(c))}; frees "
                    f"{gigabytes(max(size(c) - kept, 0))}, moves {gigabytes(moves)} to host "
                    f"RAM ({gigabytes(host_left)} free beyond the reserve)")),
                     max(size(c) - kept, 0), moves)
        for c in group:  # 2: level-2 sleeps (SGLang's release)
            if free >= want:
                return
            if c.name not in chosen and c.can_sleep and 2 in c.levels:
                kept = c.residual or 0
                if 1 in c.levels:
                    because = (f"level 1 would move {gigabytes(size(c))} to host RAM, "
                               f"{gigabytes(max(host_left, 0))} free beyond the reserve"
                               if host_headroom is not None else
                               "level 1 would move its weights to host RAM, whose headroom "
                               "is not known")
                else:
                    because = "its only sleep"
                take(c, Step(c.name, "sleep", 2, (
                    f"{idle_words(c)}, wakes in {words.duration(comeback_s(c))}; frees "
                    f"{gigabytes(max(size(c) - kept, 0))} ({because})")),
                     max(size(c) - kept, 0))
        for c in group:  # 3: stops, then stops of those put to sleep (their residual)
            if free >= want:
                return
            if c.name not in chosen:
                if c.asleep:
                    because = f"it sleeps already and still holds {gigabytes(size(c))}"
                elif c.levels:
                    because = "sleeping would not free enough"
                else:
                    because = "it cannot be put to sleep"
                take(c, Step(c.name, "stop", None, (
                    f"{idle_words(c)}, loads again in "
                    f"{words.duration(c.load_s if c.load_s is not None else DEFAULT_LOAD_S)}; "
                    f"frees {gigabytes(size(c))} ({because})")), size(c))
        for c in group:
            if free >= want:
                return
            entry = chosen.get(c.name)
            kept = size(c) - entry.frees if entry is not None else 0
            if entry is not None and entry.step.action == "sleep" and kept > 0:
                take(c, Step(c.name, "stop", None, (
                    f"{idle_words(c)}; asleep it would still hold {gigabytes(kept)}, "
                    "which the room needs")), kept)

    # idle before busy (a busy one only when the idle ones fail), lower priority first:
    # each group tries every tier before the next group is touched
    for _, group in groupby(order, key=lambda c: (c.in_flight > 0, c.priority)):
        tiers(list(group))
    if free < want:  # what cannot be evicted (starting, awaited, pinned) leaves too little
        held = ", ".join(c.name for c in others if not c.evictable and not c.pin)
        pinned = ", ".join(c.name for c in others if c.pin)
        why = [f"{held} cannot be evicted now: starting or awaited"] if held else []
        why += [f"{pinned} pinned"] if pinned else []
        return Plan(reason=f"{name} needs {gigabytes(want)}; {gigabytes(max(free, 0))} "
                           f"of the {gigabytes(budget)} budget can be made free"
                           + (f" ({'; '.join(why)})" if why else ""))
    kept_steps = list(taken)
    busy = {c.name for c in others if c.in_flight}
    asleep = {c.name for c in others if c.asleep}
    needs_busy = any(t.step.name in busy for t in taken)
    # Steps the room no longer needs are dropped, those most worth keeping (the last
    # taken) looked at first: when a busy one was needed, the idle ones' steps; always,
    # the stops of sleeping ones (asleep they cost nothing; stopped, a load). A step whose
    # victim has a later step still kept stays.
    for entry in reversed(taken):
        name_ = entry.step.name
        later = [t for t in kept_steps if t.step.name == name_
                 and kept_steps.index(t) > kept_steps.index(entry)]
        if ((name_ in busy or not needs_busy) and name_ not in asleep) or later \
                or free - entry.frees < want:
            continue
        kept_steps.remove(entry)
        free -= entry.frees
    final: dict[str, Step] = {}
    for entry in kept_steps:  # (a victim's last step stands, in the order first taken)
        final[entry.step.name] = entry.step
    return Plan(steps=tuple(final.values()))
