"""How probe outcomes move an engine between states. Pure functions of (state, outcome, time).

    starting --ready ok--> ready --health fails--> stale --threshold--> unhealthy
       ^                    ^  \\                     |                    |
       |                    |   +--- health ok -------+------- ok x N -----+
       +-- 503 / timeout ---+-- refused (no listener, process gone) --> down --answers--> starting
    stopped: on purpose (lifecycle); an identity mismatch makes an engine unhealthy.
    ready <--sleeping probe says so / nvpair put it to sleep--> sleeping --wake--> waking --> ready
"""

from __future__ import annotations

import math
from collections.abc import Collection
from typing import Literal, NamedTuple, Protocol

import msgspec
import trio

from nvpair.config.manifest import GENERATING_MIN_INTERVAL_S, ProbeSpec
from nvpair.config.settings import EngineSpec
from nvpair.state.snapshot import (
    ASLEEP_STATES,
    LISTED_STATES,
    EngineState,
    Identity,
    Model,
    ModelState,
    ProbeStats,
    State,
    shown_state,
)

LivenessProbe = Literal["ready", "health"]
#: who found a mismatch (and so alone may clear it); "listing": the listing itself raised
Finder = Literal["identity", "models", "listing"]


class Outcome(msgspec.Struct, frozen=True, gc=False):
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
    needs_identity: bool = False, sleeping: bool | None = None, sleep_probe: bool = False,
) -> EngineState:
    """Apply a ``ready`` or ``health`` probe outcome. With ``needs_identity``, an engine is
    not listed (made ready) before its identity probe has told who answers.

    ``sleeping``: what the answer said of the engine's sleep (None: it did not say).
    ``sleep_probe``: the engine has a sleeping probe; without one (SGLang), a sleeping
    engine is what nvpair made it, and only nvpair (or nothing listening) moves it."""
    engine = count(engine, probe, spec.path, outcome, now)
    stats = engine.probe(probe)
    assert stats is not None
    if engine.state in ("stopped", "cold"):
        return engine
    asleep = engine.state in ASLEEP_STATES
    if asleep and not sleep_probe and outcome.kind != "refused":
        # (SGLang answers /ready 503 while paused for its sleep: that is the sleep)
        return msgspec.structs.replace(engine, checked_at=now) if outcome.ok else engine
    if outcome.ok:
        engine = msgspec.structs.replace(engine, checked_at=now)
        if engine.mismatch:
            return enter(engine, "unhealthy", now, error=engine.mismatch)
        if sleeping and not (engine.state in ("starting", "down", "unhealthy")
                             and stats.consecutive_successes < spec.success_threshold):
            # a wake in progress stays waking until the engine says it is awake
            return enter(engine, "waking" if engine.state == "waking" else "sleeping", now,
                         error=None)
        recovering = engine.state in ("unhealthy", "starting", "down", *ASLEEP_STATES)
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
    """``ready`` turns ``stale`` when no successful health probe came for too long
    (``snapshot.shown_state``'s rule, which the listing uses too)."""
    return shown_state(engine, now, overdue_after)


def with_auth_notice(engine: EngineState, outcome: Outcome, path: str) -> EngineState:
    """Say so when an engine refuses nvpair's requests for want of an API key."""
    if outcome.http_status in (401, 403):
        notice = (f"the engine refuses GET {path} ({outcome.http_status}): it needs an API "
                  "key; set api_key_file for this engine")
        return msgspec.structs.replace(engine, notice=notice)
    if outcome.ok and engine.notice is not None:
        return msgspec.structs.replace(engine, notice=None)
    return engine


# -- the engine's first state, and when a ready one shows as stale ------------------------

def overdue_after(interval_s: float, timeout_s: float) -> float:
    """How long after its last health result a ready engine shows as stale."""
    return interval_s + timeout_s + 1.0


def initial_state(spec: EngineSpec, now: float | None = None) -> EngineState:
    """The engine as nvpair first shows it: ``starting``, since ``now`` (the current Trio
    time by default)."""
    return EngineState(
        name=spec.name,
        kind=spec.kind,
        url=spec.url,
        managed=spec.managed,
        # an on-demand engine rests cold, its configured model listed (docs/on-demand.md)
        state="cold" if spec.activation == "on_demand" else "starting",
        models=(Model(id=spec.model),) if spec.activation == "on_demand" and spec.model else (),
        since=trio.current_time() if now is None else now,
        optional=spec.optional,
        aliases=spec.aliases,
        overdue_after_s=overdue_after(spec.probes.health.interval_s, spec.probes.health.timeout_s),
    )


