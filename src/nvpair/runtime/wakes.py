"""Wake-ups on a shared grid (timer coalescing): periodic work wakes together.

On an idle node much of nvpair's CPU is the cost of waking up, not the work done awake:
on the reference machine a small step that takes 0.6 ms back to back takes 1.3-3.4 ms
after a 1 s sleep and 1.8-7.9 ms after 3 s (cold caches; ``python -m
benchmarks.wake_cost``), and five of them in one wake-up take about 5 ms where five
wake-ups take 7-11 (docs/benchmarks.md, "Wake-ups on a grid"). So
each periodic loop keeps its nominal schedule (the same number of ticks per hour) but
sleeps until the next point of a grid shared by the whole process, at or after its
nominal time: loops with different phases then wake at the same instants.

* ``grid_for(interval_s, rate)`` picks the grid: a power of two seconds (so every grid's
  points are points of the coarser ones), at most ``SLACK`` of the loop's interval (a
  5 s health probe is at most 0.5 s late), at most ``MAX_GRID_S``, and, for probes, fine
  enough that the node's probes (``rate`` a second, all engines) come about ``PER_WAKE``
  to a point: at 1,024 engines a 1/64 s grid, so they never come in one burst.
* ``sleep_until(t, grid)`` sleeps to the grid point at or after ``t``. The loops that
  sleep to one point are woken by one timer of the Trio run (a system task with one
  deadline), not each by a deadline of its own: Trio's ``sleep_until`` makes a cancel
  scope, its status and four coroutines for each sleep and wakes it by raising
  ``Cancelled`` through them; here a sleep is one coroutine waiting to be rescheduled
  (at 1,024 engines the sleeps of the probe loops were nearly half of what each young
  collection walked: docs/benchmarks.md, "One timer for the probe loops' sleeps").
* ``Ticker`` is a periodic loop's schedule on it. The probe loops pass the node's probe
  rate in (``nvpair.probing.prober.node_probe_rate``, from the configured engines).
"""

from __future__ import annotations

import heapq
import logging
import math
from functools import partial

import trio
from trio.lowlevel import Abort, RaiseCancelT, Task

log = logging.getLogger("nvpair.wakes")

#: a loop is late by at most this share of its interval
SLACK = 0.1
#: the coarsest grid (housekeeping: the collector, pool reaping, the history, the memory
#: watch, whose periods are 2 s and more, use this one)
MAX_GRID_S = 1.0
HOUSEKEEPING_S = MAX_GRID_S
#: below this a grid is not worth its lateness: the loop keeps its own time
MIN_GRID_S = 1 / 64
#: probes per grid point, on average, that the probe grid aims at
PER_WAKE = 4.0


#: loops whose lateness may be up to half their period (housekeeping)
HOUSEKEEPING_SLACK = 0.5

def grid_for(interval_s: float, rate: float = 0.0, slack: float = SLACK) -> float:
    """The grid for a loop of ``interval_s`` (0: none), late by at most ``slack`` of it,
    with ``rate`` probes a second in the node when the loop is one of them (see the
    module)."""
    widest = min(slack * interval_s, MAX_GRID_S)
    if rate > 0:
        widest = min(widest, PER_WAKE / rate)
    if widest < MIN_GRID_S:
        return 0.0
    return float(2.0 ** math.floor(math.log2(widest)))


def on_grid(t: float, grid: float) -> float:
    """The first point of ``grid`` at or after ``t`` (``t`` itself when grid is 0)."""
    if grid <= 0:
        return t
    return math.ceil(t / grid) * grid


async def sleep_until(t: float, grid: float) -> None:
    """Sleep until the first point of ``grid`` at or after ``t`` (until ``t`` when grid is
    0), woken with every other sleep to that point by the run's one timer.

    A checkpoint, as Trio's ``sleep_until``: cancellation ends the sleep with
    ``trio.Cancelled``; raises ``ValueError`` for a NaN ``t``."""
    if math.isnan(t):
        raise ValueError("sleep_until: the time is NaN")
    at = on_grid(t, grid)
    timer = _timer() if grid > 0 and at > trio.current_time() else None
    if timer is None:
        await trio.sleep_until(at)
        return
    task = trio.lowlevel.current_task()
    timer.add(at, task)
    await trio.lowlevel.wait_task_rescheduled(partial(timer.abort, at, task))


