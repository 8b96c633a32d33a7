"""Request accounting per path: how many requests an engine received and what became of them.

* ``count``: requests received (counted when the request has been read, before any answer),
* ``in_flight``: received and not yet finished,
* ``statuses``: finished requests by the status that was sent,
* ``errors``: answers with a status >= 500, plus connections the simulator reset,
* ``aborted``: the client went away before the answer was complete,
* latency: from the request read to the answer finished (or the abort).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import msgspec

#: latencies kept per path for the percentiles.
_WINDOW = 512


class PathStats(msgspec.Struct, frozen=True):
    count: int = 0
    in_flight: int = 0
    errors: int = 0
    aborted: int = 0
    resets: int = 0
    statuses: dict[int, int] = {}
    latency_sum_s: float = 0.0
    latency_max_s: float = 0.0
    latency_p50_s: float | None = None
    latency_p99_s: float | None = None


class _Counter:
    __slots__ = ("aborted", "count", "errors", "in_flight", "lat_max", "lat_sum", "recent",
                 "resets", "statuses")

    def __init__(self, in_flight: int = 0) -> None:
        self.count = 0
        self.in_flight = in_flight
        self.errors = 0
        self.aborted = 0
        self.resets = 0
        self.statuses: dict[int, int] = {}
        self.lat_sum = 0.0
        self.lat_max = 0.0
        self.recent: deque[float] = deque(maxlen=_WINDOW)

    def begin(self) -> None:
        self.count += 1
        self.in_flight += 1

    def end(self, status: int | None, *, aborted: bool, reset: bool, elapsed: float) -> None:
        self.in_flight = max(self.in_flight - 1, 0)
        if aborted:
            self.aborted += 1
        elif status is not None:
            self.statuses[status] = self.statuses.get(status, 0) + 1
        if reset:
            self.resets += 1
        if reset or (status is not None and status >= 500 and not aborted):
            self.errors += 1
        self.lat_sum += elapsed
        self.lat_max = max(self.lat_max, elapsed)
        self.recent.append(elapsed)

    def snapshot(self) -> PathStats:
        ordered = sorted(self.recent)
        return PathStats(
            count=self.count,
            in_flight=self.in_flight,
            errors=self.errors,
            aborted=self.aborted,
            resets=self.resets,
            statuses=dict(self.statuses),
            latency_sum_s=self.lat_sum,
            latency_max_s=self.lat_max,
            latency_p50_s=_quantile(ordered, 0.50),
            latency_p99_s=_quantile(ordered, 0.99),
        )


def _quantile(ordered: list[float], q: float) -> float | None:
    if not ordered:
        return None
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


class Accounting:
    """Counters per request path, plus totals. ``on_change`` runs after every update."""

    def __init__(self, on_change: Callable[[], None] = lambda: None) -> None:
        self._on_change = on_change
        self._paths: dict[str, _Counter] = {}
        self._total = _Counter()

    def begin(self, path: str) -> None:
        self._paths.setdefault(path, _Counter()).begin()
        self._total.begin()
        self._on_change()

    def end(
        self, path: str, status: int | None, *, aborted: bool, reset: bool, elapsed: float
    ) -> None:
        for counter in (self._paths.setdefault(path, _Counter()), self._total):
            counter.end(status, aborted=aborted, reset=reset, elapsed=elapsed)
        self._on_change()

    def reset(self) -> None:
        """Zero everything but ``in_flight``, so requests still running finish cleanly."""
        self._paths = {p: _Counter(c.in_flight) for p, c in self._paths.items() if c.in_flight}
        self._total = _Counter(self._total.in_flight)
        self._on_change()

    def snapshot(self) -> tuple[PathStats, dict[str, PathStats]]:
        return self._total.snapshot(), {p: c.snapshot() for p, c in sorted(self._paths.items())}
