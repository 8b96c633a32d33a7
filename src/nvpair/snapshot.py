"""The state of every engine as one immutable snapshot, and the board that publishes it.

Writers (probe loops, the sweep, the lifecycle) build a new snapshot and publish it with a
*sync* call: one reference assignment and a version bump. Readers take ``board.current``
once and never await before they finish with it, so they never wait on anything.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import msgspec
import trio

State = Literal["starting", "ready", "stale", "unhealthy", "down", "stopped"]
#: States whose models are listed (a stale engine is last known good).
LISTED_STATES: frozenset[str] = frozenset({"ready", "stale"})


class ProbeStats(msgspec.Struct, frozen=True):
    """What one probe of one engine has done: the last result and counters since start."""

    path: str
    ok: bool | None = None
    http_status: int | None = None
    latency_ms: float | None = None
    at: float | None = None  # trio time of the last result
    consecutive_failures: int = 0
    consecutive_successes: int = 0
    requests: int = 0
    failures: int = 0
    timeouts: int = 0
    latency_ms_max: float = 0.0
    latency_ms_total: float = 0.0
    error: str | None = None
    #: ticks skipped because real requests had just succeeded (passive health).
    passive: int = 0


class Model(msgspec.Struct, frozen=True):
    id: str
    created: int = 0
    owned_by: str = ""


class Identity(msgspec.Struct, frozen=True):
    model: str | None = None
    version: str | None = None


class EngineState(msgspec.Struct, frozen=True):
    name: str
    kind: str
    url: str
    managed: bool
    state: State = "starting"
    since: float = 0.0  # trio time the state was entered
    models: tuple[Model, ...] = ()
    models_at: float | None = None  # trio time of the last successful listing
    models_stale: bool = False
    #: models the engine listed that are not listed here (odd entries, beyond the cap), and
    #: why, in one line (see probes.parse_listing)
    models_left_out: int = 0
    models_left_out_why: str | None = None
    identity: Identity | None = None
    mismatch: str | None = None  # identity mismatch, reported as an error
    #: who found it, and only they clear it: "identity" (who answers) or "models" (the
    #: model list, for kinds whose identity names no model)
    mismatch_by: str | None = None
    #: a problem that does not change the state (e.g. the engine wants an API key nvpair
    #: lacks, so its model list cannot be read); shown as the error when there is no other.
    notice: str | None = None
    checked_at: float | None = None  # trio time of the last successful health/ready probe
    probes: tuple[tuple[str, ProbeStats], ...] = ()
    pid: int | None = None
    restarts: int = 0
    exit_code: int | None = None
    exited_at: float | None = None  # wall time
    error: str | None = None
    optional: bool = False
    aliases: tuple[str, ...] = ()
    #: a ready engine with no successful health probe for this long is reported stale.
    overdue_after_s: float = 30.0

    def probe(self, name: str) -> ProbeStats | None:
        for n, stats in self.probes:
            if n == name:
                return stats
        return None


class Snapshot(msgspec.Struct, frozen=True):
    version: int
    engines: tuple[EngineState, ...]

    def engine(self, name: str) -> EngineState | None:
        for e in self.engines:
            if e.name == name:
                return e
        return None


class Board:
    """Holds the current snapshot. Publishing is sync; waiting for a change is async."""

    def __init__(self, engines: tuple[EngineState, ...] = ()) -> None:
        self._current = Snapshot(version=1, engines=engines)
        self._changed = trio.Event()
        self._index = {e.name: i for i, e in enumerate(engines)}

    @property
    def current(self) -> Snapshot:
        return self._current

    def publish(self, snapshot_engines: tuple[EngineState, ...]) -> Snapshot:
        self._current = Snapshot(version=self._current.version + 1, engines=snapshot_engines)
        self._index = {e.name: i for i, e in enumerate(snapshot_engines)}
        self._changed.set()
        self._changed = trio.Event()
        return self._current

    def update(self, name: str, change: Callable[[EngineState], EngineState]) -> EngineState:
        """Replace one engine's state with ``change(old)``; sync, so nothing interleaves."""
        engines = self._current.engines
        i = self._index[name]
        new = change(engines[i])
        if new == engines[i]:
            return new
        self.publish((*engines[:i], new, *engines[i + 1:]))
        return new

    async def wait_changed(self, since_version: int) -> Snapshot:
        """Wait until the version differs from ``since_version``; return the newest snapshot."""
        while self._current.version == since_version:
            await self._changed.wait()
        return self._current
