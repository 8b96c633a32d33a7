"""A simulated engine's sleep: asleep or awake, the idle timer, the wake time, the counts.

One concept shared by the kinds that sleep (docs/simulators.md, "Sleep"):

* llama.cpp ``--sleep-idle-seconds N``: asleep once no task ran for N seconds. Only a task
  (an inference request, or ``GET /slots``, which posts one to the task queue) wakes it
  and resets the timer; ``/health``, ``/props``, ``/v1/models`` and ``/metrics`` do
  neither. That is what a real llama-server did when watched (docs/simulators.md).
* vLLM ``POST /sleep`` and ``POST /wake_up``, SGLang ``release_memory_occupation`` and
  ``resume_memory_occupation``: asleep when told, awake when told (a task does not wake
  them; the kind decides what a request to a sleeping engine gets).

Sleeping frees the simulated resident memory (``nvpair.sim.leak``) and waking holds it
again, after ``wake_s`` seconds. ``wakes`` and ``sleeps`` count the transitions, so a test
can see from the engine's side that a probe woke nothing.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import trio


class SimSleep:
    """Whether the engine sleeps now, and its transitions. ``idle_s``: asleep after this
    long without a task (None: only when told); ``wake_s``: how long waking takes;
    ``on_sleep`` and ``on_wake``: what falling asleep frees and waking holds again."""

    def __init__(self, *, idle_s: float | None, wake_s: float = 0.0,
                 on_change: Callable[[], None] = lambda: None,
                 on_sleep: Callable[[], None] = lambda: None,
                 on_wake: Callable[[], None] = lambda: None) -> None:
        if idle_s is not None and idle_s < 0:
            raise ValueError("the idle sleep time must be >= 0 (None: never by itself)")
        if wake_s < 0:
            raise ValueError("wake_s must be >= 0")
        self.idle_s = idle_s
        self.wake_s = wake_s
        self.asleep = False
        self.sleeps = 0
        self.wakes = 0
        #: tasks running now (the idle timer starts when the last one ends)
        self.tasks = 0
        self.last_task_at = trio.current_time()
        self._waking: trio.Event | None = None
        self._changed = trio.Event()
        self._on_change, self._on_sleep, self._on_wake = on_change, on_sleep, on_wake

    def attach(self, *, on_sleep: Callable[[], None], on_wake: Callable[[], None]) -> None:
        """What falling asleep frees and waking holds again (the simulated memory)."""
        self._on_sleep, self._on_wake = on_sleep, on_wake

    @property
    def waking(self) -> bool:
        return self._waking is not None

    def view(self) -> dict[str, object]:
        """What the simulator's stats show (``engine.sleep``)."""
        return {"asleep": self.asleep, "waking": self.waking, "sleeps": self.sleeps,
                "wakes": self.wakes}

    def _kick(self) -> None:
        self._changed.set()
        self._changed = trio.Event()
        self._on_change()

    def fall_asleep(self) -> bool:
        """Sleep now (False: asleep already, or a task runs or wakes it)."""
        if self.asleep or self.tasks or self._waking is not None:
            return False
        self.asleep = True
        self.sleeps += 1
        self._on_sleep()
        self._kick()
        return True

    async def wake(self) -> None:
        """Awake, after ``wake_s`` when asleep; callers at once share one wake."""
        if self._waking is not None:
            await self._waking.wait()
            return
        if not self.asleep:
            await trio.lowlevel.checkpoint()
            return
        done = self._waking = trio.Event()
        self._kick()
        try:
            await trio.sleep(self.wake_s)
            self._on_wake()
            self.asleep = False
            self.wakes += 1
            self.last_task_at = trio.current_time()
        finally:
            self._waking = None
            done.set()
            self._kick()

    @asynccontextmanager
    async def task(self) -> AsyncIterator[None]:
        """Held while a task runs: it wakes the engine first, and the idle timer restarts
        when the last task ends."""
        self.tasks += 1
        try:
            await self.wake()
            yield
        finally:
            self.tasks -= 1
            self.last_task_at = trio.current_time()
            self._kick()

    async def run(self) -> None:
        """Fall asleep after ``idle_s`` without a task, forever (nothing without
        ``idle_s``). Not startable; runs until cancelled."""
        if self.idle_s is None:
            return
        while True:
            changed = self._changed
            due = self.last_task_at + self.idle_s
            if not self.asleep and not self.tasks and self._waking is None:
                if trio.current_time() >= due:
                    self.fall_asleep()
                    continue
                with trio.move_on_at(due):
                    await changed.wait()
            else:
                await changed.wait()
