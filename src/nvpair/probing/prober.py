"""The probe loops of one engine: liveness (``ready`` then ``health``) and ``identity``.

Each request runs under its own cancel scope with the probe's timeout, applied here and only
here. Loops tick on absolute deadlines with a little jitter; a probe still running when its
next tick comes is not doubled (the loop is sequential). Outcomes become state on the board
through the pure transitions of ``nvpair.state.transitions``; a liveness tick publishes once (its
identity check included), and once more only when a 404 moved the health probe to its
fallback path (the schedule, and so "overdue", changes at once).

``run_probes`` runs one engine's loops, each inside its own fault boundary
(``nvpair.base.boundary.Part``): an exception out of a loop (a bug of nvpair's, or an engine
answer no parser expected) makes the engine ``unhealthy`` with the reason in words, is
logged once, and the loop is restarted after a backoff. It never reaches the service: the
other engines, the API and the other loop of this engine go on. A good probe afterwards
recovers the engine by the usual rules.
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable, Iterable
from contextlib import AbstractContextManager, nullcontext
from functools import partial
from typing import Protocol

import httpx2
import msgspec
import trio

from nvpair.base.boundary import Backoff, Part
from nvpair.config.manifest import GENERATING_MIN_INTERVAL_S, ProbeSpec
from nvpair.config.settings import EngineSpec
from nvpair.errors import ProbeError
from nvpair.probing import probes
from nvpair.probing.kvcache import watch_kv_cache
from nvpair.runtime import wakes
from nvpair.state.snapshot import Board, EngineState
from nvpair.state.traffic import Traffic
from nvpair.state.transitions import (
    AWAITED_READY_INTERVAL_S,
    Finder,
    Outcome,
    after_identity,
    after_liveness,
    liveness_probe,
    next_interval,
    overdue_after,
    part_failed,
    probe_interval,
    rescheduled,
)

#: (AWAITED_READY_INTERVAL_S: the next-tick policy's, in nvpair.state.transitions; named here too)
__all__ = ["AWAITED_READY_INTERVAL_S", "Enrolment", "ProbeMemory", "Prober", "open_client",
           "overdue_after", "run_probes"]

Change = Callable[[EngineState], EngineState]

#: one generator for every prober's jitter (a Random holds 2.5 KB of state).
_RNG = random.Random()
JITTER = 0.05  # fraction of the interval added at random to each tick
#: health ticks skipped in a row at most while real requests prove the engine healthy.
PASSIVE_MAX_IN_A_ROW = 3


def open_client(
    spec: EngineSpec, transport: httpx2.AsyncBaseTransport | None = None
) -> probes.ProbeClient:
    """The engine's one probe client: keep-alive, small explicit pool limits.

    At most three probes of one engine are in flight at once (liveness, identity, models),
    so the pool never queues, and Trio's deadlines fire before the pool's own timeouts.
    """
    longest = max(p.timeout_s for p in (spec.probes.ready, spec.probes.health,
                                        spec.probes.identity, spec.probes.models) if p)
    return probes.ProbeClient(spec.url, timeout_s=longest + 1.0, transport=transport)


class ProbeMemory:
    """What one engine's probes remember across probe and engine restarts: when it last got
    a generating request, and how it went (at most one per GENERATING_MIN_INTERVAL_S);
    per probe, the paths that answered 404 when last asked (a probe without any: absent)."""

    __slots__ = ("generated", "missing")

    def __init__(self) -> None:
        self.generated: tuple[float, Outcome] | None = None
        self.missing: dict[str, set[str]] = {}


class Prober:
    """Runs the probes of one engine against ``client`` and writes outcomes to ``board``."""

    @property
    def _generated(self) -> tuple[float, Outcome] | None:
        return self.memory.generated

    @_generated.setter
    def _generated(self, value: tuple[float, Outcome] | None) -> None:
        self.memory.generated = value

    def __init__(self, spec: EngineSpec, board: Board, client: probes.ProbeClient,
                 traffic: Traffic | None = None, memory: ProbeMemory | None = None,
                 probe_rate: float | None = None) -> None:
        #: what outlives this prober (kept by the engine's runner across restarts)
        self.memory = memory or ProbeMemory()
        self.spec = spec
        #: the node's probes a second (``node_probe_rate``), which sets how fine the grid
        #: its loops wake on is (nvpair.runtime.wakes); None: this engine's alone
        self.probe_rate = steady_probe_rate(spec) if probe_rate is None else probe_rate
        self.traffic = traffic
        self._passive_in_a_row = 0
        self.board = board
        self.client = client
        #: the manifest's probes by name (the spec is frozen: made once)
        self._by_name: dict[str, ProbeSpec] = dict(spec.probes.named())
        self._paths = {n: p.path for n, p in self._by_name.items()}
        #: per probe in flight, its lock (``probe``: made when needed, dropped when free;
        #: four locks an engine, kept idle, were about 0.5 KB of every engine's memory)
        self._locks: dict[str, trio.Lock] = {}
        #: per probe, the paths that answered 404 when last asked
        self._missing: dict[str, set[str]] = self.memory.missing
        self._rng = _RNG
        #: while identity is unconfirmed, good ready probes ask it again only after this
        #: backoff (up to the identity interval), never at each one
        self._identity_backoff = self._new_identity_backoff()
        self._identity_retry_at = float("-inf")
        #: what the last identity answer said of the engine's sleep (``_sleeping``)
        self._identity_sleeping: bool | None = None

    def _new_identity_backoff(self) -> Backoff | None:
        ident, ready = self.spec.probes.identity, self.spec.probes.ready
        if ident is None:
            return None
        first = min(ready.interval_s if ready else ident.interval_s, ident.interval_s)
        return Backoff(first, ident.interval_s, jitter=JITTER, rng=self._rng)

    def path(self, name: str) -> str:
        """The path probe ``name`` asks now: the manifest's, or its fallback once a 404
        moved it there."""
        return self._paths[name]

    def interval(self, name: str) -> float:
        spec = self._by_name[name]
        return probe_interval(spec, self._generates(spec, self._paths[name]))

    async def probe(self, name: str) -> tuple[Outcome, probes.Answer | None]:
        """One request of probe ``name`` under its timeout; never raises for engine trouble.

        A 404 moves the probe between the manifest's path and its fallback: at once when
        the other path is not known to be missing too (an old build lacks the path; an
        upgraded one lacks the fallback), else at the next tick (one request a tick for
        a server that has neither)."""
        spec = self._by_name[name]
        lock = self._locks.get(name)
        if lock is None:
            lock = self._locks[name] = trio.Lock()
        try:  # (taken at once when free: a probe's requests checkpoint enough)
            lock.acquire_nowait()
        except trio.WouldBlock:
            await lock.acquire()
        try:
            return await self._probe_locked(name, spec)
        finally:  # (released to a waiter, it is still locked: kept for it)
            lock.release()
            if not lock.locked() and self._locks.get(name) is lock:
                del self._locks[name]

    async def _probe_locked(self, name: str, spec: ProbeSpec
                            ) -> tuple[Outcome, probes.Answer | None]:
        """``probe`` with the probe's lock held."""
        path = self._paths[name]
        outcome, answer = await self._request(spec, path)
        if outcome.http_status != 404 or not spec.fallback_path:
            if (known := self._missing.get(name)) is not None:
                known.discard(path)
            return outcome, answer
        missing = self._missing.setdefault(name, set())
        other = spec.fallback_path if path != spec.fallback_path else spec.path
        if path not in missing:  # it worked (or was never asked): news of the other is old
            missing.discard(other)
        missing.add(path)
        if (other == spec.fallback_path and spec.fallback_cost == "generating"
                and not self.spec.allow_generating):
            return msgspec.structs.replace(outcome, kind="error", error=(
                f"the engine has no {spec.path} (an older build?) and its fallback "
                f"{spec.fallback_path} generates; set allow_generating_probes = true "
                "to use it, or upgrade the engine")), None
        self._use(name, other)
        if other in missing:
            return outcome, answer  # both missing: the other one at the next tick
        outcome, answer = await self._request(spec, other)
        if outcome.http_status == 404:
            missing.add(other)
        return outcome, answer

    def _use(self, name: str, path: str) -> None:
        self._paths[name] = path
        if name == "health":  # the schedule may change: "overdue" must follow it at once
            spec = self._by_name[name]
            self.board.update(self.spec.name, partial(
                rescheduled, interval_s=self.interval(name), timeout_s=spec.timeout_s))

    @staticmethod
    def _generates(spec: ProbeSpec, path: str) -> bool:
        return probes.generates(spec, path)

    async def _request(self, spec: ProbeSpec, path: str) -> tuple[Outcome, probes.Answer | None]:
        """``_attempt``, but an engine gets at most one generating request per
        GENERATING_MIN_INTERVAL_S, whichever probe asks (``ready`` and ``health`` can
        fall back to the same generating path): sooner, the last one's outcome stands."""
        if not self._generates(spec, path):
            return await self._attempt(spec, path)
        now = trio.current_time()
        if self._generated is not None and now < self._generated[0] + GENERATING_MIN_INTERVAL_S:
            last = self._generated[1]
            return (msgspec.structs.replace(last, kind="passive") if last.ok else last), None
        # counted before it is sent: one cut short (a restart) may have reached the engine
        self._generated = (now, Outcome(ok=False, kind="timeout", path=path, error=(
            f"GET {path} generates; the last one, sent under {GENERATING_MIN_INTERVAL_S:g} s "
            "ago, was cut short")))
        outcome, answer = await self._attempt(spec, path)
        self._generated = (now, outcome)
        return outcome, answer

    async def _attempt(self, spec: ProbeSpec, path: str) -> tuple[Outcome, probes.Answer | None]:
        started = trio.current_time()
        answer = None
        with trio.move_on_after(spec.timeout_s) as scope:
            try:
                answer = await probes.request(self.client, spec, path, api_key=self.spec.api_key)
            except ProbeError as exc:
                return Outcome(ok=False, kind=exc.kind, http_status=exc.http_status,
                               latency_ms=_ms(started), error=str(exc), path=path), None
        if scope.cancelled_caught or answer is None:
            return Outcome(ok=False, kind="timeout", latency_ms=_ms(started), path=path,
                           error=f"GET {path} did not answer within {spec.timeout_s:g} s"), None
        return Outcome(ok=True, http_status=answer.status, latency_ms=answer.latency_ms,
                       path=path), answer

    async def check_identity(self) -> None:
        """Probe identity once and publish the result (a mismatch makes the engine
        unhealthy)."""
        change = await self.identify()
        if change is not None:
            self._identity_tried(self.board.update(self.spec.name, change))

    async def identify(self) -> Change | None:
        """Probe identity once; the result as a transition of the engine, to publish
        (then hand the engine to ``_identity_tried``). None without an identity probe."""
        spec = self.spec.probes.identity
        if spec is None:
            return None
        outcome, answer = await self.probe("identity")
        self._identity_sleeping = self._sleeping("identity", answer) if outcome.ok else None
        now = trio.current_time()
        if answer is None:
            return partial(after_identity, spec=self.spec, outcome=outcome, now=now,
                           path=self._paths["identity"])
        try:
            identity, names = probes.parse_identity(answer.body, spec, self.spec.kind)
        except ProbeError as exc:
            failed = Outcome(ok=False, kind=exc.kind, http_status=answer.status,
                             latency_ms=answer.latency_ms, error=str(exc), path=outcome.path)
            return partial(after_identity, spec=self.spec, outcome=failed, now=now,
                           wrong=str(exc))
        return partial(after_identity, spec=self.spec, outcome=outcome, now=now,
                       path=self._paths["identity"], identity=identity, names=names)

    def _identity_tried(self, engine: EngineState) -> None:
        """Schedule the next identity retry of a good ready probe: backed off while who
        answers is unconfirmed (a timeout, a 5xx, a 401), at once again once it is known."""
        backoff = self._identity_backoff
        if backoff is None:
            return
        if engine.identity is None and engine.mismatch_by != "identity":
            self._identity_retry_at = trio.current_time() + backoff.next()
        else:
            backoff.reset()
            self._identity_retry_at = float("-inf")

    async def run_liveness(self) -> None:
        """Probe ``ready`` until the engine answers ready, then ``health``; forever.

        Not startable (``start_soon``): it runs until cancelled, and cancellation may land
        in any request or sleep (a request cut short publishes nothing). It raises nothing
        for engine trouble, which is state; a bug of nvpair's escapes to the loop's
        boundary (``run_probes``)."""
        name = self.spec.name
        next_tick = trio.current_time()
        while True:
            current = self.board.current.engine(name)
            assert current is not None
            probe = liveness_probe(current.state)
            outcome = self._passive(probe, current.state)
            answer = None
            if outcome is None:
                outcome, answer = await self.probe(probe)
            identified: Change | None = None
            if (outcome.ok and probe == "ready"
                    and trio.current_time() >= self._identity_retry_at):
                # Confirm who answers before listing it: a wrong engine is never listed.
                identified = await self.identify()
            sleeping = self._sleeping(probe, answer)
            if identified is not None and sleeping is None:
                # Turning ready: where the identity answer is the sleeping probe's
                # (llama-server's /props), it says whether the engine sleeps already (one
                # adopted asleep, a kept one the next nvpair adopts), so it is never
                # listed ready until the next health probe, up to 5 s later.
                sleeping = self._identity_sleeping
            spec = self._by_name[probe]
            now = trio.current_time()
            sleep = self.spec.sleep
            liveness = partial(after_liveness, probe=probe, spec=spec, outcome=outcome,
                               now=now, needs_identity=self.spec.probes.identity is not None,
                               sleeping=sleeping,
                               sleep_probe=sleep is not None and sleep.probe_path is not None)
            # one publish for the tick: the identity result, then the liveness outcome
            after = self.board.update(name, liveness if identified is None
                                      else partial(_then, identified, liveness))
            if identified is not None:
                self._identity_tried(after)
            generated = self._generated
            tick = next_interval(after, self.spec, probe=probe, outcome=outcome,
                                 generating=self._generating(),
                                 generated_at=None if generated is None else generated[0])
            next_tick = self._next(next_tick, tick.interval)
            wake = max(next_tick + self._jitter(tick.interval), tick.not_before)
            grid = self._grid(tick.interval)
            if tick.awaited:  # (a start not made for a request)
                await self._sleep_until_awaited(wakes.on_grid(wake, grid))
            else:
                await wakes.sleep_until(wake, grid)

    def _sleeping(self, probe: str, answer: probes.Answer | None) -> bool | None:
        """What a health or identity answer says of the engine's sleep, when that probe
        asks the sleeping probe's path (``sleep = true``; docs/sleep.md); None: it does
        not say."""
        sleep = self.spec.sleep
        if (sleep is None or sleep.probe_path is None or answer is None
                or probe not in ("health", "identity")
                or self._paths[probe] != sleep.probe_path):
            return None
        return probes.sleeping(answer.body, sleep.sleeping_pointer)

    def _generating(self) -> tuple[str, ...]:
        """The liveness probes whose path (the manifest's, or its fallback) generates."""
        return tuple(name for name in ("ready", "health")
                     if self._generates(self._by_name[name], self._paths[name]))

    async def _sleep_until_awaited(self, wake: float) -> None:
        """Until ``wake``, or the moment requests start waiting for this starting on-demand
        engine (its ``queued`` on the board): then its ready probe ticks at once."""
        with trio.move_on_at(wake):
            version = self.board.current.version
            while True:
                snap = await self.board.wait_changed(version)
                version = snap.version
                e = snap.engine(self.spec.name)
                if e is not None and e.queued:
                    return

    def _passive(self, probe: str, state: str) -> Outcome | None:
        """A health tick that real traffic makes unnecessary: at most 3 in a row."""
        if (probe != "health" or state != "ready" or self.traffic is None
                or self._passive_in_a_row >= PASSIVE_MAX_IN_A_ROW):
            self._passive_in_a_row = 0
            return None
        if not self.traffic.proves_healthy(self.spec.name, trio.current_time(),
                                           self.interval("health")):
            self._passive_in_a_row = 0
            return None
        self._passive_in_a_row += 1
        return Outcome(ok=True, kind="passive")

    async def run_identity(self) -> None:
        """Re-check identity on its interval while the engine answers.

        Not startable (``start_soon``): returns at once without an identity probe, else
        runs until cancelled; raises nothing for engine trouble (a bug of nvpair's escapes
        to the loop's boundary)."""
        if self.spec.probes.identity is None:
            return
        next_tick = trio.current_time() + self.interval("identity")
        while True:
            interval = self.interval("identity")
            await wakes.sleep_until(next_tick + self._jitter(interval), self._grid(interval))
            current = self.board.current.engine(self.spec.name)
            if current is not None and current.state not in ("starting", "down", "stopped"):
                await self.check_identity()
            next_tick = self._next(next_tick, self.interval("identity"))

    def _next(self, previous: float, interval: float) -> float:
        """The next tick on an absolute schedule; missed ticks are skipped, never doubled."""
        now = trio.current_time()
        nxt = previous + interval
        if nxt < now:
            nxt = now + interval * 0.5
        return nxt

    def _jitter(self, interval: float) -> float:
        return self._rng.uniform(0, JITTER * interval)

    def _grid(self, interval: float) -> float:
        """The grid this loop's ticks wake on (nvpair.runtime.wakes): shared with the node's other
        probes and housekeeping, so that an idle node wakes up seldom."""
        return wakes.grid_for(interval, self.probe_rate)


