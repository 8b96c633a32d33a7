"""Engines' wake and sleep (docs/sleep.md): the kind's calls, in order, one at a time.

A wake is single flight: a second wake (a route, or a routed request waiting for a sleeping
vLLM) joins the one in progress. A sleep drains first: the engine stops admitting, so the
router sends nothing new, and the routed requests in flight finish (however long they take:
nothing generating is cut); then the kind's sleep calls go out, which never abort (vLLM
``mode=wait``, SGLang ``retract``). Never the engines' default abort.

A model is woken by what serves it (``wake_model``): the engine it is on, when that
sleeps; for a multi-model engine (llama-server in router mode) whose model is not loaded,
a load of that model (``POST /models/load``; ``GET /slots?model=`` for a model whose
child sleeps), then its model list read every ``LOAD_POLL_S`` until it is loaded. A second
wake of the model while one runs joins it.

An engine nvpair puts to sleep (vLLM, SGLang: the kind has sleep calls) with
``idle_sleep_s`` is put to sleep once no routed request has run on it for that long
(``idle``, looked at every ``IDLE_CHECK_S``); llama-server sleeps by itself (its own
``--sleep-idle-seconds``).

Each engine's operation runs in this module's nursery, inside a boundary of its own: a
failing call is that engine's state (its error, its activity), never the service's.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from functools import partial
from typing import Any, Literal, NamedTuple
from urllib.parse import quote

import httpx2
import msgspec
import trio

from nvpair.base.boundary import Part
from nvpair.base.tls import client_tls
from nvpair.config.command import fill
from nvpair.config.manifest import EngineCall
from nvpair.config.settings import EngineSpec, placeholder_values
from nvpair.errors import NvpairError, ProbeError
from nvpair.probing.probes import parse_listing
from nvpair.runtime import wakes
from nvpair.state.snapshot import ASLEEP_STATES, Board, EngineState, ModelState
from nvpair.state.traffic import Traffic
from nvpair.state.transitions import enter, with_model_list, with_model_state
from nvpair.supervision.lifecycle import Accepted, Busy, Result

log = logging.getLogger("nvpair.sleep")

#: how often a drain before a sleep looks at the requests in flight (the router's count)
DRAIN_POLL_S = 0.05
#: states an engine can be put to sleep from
AWAKE_STATES = frozenset({"ready", "stale"})
#: a model a multi-model engine loads for a wake is looked at this often until it is loaded
#: (the 270M model loads in about 0.8 s)
LOAD_POLL_S = 0.25
#: a multi-model engine's model states a wake of the model loads (or wakes) it from
LOADABLE = frozenset({"cold", "sleeping", "loading"})
#: how often engines with ``idle_sleep_s`` are looked at (a sleep is at most this late)
IDLE_CHECK_S = 1.0


class SleepError(NvpairError):
    """A sleep or wake call failed; the message names the call and why, in one line."""


class Operation:
    """A wake or a sleep in progress: what it is, and when it ends (``error``: why not)."""

    def __init__(self, kind: str, level: int | None = None, reason: str | None = None
                 ) -> None:
        self.kind = kind
        #: a sleep's level (vLLM's ``{sleep_level}``; None: the engine's ``sleep_level``)
        self.level = level
        #: why it was asked (an idle time, an eviction), for the engine's activity
        self.reason = reason
        self.done = trio.Event()
        self.error: str | None = None
        #: a sleep still draining (no call sent yet) ends here when called off
        self.drain = trio.CancelScope()
        self.calling = False


class ModelWake(NamedTuple):
    """What a wake of a model did: the engine it concerns and the result (``Accepted``
    with ``awake``, ``waking`` or ``loading``; ``Busy`` with why not)."""

    engine: str
    result: Result


class Sleepers:
    """The wake and sleep of every engine that can sleep (``sleep = true``, or a kind whose
    sleep is always probed), by name; and the wake of a model, by id."""

    def __init__(self, specs: Iterable[EngineSpec], board: Board, traffic: Traffic, *,
                 transport: httpx2.AsyncBaseTransport | None = None) -> None:
        every = tuple(specs)
        self.specs = {s.name: s for s in every if s.sleep is not None}
        #: every engine (a multi-model engine's model is loaded whether it sleeps or not)
        self.engines = {s.name: s for s in every}
        self.board = board
        self.traffic = traffic
        self.transport = transport
        self.running: dict[str, Operation] = {}
        #: the loads of multi-model engines' models in progress, by (engine, model)
        self.loads: dict[tuple[str, str], Operation] = {}
        #: how long each engine's last wake took (seconds), what eviction plans come-backs
        #: with (``nvpair.router.evict``)
        self.woke_in: dict[str, float] = {}
        #: the level nvpair put each sleeping engine to sleep at, which its wake's calls
        #: follow (the manifest's ``wake_by_level``; not known: its ``sleep_level``)
        self.slept_at: dict[str, int] = {}
        self._nursery: trio.Nursery | None = None

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        """Run the operations asked for until cancelled.

        Started value: None, at once (wakes and sleeps are taken from then on).
        Cancellation ends the operations in progress: a wake cut short leaves the engine to
        its probes, a sleep cut short admits again. Raises: nothing (a failing operation is
        its engine's state and log line)."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                task_status.started()
                ticker = wakes.Ticker(IDLE_CHECK_S)
                idle = Part("sleep: idle engines", logger=log)  # (a bug: the next look's)
                while True:
                    await ticker.tick()
                    with idle.guard():
                        self._sleep_idle()
                        idle.ok()
        finally:
            self._nursery = None

    def _sleep_idle(self) -> None:
        """Put the engines due to sleep for their ``idle_sleep_s`` to sleep (``idle``)."""
        for name, idle_s in self.idle(trio.current_time()):
            result = self.sleep(name, reason=f"idle {idle_s:.0f} s")
            log.info("%s: idle for %.0f s (idle_sleep_s): %s", name, idle_s,
                     result.reason if isinstance(result, Busy) else "going to sleep",
                     extra={"engine": name})

    def idle(self, now: float) -> list[tuple[str, float]]:
        """The engines due to sleep for their ``idle_sleep_s``, with how long each has been
        idle: awake, admitting, nothing in flight, no operation under way, and no routed
        request since ``idle_sleep_s`` (nor a state change: a woken engine gets its time).
        Engines that sleep by themselves (no sleep calls: llama-server) are left to it."""
        due = []
        for name, spec in self.specs.items():
            if spec.idle_sleep_s is None or spec.sleep is None or not spec.sleep.sleep:
                continue
            e = self.board.current.engine(name)
            if (e is None or e.state not in AWAKE_STATES or not e.admitting
                    or name in self.running or self._in_flight(name)):
                continue
            entry = self.traffic.engines.get(name)
            ended = None if entry is None else entry.last_ended_at
            idle_s = now - max(e.since, -math.inf if ended is None else ended)
            if idle_s >= spec.idle_sleep_s:
                due.append((name, idle_s))
        return due

    def wakes_by_itself(self, name: str) -> bool:
        """Whether a routed request wakes the engine by itself (llama-server): then the
        router sends it as it is; else it waits for ``awake``."""
        spec = self.specs.get(name)
        return spec is None or spec.sleep is None or spec.sleep.request_wakes

    # -- the requests (sync: they record what is wanted and start it) ---------------------

    def wake(self, name: str) -> Result:
        """Wake engine ``name``: ``Accepted("waking")`` (also when one is in progress),
        ``Accepted("awake")`` when there is nothing to do, or ``Busy`` with why not."""
        spec, e = self.specs.get(name), self.board.current.engine(name)
        if spec is None or spec.sleep is None or e is None:
            return Busy(f"engine {name} cannot sleep or wake: set sleep = true for it "
                        "(docs/sleep.md)")
        if self._nursery is None:
            return Busy("nvpair is not running its sleep operations (starting or stopping)")
        running = self.running.get(name)
        if running is not None:
            if running.kind == "wake":
                return Accepted("waking")
            return Busy(f"engine {name} is going to sleep; wake it once it sleeps")
        if e.state not in ASLEEP_STATES:
            if e.state in AWAKE_STATES:
                return Accepted("awake")
            return Busy(f"engine {name} is {e.state}: only a sleeping engine wakes")
        self._set(name, state="waking", activity="waking")  # (at once: the answer shows it)
        self._start(name, Operation("wake"))
        return Accepted("waking")

    def levels(self, name: str) -> tuple[int, ...]:
        """The levels nvpair can put engine ``name`` to sleep at: a kind whose sleep call
        takes ``{sleep_level}`` (vLLM) at its ``sleep_level`` and deeper, ``(1, 2)`` or
        ``(2,)``; another that has sleep calls (SGLang's release keeps no copy of the
        weights) ``(2,)``; none when it sleeps only by itself (llama-server)."""
        spec = self.specs.get(name)
        if spec is None or spec.sleep is None or not spec.sleep.sleep:
            return ()
        if any("{sleep_level}" in call.path for call in spec.sleep.sleep):
            return tuple(range(spec.sleep_level, 3))
        return (2,)

    def sleep(self, name: str, level: int | None = None, *, reason: str | None = None
              ) -> Result:
        """Put engine ``name`` to sleep (at ``level``: vLLM's; None: its ``sleep_level``),
        drained first: ``Accepted("going to sleep")`` (also when in progress),
        ``Accepted("sleeping")`` when it sleeps already, or ``Busy`` with why not
        (llama-server sleeps only by itself). ``reason``: why, for its activity."""
        spec, e = self.specs.get(name), self.board.current.engine(name)
        if spec is None or spec.sleep is None or e is None:
            return Busy(f"engine {name} cannot sleep: set sleep = true for it "
                        "(docs/sleep.md)")
        if not spec.sleep.sleep:
            return Busy(f"engine {name} ({spec.kind}) has no call that puts it to sleep: it "
                        "sleeps by itself after idle_sleep_s without a request")
        if self._nursery is None:
            return Busy("nvpair is not running its sleep operations (starting or stopping)")
        running = self.running.get(name)
        if running is not None:
            if running.kind == "sleep":
                return Accepted("going to sleep")
            return Busy(f"engine {name} is waking; put it to sleep once it is awake")
        if e.state == "sleeping":
            return Accepted("sleeping")
        if e.state not in AWAKE_STATES or not e.admitting:
            why = "draining" if not e.admitting else e.state
            return Busy(f"engine {name} is {why}: only a ready engine goes to sleep")
        # at once, as a drain does: the router sends nothing new from now
        because = "" if reason is None else f" ({reason})"
        self._set(name, admitting=False, activity=f"draining to sleep{because}: "
                  f"{self._in_flight(name)} in flight, then sleep")
        self._start(name, Operation("sleep", level, reason))
        return Accepted("going to sleep")

    def wake_model(self, model: str) -> ModelWake | None:
        """Wake what serves ``model`` (an id or alias an engine here lists): None when no
        engine here lists it. ``awake`` when one serving it is awake; else the wake in
        progress is joined; else a sleeping engine is woken (``waking``), or a multi-model
        engine that has not loaded it loads it (``loading``); else ``Busy`` with why."""
        serving = [(e, _model_state(e, model)) for e in self.board.current.engines
                   if any(m.id == model for m in e.models) or model in e.aliases]
        if not serving:
            return None
        for e, state in serving:
            if e.state in AWAKE_STATES and e.admitting and state in (None, "ready"):
                return ModelWake(e.name, Accepted("awake"))
        for e, _ in serving:
            if (e.name, model) in self.loads:
                return ModelWake(e.name, Accepted("loading"))
            running = self.running.get(e.name)
            if running is not None and running.kind == "wake":
                return ModelWake(e.name, Accepted("waking"))
        for e, _ in serving:
            if e.state in ASLEEP_STATES and e.name in self.specs:
                return ModelWake(e.name, self.wake(e.name))
        for e, state in serving:
            if (e.identity is not None and e.identity.router and e.state in AWAKE_STATES
                    and state in LOADABLE):
                return ModelWake(e.name, self._load(e.name, model, state))
        why = ", ".join(f"engine {e.name} is {e.state}" + (
            "" if state is None else f" with {model} {state}") for e, state in serving)
        return ModelWake(serving[0][0].name, Busy(
            f"nothing here can wake {model}: {why}; only a sleeping engine wakes, and a "
            "multi-model engine loads a model it lists"))

    def _load(self, name: str, model: str, state: ModelState | None) -> Result:
        """Start loading ``model`` on multi-model engine ``name`` (``Accepted("loading")``)."""
        if self._nursery is None:
            return Busy("nvpair is not running its sleep operations (starting or stopping)")
        operation = self.loads[name, model] = Operation("load")
        self.board.update(name, partial(with_model_state, model=model, state="loading"))
        self._nursery.start_soon(self._run_load, name, model, state, operation)
        return Accepted("loading")

    async def _run_load(self, name: str, model: str, state: ModelState | None,
                        operation: Operation) -> None:
        spec = self.engines[name]
        try:
            started = trio.current_time()
            if state == "sleeping":  # (its child sleeps: a task for it wakes it)
                await self._request(spec, "GET", f"/slots?model={quote(model, safe='')}",
                                    None, spec.startup_budget_s)
            else:  # 400 "model is already running": someone loaded it meanwhile
                await self._request(spec, "POST", "/models/load",
                                    msgspec.json.encode({"model": model}).decode(),
                                    spec.startup_budget_s, also_ok=(400,))
            with trio.move_on_after(spec.startup_budget_s):
                while True:  # (the engine's own state, over HTTP: nothing to wait on but time)
                    answer = await self._request(spec, "GET", "/models", None, 5.0)
                    try:
                        listing = parse_listing(answer, "openai", "/models")
                    except ProbeError as exc:
                        raise SleepError(f"GET /models: {exc}") from None
                    self.board.update(name, partial(with_model_list, listing=listing,
                                                    now=trio.current_time()))
                    if any(m.id == model and m.state == "ready" for m in listing.models):
                        log.info("%s: %s loaded for a wake in %.1f s", name, model,
                                 trio.current_time() - started)
                        return
                    await trio.sleep(LOAD_POLL_S)
            raise SleepError(f"{model} was not loaded within {spec.startup_budget_s:g} s")
        except SleepError as exc:
            operation.error = str(exc)
            log.warning("%s: load of %s for a wake: %s", name, model, exc)
            if state is not None:
                self.board.update(name, partial(with_model_state, model=model, state=state))
        except Exception as exc:  # a bug of nvpair's: this engine's failure, never the service's
            operation.error = f"load failed: {type(exc).__name__}: {exc}"
            log.exception("%s: load of %s failed", name, model)
        finally:
            del self.loads[name, model]
            operation.done.set()

    def call_off(self, name: str, reason: str) -> bool:
        """End the sleep of engine ``name`` while it still waits for its requests in
        flight (no sleep call sent yet): it admits again. False when there is none such.
        Never waits."""
        running = self.running.get(name)
        if running is None or running.kind != "sleep" or running.calling:
            return False
        running.drain.cancel(reason=reason)
        running.error = f"sleep called off ({reason})"
        return True

    async def awake(self, name: str) -> str | None:
        """Wake engine ``name`` (or join the wake in progress) and wait until it is
        awake: None, or why it is not (in words). For a routed request to a sleeping
        engine that does not wake by itself."""
        result = self.wake(name)
        if isinstance(result, Busy):
            return result.reason
        running = self.running.get(name)
        if running is None:
            return None
        await running.done.wait()
        return running.error

    # -- the operations --------------------------------------------------------------------

    def _start(self, name: str, operation: Operation) -> None:
        assert self._nursery is not None  # (wake and sleep say Busy before)
        self.running[name] = operation
        self._nursery.start_soon(self._run, name, operation)

    async def _run(self, name: str, operation: Operation) -> None:
        spec = self.specs[name]
        try:
            if operation.kind == "wake":
                await self._wake(spec)
            else:
                await self._sleep(spec, operation)
        except SleepError as exc:
            operation.error = str(exc)
            log.warning("%s: %s", name, exc)
        except Exception as exc:  # a bug of nvpair's: this engine's failure, never the service's
            operation.error = f"{operation.kind} failed: {type(exc).__name__}: {exc}"
            log.exception("%s: %s failed", name, operation.kind)
            self._set(name, activity=operation.error)
        finally:
            del self.running[name]
            operation.done.set()

    async def _wake(self, spec: EngineSpec) -> None:
        assert spec.sleep is not None
        started = trio.current_time()
        # (vLLM's level 2 wakes in more calls: its weights are loaded again)
        level: Literal["1", "2"] = (
            "2" if self.slept_at.get(spec.name, spec.sleep_level) == 2 else "1")
        try:
            await self._calls(spec, spec.sleep.wake_by_level.get(level, spec.sleep.wake))
        except SleepError as exc:
            self._set(spec.name, state="sleeping", activity=f"wake failed: {exc}")
            raise
        took = trio.current_time() - started
        self.woke_in[spec.name] = took
        self.slept_at.pop(spec.name, None)
        self._set(spec.name, state="ready", error=None, activity=f"woken in {took:.1f} s")
        log.info("%s: woken in %.1f s", spec.name, took)

    async def _sleep(self, spec: EngineSpec, operation: Operation) -> None:
        assert spec.sleep is not None
        name = spec.name
        in_flight = self._in_flight(name)
        level = spec.sleep_level if operation.level is None else operation.level
        try:
            # nothing generating is cut: no deadline. The router's count tells no change,
            # so it is polled, as the lifecycle's drain polls it.
            with operation.drain:
                while self._in_flight(name) > 0:  # noqa: ASYNC110
                    await trio.sleep(DRAIN_POLL_S)
            if operation.drain.cancelled_caught:  # called off: it admits again
                self._set(name, admitting=True, activity=operation.error)
                log.info("%s: %s", name, operation.error)
                return
            operation.calling = True
            await self._calls(spec, spec.sleep.sleep, sleep_level=level)
            self.slept_at[name] = level
        except BaseException as exc:
            why = f"sleep failed: {exc}" if isinstance(exc, SleepError) else "sleep cut short"
            self._set(name, admitting=True, activity=why)
            raise
        because = "" if operation.reason is None else f" ({operation.reason})"
        self._set(name, state="sleeping", admitting=True, error=None,
                  activity=f"asleep{because}, drained ({in_flight} in flight finished first)")
        log.info("%s: asleep", name)

    def _in_flight(self, name: str) -> int:
        entry = self.traffic.engines.get(name)
        return 0 if entry is None else entry.in_flight

    async def _calls(self, spec: EngineSpec, calls: tuple[EngineCall, ...],
                     **placeholders: object) -> None:
        """Send the calls in order (``placeholders`` over the engine's own values); raise
        SleepError at the first that fails."""
        values = placeholder_values(spec) | placeholders
        for call in calls:
            await self._request(spec, call.method, fill(call.path, values), call.body,
                                call.timeout_s)

    async def _request(self, spec: EngineSpec, method: str, path: str, body: str | None,
                       timeout_s: float, *, also_ok: tuple[int, ...] = ()) -> bytes:
        """One call to the engine: its body (at most what its answer holds), or SleepError
        when it fails, is late or answers other than 2xx (or ``also_ok``)."""
        headers = {"user-agent": "nvpair"}
        if spec.api_key:
            headers["authorization"] = f"Bearer {spec.api_key}"
        if body is not None:
            headers["content-type"] = "application/json"
        what = f"{method} {path}"
        # (nvpair's one TLS context: a client's own read the trust store on the loop, 71 ms
        # a call on the loaded 2-core machine)
        async with httpx2.AsyncClient(base_url=spec.url, headers=headers, verify=client_tls(),
                                      transport=self.transport) as client:
            try:
                with trio.fail_after(timeout_s):
                    answer = await client.request(
                        method, path, timeout=timeout_s,
                        content=body.encode() if body is not None else None)
            except trio.TooSlowError:
                raise SleepError(f"{what} did not answer within {timeout_s:g} s") from None
            except httpx2.HTTPError as exc:
                raise SleepError(f"{what}: {type(exc).__name__}: {exc}") from None
        if not 200 <= answer.status_code < 300 and answer.status_code not in also_ok:
            raise SleepError(f"{what} answered {answer.status_code}: {answer.text[:200]!r}")
        return answer.content

    def _set(self, name: str, **changes: Any) -> None:
        def change(e: EngineState) -> EngineState:
            fields = dict(changes)
            state = fields.pop("state", e.state)
            if e.state in ("stopped", "cold", "down"):  # stopped meanwhile: that stands
                state = e.state
            return enter(e, state, trio.current_time(), **fields)

        self.board.update(name, change)


def _model_state(e: EngineState, model: str) -> ModelState | None:
    """``model``'s own state on engine ``e`` (a multi-model engine's), None: the engine's."""
    return next((m.state for m in e.models if m.id == model), None)
