"""The probe loops of one engine: liveness (``ready`` then ``health``) and ``identity``.

Each request runs under its own cancel scope with the probe's timeout, applied here and only
here. Loops tick on absolute deadlines with a little jitter; a probe still running when its
next tick comes is not doubled (the loop is sequential). Outcomes become state on the board.
"""

from __future__ import annotations

import random
from functools import partial

import httpx2
import msgspec
import trio

from nvpair import probes
from nvpair.boundary import Backoff
from nvpair.config import EngineSpec
from nvpair.errors import ProbeError
from nvpair.manifest import GENERATING_MIN_INTERVAL_S, PROBE_NAMES, ProbeSpec
from nvpair.router.traffic import Traffic
from nvpair.snapshot import Board, EngineState
from nvpair.state import Outcome, after_liveness, count, enter, with_auth_notice
from nvpair.tls import client_tls

JITTER = 0.05  # fraction of the interval added at random to each tick
#: health ticks skipped in a row at most while real requests prove the engine healthy.
PASSIVE_MAX_IN_A_ROW = 3


def open_client(
    spec: EngineSpec, transport: httpx2.AsyncBaseTransport | None = None
) -> httpx2.AsyncClient:
    """The engine's one probe client: keep-alive, small explicit pool limits.

    At most three probes of one engine are in flight at once (liveness, identity, models),
    so the pool never queues, and Trio's deadlines fire before httpx2's own timeouts.
    """
    longest = max(p.timeout_s for p in (spec.probes.ready, spec.probes.health,
                                        spec.probes.identity, spec.probes.models) if p)
    return httpx2.AsyncClient(
        base_url=spec.url,
        timeout=httpx2.Timeout(longest + 1.0),
        limits=httpx2.Limits(max_connections=4, max_keepalive_connections=2,
                             keepalive_expiry=4.0),
        headers={"User-Agent": "nvpair-probe"},
        trust_env=False,
        transport=transport,
        verify=client_tls(),
    )


def overdue_after(interval_s: float, timeout_s: float) -> float:
    """How long after its last health result a ready engine shows as stale."""
    return interval_s + timeout_s + 1.0


class ProbeMemory:
    """What one engine's probes remember across probe and engine restarts: when it last got
    a generating request, and how it went (at most one per GENERATING_MIN_INTERVAL_S);
    per probe, the paths that answered 404 when last asked."""

    def __init__(self) -> None:
        self.generated: tuple[float, Outcome] | None = None
        self.missing: dict[str, set[str]] = {n: set() for n in PROBE_NAMES}


