"""Engine lifecycles: start, stop and restart, with backoff, for managed and adopted engines.

Only writers touch a runner: requests (``EngineRunner.request``, sync) and the runner's own
task. Reads never do: they keep serving the snapshot while an engine starts, stops or
crashes.

One operation runs at a time per engine. A repeat of the operation in progress is
``Accepted`` (idempotent); a conflicting one is ``Busy`` with the reason, except ``stop``,
which always wins (it aborts a start that is still loading). These are domain results:
``nvpair.http.control`` says what they are in HTTP.

The process itself (spawn, output, stop, reap) is ``nvpair.supervision.process``; the runner races
its
exit against the startup budget and the requests, and gets back which came first as a value
(``Why``). ``EngineRunner(spawn=...)`` is the seam that lets tests run restarts and backoff
against a fake process under the autojump clock.

Fault boundaries (``nvpair.base.boundary.Part``): the port check, the spawn, the output pump and
the runner as a whole each turn any exception into this engine's state (``down`` with the
reason, or ``unhealthy`` for an adopted engine), logged once and retried after the
backoff; nothing a runner raises reaches the service.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Literal, TypeVar

import httpx2
import msgspec
import trio

from nvpair.base import words
from nvpair.base.boundary import Part
from nvpair.base.changes import Changes
from nvpair.base.logs import DEFAULT_RATE, Drops, EngineLog, RateCap
from nvpair.config.command import build_command, engine_env
from nvpair.config.settings import EngineSpec, is_loopback, placeholder_values
from nvpair.errors import ProbeError
from nvpair.probing import probes
from nvpair.probing.prober import Enrolment, ProbeMemory, open_client, run_probes
from nvpair.state.snapshot import LISTED_STATES, Board, EngineState
from nvpair.state.traffic import Traffic
from nvpair.state.transitions import enter
from nvpair.supervision.kept import UNKNOWN_EXIT, output_path
from nvpair.supervision.orphans import EngineProcs, Kept, command_digest
from nvpair.supervision.process import (
    KILL_WAIT_S,
    OUTPUT_DRAIN_S,
    EngineProcess,
    Spawn,
    StartError,
    Stopping,
    describe_exit,
    run_engine_process,
    spawn_process,
)

__all__ = ["KILL_WAIT_S", "OUTPUT_DRAIN_S", "Accepted", "Action", "Busy", "EngineRunner",
           "Result", "StartError", "Then", "Why", "first_of"]

log = logging.getLogger("nvpair.lifecycle")

Action = Literal["start", "stop", "restart"]
#: what a drain ends in: the engine stopped (an on-demand engine: cold) or restarted
Then = Literal["stop", "restart"]
#: how often a drain looks at the requests in flight (the router counts them in Traffic)
DRAIN_POLL_S = 0.05
#: Why a run of an engine process ended: it exited by itself, it was not ready within its
#: startup budget, or a stop or restart was asked for.
Why = Literal["exited", "budget", "stop", "restart"]
_REASONS: dict[Why, str] = {"exited": "engine process exited",
                            "budget": "startup budget exceeded",
                            "stop": "stop requested", "restart": "restart requested"}


@dataclass
class Draining:
    """A drain in progress: what it ends in, why (in words), whether the stop grace bounds
    the wait for the requests in flight, how many were in flight when it began, and how
    many were still in flight when the grace ran out (cut by the stop)."""

    then: Then
    reason: str
    bounded: bool = True
    in_flight: int = 0
    cut: int = 0


class Accepted(msgspec.Struct, frozen=True):
    """The request is taken (or was already in progress): ``operation`` is what the runner
    is doing about it (``starting``, ``stopping``, ``restarting``), or the action asked for
    when there was nothing to do."""

    operation: str


class Busy(msgspec.Struct, frozen=True):
    """The request conflicts with the operation in progress; ``reason`` says so in words."""

    reason: str


Result = Accepted | Busy

T = TypeVar("T")


async def first_of(*contenders: Callable[[], Awaitable[T]]) -> T:
    """Run the contenders concurrently; the first to return wins and cancels the rest.
    Returns the winner's value. Cancellation cancels them all; an exception of one cancels
    the rest and propagates."""
    won: list[T] = []
    async with trio.open_nursery() as nursery:
        async def contend(contender: Callable[[], Awaitable[T]]) -> None:
            value = await contender()
            if not won:
                won.append(value)
                nursery.cancel_scope.cancel(reason="another contender finished first")

        for contender in contenders:
            nursery.start_soon(contend, contender)
    return won[0]


class EngineRunner:
    """Owns one engine: its probes and, for a managed engine, its process group."""

    def __init__(self, spec: EngineSpec, board: Board, sweep: Enrolment | None,
                 log_dir: Path | None, traffic: Traffic | None = None,
                 procs: EngineProcs | None = None, *,
                 transport: httpx2.AsyncBaseTransport | None = None,
                 spawn: Spawn = spawn_process, log_rate: RateCap = DEFAULT_RATE,
                 probe_rate: float | None = None,
                 api_address: tuple[str, int] | None = None) -> None:
        self.spec = spec
        #: nvpair's own listen address: an engine set on it is told so, not "taken by"
        self.api_address = api_address
        #: the node's probes a second, for the probes' wake grid (``prober.node_probe_rate``)
        self.probe_rate = probe_rate
        self.transport = transport  # the probes' (tests use a mock engine)
        self._spawn = spawn  # how its process starts (tests use a fake process)
        #: what the probes remember across probe and engine restarts (the generating budget)
        self.memory = ProbeMemory()
        where = f"engine {spec.name}"
        down = self._publish_down
        self._runner_part = Part(f"{where}: runner", down if spec.managed else self._unhealthy,
                                 logger=log)
        self._port_part = Part(f"{where}: port check", down, logger=log)
        self._spawn_part = Part(f"{where}: start", logger=log)  # publishes with its argv
        self._output_part = Part(f"{where}: output", self._publish_notice, logger=log)
        #: the last process started (it may outlive SIGKILL: ``stuck``)
        self._proc: EngineProcess | None = None
        self._reaper: trio.Nursery | None = None
        #: the probes' scope while they run (``update`` ends it to begin them again)
        self._probing: trio.CancelScope | None = None
        self.procs = procs if procs is not None else EngineProcs(None)  # state files
        self.traffic = traffic
        #: whether an exit by itself (its code) was a kill for memory, in words, or None
        #: (the memory watch's ``MemoryWatch.explain_exit``; None: not asked)
        self.explain_exit: Callable[[int | None], str | None] | None = None
        self.board = board
        self.sweep = sweep  # where its prober is enrolled while its probes run
        #: an on-demand engine rests ``cold`` until a request starts it (docs/on-demand.md)
        self.on_demand = spec.activation == "on_demand"
        self.desired: Literal["running", "stopped"] = "stopped" if self.on_demand else "running"
        #: the state it rests in once stopped: ``stopped`` when asked to stop, ``cold`` for
        #: an on-demand engine drained (idle, evicted) or not started yet
        self.rest: Literal["stopped", "cold"] = "cold" if self.on_demand else "stopped"
        #: the drain in progress (what it ends in, why, how long it may wait), else None
        self.draining: Draining | None = None
        self.operation: str | None = None
        self._restart = False
        self._wake = Changes()  # bumped by every request
        restart = spec.manifest.restart
        self.backoff = restart.initial_s
        self.starts = 0
        #: restarts nvpair made: a start after a crash, a failed start or a restart asked
        #: for (``nvpair restart``, a memory restart); a start from stopped or cold is none
        self.restarts = 0
        self._again = False  # the next start is a restart
        self._ready_at: float | None = None  # when the current process first became ready
        #: the engine outlives nvpair (``on_exit = "keep"``; needs a state directory)
        self.keep = spec.managed and spec.on_exit == "keep" and self.procs.dir is not None
        #: its first step looks for a process a previous nvpair left it (``reclaim``)
        self._adopting = self.keep
        self.log = None
        if spec.managed:
            path = None if log_dir is None else log_dir / f"{spec.name}.log"
            self.log = EngineLog(path, redact=(spec.api_key or "",), rate=log_rate,
                                 name=spec.name)
            self.log.on_drops = self._publish_drops

    # -- the write API (sync: it only records what is wanted and wakes the task) ----------

    def request(self, action: Action) -> Result:
        """Ask for ``action``; the runner's task carries it out. Never waits.

        Returns ``Accepted`` (also for a repeat of what is in progress, or nothing to do)
        or ``Busy`` when a stop is in progress and ``action`` is a start or restart."""
        if action == "stop":
            self.rest = "stopped"
            if self.desired == "stopped":
                return self._accepted(action)
            self.desired = "stopped"
            self.operation = "stopping"
        elif action == "start":
            if self.operation == "stopping":
                return Busy(f"engine {self.spec.name} is stopping; start it once it has stopped")
            if self.desired == "running":
                self._kick()  # nothing to change, but it ends a wait after a runner failure
                return self._accepted(action)
            self.desired = "running"
            self.rest = "cold" if self.on_demand else "stopped"
            self.operation = "starting"
        else:
            if self.operation == "stopping":
                return Busy(f"engine {self.spec.name} is stopping; start it once it has stopped")
            if self._restart:
                return self._accepted(action)
            self.desired = "running"
            self._restart = True
            self.operation = "restarting"
        self._kick()
        return self._accepted(action)

    def drain(self, *, then: Then = "stop", reason: str = "drain requested",
              bounded: bool = True) -> Result:
        """Stop admitting, let the routed requests in flight finish (up to the stop grace;
        ``bounded=False``: however long they take), then stop (an on-demand engine:
        ``cold``) or restart. Never waits.

        The engine's state shows ``admitting: false`` at once, so the router sends its
        models elsewhere (another engine or a peer), or queues or answers 503 meanwhile.
        Returns ``Accepted("draining")`` (also for a repeat), ``Accepted("stop")`` when a
        stopped engine is asked to drain to a stop (nothing to do), or ``Busy``: a stop in
        progress, a drain to the other end, or a restart of an engine that is stopped."""
        name = self.spec.name
        if self.draining is not None:  # (also once it stops or restarts for the drain)
            if self.draining.then == then:
                return Accepted("draining")
            return Busy(f"engine {name} is draining to {self.draining.then} already")
        if self.operation == "stopping":
            return Busy(f"engine {name} is stopping already")
        if self.desired == "stopped":
            if then == "stop":
                return Accepted("stop")
            return Busy(f"engine {name} is stopped; start it instead")
        in_flight = self._in_flight()
        self.draining = Draining(then, reason, bounded, in_flight)
        self.operation = "draining"
        activity = f"draining ({reason}): {in_flight} in flight, then {then}"
        self._set(admitting=False, activity=activity)
        log.info("%s: %s", name, activity)
        self._kick()
        return Accepted("draining")

    def unload(self) -> Result:
        """Stop at once and rest ``cold`` (an on-demand engine whose start failed: the next
        request tries again, rather than the restart loop); otherwise a plain stop."""
        result = self.request("stop")
        self.rest = "cold" if self.on_demand else "stopped"
        return result

    def call_off(self, drained_for: str, reason: str) -> bool:
        """End the drain asked for ``drained_for`` (its reason) while it still waits for
        requests in flight: the engine admits again, nothing stops. False when there is
        no such drain (none, another, or its end is asked for already). Never waits."""
        if (self.draining is None or self.draining.reason != drained_for
                or self.operation != "draining"):
            return False
        self.draining = None
        self.operation = None
        activity = f"drain called off ({reason})"
        self._set(admitting=True, activity=activity)
        log.info("%s: %s", self.spec.name, activity)
        self._kick()
        return True

    def _in_flight(self) -> int:
        """Routed requests in flight on this engine (nvpair.state.traffic, the router's count)."""
        entry = None if self.traffic is None else self.traffic.engines.get(self.spec.name)
        return 0 if entry is None else entry.in_flight

    async def _drained(self) -> bool:
        """Until nothing is in flight, the stop grace has passed (a bounded drain), a stop
        or restart was asked for meanwhile, or the drain was called off (False); then what
        the drain ends in is asked for (True)."""
        draining = self.draining
        assert draining is not None
        grace = self.spec.stop_grace_s if draining.bounded else math.inf
        with trio.move_on_after(grace) as waited:
            while (self._in_flight() > 0 and not self._wanted_off()
                   and self.draining is draining):
                with trio.move_on_after(DRAIN_POLL_S):
                    await self._wake.wait()
        if self.draining is not draining:  # called off: it admits again
            return False
        if waited.cancelled_caught:  # (counted now: once stopped, the cut ones have ended)
            draining.cut = self._in_flight()
        if self._wanted_off():
            return True
        if draining.then == "stop":
            self.desired = "stopped"
            self.rest = "cold" if self.on_demand else "stopped"
            self.operation = "stopping"
        else:
            self._restart = True
            self.operation = "restarting"
        return True

    def _drain_done(self) -> None:
        draining = self.draining
        if draining is not None:
            self.draining = None
            done = "stopped" if draining.then == "stop" else "restarted"
            waited = (f": {words.requests(draining.in_flight)} in flight finished"
                      if draining.in_flight and not draining.cut else "")
            cut = (f"; {words.requests(draining.cut)} still in flight after the stop grace "
                   f"({self.spec.stop_grace_s:g} s) cut" if draining.cut else "")
            activity = f"drained ({draining.reason}){waited}, then {done}{cut}"
            self._set(activity=activity)
            log.info("%s: %s", self.spec.name, activity)

    def _accepted(self, action: Action) -> Accepted:
        return Accepted(self.operation or action)

    def _kick(self) -> None:
        self._wake.bump()

    async def _until(self, predicate: Callable[[], bool]) -> None:
        while not predicate():
            await self._wake.wait()

    def _set(self, **changes: Any) -> None:
        def change(e: EngineState) -> EngineState:
            fields = dict(changes)
            return enter(e, fields.pop("state", e.state), trio.current_time(), **fields)

        self.board.update(self.spec.name, change)

    def _publish_down(self, reason: str | None) -> None:
        if reason is not None:
            self._set(state="down", pid=None, error=reason)

    def _unhealthy(self, reason: str | None) -> None:
        if reason is not None:
            self._set(state="unhealthy", error=reason)

    def _publish_notice(self, reason: str | None) -> None:
        notice = None if reason is None else f"engine output is not logged: {reason}"
        self.board.update(self.spec.name,
                          lambda e: msgspec.structs.replace(e, notice=notice))

    def _publish_drops(self, drops: Drops) -> None:
        self.board.update(self.spec.name, lambda e: msgspec.structs.replace(
            e, log_dropped=drops.dropped, log_dropping=drops.episode))

    # -- the task ------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the engine until cancelled.

        Started value: None, at once (requests are taken from then on). Cancellation stops
        a managed engine gracefully (its stop signal, the grace period, SIGKILL; shielded
        and bounded, its last output logged) and closes its log. Raises: nothing but
        Cancelled. Whatever a step raises is this engine's failure (its state, its log
        line), never the service's: the step is tried again after a backoff (a request
        ends it early)."""
        if self._adopting and self.spec.name in self.procs.adoptable:
            self.desired = "running"  # (an on-demand engine left running is not cold)
        try:
            async with trio.open_nursery() as reaper:
                self._reaper = reaper
                task_status.started()
                while True:
                    try:
                        await self._step()
                    except Exception as exc:
                        self._runner_part.failed(exc)
                        self.operation = None
                        with trio.move_on_after(self._runner_part.backoff.next()):
                            await self._wake.wait()  # any request ends the wait
                    else:
                        self._runner_part.ok()
        finally:
            if self.log is not None:
                self.log.close()

    async def _step(self) -> None:
        if self.desired == "stopped":
            # The last model list stays (unlisted while stopped): a request for it
            # gets "not ready" (503), not "no such model" (404).
            self._drain_done()
            # cold after a failed start: the reason stays in sight until the next start
            was = self.board.current.engine(self.spec.name)
            kept = was.error if self.rest == "cold" and was and was.state == "down" else None
            self._set(state=self.rest, pid=None, error=self.stuck or kept, admitting=True)
            self.operation = None
            self._again = False
            await self._until(lambda: self.desired == "running")
            return
        self._restart = False
        if self.spec.managed:
            await self._run_process()
        else:
            await self._adopt()

    def _probes(self) -> partial[Any]:
        return partial(run_probes, self.spec, self.board, self.sweep, traffic=self.traffic,
                       transport=self.transport, memory=self.memory,
                       probe_rate=self.probe_rate)

    def move_log(self, log_dir: Path) -> None:
        """Its log from now on in ``log_dir`` (a reload's): the process is left alone, its
        next lines land in the new file (``EngineLog.move``). (A kept engine's own output
        file, in the state directory, stays where it is: nvpair follows it and copies
        what it reads into this log.)"""
        if self.log is not None:
            self.log.move(log_dir / f"{self.spec.name}.log")

    def update(self, spec: EngineSpec) -> None:
        """Take ``spec`` in place (a reload changed what nvpair does about this engine, not
        its process): the process is left alone; the probes begin again with it when
        what they use changed (their settings, the API key), else they run on as they
        are. Sync, never waits."""
        old, self.spec = self.spec, spec
        if self.log is not None and spec.api_key:  # (masked in its output: never logged)
            self.log.add_secret(spec.api_key)
        used = (old.probes, old.api_key, old.allow_generating, old.kv_cache_probe_s)
        now = (spec.probes, spec.api_key, spec.allow_generating, spec.kv_cache_probe_s)
        if used != now and self._probing is not None:
            self._probing.cancel(reason="its probe settings changed (reload)")

    async def _keep_probing(self, *, task_status: trio.TaskStatus[None]
                            = trio.TASK_STATUS_IGNORED) -> None:
        """The probes (``run_probes``), begun again with the spec of the moment each time
        ``update`` ends them. Started value: None, once they first started. Cancellation
        ends them. Raises: nothing but Cancelled (a probe's failure is the engine's state)."""
        while True:
            with trio.CancelScope() as self._probing:
                async with trio.open_nursery() as nursery:
                    await nursery.start(self._probes())
                    task_status.started()
                    task_status = trio.TASK_STATUS_IGNORED
                    await trio.sleep_forever()

    async def _adopt(self) -> None:
        """Probe an engine nvpair does not own; never signal it."""
        self._set(state="starting", error=None)
        self.operation = None
        async with trio.open_nursery() as nursery:
            await nursery.start(self._keep_probing)
            await self._asked()
            nursery.cancel_scope.cancel(reason="stop requested")

    async def _run_process(self) -> None:
        spec = self.spec
        adopt = self.procs.take(spec.name) if self._adopting else None
        self._adopting = False
        if adopt is not None:  # its own port: not taken by another
            taken = None
        else:
            try:
                taken = await self._port_taken()  # (it says when the check worked)
            except Exception as exc:  # the check itself failed: no start, the reason shown
                taken = self._port_part.failed(exc)
        if taken:
            self._set(state="down", pid=None, error=taken)
            self.operation = None
            await self._back_off()
            return
        if self._wanted_off():  # asked while the port was checked
            return
        argv, extra_env = build_command(spec.manifest, spec.command, placeholder_values(spec))
        env = engine_env(os.environ, extra_env, spec.env)  # never nvpair's own secrets
        assert self.log is not None and self._reaper is not None
        keep = None
        if self.keep:
            assert self.procs.dir is not None
            digest = command_digest(argv, {**extra_env, **spec.env})
            if adopt is not None:  # restarts and backoff go on from the record
                self.restarts = adopt.kept.restarts if adopt.kept else self.restarts
                self.backoff = adopt.kept.backoff_s if adopt.kept else self.backoff
            keep = Kept(digest=digest, restarts=self.restarts + self._again,
                        backoff_s=self.backoff,
                        output=str(output_path(self.procs.dir, spec.name)))
        if adopt is not None:
            self.log.write(f"[nvpair] adopted process {adopt.pid}, left running by nvpair "
                           f"{adopt.nvpair_pid} (on_exit = keep)")
        else:
            self.log.write(f"[nvpair] starting: {_shown(argv, spec.api_key)}")
        run = partial(run_engine_process, argv, env, name=spec.name, log_to=self.log,
                      output=self._output_part, procs=self.procs, reaper=self._reaper,
                      spawn=self._spawn, keep=keep, adopt=adopt,
                      stopping=Stopping(spec.manifest.stop.signal, spec.stop_grace_s))
        proc: EngineProcess | None = None
        async with trio.open_nursery() as lifetime:  # the process's: cancelled, it stops
            try:
                proc = await lifetime.start(run)
            except Exception as exc:  # OSError, but also ValueError (a NUL, an `=` in a name)
                failure = exc
            else:
                changed = (adopt is not None and keep is not None and adopt.kept is not None
                           and adopt.kept.digest != keep.digest)
                why = await self._serve(proc, adopted=adopt is not None, changed=changed)
                proc.stop_on_cancel()  # (a kept engine too: this is a stop, not nvpair's exit)
                lifetime.cancel_scope.cancel(reason=_REASONS[why])
        if proc is None:
            await self._failed_start(argv, failure)
        else:
            await self._after_exit(proc.returncode, why)

    async def _serve(self, proc: EngineProcess, *, adopted: bool = False,
                     changed: bool = False) -> Why:
        """A process just started (or ``adopted``): probe it until it exits, misses its
        startup budget or a stop or restart is asked for, whichever comes first; that is
        returned. ``changed``: an adopted process whose command is no longer the config's
        is drained and restarted."""
        self._spawn_part.ok()
        self._proc = proc
        if not adopted:
            self.starts += 1
            self.restarts += self._again
        self._again = False
        self._ready_at = None
        self._set(state="starting", pid=proc.pid, error=None, exit_code=None,
                  exited_at=None, restarts=self.restarts, admitting=True)
        self.operation = None
        if changed:
            log.info("%s: its command changed while nvpair was down: restarting it",
                     self.spec.name)
            self.drain(then="restart", reason="its command changed while nvpair was down")
        async with trio.open_nursery() as probing:
            await probing.start(self._keep_probing)
            why = await first_of(partial(self._exited, proc), self._budget, self._asked)
            probing.cancel_scope.cancel(reason=_REASONS[why])
        return why

    async def _failed_start(self, argv: list[str], exc: Exception) -> None:
        """A spawn that raised: the engine is down with the reason, tried after the backoff."""
        assert self.log is not None
        failure: Exception = exc
        if isinstance(exc, OSError):
            failure = StartError(f"cannot start {argv[0]}: {exc.strerror or exc}")
        reason = self._spawn_part.failed(failure)
        if not isinstance(exc, OSError):
            reason = f"cannot start {argv[0]}: {type(exc).__name__}: {exc}"
        self.log.write(f"[nvpair] {reason}")
        self._set(state="down", pid=None, error=reason)
        self.operation = None
        await self._back_off()

    # The three ways a run of the process ends; the first to return wins (``first_of``).

    async def _exited(self, proc: EngineProcess) -> Why:
        await proc.wait()
        return "exited"

    async def _budget(self) -> Why:
        """"budget" if the process is not ready within its startup budget; once ready, it
        never returns (the budget bounds the start only)."""
        with trio.move_on_after(self.spec.startup_budget_s) as budget:
            await self._until_ready()
        if budget.cancelled_caught:
            return "budget"
        self._ready_at = trio.current_time()
        await trio.sleep_forever()

    async def _asked(self) -> Why:
        while True:
            await self._until(lambda: self._wanted_off() or self.draining is not None)
            if self.draining is None or await self._drained():
                break  # (else the drain was called off: the engine admits again)
        return "stop" if self.desired != "running" else "restart"

    def _wanted_off(self) -> bool:
        return self.desired != "running" or self._restart

    @property
    def stuck(self) -> str | None:
        """What to say of the last process while it outlives SIGKILL (D state), else None."""
        return None if self._proc is None else self._proc.stuck

    async def _after_exit(self, code: int | None, why: Why) -> None:
        spec = self.spec
        stuck = self.stuck
        self._again = why != "stop"
        if why in ("stop", "restart"):
            self._drain_done()
            self._set(state=self.rest if why == "stop" else "starting", pid=None,
                      exit_code=None if code == UNKNOWN_EXIT else code, exited_at=_wall(),
                      error=stuck, admitting=True)
            return
        if self.draining is not None and self.draining.then == "stop":  # it ended by itself
            self.desired = "stopped"
        if why == "budget":
            last = self.board.current.engine(spec.name)
            detail = f" (last probe: {last.error})" if last and last.error else ""
            error = f"not ready within its startup budget of {spec.startup_budget_s:g} s{detail}"
        else:
            error = f"engine process {describe_exit(code)}"
            cause = None if self.explain_exit is None else self.explain_exit(code)
            if cause is not None:
                error = f"engine process {describe_exit(code)}: {cause}"
            # (killed by a signal: the signal is the cause, not what it said before)
            elif code is not None and code >= 0 and self.log is not None and (
                    said := last_said(self.log.tail(LAST_SAID_LINES).lines)):
                error = f"{error} (its last line: {said})"
        if stuck is not None:
            error = f"{error}; {stuck}"
        if self._ready_for() >= spec.manifest.restart.reset_after_s:
            self.backoff = spec.manifest.restart.initial_s
        self._set(state="down", pid=None, exit_code=None if code == UNKNOWN_EXIT else code,
                  exited_at=_wall(), error=error)
        log.warning("%s: %s", spec.name, error)  # whether it restarts is said once it does
        await self._back_off()

    async def _back_off(self) -> None:
        """Wait the backoff (a stop or restart request ends it early), then double it.
        Still wanted running then, it is started again: that is logged, and counted."""
        began = trio.current_time()
        with trio.move_on_after(self.backoff):
            await self._until(self._wanted_off)
        self.backoff = min(self.backoff * 2, self.spec.manifest.restart.max_s)
        self._again = self.desired == "running"
        if self._again:
            log.info("%s: starting it again after %.1f s", self.spec.name,
                     trio.current_time() - began)

    async def _until_ready(self) -> None:
        version = -1
        while True:
            snap = await self.board.wait_changed(version)
            version = snap.version
            e = snap.engine(self.spec.name)
            # (a sleeping engine has loaded and served: docs/sleep.md)
            if e is not None and e.state in LISTED_STATES:
                return

    def _ready_for(self) -> float:
        """How long this process has served since it first became ready (flips to stale
        and back do not count: the backoff resets once a process has served long enough)."""
        return 0.0 if self._ready_at is None else trio.current_time() - self._ready_at

    async def _port_taken(self) -> str | None:
        """What already answers on the engine's port, if anything (so we never spawn a twin)."""
        spec = self.spec
        own = self.api_address
        if own is not None and own[1] == spec.port and same_address(own[0], spec.host):
            return (f"port {spec.port} is nvpair's own API (listen = {own[0]}:{own[1]}): "
                    f"give engine {spec.name} another port")
        # Refused: free (or bound by a loading engine that does not listen yet). A connect
        # that hangs means a listener that does not accept: taken, too.
        with trio.move_on_after(1.0):
            try:
                stream = await trio.open_tcp_stream(spec.host, spec.port)
            except OSError:
                self._port_part.ok()
                return None
            await stream.aclose()
        where = f"port {spec.port}"
        try:
            answer = await _identify(spec)
        except Exception as exc:  # whatever answers there, it is taken: say what we know
            answer = f"a server nvpair could not identify ({self._port_part.failed(exc)})"
        else:
            self._port_part.ok()
        return f"{where} is taken by {answer}; nvpair will not start a second engine there"


def same_address(a: str, b: str) -> bool:
    """Whether listening on host ``a`` and host ``b`` with one port collides: the same host,
    a wildcard on either side, or loopback on both."""
    wildcard = ("", "0.0.0.0", "::", "*")
    return a == b or a in wildcard or b in wildcard or (is_loopback(a) and is_loopback(b))


async def _identify(spec: EngineSpec) -> str:
    ident = spec.probes.identity
    name = spec.manifest.display_name
    async with open_client(spec) as client:
        names: tuple[str, ...] = ()
        with trio.move_on_after(3.0):
            if ident is not None:
                try:
                    answer = await probes.request(client, ident, ident.path, api_key=spec.api_key)
                    _identity, names = probes.parse_identity(answer.body, ident, spec.kind)
                except ProbeError as exc:
                    if exc.kind == "mismatch":
                        return f"something that does not answer like {name}"
                    if exc.kind == "refused":
                        return "a process that accepts connections but is not serving HTTP"
            models = spec.probes.models
            if not names and models is not None:
                try:
                    answer = await probes.request(client, models, models.path,
                                                  api_key=spec.api_key)
                    names = tuple(m.id for m in probes.parse_models(answer.body, models.format,
                                                                    models.path))
                except ProbeError:
                    pass
    serving = f" serving {', '.join(names)}" if names else ""
    return f"another {name}{serving}"


#: how far back the engine's last meaningful line is looked for in its log
LAST_SAID_LINES = 40
#: words that make an engine's line the one that says why it ended
_TELLING = ("error", "fail", "fatal", "exception", "cannot", "can't", "unable", "not found",
            "no such", "denied", "abort", "killed", "out of memory")


#: words of a line that says only that the engine is going (llama-server's last line is
#: "exiting due to model loading error"; the line before names the model)
_GOING = ("exiting", "cleaning up", "shutting down")


def last_said(lines: list[str]) -> str | None:
    """The engine's own line that best says why it ended: the last one with an error word
    in it (passing over lines that only say it is exiting), else its last line; never
    nvpair's ``[nvpair] ...`` bookkeeping nor a blank."""
    own = [line.strip() for line in lines
           if line.strip() and not line.startswith("[nvpair]")]
    telling = [line for line in own if any(w in line.lower() for w in _TELLING)]
    causes = [line for line in telling if not any(w in line.lower() for w in _GOING)]
    best = causes or telling or own
    return best[-1] if best else None


def _shown(argv: list[str], secret: str | None) -> str:
    return " ".join("***" if secret and secret in a else a for a in argv)


def _wall() -> float:
    return round(time.time(), 3)