def _then(first: Change, second: Change, engine: EngineState) -> EngineState:
    return second(first(engine))


def _ms(started: float) -> float:
    return (trio.current_time() - started) * 1000


# -- one engine's probe loops, each in its fault boundary ------------------------------------

def unhealthy_with(board: Board, name: str, by: Finder | None = None
                   ) -> Callable[[str | None], None]:
    """A part's ``publish``: its failure makes engine ``name`` unhealthy with the reason.
    A recovery publishes nothing: the next good probe moves the engine on by the usual
    rules (and clears the error). With ``by``, the failure holds until ``by``'s probe
    clears it (``state.part_failed``)."""

    def publish(reason: str | None) -> None:
        if reason is not None:
            board.update(name, partial(part_failed, reason=reason, now=trio.current_time(),
                                       by=by))

    return publish


class LoopPart(Part):
    """A probe loop's boundary. It works again once one of its probes has recorded a
    result after the failure (a loop that never returns says so no other way)."""

    def __init__(self, name: str, board: Board, engine: str, probes: tuple[str, ...],
                 by: Finder | None = None, *, nursery: trio.Nursery) -> None:
        super().__init__(name, unhealthy_with(board, engine, by))
        self.board, self.engine, self.probes = board, engine, probes
        self.failed_at = float("-inf")
        #: where the recovery watcher runs, started at a failure only (an idle task per
        #: loop and engine was about 2 KB of every engine's memory, at 1,000 engines)
        self._nursery = nursery
        self._watching = False

    def failed(self, exc: BaseException) -> str:
        self.failed_at = trio.current_time()
        if not self._watching:
            self._watching = True
            self._nursery.start_soon(self.watch_recovery)
        return super().failed(exc)

    async def watch_recovery(self) -> None:
        """Call ``ok()`` when a probe result newer than the last failure is on the board,
        then return (``failed`` starts it again at the next failure).

        Not startable (``start_soon``); returns at recovery or when cancelled, raises
        nothing."""
        try:
            version = -1
            while self.failure is not None:
                snap = await self.board.wait_changed(version)
                version = snap.version
                e = snap.engine(self.engine)
                if e is not None and any(
                        (s := e.probe(p)) is not None and s.at is not None
                        and s.at > self.failed_at for p in self.probes):
                    self.ok()
        finally:
            self._watching = False


