"""The last hour of each engine's probe latency and memory, kept in memory for the dashboard.

``History.observe`` reads a snapshot: each liveness probe result (``ready`` or ``health``)
newer than the last one seen goes into the engine's current bucket of ``step_s`` seconds
(its mean and its maximum), and so does the engine's memory where the memory watch gives
one. A bucket that ends becomes a point; an engine keeps at most ``points`` of them (an
hour at the defaults: 360 points of 10 s), so the memory is bounded by the number of
engines. ``History.run`` observes the board at most once a second, only when it changed:
it never waits on an engine, and a probe result is never delayed by it.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import trio

from nvpair.snapshot import Board, EngineState, Snapshot

#: the probes whose latency is charted: what nvpair's own liveness probes cost the engine
CHARTED = ("ready", "health")


def memory_bytes(engine: EngineState) -> int | None:
    """The engine's anonymous memory plus its swap, where the memory watch reports it
    (a ``memory`` field with ``rss_anon_bytes`` and ``swap_bytes``, as an object or a
    mapping); None where it does not."""
    memory = getattr(engine, "memory", None)
    if memory is None:
        return None

    def field(name: str) -> Any:
        return memory.get(name) if isinstance(memory, dict) else getattr(memory, name, None)

    anon = field("rss_anon_bytes")
    if not isinstance(anon, int):
        return None
    swap = field("swap_bytes")
    return anon + (swap if isinstance(swap, int) else 0)


class Series:
    """One engine's points: ``(bucket start, latency mean, latency max, memory)``."""

    def __init__(self, points: int) -> None:
        self.points: deque[tuple[float, float | None, float | None, int | None]] = deque(
            maxlen=points)
        self.seen: dict[str, float] = {}  # probe -> the ``at`` of the last result taken
        self.bucket: float | None = None  # start of the open bucket
        self.total = 0.0
        self.count = 0
        self.max: float | None = None
        self.memory: int | None = None

    def close(self) -> None:
        if self.bucket is not None and (self.count or self.memory is not None):
            mean = round(self.total / self.count, 2) if self.count else None
            self.points.append((self.bucket, mean, self.max, self.memory))
        self.total, self.count, self.max, self.memory = 0.0, 0, None, None

    def doc(self, now: float, step_s: float) -> list[list[float | int | None]]:
        """The points as ``[age_s, mean, max, memory]``, each aged from its bucket's middle
        (the open bucket's from now: it is still filling)."""
        rows = [[round(max(0.0, now - t - step_s / 2), 1), mean, peak, mem]
                for t, mean, peak, mem in self.points]
        if self.bucket is not None and (self.count or self.memory is not None):
            rows.append([0.0,
                         round(self.total / self.count, 2) if self.count else None,
                         self.max, self.memory])
        return rows


class History:
    """Per engine, the last ``points`` buckets of ``step_s`` seconds (see the module)."""

    def __init__(self, board: Board, *, step_s: float = 10.0, points: int = 360) -> None:
        self.board = board
        self.step_s = step_s
        self.points = points
        self.engines: dict[str, Series] = {}

    def observe(self, snap: Snapshot, now: float) -> None:
        """Take what is new in ``snap`` (sync; engines no longer on the board are dropped)."""
        bucket = now - now % self.step_s
        names = set()
        for engine in snap.engines:
            names.add(engine.name)
            series = self.engines.get(engine.name)
            if series is None:
                series = self.engines[engine.name] = Series(self.points)
            if series.bucket != bucket:
                series.close()
                series.bucket = bucket
            for name, probe in engine.probes:
                if (name not in CHARTED or probe.at is None or probe.latency_ms is None
                        or series.seen.get(name) == probe.at):
                    continue
                series.seen[name] = probe.at
                series.total += probe.latency_ms
                series.count += 1
                latency = round(probe.latency_ms, 2)
                series.max = latency if series.max is None else max(series.max, latency)
            memory = memory_bytes(engine)
            if memory is not None:
                series.memory = memory
        for gone in self.engines.keys() - names:
            del self.engines[gone]

    def doc(self, now: float, engine: str | None = None) -> dict[str, Any]:
        """``GET /v1/history``: per engine, ``points`` as ``[age_s, latency_ms mean,
        latency_ms max, memory_bytes]``, oldest first, the open bucket last."""
        return {
            "step_s": self.step_s,
            "columns": ["age_s", "latency_ms", "latency_ms_max", "memory_bytes"],
            "engines": {name: series.doc(now, self.step_s)
                        for name, series in self.engines.items()
                        if engine is None or name == engine},
        }

    async def run(self, *, every_s: float = 1.0,
                  task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Observe the board whenever it changed, at most once per ``every_s``; forever.

        Started value: None, after the first observation. Cancellation ends it at any
        await. Raises nothing of its own (a bug escapes to the caller's boundary)."""
        snap = self.board.current
        self.observe(snap, trio.current_time())
        task_status.started()
        while True:
            await trio.sleep(every_s)
            snap = await self.board.wait_changed(snap.version)
            self.observe(snap, trio.current_time())
