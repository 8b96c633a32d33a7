"""A fixed-bucket histogram of durations (seconds): one ``observe`` is a bisect and two adds.

The parts that time things (the router, the sweep) own one each and ``/metrics``
(``nvpair.http.metrics``) reads them; nothing here awaits, locks or allocates per observation.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator, Sequence

#: the router's first byte and request duration: 5 ms to 300 s (15 buckets)
ROUTER_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                    60.0, 120.0, 300.0)
#: an on-demand start, from its first waiting request to ready: 0.5 s to 20 min (a large
#: model loads for minutes)
ACTIVATION_BUCKETS_S = (0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0)
#: a model-list sweep: bounded by its shared deadline (seconds)
SWEEP_BUCKETS_S = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class Histogram:
    """Counts of observations at or below each upper bound (``le``), their sum and count."""

    __slots__ = ("bounds", "count", "counts", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        if list(bounds) != sorted(set(bounds)) or not bounds:
            raise ValueError(f"histogram bounds must rise strictly, got {list(bounds)}")
        self.bounds = tuple(float(b) for b in bounds)
        #: per bucket, not cumulative (the last one: above every bound)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def cumulative(self) -> Iterator[tuple[float, int]]:
        """(upper bound, observations at or below it), ending with (inf, count)."""
        total = 0
        for bound, n in zip((*self.bounds, float("inf")), self.counts, strict=True):
            total += n
            yield bound, total
