"""What the memory watch publishes: an engine's memory and the node's, as the snapshot holds
them, and the status documents made of them.

The memory watch (``nvpair.supervision.memwatch``) writes these into the board with one call per
tick
(``nvpair.state.snapshot.Board.publish_memory``). They are not part of what the listing shows
(``nvpair.state.snapshot.listed_key``), so a reading never moves the listing version: ``/v1/models``
is not rebuilt for it, the router's model index and the advert neither.
"""

from __future__ import annotations

from typing import Any

import msgspec

#: the trends, mildest first (``nvpair.supervision.memtrend.Trend``'s values)
TRENDS = ("flat", "growing", "leaking", "critical")


class ProcMemory(msgspec.Struct, frozen=True, gc=False):
    """One process of an engine: its anonymous resident memory and swap (bytes)."""

    pid: int
    name: str
    rss_anon_bytes: int
    swap_bytes: int


class EngineMemory(msgspec.Struct, frozen=True, gc=False):
    """One engine's memory as last read. ``source``: ``proc`` (its processes' status),
    ``cgroup`` (the processes of a configured cgroup) or ``none`` (no process known:
    not started, or its pid not found yet); ``error`` says why a read failed (the
    readings are then the last good ones, or None)."""

    source: str = "none"
    error: str | None = None
    rss_anon_bytes: int | None = None
    swap_bytes: int | None = None
    rss_bytes: int | None = None
    processes: int = 0
    top: tuple[ProcMemory, ...] = ()
    trend: str = "flat"
    slope_bytes_per_h: float | None = None
    exhaustion_s: float | None = None
    floor_bytes: int | None = None
    #: seconds of readings the trend rests on
    covered_s: float = 0.0
    why: str = ""
    #: restarts nvpair made because the engine was leaking (action restart_when_quiet)
    memory_restarts: int = 0
    #: what the action is doing now (``waiting for quiet``, ``restarting``), or None
    action: str | None = None
    #: trio time of the reading
    at: float | None = None


class NodeMemory(msgspec.Struct, frozen=True, gc=False):
    """The node's memory as last read (bytes; None: not read, or not on this kernel)."""

    mem_total: int | None = None
    mem_available: int | None = None
    anon_pages: int | None = None
    swap_total: int | None = None
    swap_free: int | None = None
    #: what the OOM killers keep free (earlyoom's rule, or the config's ``reserve_bytes``)
    reserve_bytes: int | None = None
    #: ``mem_available - reserve_bytes``: what engines may still grow by (can be negative)
    headroom_bytes: int | None = None
    psi_some_avg10: float | None = None
    psi_full_avg10: float | None = None
    cgroup: str | None = None
    cgroup_current: int | None = None
    cgroup_max: int | None = None
    oom_kills: int | None = None
    unified_memory: bool = False
    trend: str = "flat"
    slope_bytes_per_h: float | None = None
    exhaustion_s: float | None = None
    why: str = ""
    error: str | None = None
    at: float | None = None


def _round(value: float | None, digits: int = 1) -> float | None:
    return None if value is None else round(value, digits)


def engine_doc(m: EngineMemory | None) -> dict[str, Any] | None:
    """The ``memory`` block of an engine's status (docs/api.md, docs/memory.md)."""
    if m is None:
        return None
    return {
        "source": m.source,
        "error": m.error,
        "rss_anon_bytes": m.rss_anon_bytes,
        "swap_bytes": m.swap_bytes,
        "rss_bytes": m.rss_bytes,
        "processes": m.processes,
        "top": [{"pid": p.pid, "name": p.name, "rss_anon_bytes": p.rss_anon_bytes,
                 "swap_bytes": p.swap_bytes} for p in m.top],
        "trend": m.trend,
        "slope_bytes_per_h": _round(m.slope_bytes_per_h),
        "exhaustion_s": _round(m.exhaustion_s),
        "floor_bytes": m.floor_bytes,
        "covered_s": _round(m.covered_s, 3),
        "why": m.why,
        "memory_restarts": m.memory_restarts,
        "action": m.action,
    }


def node_doc(m: NodeMemory | None) -> dict[str, Any] | None:
    """``node.memory`` in ``/v1/engines``."""
    if m is None:
        return None
    doc = msgspec.structs.asdict(m)
    doc.pop("at")
    doc["slope_bytes_per_h"] = _round(m.slope_bytes_per_h)
    doc["exhaustion_s"] = _round(m.exhaustion_s)
    return doc


def event_doc(m: EngineMemory | None) -> dict[str, Any] | None:
    """What an engine event shows of its memory: the trend and the action, never the
    readings (they move every tick; an event is a change of content)."""
    if m is None:
        return None
    return {"trend": m.trend, "memory_restarts": m.memory_restarts, "action": m.action}


def trend_level(trend: str) -> int:
    """A trend as a number for a gauge: 0 flat, 1 growing, 2 leaking, 3 critical."""
    return TRENDS.index(trend) if trend in TRENDS else 0
