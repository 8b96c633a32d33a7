"""The engines' runners as a set that changes while nvpair runs (a reload).

Each runner runs in the fleet's nursery inside a cancel scope of its own, so one engine
can be stopped, replaced or added without touching any other: an unchanged engine keeps
its task, its process and its probes. Taking an engine out is a drain first (it stops
admitting; the routed requests in flight finish, however long they take: nothing
generating is cut), then the cancellation of its scope, which stops a managed process
gracefully (``EngineRunner.run``). That happens in a task of its own: the caller never
waits for a drain.

The ``runners`` dict is shared with the parts that look engines up by name (the API's
control, the memory watch, the activator): the fleet keeps it current, and a replaced
engine's new runner is in it once the old one has stopped.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import trio

from nvpair.base.boundary import Part
from nvpair.supervision.lifecycle import DRAIN_POLL_S, EngineRunner

log = logging.getLogger("nvpair.lifecycle")


@dataclass
class _Slot:
    runner: EngineRunner
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    ended: trio.Event = field(default_factory=trio.Event)
    #: set while the engine is being taken out (its drain and stop under way)
    leaving: bool = False


class Fleet:
    """Runs, replaces and removes engine runners by name (see the module docstring)."""

    def __init__(self, runners: dict[str, EngineRunner]) -> None:
        self.runners = runners
        self._slots: dict[str, _Slot] = {}
        #: what replaces an engine being taken out, by name (the newest asked for wins)
        self._next: dict[str, Callable[[], EngineRunner]] = {}
        #: what to call once an engine is out (the newest asked for wins)
        self._after: dict[str, Callable[[EngineRunner], None] | None] = {}
        self._nursery: trio.Nursery | None = None

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        """Own the runners until cancelled. Started value: None, at once (runners may be
        started from then on). Cancellation stops every engine (each runner's own
        graceful stop, in parallel). Raises: nothing but Cancelled (a runner's failure is
        its engine's state)."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                task_status.started()
                await trio.sleep_forever()
        finally:
            self._nursery = None  # (a reload that ends after nvpair's shutdown starts none)

    def start(self, runner: EngineRunner) -> None:
        """Run ``runner`` (it becomes ``runners[name]``). Sync. An engine of that name
        still being taken out (removed, then added back) is replaced by it once out.
        Once the fleet has ended (nvpair shuts down), nothing is started."""
        if self._nursery is None:  # the fleet has ended: nvpair is shutting down
            return
        if self.leaving(runner.spec.name):
            self.replace(runner.spec.name, lambda: runner)
            return
        slot = _Slot(runner)
        self._slots[runner.spec.name] = slot
        self.runners[runner.spec.name] = runner
        self._nursery.start_soon(self._run, slot)

    @staticmethod
    async def _run(slot: _Slot) -> None:
        try:
            with slot.scope:
                await slot.runner.run()
        finally:
            slot.ended.set()

    def replace(self, name: str, make: Callable[[], EngineRunner],
                then: Callable[[EngineRunner], None] | None = None) -> None:
        """Drain engine ``name`` and stop it, then start ``make()`` in its place and call
        ``then(new runner)``. Sync: the drain runs in a task of its own. Asked again while
        the old one drains, the newest ``make`` is the one started."""
        self._next[name] = make
        self._take_out(name, "its config changed (reload)", then)

    def remove(self, name: str, then: Callable[[], None] | None = None) -> None:
        """Drain engine ``name`` and stop it (an adopted one is only forgotten: nvpair never
        signals it), then call ``then()``. Sync."""
        self._next.pop(name, None)
        self._take_out(name, "removed from the config (reload)",
                       None if then is None else lambda _runner: then())

    def _take_out(self, name: str, reason: str,
                  then: Callable[[EngineRunner], None] | None) -> None:
        if self._nursery is None:  # the fleet has ended: every engine has stopped
            return
        slot = self._slots[name]
        if slot.leaving:  # its drain is under way: it ends with what is asked last
            self._after[name] = then
            return
        slot.leaving = True
        self._after[name] = then
        if slot.runner.spec.managed:
            slot.runner.drain(then="stop", reason=reason, bounded=False)
        self._nursery.start_soon(self._leave, name, slot)

    async def _leave(self, name: str, slot: _Slot) -> None:
        runner = slot.runner
        if runner.spec.managed:  # until nothing routed to it is in flight, and it stopped
            # (by its own drain: a kept engine, on_exit = "keep", outlives a cancellation
            # of its runner, so a cancel alone left it running beside its successor)
            while not (_in_flight(runner) == 0 and _at_rest(runner)) and not slot.ended.is_set():
                with trio.move_on_after(DRAIN_POLL_S):  # (the router's count: polled)
                    await slot.ended.wait()
        slot.scope.cancel(reason="taken out of the config (reload)")
        await slot.ended.wait()
        if self._slots.get(name) is slot:
            del self._slots[name]
        then = self._after.pop(name, None)
        make = self._next.pop(name, None)
        # (what comes after, a new runner or the caller's step, is this engine's: a
        # failure in it, a bug, is logged as the engine's and never ends the fleet)
        if self.runners.get(name) is runner:  # (it has ended: its successor, if any,
            del self.runners[name]            # takes the name once made)
        with Part(f"engine {name}: reload", logger=log).guard():
            if make is None:
                if then is not None:
                    then(runner)
                return
            new = make()
            self.start(new)
            if then is not None:
                then(new)

    def leaving(self, name: str) -> bool:
        """Whether engine ``name`` is being taken out (drained, stopped, replaced)."""
        slot = self._slots.get(name)
        return slot is not None and slot.leaving


def _at_rest(runner: EngineRunner) -> bool:
    """The runner's engine is stopped (its drain to a stop has ended) and stays so."""
    return runner.desired == "stopped" and runner.operation is None


def _in_flight(runner: EngineRunner) -> int:
    """Routed requests in flight on the runner's engine (the router's count)."""
    entry = None if runner.traffic is None else runner.traffic.engines.get(runner.spec.name)
    return 0 if entry is None else entry.in_flight
