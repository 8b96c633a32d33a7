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
* ``Ticker`` is a periodic loop's schedule on it; ``probing`` counts an engine's probes
  in the node's rate for as long as its probes run (per Trio run: ``trio.lowlevel.RunVar``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import trio

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

_RATE: trio.lowlevel.RunVar[float] = trio.lowlevel.RunVar("nvpair.wakes.rate", default=0.0)


@contextmanager
def probing(per_s: float) -> Iterator[None]:
    """Count ``per_s`` probes a second in the node's probe rate while the block runs."""
    _RATE.set(_RATE.get() + per_s)
    try:
        yield
    finally:
        _RATE.set(_RATE.get() - per_s)


def probe_rate() -> float:
    """Probes a second of every engine whose probes run now (in this Trio run)."""
    return max(0.0, _RATE.get())


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
        await trio.sleep_until(on_grid(self.nominal, self.grid))
