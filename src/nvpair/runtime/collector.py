"""How nvpair runs Python's cyclic garbage collector: short pauses, whatever the node's size.

CPython frees almost everything by reference counting; the cyclic collector only finds
groups of objects that refer to each other and nothing else does. A full collection walks
every tracked object the process holds, and at 1,024 engines nvpair holds 60,000 to
110,000 of them (each engine's probe tasks, cancel scopes, keep-alive connections, leak
detector): 26-54 ms a full collection, twice in 20 s, a stall of the whole event loop
(``/healthz`` included). Measured in that state with ``gc.DEBUG_SAVEALL``, those
collections found no garbage at all: the walk was all cost.

So, as large Python services do, what is alive is *frozen* (``gc.freeze``): moved out of
the collector's sight. A frozen object is still freed the usual way when nothing refers
to it; the collector's automatic runs then walk only what was made since.

* nvpair freezes right after each automatic collection of the middle generation (or
  a full one): those
  have just walked everything young, and what survived is all that would be frozen. So
  freezing costs no walk of its own (``gc.freeze`` moves lists) and no collection is run
  for it. Until 72b9df2 a task collected the young generations itself every 2 s and
  then froze: at 1,024 engines under load that collection walked 10,000-20,000 young
  objects, many of them tuples that refer to every engine, and held the event loop
  5-20 ms of CPU (up to 40 ms by the clock) every 2 s.
* the middle generation is collected after every second collection of the youngest
  (``gc.set_threshold(700, 1, 10)``; Python's default is every tenth): what a probe in
  flight keeps alive is then walked in shorter runs and frozen sooner. At 1,024 engines
  under load the longest collection took 4.4 ms of CPU, where it took 17.5 with the
  default, and all collections together 232 ms in 10 s, where they took 293 (one run of
  each, ``docs/benchmarks.md``).
* the young generations are also held to a size (``young_limit``, 2,000 objects).
  CPython counts allocations *less deallocations* since the last collection, of any
  generation: each frozen object that dies (a probe's result replaced by the next one,
  an old snapshot) cancels one young allocation in that count. With everything frozen,
  a node whose state turns over grows its young generation far past the threshold with
  no collection: at 1,024 engines 10,000-18,000 young objects were walked at once (7-15
  ms of CPU, a stall of the loop inside whatever step allocated next). So ``keep``
  looks at their size (``gc.get_objects``: a list of them, microseconds) and above the
  limit collects them and freezes (``trim``); it looks again when, at the rate they grew
  since the last look, they will hold half the limit: every 1/32 s at the soonest, once
  a second at the latest (an idle small node).
* what freezing gives up: a cycle of frozen objects that later becomes garbage is not
  found. That is bounded here: every ``check_s`` (an hour) nvpair compares its resident
  memory with what it was after the last full collection, and when it grew by
  ``growth`` (a quarter) or more it unfreezes and runs one full collection (logged, with
  its length and what it freed). A node that leaks no cycles never pays that pause.

All of this is written for CPython's collector of three generations (``gc.get_objects(1)``,
``gc.collect(1)``, a callback at generation 1, the thresholds above). CPython 3.14's
incremental collector has no generation 1: ``get_objects(1)`` returns nothing there and
``collect(1)`` is one increment. So ``nvpair serve`` tunes nothing on another interpreter
(``left_alone`` says why, and the log says so once at start), and Python's own
collector runs as it would without nvpair.

``run`` is started once per process by ``nvpair serve`` (``nvpair.service.main``).
"""

from __future__ import annotations

import gc
import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import trio

from nvpair.runtime import wakes

log = logging.getLogger("nvpair.collector")

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def resident_bytes() -> int | None:
    """This process's resident memory (``/proc/self/statm``); None where unreadable."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None


def left_alone(version: tuple[int, ...] = tuple(sys.version_info[:2]),
               implementation: str = sys.implementation.name) -> str | None:
    """Why the collector is not tuned on this interpreter (the running one by default),
    in words; None when the policy here is for it: CPython before 3.14."""
    if implementation != "cpython":
        return (f"{implementation} is not CPython, whose collector of three generations "
                "nvpair's tuning is written for")
    if tuple(version[:2]) >= (3, 14):
        return (f"CPython {version[0]}.{version[1]}'s incremental collector has no "
                "generation 1, which nvpair's tuning is written for")
    return None


@dataclass(frozen=True)
class Policy:
    """The collector's thresholds, and when a full collection is worth its pause."""

    check_s: float = 3600.0
    growth: float = 1.25
    thresholds: tuple[int, int, int] = (700, 1, 10)
    #: young objects (generations 0 and 1) above which ``trim`` collects (see the module)
    young_limit: int = 2_000
    #: the young generation's size is looked at every this many seconds at least, at most
    young_check_s: tuple[float, float] = (1 / 32, 1.0)


