"""The handle ``serve_sim`` starts with: ports, stats, and sync controls for in-process tests.

Every control here is also reachable over the control port (:mod:`nvpair.sim.control`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from nvpair.sim.accounting import PathStats
from nvpair.sim.dist import Rendezvous
from nvpair.sim.engine import Engine
from nvpair.sim.faults import Fault, FaultMode, GarbageKind
from nvpair.sim.options import Phase, SimOptions
from nvpair.sim.port import EnginePort


class SimStats(msgspec.Struct, frozen=True):
    """A snapshot of one simulator (``GET /__sim/stats`` sends it as JSON)."""

    kind: str
    phase: str
    #: the model name served now (the ``mismatch`` fault changes it).
    model: str
    port: int
    #: whether the engine port accepts connections now.
    listening: bool
    control_port: int | None
    faults: tuple[Fault, ...]
    #: kind-specific state: SGLang's server_status, Ollama's loaded models, workers, ...
    engine: dict[str, Any]
    #: accepted connections on the engine port.
    connections: int
    active_generations: int
    tokens_generated: int
    exit_code: int | None
    total: PathStats
    paths: dict[str, PathStats]

    def path(self, path: str) -> PathStats:
        """The stats of ``path`` (zeros when it was never requested)."""
        return self.paths.get(path, PathStats())


class SimHandle:
    """A running simulator. Methods are sync and take effect at once."""

    def __init__(self, engine: Engine, port: EnginePort) -> None:
        self._engine = engine
        self._state = engine.state
        self._port = port
        self.options: SimOptions = engine.options
        self.kind: str = engine.options.kind
        #: the engine port (0 for a headless vLLM worker, which has none).
        self.port = engine.port
        self.control_port: int | None = None
        #: rank 0 of a multi-node group: the port workers join (its dist_init_addr port).
        self.dist_port: int | None = None
        self.child_pids: tuple[int, ...] = ()
        self.rendezvous: Rendezvous | None = None

    @property
    def url(self) -> str:
        return _url(self.options.host, self.port)

    @property
    def control_url(self) -> str | None:
        return None if self.control_port is None else _url(self.options.host, self.control_port)

    @property
    def dist_addr(self) -> str | None:
        return None if self.dist_port is None else f"{self.options.host}:{self.dist_port}"

    @property
    def phase(self) -> Phase:
        return self._state.phase

    @property
    def exit_code(self) -> int | None:
        return self._state.exit_code

    @property
    def engine(self) -> Engine:
        return self._engine

    @property
    def listening(self) -> bool:
        return self._port.listening

    async def settle(self) -> None:
        """Wait until the engine port listens exactly when the phase and faults say it should
        (a phase or fault set from outside is applied to the listener by a task)."""
        engine = self._engine
        await self._state.wait_until(
            lambda: engine.headless or self._port.listening == engine.wants_listening()
        )

    def stats(self) -> SimStats:
        state = self._state
        total, paths = state.accounting.snapshot()
        extra = self._engine.status()
        if self._engine.sleep is not None:
            extra = {**extra, "sleep": self._engine.sleep.view()}
        if self.rendezvous is not None:
            extra |= {"workers_joined": sorted(self.rendezvous.joined),
                      "workers_ready": sorted(self.rendezvous.ready)}
        if self.child_pids:
            extra["child_pids"] = list(self.child_pids)
        return SimStats(
            kind=self.kind, phase=state.phase, model=self._engine.served_model, port=self.port,
            listening=self._port.listening, control_port=self.control_port,
            faults=state.faults.active(), engine=extra,
            connections=state.connections, active_generations=state.active,
            tokens_generated=state.tokens_generated, exit_code=state.exit_code,
            total=total, paths=paths,
        )

    def set_fault(
        self, fault: Fault | FaultMode, *, paths: Sequence[str] = (), seconds: float | None = None,
        status: int | None = None, exit_code: int | None = None, model: str | None = None,
        kind: GarbageKind | None = None,
    ) -> None:
        """Switch a fault on (``"none"`` clears all); see :class:`Fault` for the modes."""
        if not isinstance(fault, Fault):
            fault = Fault(fault, paths=tuple(paths), seconds=seconds, status=status,
                          exit_code=exit_code, model=model, kind=kind)
        self._state.set_fault(fault)

    def clear_faults(self) -> None:
        self._state.set_fault(Fault("none"))

    def set_phase(self, phase: Phase) -> None:
        self._state.set_phase(phase)

    def reset_stats(self) -> None:
        self._state.accounting.reset()

    def stop(self) -> None:
        """What SIGTERM does: the engine shuts down its way, then exits with code 0."""
        self._state.request_stop()

    async def wait_phase(self, *phases: Phase) -> None:
        await self._state.wait_until(lambda: self._state.phase in phases)

    async def wait_until(self, predicate: Callable[[SimStats], bool]) -> SimStats:
        """Wait until ``predicate(stats)`` holds (re-checked on every change); the stats."""
        found: list[SimStats] = []

        def check() -> bool:
            stats = self.stats()
            if predicate(stats):
                found.append(stats)
                return True
            return False

        await self._state.wait_until(check)
        return found[0]

    async def wait_exited(self) -> int:
        await self._state.exited.wait()
        assert self._state.exit_code is not None
        return self._state.exit_code


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
