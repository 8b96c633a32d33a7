"""Ages as the API shows them: seconds since a monotonic timestamp, at read time."""

from __future__ import annotations

from collections.abc import Iterable


def ages(now: float, ats: Iterable[float | None]) -> list[float | None]:
    """Seconds since each of ``ats`` for an API answer (ms resolution; None for one that
    never happened). One pass for many (a listing's every engine): no call per age."""
    return [None if at is None else round(now - at if now > at else 0.0, 3) for at in ats]


def age(now: float, at: float | None) -> float | None:
    """Seconds since ``at`` for an API answer (ms resolution), None when it never happened."""
    return ages(now, (at,))[0]
