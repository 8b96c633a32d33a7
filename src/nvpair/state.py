"""How probe outcomes move an engine between states. Pure functions of (state, outcome, time).

    starting --ready ok--> ready --health fails--> stale --threshold--> unhealthy
       ^                    ^  \\                     |                    |
       |                    |   +--- health ok -------+------- ok x N -----+
       +-- 503 / timeout ---+-- refused (no listener, process gone) --> down --answers--> starting
    stopped: on purpose (lifecycle); an identity mismatch makes an engine unhealthy.
"""

from __future__ import annotations

import msgspec

from nvpair.manifest import ProbeSpec
from nvpair.snapshot import EngineState, ProbeStats, State


class Outcome(msgspec.Struct, frozen=True):
    """The result of one probe request as the loop saw it."""

    ok: bool
    kind: str = "ok"  # ok, refused, timeout, status, error, body, mismatch
    http_status: int | None = None
    latency_ms: float | None = None
    error: str | None = None
    path: str | None = None  # the path requested (a fallback's, once it took over)


def record(stats: ProbeStats, outcome: Outcome, now: float) -> ProbeStats:
    """Counters after one more request (or one tick proved healthy by real traffic)."""
    if outcome.kind == "passive":
        # real traffic is no answer of the probe: its failures in a row still count
        return msgspec.structs.replace(stats, ok=True, at=now,
                                       consecutive_successes=stats.consecutive_successes + 1,
                                       passive=stats.passive + 1, error=None)
    latency = outcome.latency_ms or 0.0
    return msgspec.structs.replace(
        stats,
        ok=outcome.ok,
        http_status=outcome.http_status,
        latency_ms=outcome.latency_ms,
        at=now,
        consecutive_failures=0 if outcome.ok else stats.consecutive_failures + 1,
        consecutive_successes=stats.consecutive_successes + 1 if outcome.ok else 0,
        requests=stats.requests + 1,
        failures=stats.failures + (0 if outcome.ok else 1),
        timeouts=stats.timeouts + (1 if outcome.kind == "timeout" else 0),
        latency_ms_max=max(stats.latency_ms_max, latency),
        latency_ms_total=stats.latency_ms_total + latency,
        error=None if outcome.ok else outcome.error,
    )


def with_probe(engine: EngineState, name: str, stats: ProbeStats) -> EngineState:
    probes = tuple((n, stats if n == name else s) for n, s in engine.probes)
    if all(n != name for n, _ in engine.probes):
        probes += ((name, stats),)
    return msgspec.structs.replace(engine, probes=probes)


def count(engine: EngineState, probe: str, path: str, outcome: Outcome, now: float
          ) -> EngineState:
    """The engine with one more outcome counted for ``probe``; its stats name the path the
    outcome came from (``path``, the manifest's, when the outcome did not request one)."""
    stats = record(engine.probe(probe) or ProbeStats(path=path), outcome, now)
    if outcome.path is not None and outcome.path != stats.path:
        stats = msgspec.structs.replace(stats, path=outcome.path)
    return with_probe(engine, probe, stats)


def enter(engine: EngineState, state: State, now: float, **changes: object) -> EngineState:
    since = engine.since if engine.state == state else now
    return msgspec.structs.replace(engine, state=state, since=since, **changes)


def after_liveness(
    engine: EngineState, probe: str, spec: ProbeSpec, outcome: Outcome, now: float,
    needs_identity: bool = False,
) -> EngineState:
    """Apply a ``ready`` or ``health`` probe outcome. With ``needs_identity``, an engine is
    not listed (made ready) before its identity probe has told who answers."""
    engine = count(engine, probe, spec.path, outcome, now)
    stats = engine.probe(probe)
    assert stats is not None
    if engine.state == "stopped":
        return engine
    if outcome.ok:
        engine = msgspec.structs.replace(engine, checked_at=now)
        if engine.mismatch:
            return enter(engine, "unhealthy", now, error=engine.mismatch)
        recovering = engine.state in ("unhealthy", "starting", "down")
        if recovering and stats.consecutive_successes < spec.success_threshold:
            return engine
        if recovering and needs_identity and engine.identity is None:
            ident = engine.probe("identity")
            why = ident.error if ident is not None and ident.error else "not probed yet"
            return enter(engine, "unhealthy" if engine.state == "unhealthy" else "starting",
                         now, error=f"answers, but who answers is not confirmed yet ({why})")
        return enter(engine, "ready", now, error=None)
    error = outcome.error
    if outcome.kind == "refused":
        # Nothing listens: a managed engine that is loading (port closed while loading)
        # is still starting; anything else is down.
        if engine.managed and engine.state == "starting":
            return msgspec.structs.replace(engine, error=error)
        return enter(engine, "down", now, error=error)
    if probe == "ready" or engine.state in ("starting", "down"):
        return enter(engine, "starting", now, error=error)
    if stats.consecutive_failures >= spec.failure_threshold:
        return enter(engine, "unhealthy", now, error=error)
    if engine.state == "unhealthy":
        return msgspec.structs.replace(engine, error=error)
    return enter(engine, "stale", now, error=error)


def effective_state(engine: EngineState, now: float, overdue_after: float) -> State:
    """``ready`` turns ``stale`` when no successful health probe came for too long."""
    if (engine.state == "ready" and engine.checked_at is not None
            and now - engine.checked_at > overdue_after):
        return "stale"
    return engine.state


def with_auth_notice(engine: EngineState, outcome: Outcome, path: str) -> EngineState:
    """Say so when an engine refuses nvpair's requests for want of an API key."""
    if outcome.http_status in (401, 403):
        notice = (f"the engine refuses GET {path} ({outcome.http_status}): it needs an API "
                  "key; set api_key_file for this engine")
        return msgspec.structs.replace(engine, notice=notice)
    if outcome.ok and engine.notice is not None:
        return msgspec.structs.replace(engine, notice=None)
    return engine