def rescheduled(engine: EngineState, interval_s: float, timeout_s: float) -> EngineState:
    """The engine once its health probe runs every ``interval_s`` (its path changed, and
    with it the schedule): "overdue" follows the schedule."""
    return msgspec.structs.replace(engine, overdue_after_s=overdue_after(interval_s, timeout_s))


def liveness_probe(state: State) -> LivenessProbe:
    """The liveness probe an engine in ``state`` gets next: ``ready`` until it answers
    ready (starting, or down: nothing listened), then ``health``."""
    return "ready" if state in ("starting", "down") else "health"


# -- the liveness loop's next tick ----------------------------------------------------------

#: the ready probe's interval at most while routed requests wait for the engine to start
#: (``EngineState.queued``, the activation queue's count on the board): a cold request
#: then waits at most this long after the engine is ready, not the manifest's interval
AWAITED_READY_INTERVAL_S = 0.1


class NextTick(NamedTuple):
    """When the liveness loop probes next, and what (``next_interval``)."""

    #: the probe that runs next
    probe: LivenessProbe
    #: its interval: the schedule's step (and the wake grid's, nvpair.runtime.wakes)
    interval: float
    #: the earliest it may be sent: an engine gets one generating request per
    #: GENERATING_MIN_INTERVAL_S, whichever probe sends it (-inf: no such bound)
    not_before: float
    #: a starting on-demand engine that no request waits for: a request that comes to
    #: wait for it (its ``queued`` on the board) ends the sleep at once
    awaited: bool


def probe_interval(spec: ProbeSpec, generating: bool) -> float:
    """A probe's interval: the manifest's, and at least GENERATING_MIN_INTERVAL_S while
    its path generates (a fallback may move a cheap probe onto a generating path)."""
    return max(spec.interval_s, GENERATING_MIN_INTERVAL_S) if generating else spec.interval_s


def awaits_identity(engine: EngineState, spec: EngineSpec, probe: str,
                    outcome: Outcome) -> bool:
    """The engine answers ready, enough times in a row, and only who answers is unknown
    (its identity probe has not told yet)."""
    ready, stats = spec.probes.ready, engine.probe("ready")
    return (probe == "ready" and outcome.ok and engine.state == "starting"
            and spec.probes.identity is not None and engine.identity is None
            and stats is not None and stats.consecutive_successes >= ready.success_threshold)


def next_interval(after: EngineState, spec: EngineSpec, *, probe: str, outcome: Outcome,
                  generating: Collection[str] = (), generated_at: float | None = None
                  ) -> NextTick:
    """The liveness loop's next tick, after one that sent ``probe``, saw ``outcome`` and
    left the engine as ``after``. ``generating``: the liveness probes whose path (the
    manifest's or its fallback) generates now; ``generated_at``: when the engine's last
    generating request was sent (None: never).

    The next tick follows the interval of the probe that runs next; a ready probe runs at
    most every AWAITED_READY_INTERVAL_S while requests wait for the engine (a cheap probe
    only), and no more often than health while only who answers is unknown."""
    probes = spec.probes
    following = liveness_probe(after.state)
    interval = probe_interval(probes.ready if following == "ready" else probes.health,
                              following in generating)
    if following == "ready" and after.queued and "ready" not in generating:
        interval = min(interval, AWAITED_READY_INTERVAL_S)
    if following == "ready" and awaits_identity(after, spec, probe, outcome):
        interval = max(interval, probe_interval(probes.health, "health" in generating))
    not_before = -math.inf
    if generated_at is not None and following in generating:
        not_before = generated_at + GENERATING_MIN_INTERVAL_S
    awaited = (following == "ready" and not after.queued
               and interval > AWAITED_READY_INTERVAL_S and spec.activation == "on_demand")
    return NextTick(following, interval, not_before, awaited)

# -- who answers: the mismatch rules --------------------------------------------------------

def same_model(expected: str, served: str) -> bool:
    """Whether a served name is the expected model: equal, or equal after the path."""
    a, b = (_plain(x) for x in (expected, served))
    if a == b:
        return True
    tail_a, tail_b = a.rstrip("/").rsplit("/", 1)[-1], b.rstrip("/").rsplit("/", 1)[-1]
    return tail_a == tail_b