class _Timer:
    """The sleeps of one Trio run to grid points, and the system task that ends them.

    ``waiting`` holds the sleeping tasks of each point; ``due`` is a heap of the points (a
    point whose sleepers all left stays there until it comes: waking it wakes nobody). The
    task sleeps in a cancel scope whose deadline is the earliest point, moved earlier
    when an earlier point is added, and at each point reschedules its sleepers at once."""

    def __init__(self) -> None:
        self.waiting: dict[float, dict[Task, None]] = {}
        self.due: list[float] = []
        self.scope = trio.CancelScope()
        self.broken = False

    def add(self, at: float, task: Task) -> None:
        tasks = self.waiting.get(at)
        if tasks is None:
            tasks = self.waiting[at] = {}
            heapq.heappush(self.due, at)
            if at < self.scope.deadline:
                self.scope.deadline = at
        tasks[task] = None

    def abort(self, at: float, task: Task, _raise_cancel: RaiseCancelT) -> Abort:
        """A sleeper cancelled: it leaves its point (Trio then raises ``Cancelled`` in it)."""
        tasks = self.waiting.get(at)
        if tasks is not None:
            tasks.pop(task, None)
            if not tasks:
                del self.waiting[at]
        return Abort.SUCCEEDED

    def wake_due(self) -> None:
        """Reschedule the sleepers of every point come; each leaves ``waiting`` as it is
        woken, so that a failure midway leaves the rest there for ``run`` to wake."""
        now = trio.current_time()
        while self.due and self.due[0] <= now:
            tasks = self.waiting.get(self.due[0], {})
            while tasks:
                trio.lowlevel.reschedule(tasks.popitem()[0])
            self.waiting.pop(heapq.heappop(self.due), None)

    async def run(self) -> None:
        """The timer task: runs until the run ends (cancelled then). A bug here must not
        end the run (a system task's exception would) nor leave a sleeper asleep: every
        sleeper is woken at once, and later sleeps keep their own deadlines."""
        try:
            while True:
                with trio.CancelScope(deadline=self.due[0] if self.due else math.inf) as scope:
                    self.scope = scope
                    await trio.sleep_forever()
                self.wake_due()
        except Exception:
            log.exception("the wake-up timer stopped (a bug in nvpair); sleeps keep their "
                          "own deadlines from now on")
            self.broken = True
            for tasks in self.waiting.values():
                for task in tasks:
                    trio.lowlevel.reschedule(task)
            self.waiting.clear()


_TIMER: trio.lowlevel.RunVar[_Timer | None] = trio.lowlevel.RunVar("nvpair.wakes.timer",
                                                                   default=None)


def _timer() -> _Timer | None:
    """This run's timer, its task started on first use; None once it broke."""
    timer = _TIMER.get()
    if timer is None:
        timer = _Timer()
        _TIMER.set(timer)
        trio.lowlevel.spawn_system_task(timer.run, name="nvpair.wakes.timer")
    return None if timer.broken else timer


class Ticker:
    """A periodic loop's schedule: a tick every ``every_s`` from when it was made (missed
    ticks are skipped, never doubled), each woken at the grid point after it."""

    def __init__(self, every_s: float, grid: float | None = None) -> None:
        self.every_s = every_s
        self.grid = grid_for(every_s, slack=HOUSEKEEPING_SLACK) if grid is None else grid
        self.nominal = trio.current_time()

    async def tick(self) -> None:
        """Sleep until the next tick. Cancellation: a plain sleep."""
        now = trio.current_time()
        self.nominal += self.every_s
        if self.nominal < now:
            self.nominal = now
        await sleep_until(self.nominal, self.grid)
