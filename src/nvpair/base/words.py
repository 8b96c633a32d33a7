"""Counts and durations in words, for the lines people read (activities, log lines, the
reasons an engine's state gives)."""

from __future__ import annotations


def requests(n: int) -> str:
    """``1 request``, ``3 requests``."""
    return f"{n} request" if n == 1 else f"{n} requests"


def duration(seconds: float) -> str:
    """``4.2 s`` under two minutes, else whole minutes: ``7 min``."""
    if seconds >= 120:
        return f"{seconds / 60:.0f} min"
    return f"{seconds:.1f} s"