class Enrolment(Protocol):
    """Where a running engine's prober is enrolled while its probes run (the sweep:
    ``nvpair.probing.sweep.Sweep.enrolled``)."""

    def enrolled(self, prober: Prober) -> AbstractContextManager[None]: ...


def steady_probe_rate(spec: EngineSpec) -> float:
    """The probes a second of ``spec``'s engine once it is ready: health, identity and its
    model list (for the node's probe grid, nvpair.runtime.wakes)."""
    probes = spec.probes
    return sum(1 / p.interval_s for p in (probes.health, probes.identity, probes.models)
               if p is not None and p.interval_s > 0)


def node_probe_rate(specs: Iterable[EngineSpec]) -> float:
    """The probes a second of a node whose engines are ``specs``, all ready: the most it
    probes, which sets how fine the probe grid is (nvpair.runtime.wakes). Counted from the
    configuration, not from the engines probed at the moment, so that one engine's start
    or stop moves no other engine's grid."""
    return sum(steady_probe_rate(spec) for spec in specs)


async def run_probes(
    spec: EngineSpec,
    board: Board,
    sweep: Enrolment | None = None,
    *,
    transport: httpx2.AsyncBaseTransport | None = None,
    traffic: Traffic | None = None,
    memory: ProbeMemory | None = None,
    probe_rate: float | None = None,
    task_status: trio.TaskStatus[Prober] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Probe one engine until cancelled, its loops each in its own boundary.

    Started value: the engine's ``Prober``, enrolled in ``sweep`` (when given) until this
    returns, so the sweep lists the engine only while its probes run. ``memory`` is what
    the engine's probes remember across restarts (the runner's); ``probe_rate`` the
    node's (``node_probe_rate``; None: this engine's alone).

    Cancellation: cancel the surrounding scope; the loops end, the prober leaves the
    sweep and the engine's client closes, so no connection outlives the loops. Raises:
    nothing from the loops (each failure is the engine's state, and the loop restarts);
    only an error opening the client, before ``started``.
    """
    async with open_client(spec, transport) as client, trio.open_nursery() as nursery:
        prober = Prober(spec, board, client, traffic, memory, probe_rate)
        with sweep.enrolled(prober) if sweep is not None else nullcontext():
            # (the identity loop's failure holds until an identity check clears it: good
            # health probes alone would make the engine ready between its failures)
            loops: list[tuple[str, tuple[str, ...], Finder | None,
                              Callable[[], Awaitable[None]]]] = [
                ("health probes", ("ready", "health"), None, prober.run_liveness),
                ("identity probe", ("identity",), "identity", prober.run_identity),
            ]
            for what, names, by, loop in loops:
                part = LoopPart(f"engine {spec.name}: {what}", board, spec.name, names, by,
                                nursery=nursery)
                nursery.start_soon(partial(part.supervise, loop))
            if spec.kv_cache_probe_s is not None and spec.manifest.kv_cache is not None:
                # (its own boundary: a reading is never a health signal, docs/metrics.md)
                kv = Part(f"engine {spec.name}: KV-cache reading")
                nursery.start_soon(partial(kv.supervise, partial(
                    watch_kv_cache, spec, board, spec.kv_cache_probe_s)))
            task_status.started(prober)
            await trio.sleep_forever()