def _plain(name: str) -> str:
    name = name.strip().lower()
    return name.removesuffix(":latest")


def with_mismatch(engine: EngineState, by: Finder, mismatch: str | None, now: float
                  ) -> EngineState:
    """The one mismatch rule. A finding (``mismatch``, in words) makes the engine unhealthy
    and is ``by``'s; only ``by`` clears it, by finding nothing wrong. A cleared mismatch
    moves no state: the next good health probe makes the engine ready again."""
    if mismatch:
        engine = msgspec.structs.replace(engine, mismatch=mismatch, mismatch_by=by)
        return enter(engine, "unhealthy", now, error=mismatch)
    if engine.mismatch_by == by:
        return msgspec.structs.replace(engine, mismatch=None, mismatch_by=None)
    return engine


def where(spec: EngineSpec) -> str:
    """The engine's address, as mismatch messages name it."""
    return f"{spec.host}:{spec.port}"


def after_identity(
    engine: EngineState, spec: EngineSpec, outcome: Outcome, now: float, *,
    path: str | None = None, identity: Identity | None = None, names: tuple[str, ...] = (),
    wrong: str | None = None,
) -> EngineState:
    """Apply an identity probe's result: ``identity`` and the model ``names`` it gave when
    the answer parsed, ``wrong`` (why, in words) when the answer is not this kind's.

    Another kind of server (``wrong``, or a 404 on a path this kind always has) is a
    mismatch, and who answers is forgotten: it must be confirmed again before the engine
    is listed. A served model other than the configured one is a mismatch too. ``path``
    (the probe's path now) names what a 401/403 refused."""
    ident = spec.probes.identity
    assert ident is not None
    engine = count(engine, "identity", ident.path, outcome, now)
    if wrong is None and identity is None and outcome.http_status == 404:
        wrong = f"does not look like {spec.kind}: GET {outcome.path} answered 404"
    if wrong is not None:
        engine = msgspec.structs.replace(engine, identity=None)
        return with_mismatch(engine, "identity", f"{where(spec)} {wrong}", now)
    engine = with_auth_notice(engine, outcome, path or ident.path)
    if identity is None:  # unconfirmed (a timeout, a 5xx, a 401): nothing found, nothing cleared
        return engine
    engine = msgspec.structs.replace(engine, identity=identity)
    mismatch = None
    if spec.model and names and not any(same_model(spec.model, n) for n in names):
        mismatch = f"{where(spec)} serves {names[0]}, expected {spec.model}"
    return with_mismatch(engine, "identity", mismatch, now)


# -- the model list -------------------------------------------------------------------------

class Listed(Protocol):
    """A parsed model list (``nvpair.probing.probes.Listing``): the models, and how many were left
    out and why."""

    @property
    def models(self) -> tuple[Model, ...]: ...
    @property
    def left_out(self) -> int: ...
    @property
    def why(self) -> str | None: ...


def after_models(
    engine: EngineState, spec: EngineSpec, outcome: Outcome, now: float, *,
    path: str | None = None, listing: Listed | None = None,
) -> EngineState:
    """Apply a model-list result: ``listing`` when the answer parsed (its models, and how
    many were left out and why), else the earlier list is kept, marked stale.

    A list without the configured model is a mismatch, unless the kind's identity names
    the model (then the identity probe checks it). ``path`` (the probe's path now) names
    what a 401/403 refused."""
    models = spec.probes.models
    assert models is not None
    engine = count(engine, "models", models.path, outcome, now)
    engine = with_auth_notice(engine, outcome, path or models.path)
    # the listing ran to its end (whatever the engine answered): a failure of it is over
    engine = with_mismatch(engine, "listing", None, now)
    if listing is None:
        return msgspec.structs.replace(engine, models_stale=bool(engine.models))
    engine = msgspec.structs.replace(
        engine, models=steady_models(engine.models, listing.models), models_at=now,
        models_stale=False, models_left_out=listing.left_out, models_left_out_why=listing.why)
    ident = spec.probes.identity
    mismatch = None
    if (spec.model and not (ident and ident.model_pointers)
            and not any(same_model(spec.model, m.id) for m in listing.models)):
        served = ", ".join(m.id for m in listing.models) or "no model"
        mismatch = f"{where(spec)} serves {served}, expected {spec.model}"
    return with_mismatch(engine, "models", mismatch, now)