class Prober:
    """Runs the probes of one engine against ``client`` and writes outcomes to ``board``."""

    @property
    def _generated(self) -> tuple[float, Outcome] | None:
        return self.memory.generated

    @_generated.setter
    def _generated(self, value: tuple[float, Outcome] | None) -> None:
        self.memory.generated = value

    def __init__(self, spec: EngineSpec, board: Board, client: httpx2.AsyncClient,
                 traffic: Traffic | None = None, memory: ProbeMemory | None = None) -> None:
        #: what outlives this prober (kept by the engine's runner across restarts)
        self.memory = memory or ProbeMemory()
        self.spec = spec
        self.traffic = traffic
        self._passive_in_a_row = 0
        self.board = board
        self.client = client
        self._paths = {n: p.path for n, p in self._specs().items()}
        self._locks: dict[str, trio.Lock] = {n: trio.Lock() for n in PROBE_NAMES}
        #: per probe, the paths that answered 404 when last asked
        self._missing: dict[str, set[str]] = self.memory.missing
        self._rng = random.Random()
        #: while identity is unconfirmed, good ready probes ask it again only after this
        #: backoff (up to the identity interval), never at each one
        self._identity_backoff = self._new_identity_backoff()
        self._identity_retry_at = float("-inf")

    def _new_identity_backoff(self) -> Backoff | None:
        ident, ready = self.spec.probes.identity, self.spec.probes.ready
        if ident is None:
            return None
        first = min(ready.interval_s if ready else ident.interval_s, ident.interval_s)
        return Backoff(first, ident.interval_s, jitter=JITTER, rng=self._rng)

    def _specs(self) -> dict[str, ProbeSpec]:
        return dict(self.spec.probes.named())

    def interval(self, name: str) -> float:
        spec = self._specs()[name]
        if self._generates(spec, self._paths[name]):
            return max(spec.interval_s, GENERATING_MIN_INTERVAL_S)
        return spec.interval_s

    async def probe(self, name: str) -> tuple[Outcome, probes.Answer | None]:
        """One request of probe ``name`` under its timeout; never raises for engine trouble.

        A 404 moves the probe between the manifest's path and its fallback: at once when
        the other path is not known to be missing too (an old build lacks the path; an
        upgraded one lacks the fallback), else at the next tick (one request a tick for
        a server that has neither)."""
        spec = self._specs()[name]
        async with self._locks[name]:
            path = self._paths[name]
            outcome, answer = await self._request(spec, path)
            if outcome.http_status != 404 or not spec.fallback_path:
                self._missing[name].discard(path)
                return outcome, answer
            missing = self._missing[name]
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
        if name == "health":  # the schedule may change: "overdue" must follow it
            spec = self._specs()[name]
            overdue = overdue_after(self.interval(name), spec.timeout_s)
            self.board.update(self.spec.name, lambda e: msgspec.structs.replace(
                e, overdue_after_s=overdue))

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
        """Probe identity once and record the result (a mismatch makes the engine unhealthy)."""
        spec = self.spec.probes.identity
        if spec is None:
            return
        outcome, answer = await self.probe("identity")
        now = trio.current_time()
        identity = names = None
        if answer is None and outcome.http_status == 404:  # this kind always has the path
            self._record_mismatch(outcome, now, f"{self.where} does not look like "
                                  f"{self.spec.kind}: GET {outcome.path} answered 404")
            return
        if answer is not None:
            try:
                identity, names = probes.parse_identity(answer.body, spec, self.spec.kind)
            except ProbeError as exc:
                outcome = Outcome(ok=False, kind=exc.kind, http_status=answer.status,
                                  latency_ms=answer.latency_ms, error=str(exc),
                                  path=outcome.path)
                self._record_mismatch(outcome, now, f"{self.where} {exc}")
                return
        mismatch = None
        if (identity is not None and self.spec.model and names
                and not any(probes.same_model(self.spec.model, n) for n in names)):
                mismatch = f"{self.where} serves {names[0]}, expected {self.spec.model}"

        def change(e: EngineState) -> EngineState:
            e = count(e, "identity", spec.path, outcome, now)
            e = with_auth_notice(e, outcome, self._paths["identity"])
            if identity is None:
                return e
            e = msgspec.structs.replace(e, identity=identity)
            if mismatch:
                e = msgspec.structs.replace(e, mismatch=mismatch, mismatch_by="identity")
                return enter(e, "unhealthy", now, error=mismatch)
            if e.mismatch_by == "identity":  # the model list's finding is the sweep's
                e = msgspec.structs.replace(e, mismatch=None, mismatch_by=None)
            return e  # a cleared mismatch lets the next good health probe make it ready

        after = self.board.update(self.spec.name, change)
        self._identity_tried(after)

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

    def _record_mismatch(self, outcome: Outcome, now: float, message: str) -> None:
        spec = self.spec.probes.identity
        assert spec is not None

        def change(e: EngineState) -> EngineState:
            e = count(e, "identity", spec.path, outcome, now)
            # who answers is not known: it must be confirmed again before it is listed
            e = msgspec.structs.replace(e, mismatch=message, mismatch_by="identity",
                                        identity=None)
            return enter(e, "unhealthy", now, error=message)

        self._identity_tried(self.board.update(self.spec.name, change))

    @property
    def where(self) -> str:
        return f"{self.spec.host}:{self.spec.port}"

    async def run_liveness(self) -> None:
        """Probe ``ready`` until the engine answers ready, then ``health``; forever."""
        name = self.spec.name
        next_tick = trio.current_time()
        while True:
            current = self.board.current.engine(name)
            assert current is not None
            probe = "ready" if current.state in ("starting", "down") else "health"
            outcome = self._passive(probe, current.state)
            if outcome is None:
                outcome, _ = await self.probe(probe)
            if (outcome.ok and probe == "ready"
                    and trio.current_time() >= self._identity_retry_at):
                # Confirm who answers before listing it: a wrong engine is never listed.
                await self.check_identity()
            spec = self._specs()[probe]
            now = trio.current_time()
            after = self.board.update(name, partial(
                after_liveness, probe=probe, spec=spec, outcome=outcome, now=now,
                needs_identity=self.spec.probes.identity is not None))
            # The next tick follows the interval of the probe that runs next.
            following = "ready" if after.state in ("starting", "down") else "health"
            interval = self.interval(following)
            if following == "ready" and self._awaits_identity(after, probe, outcome):
                # It answers ready; only who answers is unknown: no need to ask it more
                # often than a ready engine's health.
                interval = max(interval, self.interval("health"))
            next_tick = self._next(next_tick, interval)
            wake = next_tick + self._jitter(interval)
            if self._generated is not None and self._generates(self._specs()[following],
                                                               self._paths[following]):
                wake = max(wake, self._generated[0] + GENERATING_MIN_INTERVAL_S)
            await trio.sleep_until(wake)

    def _awaits_identity(self, engine: EngineState, probe: str, outcome: Outcome) -> bool:
        ready = self.spec.probes.ready
        stats = engine.probe("ready")
        return (probe == "ready" and outcome.ok and engine.state == "starting"
                and self.spec.probes.identity is not None and engine.identity is None
                and ready is not None and stats is not None
                and stats.consecutive_successes >= ready.success_threshold)

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
        """Re-check identity on its interval while the engine answers."""
        if self.spec.probes.identity is None:
            return
        next_tick = trio.current_time() + self.interval("identity")
        while True:
            await trio.sleep_until(next_tick + self._jitter(self.interval("identity")))
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


def _ms(started: float) -> float:
    return (trio.current_time() - started) * 1000