@dataclass
class Collector:
    """Freezes what is alive after each automatic collection of the middle generation; a
    full collection only when the resident memory grew (see the module). ``rss`` is the
    seam tests use."""

    policy: Policy = Policy()
    rss: Callable[[], int | None] = resident_bytes
    #: full collections run, and the last one's length in seconds (``nvpair`` logs them)
    full_runs: int = 0
    last_full_s: float = 0.0
    #: collections ``trim`` ran
    trims: int = 0
    _settled: int | None = None

    def freeze(self) -> None:
        """Collect the young generations, then freeze everything alive (sync)."""
        gc.collect(1)
        gc.freeze()

    def full(self) -> int:
        """Unfreeze and run one full collection, then freeze again; the objects freed."""
        started = time.perf_counter()
        gc.unfreeze()
        freed = gc.collect()
        gc.freeze()
        self.full_runs += 1
        self.last_full_s = time.perf_counter() - started
        self._settled = self.rss()
        return freed

    def check(self) -> bool:
        """Whether the resident memory grew by ``growth`` since the last full collection
        (the first check only notes it); a full collection then."""
        now = self.rss()
        if now is None:
            return False
        if self._settled is None:
            self._settled = now
            return False
        if now < self._settled * self.policy.growth:
            return False
        settled = self._settled
        freed = self.full()
        log.info("nvpair's memory grew from %.1f to %.1f MB: a full garbage collection took "
                 "%.1f ms and freed %d objects", settled / 2**20, now / 2**20,
                 self.last_full_s * 1000, freed)
        return True

    def begin(self) -> None:
        """The thresholds, the first freeze, and the memory it settles at (sync)."""
        gc.set_threshold(*self.policy.thresholds)
        self.freeze()
        self.check()

    def _collected(self, phase: str, info: dict[str, int]) -> None:
        """``gc.callbacks``: after a collection of generation 1 or 2 (the young ones
        walked), freeze what survived."""
        if phase == "stop" and info.get("generation", 0) >= 1:
            gc.freeze()

    def trim(self) -> int:
        """When the young generations hold more than ``young_limit`` objects (what a
        collection of them would walk), collect them and freeze what survived (sync);
        the young objects seen."""
        young = len(gc.get_objects(0)) + len(gc.get_objects(1))
        if young > self.policy.young_limit:
            self.freeze()
            self.trims += 1
        return young

    def next_look(self, since_s: float, young: int) -> float:
        """When to look at the young generations again: when, at the rate they grew since
        the last look ``since_s`` ago (``young`` now, none after it), they will hold half
        the limit; within ``young_check_s``."""
        shortest, longest = self.policy.young_check_s
        every_s = longest if young <= 0 else since_s * self.policy.young_limit / 2 / young
        return min(max(every_s, shortest), longest)

    async def keep(self) -> None:
        """After ``begin``: freeze after each collection of generation 1 or 2, hold the
        young generations to ``young_limit`` (``trim``), check the memory every
        ``check_s``; forever. Cancellation: at its sleep; the freezing stops with it."""
        gc.callbacks.append(self._collected)
        try:
            every_s = self.policy.young_check_s[1]
            looked = trio.current_time()
            check_at = looked + self.policy.check_s
            while True:
                await wakes.sleep_until(trio.current_time() + every_s,
                                        wakes.grid_for(every_s, slack=1.0))
                now = trio.current_time()
                every_s = self.next_look(now - looked, self.trim())
                looked = now
                if now >= check_at:
                    check_at += self.policy.check_s
                    self.check()
        finally:
            gc.callbacks.remove(self._collected)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        """``begin``, then ``keep``. Started value: None, after the first freeze.
        Cancellation: as ``keep``. Raises nothing of its own."""
        self.begin()
        task_status.started()
        await self.keep()
