"""The last hour of each engine's probe latency and memory, kept in memory for the dashboard.

``History.observe`` reads a snapshot: each liveness probe result (``ready`` or ``health``)
newer than the last one seen goes into the engine's current bucket of ``step_s`` seconds
(its mean and its maximum), and so does the engine's memory where the memory watch gives
one. A bucket that ends becomes a point; an engine keeps at most ``points`` of them (an
hour at the defaults: 360 points of 10 s) in three arrays of doubles, about 9 KB an
engine whatever runs for how long. ``History.run`` observes the board at most once a
second, only when it changed: it never waits on an engine, and a probe result is never
delayed by it.

An observation looks only at the engines the board changed since the last one
(``Board.touched``), not at every engine: at 1,024 engines a walk of them all was a 3-5 ms
step of the loop every second, where about a fifth of them have a new result. An engine's
buckets move on when it is next looked at or read (``Series.advance``); an engine whose
memory did not change keeps it in every bucket meanwhile, as if it had been looked at.
"""

from __future__ import annotations

import math
from array import array
from typing import Any

import trio

from nvpair.runtime import wakes
from nvpair.state.snapshot import Board, EngineState, Snapshot

#: the probes whose latency is charted: what nvpair's own liveness probes cost the engine
CHARTED = ("ready", "health")
NAN = math.nan


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
    """One engine's closed buckets, oldest first, one slot per bucket (NaN: no value),
    from bucket number ``first``; and the open bucket's sums."""

    def __init__(self, points: int) -> None:
        self.size = points
        self.first = 0  # the bucket number of the oldest slot
        self.mean = array("d")
        self.max = array("d")
        self.memory = array("d")
        self.seen: dict[str, float] = {}  # probe -> the ``at`` of the last result taken
        self.bucket: int | None = None  # the open bucket's number
        self.total = 0.0
        self.count = 0
        self.peak = NAN
        self.mem = NAN
        self.last_mem = NAN  # the engine's memory when last looked at (NaN: none)

    def open_values(self) -> tuple[float, float, float]:
        """The open bucket's mean and max latency (rounded to 0.01 ms) and memory."""
        return (round(self.total / self.count, 2) if self.count else NAN,
                round(self.peak, 2), self.mem)

    def advance(self, bucket: int) -> None:
        """Move on to ``bucket`` (now's): close the open bucket when it is older, and each
        bucket skipped since, which holds the memory last seen (when there was any)."""
        if self.bucket is not None and bucket <= self.bucket:
            return
        skipped = 0 if self.bucket is None else bucket - self.bucket - 1
        self.roll(bucket)
        if skipped > 0 and not math.isnan(self.last_mem):
            for b in range(max(bucket - skipped, bucket - self.size), bucket):
                self._close(b, (NAN, NAN, self.last_mem))
        self.mem = self.last_mem

    def roll(self, bucket: int) -> None:
        """Close the open bucket (if it holds anything) and open ``bucket``."""
        if self.bucket is not None and (self.count or not math.isnan(self.mem)):
            self._close(self.bucket, self.open_values())
        self.bucket = bucket
        self.total, self.count, self.peak, self.mem = 0.0, 0, NAN, NAN

    def _close(self, bucket: int, values: tuple[float, float, float]) -> None:
        """Append bucket ``bucket`` (after every closed one) with ``values``."""
        if not self.mean:
            self.first = bucket
        gap = min(bucket - (self.first + len(self.mean)), self.size)
        for column, value in zip((self.mean, self.max, self.memory), values, strict=True):
            if gap > 0:
                column.extend([NAN] * gap)
            column.append(value)
        if (extra := len(self.mean) - self.size) > 0:
            for column in (self.mean, self.max, self.memory):
                del column[:extra]
        self.first = bucket + 1 - len(self.mean)

    def doc(self, now: float, step_s: float, last: int) -> dict[str, Any]:
        """The last ``last`` buckets up to the newest (the open one, when it holds
        anything), as columns (null: no value), the first ``first_age_s`` old."""
        has_open = self.bucket is not None and (self.count or not math.isnan(self.mem))
        if not has_open and not self.mean:
            return {"first_age_s": 0.0, "latency_ms": [], "latency_ms_max": [],
                    "memory_bytes": []}
        end = self.first + len(self.mean)  # one past the newest closed bucket
        newest = self.bucket if has_open and self.bucket is not None else end - 1
        start = max(self.first, newest - last + 1) if self.mean else newest
        skip = max(0, start - self.first)
        # NaN is encoded as null: no per-value work here (at K = 1,024, 60 points each: ~10 ms)
        mean, peak, memory = (c[skip:].tolist() for c in (self.mean, self.max, self.memory))
        if has_open:
            gap = self.bucket - max(end, start) if self.bucket is not None else 0
            for column, value in zip((mean, peak, memory), self.open_values(), strict=True):
                column.extend([NAN] * max(0, gap))
                column.append(value)
        return {"first_age_s": round(max(0.0, now - (start + 0.5) * step_s), 1),
                "latency_ms": mean, "latency_ms_max": peak, "memory_bytes": memory}


class History:
    """Per engine, the last ``points`` buckets of ``step_s`` seconds (see the module)."""

    def __init__(self, board: Board, *, step_s: float = 10.0, points: int = 360) -> None:
        self.board = board
        self.step_s = step_s
        self.points = points
        self.engines: dict[str, Series] = {}
        #: the engines the board changed since the last observation
        self._touched = board.touched()

    def observe(self, snap: Snapshot, now: float) -> None:
        """Take what is new on the board, ``snap`` being its current snapshot (sync;
        engines no longer on the board are dropped). Looks at the engines changed since
        the last observation only."""
        bucket = int(now // self.step_s)
        everything, names = self._touched.take()
        if everything:
            on_board = {e.name for e in snap.engines}
            for gone in self.engines.keys() - on_board:
                del self.engines[gone]
            names |= on_board
        for changed in names:
            engine = snap.engine(changed)
            if engine is None:
                self.engines.pop(changed, None)
                continue
            series = self.engines.get(changed)
            if series is None:
                series = self.engines[changed] = Series(self.points)
            series.advance(bucket)
            for name, probe in engine.probes:
                if (name not in CHARTED or probe.at is None or probe.latency_ms is None
                        or series.seen.get(name) == probe.at):
                    continue
                series.seen[name] = probe.at
                series.total += probe.latency_ms
                series.count += 1
                if not probe.latency_ms <= series.peak:  # (NaN: the first)
                    series.peak = probe.latency_ms
            memory = memory_bytes(engine)
            series.last_mem = NAN if memory is None else float(memory)
            if memory is not None:
                series.mem = series.last_mem

    def doc(self, now: float, engine: str | None = None,
            last: int | None = None) -> dict[str, Any]:
        """``GET /v1/history``: per engine, the last ``last`` buckets (all by default) up
        to the newest, the one still filling included, as columns, oldest first, the
        first ``first_age_s`` old (from its bucket's middle), each next ``step_s`` later."""
        last = self.points if last is None else max(1, min(last, self.points))
        bucket = int(now // self.step_s)
        for series in self.engines.values():
            series.advance(bucket)
        return {
            "step_s": self.step_s,
            "engines": {name: series.doc(now, self.step_s, last)
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
        ticker = wakes.Ticker(every_s)
        while True:
            await ticker.tick()
            snap = await self.board.wait_changed(snap.version)
            self.observe(snap, trio.current_time())
