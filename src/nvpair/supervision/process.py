"""One engine process: spawn it, copy its output into its log, stop it, reap it.

``run_engine_process`` is the whole life of one process, as a startable:

* spawn: an argv (never a shell) in a new session, so the process leads its own group
  (SGLang and vLLM ranks are in it); stdin is /dev/null, stdout and stderr one pipe;
* the output is copied into the engine's log until its end, past the exit and the stop (its
  last lines, a traceback say, are the ones a user needs), inside a fault boundary;
* cancellation stops it: the stop signal to the group, the grace period (cut short once
  ``EngineProcs.kill_now`` is set: a second signal to nvpair), SIGKILL, a bounded wait for
  the reap (``KILL_WAIT_S``), then SIGKILL to whatever is left of the group;
* the orphan state file (``nvpair.supervision.orphans.EngineProcs``) is written once the process
runs
  and removed once it is reaped, so a later nvpair can stop what a killed one left.

The process handle (``EngineProcess``) is the started value; the caller races its
``wait()`` against whatever else may end the run (a startup budget, a request), and
cancels. ``spawn`` is the seam: tests pass a fake process that exits on cue, so restarts
and backoff run under the autojump clock.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
from collections.abc import Awaitable, Callable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Protocol

import msgspec
import trio

from nvpair.base.boundary import Part
from nvpair.base.logs import EngineLog
from nvpair.errors import NvpairError
from nvpair.supervision.kept import UNKNOWN_EXIT, AdoptedProcess, OutputTail, open_output
from nvpair.supervision.orphans import EngineProcs, Kept, Record, unless_killing

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


class Proc(Protocol):
    """What nvpair needs of a running process (``OsProcess``, or a test's fake)."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    @property
    def stdout(self) -> trio.abc.ReceiveStream | None: ...

    async def wait(self) -> int: ...

    def signal_group(self, sig: int) -> None:
        """Send ``sig`` to the process's group (it leads one); never raises for a group
        that is gone."""


#: Starts a process: ``spawn(argv, env)``. It raises what starting raises (OSError; and
#: ValueError for a NUL in argv or an ``=`` in an environment name).
Spawn = Callable[[Sequence[str], Mapping[str, str]], Awaitable[Proc]]


class OsProcess:
    """A real child process, leader of its own process group."""

    def __init__(self, process: trio.Process) -> None:
        self.process = process

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def returncode(self) -> int | None:
        return self.process.returncode

    @property
    def stdout(self) -> trio.abc.ReceiveStream | None:
        return self.process.stdout

    async def wait(self) -> int:
        return await self.process.wait()

    def signal_group(self, sig: int) -> None:
        killpg(self.process.pid, sig)


async def spawn_process(argv: Sequence[str], env: Mapping[str, str], *,
                        output: Path | None = None) -> Proc:
    """The real ``Spawn``: no shell, a new session, stdout and stderr into one pipe (or,
    ``output``: into that file, emptied first: a kept engine's, ``nvpair.supervision.kept``)."""
    if output is None:
        process = await trio.lowlevel.open_process(
            list(argv), env=dict(env), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, start_new_session=True)
        return OsProcess(process)
    fd = open_output(output)
    try:
        process = await trio.lowlevel.open_process(
            list(argv), env=dict(env), stdin=subprocess.DEVNULL, stdout=fd,
            stderr=subprocess.STDOUT, start_new_session=True)
    finally:
        os.close(fd)
    return OsProcess(process)


class Stopping(msgspec.Struct, frozen=True):
    """How an engine's process is stopped: its manifest's stop signal, then SIGKILL after
    ``grace_s``."""

    signal: str = "SIGTERM"
    grace_s: float = 10.0


class EngineProcess:
    """The started value of ``run_engine_process``: one running engine process."""

    def __init__(self, proc: Proc, *, kept: bool = False) -> None:
        self.proc = proc
        #: while the process outlives SIGKILL (D state): what to say about it; None once
        #: it is reaped (or if it never was stuck).
        self.stuck: str | None = None
        #: a kept engine (``on_exit = "keep"``): a cancellation of its run leaves it running
        #: (nvpair exits), unless ``stop_on_cancel`` was called first (a stop or restart)
        self.kept = kept
        #: whether the run left it running as nvpair exited
        self.left = False

    def stop_on_cancel(self) -> None:
        """The next cancellation of the run is a stop (asked for), also of a kept engine."""
        self.kept = False

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        """The exit status once reaped (negative: the signal that ended it), else None."""
        return self.proc.returncode

    async def wait(self) -> int:
        """Until the process exits (it is not stopped: cancel ``run_engine_process`` for
        that). Returns its exit status."""
        return await self.proc.wait()


async def run_engine_process(
    argv: Sequence[str],
    env: Mapping[str, str],
    *,
    name: str,
    log_to: EngineLog,
    output: Part,
    stopping: Stopping,
    procs: EngineProcs,
    reaper: trio.Nursery,
    spawn: Spawn = spawn_process,
    keep: Kept | None = None,
    adopt: Record | None = None,
    task_status: trio.TaskStatus[EngineProcess] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run engine ``name``'s process from spawn to reap.

    Started value: the ``EngineProcess`` (once spawned and its state file written).

    Returns once the process has exited by itself and its output has been read to its end
    (at most ``OUTPUT_DRAIN_S`` more). Cancellation stops it, shielded: ``stopping.signal``
    to its group, ``stopping.grace_s``, SIGKILL, up to ``KILL_WAIT_S`` for the reap, the
    output read on meanwhile; then Cancelled propagates. A process that outlives SIGKILL
    is left to a task in ``reaper`` (``EngineProcess.stuck`` says so until it is reaped).
    The last log line says how the process ended.

    ``keep``: an engine that outlives nvpair (``on_exit = "keep"``): its output goes to
    its file (``keep.output``), which is followed (``nvpair.supervision.kept``); its record
    says so; a cancellation leaves it running unless ``EngineProcess.stop_on_cancel`` was
    called. ``adopt``: instead of a spawn, the kept process of that record (its output
    read on from the record's offset).

    Raises: whatever ``spawn`` raises, before it is started (nothing was spawned then).
    Copying the output never raises: ``output`` is its fault boundary (on a failure the
    output is read and dropped for the backoff, then copied again).
    """
    offset = 0
    proc: Proc
    if adopt is not None and keep is not None:
        proc = AdoptedProcess(adopt.pid, adopt.start_time)
        offset = adopt.kept.offset if adopt.kept is not None else 0
        argv = adopt.argv
        procs.record(name, proc.pid, argv, msgspec.structs.replace(keep, offset=offset))
    else:
        if keep is not None and spawn is spawn_process:  # (a test's fake spawns as it likes)
            spawn = partial(spawn_process, output=Path(keep.output))
        with procs.spawning():  # not a stray before it is on record
            proc = await spawn(argv, env)
            procs.record(name, proc.pid, argv, keep)  # until reaped: docs/deploy.md
    handle = EngineProcess(proc, kept=keep is not None)
    ended = trio.Event()  # (a kept engine's output file is read to its end after this)
    tail = None if keep is None else OutputTail(Path(keep.output), offset, ended,
                                                partial(procs.rewrite, proc.pid))
    try:
        async with trio.open_nursery() as pumping:
            pumped = trio.Event()
            # shielded: on nvpair's own shutdown the output is read on while the engine
            # stops (and a chatty engine never blocks on a full pipe)
            reading = trio.CancelScope(shield=True)

            async def pump(stream: trio.abc.ReceiveStream) -> None:
                try:
                    with reading:
                        await pump_output(stream, log_to, output)
                finally:
                    pumped.set()

            source = tail if tail is not None else proc.stdout
            if source is None:
                pumped.set()
            else:
                pumping.start_soon(pump, source)
            try:
                task_status.started(handle)
                await proc.wait()
            finally:
                with trio.CancelScope(shield=True):
                    if handle.kept and proc.returncode is None:  # nvpair exits: it stays
                        handle.left = True
                    else:
                        handle.stuck = await terminate(proc, stopping, procs.kill_now)
                        if handle.stuck is not None:
                            log.warning("%s: %s", name, handle.stuck)
                        ended.set()
                        with trio.move_on_after(OUTPUT_DRAIN_S):  # a child may hold the pipe
                            await pumped.wait()
                reading.cancel(reason="nvpair is exiting" if handle.left
                               else "engine process ended")
    finally:
        if tail is not None:
            tail.close()
        if handle.left:
            assert tail is not None
            procs.rewrite(proc.pid, tail.offset)  # (at exit: the loop may wait for it)
            procs.left[proc.pid] = name
            log_to.write(f"[nvpair] nvpair exits; process {proc.pid} keeps running "
                         "(on_exit = keep)")
        else:
            log_to.write(f"[nvpair] process {proc.pid} ended: {describe_exit(proc.returncode)}"
                         if handle.stuck is None else f"[nvpair] {handle.stuck}")
            if proc.returncode is not None:  # reaped
                procs.forget(name, proc.pid)
                if keep is not None:  # read to its end: its words are in the log now
                    with contextlib.suppress(OSError):
                        os.unlink(keep.output)
            else:  # reaped whenever the kernel lets it go
                reaper.start_soon(_reap_late, handle, name, procs)


async def terminate(proc: Proc, stopping: Stopping,
                    kill_now: trio.Event | None = None) -> str | None:
    """Stop signal to the process group, the grace period, then SIGKILL; always reap (up to
    ``KILL_WAIT_S`` after SIGKILL). Then SIGKILL to what is left of the group: ranks or
    helpers of a leader that is gone are orphans. Once ``kill_now`` is set (before or
    during the grace period), SIGKILL follows the stop signal at once.

    Returns None once reaped, else what to say of a process that outlived SIGKILL.
    Not cancellable in effect: callers shield it (it is bounded by grace + KILL_WAIT_S)."""
    stuck = None
    if proc.returncode is None:
        proc.signal_group(getattr(signal, stopping.signal))
        with trio.move_on_after(stopping.grace_s):
            await unless_killing(proc.wait, kill_now)
        if proc.returncode is None:
            proc.signal_group(signal.SIGKILL)
            with trio.move_on_after(KILL_WAIT_S):
                await proc.wait()
        if proc.returncode is None:
            stuck = (f"process {proc.pid} did not exit within {KILL_WAIT_S:g} s of "
                     "SIGKILL (stuck in the kernel, D state?); nvpair no longer waits for it")
    proc.signal_group(signal.SIGKILL)
    return stuck


async def _reap_late(handle: EngineProcess, name: str, procs: EngineProcs) -> None:
    await handle.wait()
    handle.stuck = None
    procs.forget(name, handle.pid)
    log.info("%s: process %d has exited at last (%s)", name, handle.pid,
             describe_exit(handle.returncode))


async def pump_output(stream: trio.abc.ReceiveStream, log_to: EngineLog, part: Part) -> None:
    """The engine's output into its log, inside the boundary ``part``: if copying fails,
    the output is read and dropped for the backoff (so the engine never blocks on a full
    pipe), then copied again. Ends at EOF; raises nothing but Cancelled."""
    while True:
        try:
            await log_to.pump(_Copying(stream, part))
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


class _Copying(trio.abc.ReceiveStream):
    """``stream`` as the pump reads it: each time the pump asks for more, it has copied
    what it got before, so ``part`` works (again: its notice goes, its backoff resets)."""

    def __init__(self, stream: trio.abc.ReceiveStream, part: Part) -> None:
        self.stream, self.part = stream, part
        self._got = False

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        if self._got:
            self.part.ok()
        data = await self.stream.receive_some(max_bytes)
        self._got = True
        return data

    async def aclose(self) -> None:
        await self.stream.aclose()


def killpg(pgid: int, sig: int) -> None:
    """``os.killpg``, silent when the group is gone (or not ours)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def describe_exit(code: int | None) -> str:
    """How a process ended, in words (``exited with code 3``, ``killed by SIGKILL``)."""
    if code is None:
        return "is still running"
    if code == UNKNOWN_EXIT:
        return "ended (adopted from a previous nvpair, it is not nvpair's child: its exit " \
               "status is unknown)"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"
