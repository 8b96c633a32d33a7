"""Ages as the API shows them: seconds since a monotonic timestamp, at read time."""

from __future__ import annotations


def age(now: float, at: float | None) -> float | None:
    """Seconds since ``at`` for an API answer (ms resolution), None when it never happened."""
    return None if at is None else round(max(0.0, now - at), 3)