def with_model_list(engine: EngineState, listing: Listed, now: float) -> EngineState:
    """A multi-model engine's model list read outside the sweep (the router reads it again
    after a request the engine answered: docs/multi-model.md): its models' own states and
    the list's time, ahead of the sweep's next list. An engine not listed is left alone."""
    if engine.state not in LISTED_STATES:
        return engine
    return msgspec.structs.replace(
        engine, models=steady_models(engine.models, listing.models), models_at=now,
        models_stale=False)


def steady_models(old: tuple[Model, ...], new: tuple[Model, ...]) -> tuple[Model, ...]:
    """``new``, with each model still listed as it was first seen: vLLM and llama-server
    answer every model list with ``created`` set to the current time, which would make
    every listing a change (a new ``/v1/models`` body, an event, an advert) though nothing
    changed. A model keeps the ``created`` of its first sighting while it stays listed
    (its own state, router mode's, is the new one); when nothing else changed, the old
    tuple itself is kept."""
    if not old:
        return new
    if len(old) == len(new) and all(
            a.id == b.id and a.owned_by == b.owned_by and a.state == b.state
            for a, b in zip(old, new, strict=True)):
        return old
    seen = {(m.id, m.owned_by): m for m in old}
    return tuple(_kept(seen.get((m.id, m.owned_by)), m) for m in new)


def _kept(old: Model | None, new: Model) -> Model:
    """``new`` as first seen: the old one's ``created``, the new one's state."""
    if old is None or old.state == new.state:
        return old or new
    return msgspec.structs.replace(old, state=new.state)


def with_model_state(engine: EngineState, model: str, state: ModelState) -> EngineState:
    """A multi-model engine's ``model`` in ``state`` as a routed request showed it (loaded
    when the engine answered, cold once nvpair unloaded it), ahead of its next model
    list, which has the last word. Models without a state of their own are left alone."""
    if not any(m.id == model and m.state is not None and m.state != state
               for m in engine.models):
        return engine
    return msgspec.structs.replace(engine, models=tuple(
        msgspec.structs.replace(m, state=state) if m.id == model and m.state is not None
        else m for m in engine.models))


def models_missed(engine: EngineState, spec: ProbeSpec, deadline_s: float, now: float
                  ) -> EngineState:
    """The model list did not answer within the sweep's deadline: counted as a timeout;
    the earlier list is kept, marked stale."""
    outcome = Outcome(ok=False, kind="timeout", error=(
        f"model list did not answer within the {deadline_s:g} s sweep deadline"))
    engine = count(engine, "models", spec.path, outcome, now)
    return msgspec.structs.replace(engine, models_stale=True)


# -- a fault boundary's failure ---------------------------------------------------------------

def part_failed(engine: EngineState, reason: str, now: float, by: Finder | None = None
                ) -> EngineState:
    """A part of this engine's supervision failed (a probe loop or its listing raised):
    unhealthy with the reason, unless stopped on purpose (that stays what it shows). A good
    probe afterwards moves the engine on by the usual rules (and clears the error).

    With ``by`` (the identity loop, the listing), the failure is that finder's, as with
    ``with_mismatch``: the engine stays unhealthy until ``by`` works again, so a part that
    keeps failing does not flap the engine ready at each good health probe. A mismatch
    another finder found stays its own."""
    if engine.state in ("stopped", "cold"):
        return engine
    if by is not None and (engine.mismatch is None or engine.mismatch_by == by):
        return with_mismatch(engine, by, reason, now)
    return enter(engine, "unhealthy", now, error=reason)


def listing_failed(engine: EngineState, spec: ProbeSpec | None, reason: str, now: float
                   ) -> EngineState:
    """The engine's listing raised: counted as an error of its models probe (``spec``,
    when known), the earlier list kept, marked stale, and the engine unhealthy until a
    listing runs to its end again, whatever the engine answers (the listing's finding, as
    with ``with_mismatch``: a good health probe alone does not clear it, or the engine
    would flap at every listing)."""
    if spec is not None:
        engine = count(engine, "models", spec.path,
                       Outcome(ok=False, kind="error", error=reason), now)
    engine = msgspec.structs.replace(engine, models_stale=bool(engine.models))
    return part_failed(engine, reason, now, by="listing")
