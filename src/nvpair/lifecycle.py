"""Engine lifecycles: start, stop and restart, with backoff, for managed and adopted engines.

Only writers touch a runner: API commands (``request``, sync) and the runner's own task.
Reads never do: they keep serving the snapshot while an engine starts, stops or crashes.

One operation runs at a time per engine. A repeat of the operation in progress is accepted
(202, idempotent); a conflicting one gets 409, except ``stop``, which always wins (it
aborts a start that is still loading).

Fault boundaries (``nvpair.boundary.Part``): the port check, the spawn, the output pump and
the runner as a whole each turn any exception into this engine's state (``down`` with the
reason, or ``unhealthy`` for an adopted engine), logged once and retried after the
backoff; nothing a runner raises reaches the service.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
from collections.abc import Callable, MutableMapping
from functools import partial
from pathlib import Path
from typing import Any, Literal

import httpx2
import msgspec
import trio

from nvpair import probes
from nvpair.asgi import error_doc
from nvpair.boundary import Part
from nvpair.command import build_command, engine_env
from nvpair.config import EngineSpec, placeholder_values
from nvpair.errors import NvpairError, ProbeError
from nvpair.logs import EngineLog
from nvpair.orphans import EngineProcs
from nvpair.prober import ProbeMemory, Prober, open_client
from nvpair.router.traffic import Traffic
from nvpair.snapshot import Board, EngineState
from nvpair.state import enter
from nvpair.supervisor import run_probes
from nvpair.views import engine_status

log = logging.getLogger("nvpair.lifecycle")

#: How long the engine's output is still read once it has ended (a child it left behind
#: may hold the pipe open).
OUTPUT_DRAIN_S = 2.0
#: How long a process is waited for after SIGKILL. One in uninterruptible sleep (D state:
#: stuck in the kernel, on a dead NFS mount or a GPU driver) ignores even SIGKILL until
#: the kernel lets go; nvpair says so and goes on instead of waiting without end.
KILL_WAIT_S = 5.0


class StartError(NvpairError):
    """A managed engine could not be started (an expected failure: one line, no traceback)."""

Action = Literal["start", "stop", "restart"]


class EngineRunner:
    """Owns one engine: its probes and, for a managed engine, its process group."""

    def __init__(self, spec: EngineSpec, board: Board, registry: MutableMapping[str, Prober],
                 log_dir: Path | None, traffic: Traffic | None = None,
                 procs: EngineProcs | None = None, *,
                 transport: httpx2.AsyncBaseTransport | None = None) -> None:
        self.spec = spec
        self.transport = transport  # the probes' (tests use a mock engine)
        #: what the probes remember across probe and engine restarts (the generating budget)
        self.memory = ProbeMemory()
        where = f"engine {spec.name}"
        down = self._publish_down
        self._runner_part = Part(f"{where}: runner", down if spec.managed else self._unhealthy,
                                 logger=log)
        self._port_part = Part(f"{where}: port check", down, logger=log)
        self._spawn_part = Part(f"{where}: start", logger=log)  # publishes with its argv
        self._output_part = Part(f"{where}: output", self._publish_notice, logger=log)
        #: a process that outlived SIGKILL (D state), while it does: what to say about it
        self._stuck: str | None = None
        self._reaper: trio.Nursery | None = None
        self.procs = procs if procs is not None else EngineProcs(None)  # state files
        self.traffic = traffic
        self.board = board
        self.registry = registry
        self.desired: Literal["running", "stopped"] = "running"
        self.operation: str | None = None
        self._restart = False
        self._wake = trio.Event()
        restart = spec.manifest.restart
        self.backoff = restart.initial_s
        self.starts = 0
        self._ready_at: float | None = None  # when the current process first became ready
        self.log = None
        if spec.managed:
            path = None if log_dir is None else log_dir / f"{spec.name}.log"
            self.log = EngineLog(path, redact=(spec.api_key or "",))

    # -- the write API (sync: it only records what is wanted and wakes the task) ----------

    def request(self, action: Action) -> tuple[int, str | None]:
        if action == "stop":
            if self.desired == "stopped":
                return 202, None
            self.desired = "stopped"
            self.operation = "stopping"
        elif action == "start":
            if self.operation == "stopping":
                return 409, f"engine {self.spec.name} is stopping; start it once it has stopped"
            if self.desired == "running":
                return 202, None
            self.desired = "running"
            self.operation = "starting"
        else:
            if self.operation == "stopping":
                return 409, f"engine {self.spec.name} is stopping; start it once it has stopped"
            if self._restart:
                return 202, None
            self.desired = "running"
            self._restart = True
            self.operation = "restarting"
        self._kick()
        return 202, None

    def _kick(self) -> None:
        self._wake.set()
        self._wake = trio.Event()

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

    # -- the task ------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the engine until cancelled; cancellation stops a managed engine gracefully.

        Whatever a step raises is this engine's failure (its state, its log line), never
        the service's: the step is tried again after a backoff (a request ends it early)."""
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
            self._set(state="stopped", pid=None, error=self._stuck)
            self.operation = None
            await self._until(lambda: self.desired == "running")
            return
        self._restart = False
        if self.spec.managed:
            await self._run_process()
        else:
            await self._adopt()

    def _probes(self) -> partial[Any]:
        return partial(run_probes, self.spec, self.board, self.registry, traffic=self.traffic,
                       transport=self.transport, memory=self.memory)

    async def _adopt(self) -> None:
        """Probe an engine nvpair does not own; never signal it."""
        self._set(state="starting", error=None)
        self.operation = None
        async with trio.open_nursery() as nursery:
            await nursery.start(self._probes())
            await self._until(lambda: self.desired != "running" or self._restart)
            nursery.cancel_scope.cancel(reason="stop requested")

    async def _run_process(self) -> None:
        spec = self.spec
        try:
            taken = await self._port_taken()
        except Exception as exc:  # the check itself failed: no start, the reason shown
            taken = self._port_part.failed(exc)
        else:
            self._port_part.ok()
        if taken:
            self._set(state="down", pid=None, error=taken)
            self.operation = None
            await self._back_off()
            return
        if self.desired != "running" or self._restart:  # asked while the port was checked
            return
        argv, extra_env = build_command(spec.manifest, spec.command, placeholder_values(spec))
        env = engine_env(os.environ, extra_env, spec.env)  # never nvpair's own secrets
        assert self.log is not None
        self.log.write(f"[nvpair] starting: {_shown(argv, spec.api_key)}")
        try:
            proc = await trio.lowlevel.open_process(
                argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, start_new_session=True)
        except Exception as exc:  # OSError, but also ValueError (a NUL, an `=` in a name)
            failure = exc
            if isinstance(exc, OSError):
                failure = StartError(f"cannot start {argv[0]}: {exc.strerror or exc}")
            reason = self._spawn_part.failed(failure)
            if not isinstance(exc, OSError):
                reason = f"cannot start {argv[0]}: {type(exc).__name__}: {exc}"
            self.log.write(f"[nvpair] {reason}")
            self._set(state="down", pid=None, error=reason)
            self.operation = None
            await self._back_off()
            return
        self._spawn_part.ok()
        self.procs.record(spec.name, proc.pid, argv)  # until reaped: docs/deploy.md
        self.starts += 1
        self._ready_at = None
        self._set(state="starting", pid=proc.pid, error=None, exit_code=None, exited_at=None,
                  restarts=self.starts - 1)
        self.operation = None
        why = "exited"
        assert proc.stdout is not None
        # The output is read until its end, past the process's exit and its stop: its last
        # lines (a traceback, say) are the ones a user needs.
        try:
            async with trio.open_nursery() as output:
                pumped = trio.Event()
                # shielded: on nvpair's own shutdown the output is read on while the
                # engine stops (and a chatty engine never blocks on a full pipe)
                reading = trio.CancelScope(shield=True)

                async def pump(stream: trio.abc.ReceiveStream) -> None:
                    try:
                        with reading:
                            await self._pump(stream)
                    finally:
                        pumped.set()

                output.start_soon(pump, proc.stdout)
                try:
                    async with trio.open_nursery() as nursery:
                        await nursery.start(self._probes())

                        async def watch_budget() -> None:
                            nonlocal why
                            with trio.move_on_after(spec.startup_budget_s):
                                await self._until_ready()
                                self._ready_at = trio.current_time()
                                return
                            why = "budget"
                            nursery.cancel_scope.cancel(reason="startup budget exceeded")

                        async def watch_requests() -> None:
                            nonlocal why
                            await self._until(lambda: self.desired != "running" or self._restart)
                            why = "stop" if self.desired != "running" else "restart"
                            nursery.cancel_scope.cancel(reason=f"{why} requested")

                        nursery.start_soon(watch_budget)
                        nursery.start_soon(watch_requests)
                        await proc.wait()
                        nursery.cancel_scope.cancel(reason="engine process exited")
                finally:
                    with trio.CancelScope(shield=True):
                        await self._terminate(proc)
                        with trio.move_on_after(OUTPUT_DRAIN_S):  # a child may hold the pipe
                            await pumped.wait()
                    reading.cancel(reason="engine process ended")
        finally:
            self.log.write(f"[nvpair] process {proc.pid} ended: {_describe(proc.returncode)}"
                           if self._stuck is None else f"[nvpair] {self._stuck}")
            if proc.returncode is not None:  # reaped
                self.procs.forget(spec.name, proc.pid)
        await self._after_exit(proc.returncode, why)

    async def _pump(self, stream: trio.abc.ReceiveStream) -> None:
        """The engine's output into its log, inside a boundary: if copying fails, the output
        is read and dropped for the backoff (so the engine never blocks on a full pipe),
        then copied again. Ends at EOF."""
        assert self.log is not None
        part = self._output_part
        while True:
            try:
                await self.log.pump(stream)
                return
            except Exception as exc:
                part.failed(exc)
            with trio.move_on_after(part.backoff.next()):
                try:
                    while await stream.receive_some(65536):
                        pass
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass
                return  # the end of the output came while dropping it

    async def _after_exit(self, code: int | None, why: str) -> None:
        spec = self.spec
        if why in ("stop", "restart"):
            self._set(state="stopped" if why == "stop" else "starting", pid=None,
                      exit_code=code, exited_at=_wall(), error=self._stuck)
            return
        if why == "budget":
            last = self.board.current.engine(spec.name)
            detail = f" (last probe: {last.error})" if last and last.error else ""
            error = f"not ready within its startup budget of {spec.startup_budget_s:g} s{detail}"
        else:
            error = f"engine process {_describe(code)}"
        if self._stuck is not None:
            error = f"{error}; {self._stuck}"
        if self._ready_for() >= spec.manifest.restart.reset_after_s:
            self.backoff = spec.manifest.restart.initial_s
        self._set(state="down", pid=None, exit_code=code, exited_at=_wall(),
                  error=error)
        log.warning("%s: %s; restarting in %.1f s", spec.name, error, self.backoff)
        await self._back_off()

    async def _back_off(self) -> None:
        """Wait the backoff (a stop or restart request ends it early), then double it."""
        with trio.move_on_after(self.backoff):
            await self._until(lambda: self.desired != "running" or self._restart)
        self.backoff = min(self.backoff * 2, self.spec.manifest.restart.max_s)

    async def _until_ready(self) -> None:
        version = -1
        while True:
            snap = await self.board.wait_changed(version)
            version = snap.version
            e = snap.engine(self.spec.name)
            if e is not None and e.state in ("ready", "stale"):
                return

    def _ready_for(self) -> float:
        """How long this process has served since it first became ready (flips to stale
        and back do not count: the backoff resets once a process has served long enough)."""
        return 0.0 if self._ready_at is None else trio.current_time() - self._ready_at

    async def _terminate(self, proc: trio.Process) -> None:
        """Stop signal to the process group, the grace period, then SIGKILL; always reap."""
        if proc.returncode is None:
            stop = getattr(signal, self.spec.manifest.stop.signal)
            _killpg(proc.pid, stop)
            with trio.move_on_after(self.spec.stop_grace_s):
                await proc.wait()
            if proc.returncode is None:
                _killpg(proc.pid, signal.SIGKILL)
                with trio.move_on_after(KILL_WAIT_S):
                    await proc.wait()
            if proc.returncode is None:
                self._stuck = (f"process {proc.pid} did not exit within {KILL_WAIT_S:g} s of "
                               "SIGKILL (stuck in the kernel, D state?); nvpair no longer "
                               "waits for it")
                log.warning("%s: %s", self.spec.name, self._stuck)
                if self._reaper is not None:  # reaped whenever the kernel lets it go
                    self._reaper.start_soon(self._reap, proc)
        # The leader is gone; ranks or helpers left in its group are orphans: end them.
        _killpg(proc.pid, signal.SIGKILL)

    async def _reap(self, proc: trio.Process) -> None:
        await proc.wait()
        self._stuck = None
        self.procs.forget(self.spec.name, proc.pid)
        log.info("%s: process %d has exited at last (%s)", self.spec.name, proc.pid,
                 _describe(proc.returncode))

    async def _port_taken(self) -> str | None:
        """What already answers on the engine's port, if anything (so we never spawn a twin)."""
        spec = self.spec
        # Refused: free (or bound by a loading engine that does not listen yet). A connect
        # that hangs means a listener that does not accept: taken, too.
        with trio.move_on_after(1.0):
            try:
                stream = await trio.open_tcp_stream(spec.host, spec.port)
            except OSError:
                return None
            await stream.aclose()
        where = f"port {spec.port}"
        try:
            answer = await _identify(spec)
        except Exception as exc:  # whatever answers there, it is taken: say what we know
            answer = f"a server nvpair could not identify ({self._port_part.failed(exc)})"
        return f"{where} is taken by {answer}; nvpair will not start a second engine there"


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


def _killpg(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _describe(code: int | None) -> str:
    if code is None:
        return "is still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


def _shown(argv: list[str], secret: str | None) -> str:
    return " ".join("***" if secret and secret in a else a for a in argv)


def _wall() -> float:
    import time

    return round(time.time(), 3)


class Lifecycles:
    """The API's controller: commands and logs for every engine, by name."""

    def __init__(self, runners: dict[str, EngineRunner], board: Board, node: str) -> None:
        self.runners = runners
        self.board = board
        self.node = node

    async def command(self, name: str, action: str) -> tuple[int, dict[str, Any]]:
        runner = self.runners[name]
        status, message = runner.request(action)  # type: ignore[arg-type]
        snap = self.board.current
        engine = snap.engine(name)
        assert engine is not None
        if status != 202:
            return status, error_doc(status, message or action, "engine_busy")
        doc = engine_status(engine, snap, trio.current_time(), self.node)
        doc["operation"] = runner.operation or action
        if not runner.spec.managed:
            doc["note"] = ("adopted engine: nvpair never signals it; stop unlists it and "
                           "stops probing, start resumes probing")
        return 202, doc

    def log(self, name: str) -> EngineLog | None:
        runner = self.runners.get(name)
        return None if runner is None else runner.log
