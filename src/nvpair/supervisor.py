"""One engine's supervisor: its probe client and its probe loops in one nursery.

Each loop runs inside its own fault boundary (``nvpair.boundary.Part``): an exception out
of a loop (a bug of nvpair's, or an engine answer no parser expected) makes the engine
``unhealthy`` with the reason in words, is logged once, and the loop is restarted after a
backoff. It never reaches the service: the other engines, the API and the other loop of
this engine go on. A good probe afterwards recovers the engine by the usual rules.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from functools import partial

import httpx2
import trio

from nvpair.boundary import Part
from nvpair.config import EngineSpec
from nvpair.prober import ProbeMemory, Prober, open_client, overdue_after
from nvpair.router.traffic import Traffic
from nvpair.snapshot import Board, EngineState
from nvpair.state import enter


def initial_state(spec: EngineSpec) -> EngineState:
    return EngineState(
        name=spec.name,
        kind=spec.kind,
        url=spec.url,
        managed=spec.managed,
        state="starting",
        since=trio.current_time(),
        optional=spec.optional,
        aliases=spec.aliases,
        overdue_after_s=overdue_after(spec.probes.health.interval_s, spec.probes.health.timeout_s),
    )


def unhealthy_with(board: Board, name: str) -> Callable[[str | None], None]:
    """A part's ``publish``: its failure makes engine ``name`` unhealthy with the reason.
    A recovery publishes nothing: the next good probe moves the engine on by the usual
    rules (and clears the error)."""

    def publish(reason: str | None) -> None:
        if reason is None:
            return

        def change(e: EngineState) -> EngineState:
            if e.state == "stopped":  # stopped on purpose: that stays what it shows
                return e
            return enter(e, "unhealthy", trio.current_time(), error=reason)

        board.update(name, change)

    return publish


class LoopPart(Part):
    """A probe loop's boundary. It works again once one of its probes has recorded a
    result after the failure (a loop that never returns says so no other way)."""

    def __init__(self, name: str, board: Board, engine: str, probes: tuple[str, ...]) -> None:
        super().__init__(name, unhealthy_with(board, engine))
        self.board, self.engine, self.probes = board, engine, probes
        self.failed_at = float("-inf")
        self._failing = trio.Event()

    def failed(self, exc: BaseException) -> str:
        self.failed_at = trio.current_time()
        self._failing.set()
        return super().failed(exc)

    async def watch_recovery(self) -> None:
        """Call ``ok()`` when a probe result newer than the last failure is on the board."""
        while True:
            await self._failing.wait()
            version = -1
            while self.failure is not None:
                snap = await self.board.wait_changed(version)
                version = snap.version
                e = snap.engine(self.engine)
                if e is not None and any(
                        (s := e.probe(p)) is not None and s.at is not None
                        and s.at > self.failed_at for p in self.probes):
                    self.ok()
            self._failing = trio.Event()


async def run_probes(
    spec: EngineSpec,
    board: Board,
    registry: MutableMapping[str, Prober],
    *,
    transport: httpx2.AsyncBaseTransport | None = None,
    traffic: Traffic | None = None,
    memory: ProbeMemory | None = None,
    task_status: trio.TaskStatus[Prober] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Probe one engine until cancelled. Started value: its Prober (registered for the sweep).

    ``memory`` is what the engine's probes remember across restarts (the runner's).
    Cancellation closes the engine's client, so no connection outlives the loops.
    """
    async with open_client(spec, transport) as client, trio.open_nursery() as nursery:
        prober = Prober(spec, board, client, traffic, memory)
        registry[spec.name] = prober
        try:
            loops: list[tuple[str, tuple[str, ...], Callable[[], Awaitable[None]]]] = [
                ("health probes", ("ready", "health"), prober.run_liveness),
                ("identity probe", ("identity",), prober.run_identity),
            ]
            for what, names, loop in loops:
                part = LoopPart(f"engine {spec.name}: {what}", board, spec.name, names)
                nursery.start_soon(part.watch_recovery)
                nursery.start_soon(partial(part.supervise, loop))
            task_status.started(prober)
            await trio.sleep_forever()
        finally:
            if registry.get(spec.name) is prober:
                del registry[spec.name]
