"""The simulated engine's core: phase, faults, accounting, the decode loop and the exit.

Everything here is changed by sync methods and read without locks. Each change bumps
``version`` and wakes the tasks in :meth:`SimState.wait_until`, so tasks and tests wait on
conditions instead of sleeping.
"""

from __future__ import annotations

import logging
import math
import os
import sys
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager

import trio

from nvpair.sim.accounting import Accounting
from nvpair.sim.faults import Fault, FaultBook, FaultMode
from nvpair.sim.options import PHASES, Phase, SimOptions

log = logging.getLogger("nvpair.sim")

#: phases in which the engine is up and serving (the listener is open for every kind).
SERVING: frozenset[str] = frozenset({"ready", "busy", "unhealthy", "hung", "dead"})


class SimState:
    """Mutable state of one simulator. Create it inside ``trio.run``."""

    def __init__(self, options: SimOptions) -> None:
        self.options = options
        self.phase: Phase = "loading"
        self.version = 0
        self._changed = trio.Event()
        self.faults = FaultBook()
        self.accounting = Accounting(on_change=self.touch)
        self.connections = 0
        #: generations running now, and tokens produced since start.
        self.active = 0
        self.tokens_generated = 0
        #: trio time the engine became busy (forced busy phase or a running generation).
        self.busy_since: float | None = None
        self.stop_requested = trio.Event()
        self.exited = trio.Event()
        self.exit_code: int | None = None

    def count_connection(self) -> None:
        self.connections += 1
        self.touch()

    # -- change notification ---------------------------------------------------------------

    def touch(self) -> None:
        self.version += 1
        self._changed.set()
        self._changed = trio.Event()

    async def wait_changed(self, since: int) -> None:
        """Return once anything changed after ``version`` was ``since``."""
        await trio.lowlevel.checkpoint()
        while self.version == since:
            await self._changed.wait()

    async def wait_until(self, predicate: Callable[[], bool]) -> None:
        """Return once ``predicate()`` is true; it is re-checked after every change."""
        await trio.lowlevel.checkpoint()
        while True:
            changed = self._changed
            if predicate():
                return
            await changed.wait()

    # -- phase and faults ------------------------------------------------------------------

    def set_phase(self, phase: Phase) -> None:
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}; one of {', '.join(PHASES)}")
        if phase == self.phase:
            return
        log.info("phase %s -> %s", self.phase, phase)
        self.phase = phase
        self._update_busy()
        self.touch()

    def set_fault(self, fault: Fault) -> None:
        self.faults.set(fault, trio.current_time())
        log.info("fault %s", "cleared" if fault.mode == "none" else fault)
        self.touch()

    def fault(self, mode: FaultMode, path: str | None = None) -> Fault | None:
        """The active fault of ``mode`` if it applies to ``path`` (any path when None)."""
        fault = self.faults.get(mode)
        if fault is None or (path is not None and not fault.matches(path)):
            return None
        return fault

    # -- stop and exit ---------------------------------------------------------------------

    def request_stop(self) -> None:
        """What SIGTERM does: the engine runs its shutdown, then exits."""
        self.stop_requested.set()

    def request_exit(self, code: int, *, hard: bool = False) -> None:
        """The process exits with ``code``. ``hard`` (a crash) may end the process at once."""
        if self.exit_code is not None:
            return
        log.info("exit %d%s", code, " (crash)" if hard else "")
        if hard and self.options.hard_exit:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        self.exit_code = code
        self.exited.set()
        self.touch()

    # -- the engine loop -------------------------------------------------------------------

    @property
    def busy(self) -> bool:
        return self.busy_since is not None

    def _update_busy(self) -> None:
        busy = self.phase == "busy" or self.active > 0
        if busy and self.busy_since is None:
            self.busy_since = trio.current_time()
        elif not busy:
            self.busy_since = None

    async def wait_not_hung(self) -> None:
        await self.wait_until(lambda: self.phase != "hung")

    async def wait_step_end(self) -> None:
        """A queued request: wait for the end of the current engine step.

        At once when idle, the rest of the current ``decode_step_s`` when busy, and until the
        engine is no longer hung when hung.
        """
        await trio.lowlevel.checkpoint()
        if self.phase == "hung":
            await self.wait_not_hung()
        since = self.busy_since
        if since is None:
            return
        step = self.options.decode_step_s
        # a request arriving on a boundary waits for the next one (the epsilon absorbs float
        # error, so that three serialized requests really take three steps)
        steps = math.floor((trio.current_time() - since) / step + 1e-9) + 1
        await trio.sleep_until(since + steps * step)

    @contextmanager
    def generating(self) -> Iterator[None]:
        """Marks a generation as running: the engine is busy while any is."""
        self.active += 1
        self._update_busy()
        self.touch()
        try:
            yield
        finally:
            self.active -= 1
            self._update_busy()
            self.touch()

    async def decode(self, n_tokens: int, on_token: Callable[[int], Awaitable[None]]) -> None:
        """Produce ``n_tokens`` at ``token_rate`` after ``prefill_s``; stops while hung.

        Call inside :meth:`generating`. ``on_token(i)`` runs after token ``i`` is produced.
        """
        interval = 1.0 / self.options.token_rate
        await trio.sleep(self.options.prefill_s)
        next_at = trio.current_time()
        for i in range(n_tokens):
            next_at += interval
            await trio.sleep_until(next_at)
            if self.phase == "hung":
                await self.wait_not_hung()
                next_at = trio.current_time()
            self.tokens_generated += 1
            self.touch()
            await on_token(i)
