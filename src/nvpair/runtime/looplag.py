"""An opt-in loop-lag probe: how long the event loop went without running a 5 ms timer.

With ``NVPAIR_LOOP_LAG_FILE=PATH`` in its environment, ``nvpair serve`` runs a task that
sleeps 5 ms in a loop and measures the gap between its wake-ups, and a Trio instrument
times every task step. Once a second it appends one JSON line to ``PATH``: ``{"t": <unix
time>, "max_ms": <longest gap in that second>, "max_cpu_ms": <the CPU the loop's thread
spent in that gap>, "ticks": <wake-ups>, "step_ms": <longest task step>, "step_task": <the
task that took it>, "gc_ms": <longest garbage collection>, "gc_gen": <its generation>}``.
A gap is what any task waiting on the loop waited at worst, the timer's own 5 ms included,
so an idle loop shows about 5 ms and a step that held the loop for 40 ms shows about 45;
the step names who held it. A gap long by the clock in which the thread spent little CPU
was the process waiting for a core (the machine busy), not nvpair's work.

Steps are timed by the clock only (``time.perf_counter``, about 60 ns). Before 8dc19e2 they
were timed by the thread's CPU clock as well, but ``time.thread_time`` is a system call
(about 0.75 us here), and two of them a step more than doubled what a short task step
costs (about 3 us bare, 7-8 us so timed, 4 us timed by the clock only): the probe added
load to what it measured. The CPU clock is now read once a tick.

While a file
``PATH.pause`` exists the probe pauses (checked once a second). Without the variable
nothing runs. The benchmarks
(docs/benchmarks.md) read the file to report the longest stall beside the latencies.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import time

import trio

from nvpair.runtime import wakes

log = logging.getLogger("nvpair.looplag")

ENV = "NVPAIR_LOOP_LAG_FILE"
TICK_S = 0.005
REPORT_S = 1.0
#: while ``PATH`` + this exists the probe does not tick (nor time task steps): its own 200
#: wake-ups a second cost about 2 % of a core, which a benchmark of idle CPU must not count
PAUSE_SUFFIX = ".pause"
PAUSED_CHECK_S = 1.0


class _Steps(trio.abc.Instrument):
    """The longest task step since the last ``take()`` and its task's name, by the clock
    (see the module for why not by the CPU clock too)."""

    def __init__(self) -> None:
        self.started: float | None = None  # the step running when added is not timed
        self.worst = 0.0
        self.task = ""

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self.started = time.perf_counter()

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        if self.started is None:
            return
        took = time.perf_counter() - self.started
        if took > self.worst:
            self.worst, self.task = took, task.name

    def take(self) -> dict[str, float | int | str]:
        out: dict[str, float | int | str] = {
            "step_ms": round(self.worst * 1000, 3), "step_task": self.task}
        self.worst = 0.0
        self.task = ""
        return out


class _Collections:
    """The longest garbage collection since the last ``take()`` (a pause inside whatever step
    allocated at the time), from ``gc.callbacks``."""

    def __init__(self) -> None:
        self.started = 0.0
        self.worst = 0.0
        self.generation = -1

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self.started = time.perf_counter()
            return
        took = time.perf_counter() - self.started
        if took > self.worst:
            self.worst, self.generation = took, info.get("generation", -1)

    def take(self) -> dict[str, float | int | str]:
        out: dict[str, float | int | str] = {"gc_ms": round(self.worst * 1000, 3),
                                             "gc_gen": self.generation}
        self.worst, self.generation = 0.0, -1
        return out


def _append(fd: int, line: dict[str, float | int | str]) -> None:
    """One short line to a local file opened with O_APPEND: a few microseconds."""
    os.write(fd, (json.dumps(line) + "\n").encode())


def _paused(pause: str) -> bool:
    """Whether the pause file exists (one stat of a local file: microseconds)."""
    return os.path.exists(pause)


async def probe(path: str, tick_s: float = TICK_S, report_s: float = REPORT_S) -> None:
    """Measure until cancelled, appending a line to ``path`` every ``report_s`` seconds.

    Never returns by itself; cancellation ends it (the last partial second is written).
    Raises OSError only when ``path`` cannot be opened.
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    steps, collections = _Steps(), _Collections()
    pause = path + PAUSE_SUFFIX
    worst, worst_cpu, ticks = 0.0, 0.0, 0
    try:
        while True:
            paused = wakes.Ticker(PAUSED_CHECK_S, wakes.HOUSEKEEPING_S)
            while True:  # (a pause is checked once a report: see PAUSE_SUFFIX)
                if not _paused(pause):
                    break
                await paused.tick()  # (on the housekeeping grid: no wake-up of its own)
            trio.lowlevel.add_instrument(steps)
            gc.callbacks.append(collections)
            last, last_cpu = trio.current_time(), time.thread_time()
            report_at = last + report_s
            try:
                while True:
                    await trio.sleep(tick_s)
                    now, cpu = trio.current_time(), time.thread_time()
                    if now - last > worst:
                        worst, worst_cpu = now - last, cpu - last_cpu
                    ticks += 1
                    last, last_cpu = now, cpu
                    if now >= report_at:
                        _append(fd, {"t": round(time.time(), 3),
                                     "max_ms": round(worst * 1000, 3),
                                     "max_cpu_ms": round(worst_cpu * 1000, 3), "ticks": ticks,
                                     **steps.take(), **collections.take()})
                        worst, worst_cpu, ticks = 0.0, 0.0, 0
                        report_at = now + report_s
                        if _paused(pause):
                            break
            finally:
                trio.lowlevel.remove_instrument(steps)
                gc.callbacks.remove(collections)
    finally:
        if ticks:
            _append(fd, {"t": round(time.time(), 3), "max_ms": round(worst * 1000, 3),
                         "max_cpu_ms": round(worst_cpu * 1000, 3), "ticks": ticks,
                         **steps.take(), **collections.take()})
        os.close(fd)


async def from_env() -> None:
    """The probe if ``NVPAIR_LOOP_LAG_FILE`` is set; otherwise returns at once. A file that
    cannot be written is a warning, never an error of the service."""
    path = os.environ.get(ENV)
    if path:
        try:
            await probe(path)
        except OSError as exc:
            log.warning("loop-lag probe stopped: %s: %s", path, exc)
        except Exception:  # a bug in the probe is the probe's, never the service's
            log.exception("loop-lag probe stopped (a bug in nvpair)")
