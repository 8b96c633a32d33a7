"""Engine processes on record, so that no engine is left running unknown after nvpair dies.

Managed engines run in their own session (so that a stop reaches their whole process
group), which also means they outlive an nvpair that is SIGKILLed or OOM-killed. So each
engine process nvpair starts gets a state file (``<state_dir>/engines/<name>.<pid>.json``:
its pid, its start time, the boot it started in, its argv, and which nvpair started it),
written atomically and removed once the process has ended and been reaped.

At start, before any engine starts, nvpair reads the files a previous nvpair left
(:func:`reclaim`). A process is the one on record only if its pid, boot and start time
(field 22 of ``/proc/PID/stat``, in clock ticks since boot) all match: a pid reused by
another process has another start time and is never signalled. A record whose nvpair is
still running belongs to that nvpair and is left alone (several nvpairs may share a state
directory). The orphans of a dead nvpair are stopped like a managed engine is: the stop
signal to the process group, the grace period, then SIGKILL.

nvpair also makes itself a child subreaper (Linux), so that processes an engine
double-forks (daemons, helpers that detach) come back to it rather than to init;
:func:`reap_strays` reaps those that end (Trio only waits for the processes it started)
and :func:`end_strays` stops those still running when nvpair exits.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import logging
import os
import signal
import sys
import tempfile
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

import msgspec
import trio

from nvpair.base.boundary import Part
from nvpair.base.decoding import is_digits, json_error, one_line
from nvpair.errors import NvpairError

if TYPE_CHECKING:
    from nvpair.config.settings import EngineSpec

log = logging.getLogger("nvpair.orphans")

#: a state file larger than this is not one nvpair wrote (an argv is at most ~2 MiB on
#: Linux; engines' are a few hundred bytes).
MAX_FILE_BYTES = 1 << 20
#: grace for an orphan whose engine is no longer in the config (its manifest is unknown).
DEFAULT_GRACE_S = 10.0
#: how often a process that is not our child is checked while we wait for it to end
#: (when pidfd_open is unavailable).
POLL_S = 0.05
PR_SET_CHILD_SUBREAPER = 36
#: how long a process is waited for after SIGKILL: one stuck in the kernel (D state)
#: ignores even that, and nvpair goes on (saying so) rather than wait without end.
KILL_WAIT_S = 5.0

class StateFileError(NvpairError):
    """A state file is not one nvpair wrote (one line: which file, what is wrong)."""


class OrphanStuck(NvpairError):
    """An orphan outlived SIGKILL (it is stuck in the kernel)."""


class Record(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One managed engine process, as its state file says."""

    engine: Annotated[str, msgspec.Meta(pattern=r"^[a-z0-9][a-z0-9_-]{0,62}$")]
    pid: Annotated[int, msgspec.Meta(ge=1, le=1 << 22)]
    #: field 22 of /proc/PID/stat: clock ticks since boot when the process started.
    start_time: Annotated[int, msgspec.Meta(ge=0, le=1 << 62)]
    boot_id: Annotated[str, msgspec.Meta(max_length=64)]
    argv: Annotated[tuple[str, ...], msgspec.Meta(min_length=1)]
    nvpair_pid: Annotated[int, msgspec.Meta(ge=1, le=1 << 22)]
    nvpair_start_time: Annotated[int, msgspec.Meta(ge=0, le=1 << 62)]
    version: Literal[1] = 1
    #: what nvpair's exit does to it: "stop", or "keep" (the next nvpair adopts it)
    on_exit: Literal["stop", "keep"] = "stop"
    #: with keep: what the next nvpair needs to adopt it as the managed engine it was
    kept: Kept | None = None


class Kept(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What a kept engine's record adds (``on_exit = "keep"``): the digest of the command it
    runs (``command_digest``: another digest in the config means a restart), the runner's
    restarts and backoff when it was started, its output file with how far nvpair has
    read it, and for a group's rank its epoch and its head's boot."""

    digest: Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{64}$")]
    restarts: Annotated[int, msgspec.Meta(ge=0, le=1 << 31)] = 0
    backoff_s: Annotated[float, msgspec.Meta(ge=0, le=1e6)] = 0.0
    output: Annotated[str, msgspec.Meta(min_length=1, max_length=4096)] = "-"
    offset: Annotated[int, msgspec.Meta(ge=0, le=1 << 62)] = 0
    #: a group rank's (``nvpair.supervision.group``): the epoch it runs for, and the boot
    #: of the head it was started for (the next nvpair keeps it only while the head has both)
    epoch: Annotated[int, msgspec.Meta(ge=0)] | None = None
    head_boot: Annotated[str, msgspec.Meta(max_length=64)] | None = None


def command_digest(argv: Sequence[str], env: Mapping[str, str]) -> str:
    """What a managed engine's process runs, as a sha256: its argv and the environment the
    config gives it (a secret in it is hashed, never stored)."""
    doc = msgspec.json.encode([list(argv), sorted(env.items())])
    return hashlib.sha256(doc).hexdigest()


def parse_record(data: bytes, source: str) -> Record:
    """Decode a state file; raise :class:`StateFileError` with one line on anything else."""
    if len(data) > MAX_FILE_BYTES:
        raise StateFileError(f"{source}: over {MAX_FILE_BYTES} bytes; not an nvpair state file")
    try:
        return msgspec.json.decode(data, type=Record, strict=True)
    except msgspec.ValidationError as exc:
        raise StateFileError(one_line(source, exc)) from None
    except (msgspec.DecodeError, RecursionError, UnicodeDecodeError) as exc:
        raise StateFileError(f"{source}: {json_error(data, exc)}") from None


# -- what /proc says ----------------------------------------------------------------------


class Stat(msgspec.Struct, frozen=True):
    state: str
    ppid: int
    pgrp: int
    session: int
    start_time: int


def stat(pid: int) -> Stat | None:
    """Fields of /proc/PID/stat, or None if there is no such process (or no /proc)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return parse_stat(text)


def parse_stat(text: str) -> Stat | None:
    """/proc/PID/stat: the command (field 2) is in parentheses and may hold anything, spaces
    and ')' included, so the fields are counted from its last ')'."""
    _head, sep, tail = text.rpartition(")")
    fields = tail.split()
    if not sep or len(fields) < 20:
        return None
    try:
        # fields[0] is field 3 (state), so field N is fields[N - 3]
        return Stat(state=fields[0], ppid=int(fields[1]), pgrp=int(fields[2]),
                    session=int(fields[3]), start_time=int(fields[19]))
    except ValueError:
        return None


def running(pid: int, start_time: int) -> bool:
    """Whether the process ``pid`` that started at ``start_time`` still runs (a zombie has
    ended; a pid with another start time is another process)."""
    s = stat(pid)
    return s is not None and s.start_time == start_time and s.state not in ("Z", "X")


def boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def cmdline(pid: int) -> tuple[str, ...] | None:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return tuple(os.fsdecode(a) for a in raw.split(b"\0")[:-1])


def _processes() -> Iterable[tuple[int, Stat]]:
    try:
        entries = list(os.scandir("/proc"))
    except OSError:
        return
    for entry in entries:
        if is_digits(entry.name):
            s = stat(int(entry.name))
            if s is not None:
                yield int(entry.name), s


def _children() -> Iterable[tuple[int, Stat]]:
    """This process's children: from /proc/self/task/*/children (cheap), else a scan."""
    me = os.getpid()
    pids: set[int] = set()
    try:
        for task in os.listdir(f"/proc/{me}/task"):
            pids.update(int(p) for p in Path(f"/proc/{me}/task/{task}/children").read_text()
                        .split())
    except (OSError, ValueError):  # a kernel without CONFIG_PROC_CHILDREN
        yield from ((pid, s) for pid, s in _processes() if s.ppid == me)
        return
    for pid in sorted(pids):
        s = stat(pid)
        if s is not None and s.ppid == me:
            yield pid, s


# -- the records ---------------------------------------------------------------------------


class EngineProcs:
    """The state files of the engine processes this nvpair runs (``None``: keep none)."""

    def __init__(self, state_dir: Path | None) -> None:
        self.dir = None if state_dir is None else state_dir / "engines"
        #: engine processes started and not yet reaped, by pid
        self.live: dict[int, str] = {}
        self._me = stat(os.getpid())
        self._boot = boot_id()
        self._part = Part("state files")
        #: spawns under way: their process may have exited before it is on record
        self._spawning = 0
        self._reap_deferred = False
        #: set when nvpair must end its engines at once (a second SIGTERM or SIGINT while
        #: it shuts down): a stop in its grace period goes on to SIGKILL now.
        self.kill_now = trio.Event()
        #: what is on record of each live process, by pid (rewritten with a new offset)
        self.records: dict[int, Record] = {}
        #: kept engines a previous nvpair left, found by ``reclaim``, by engine: each
        #: runner takes its own (``take``) and adopts it
        self.adoptable: dict[str, Record] = {}
        #: processes of kept engines left running as this nvpair exits, by pid
        self.left: dict[int, str] = {}

    def _path(self, engine: str, pid: int) -> Path:
        assert self.dir is not None
        return self.dir / f"{engine}.{pid}.json"

    @contextlib.contextmanager
    def spawning(self) -> Iterator[None]:
        """Around a spawn and its ``record``: strays are not reaped meanwhile (the new
        process is our child before it is on record, and may already have exited: reaped
        as a stray, its exit status would be lost), but once the block ends."""
        self._spawning += 1
        try:
            yield
        finally:
            self._spawning -= 1
            if self._spawning == 0 and self._reap_deferred:
                self._reap_deferred = False
                reap_once(self)

    def record(self, engine: str, pid: int, argv: Iterable[str], kept: Kept | None = None
               ) -> None:
        """Write the state file of a process just started, or just adopted (atomically:
        a temporary file, fsync, rename). ``kept``: an engine that outlives nvpair. Never
        raises: an engine runs even where its state file cannot be written (logged)."""
        self.live[pid] = engine
        s = stat(pid)
        if self.dir is None or s is None or self._me is None:
            return
        doc = Record(engine=engine, pid=pid, start_time=s.start_time, boot_id=self._boot,
                     argv=tuple(argv), nvpair_pid=os.getpid(),
                     nvpair_start_time=self._me.start_time,
                     on_exit="stop" if kept is None else "keep", kept=kept)
        self.records[pid] = doc
        self._write(doc)

    def rewrite(self, pid: int, offset: int) -> None:
        """A kept engine's record again, with how far its output has been read. Never
        raises (a failure is logged). Blocking (an fsync): call it off the loop, or at
        exit."""
        doc = self.records.get(pid)
        if doc is None or doc.kept is None or doc.kept.offset == offset:
            return
        doc = msgspec.structs.replace(doc, kept=msgspec.structs.replace(doc.kept,
                                                                         offset=offset))
        self.records[pid] = doc
        self._write(doc)

    def _write(self, doc: Record) -> None:
        if self.dir is None:
            return
        with self._part.guard():
            self.dir.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{doc.engine}.", dir=self.dir)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(msgspec.json.encode(doc))
                    f.flush()
                    # the record, whole, before its name points at it (a write, fsync and
                    # rename of ~500 bytes: 0.3 ms median, 0.55 ms at most in 50, on ext4)
                    os.fsync(f.fileno())
                os.replace(tmp, self._path(doc.engine, doc.pid))
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
            self._part.ok()

    def take(self, engine: str) -> Record | None:
        """The record of ``engine``'s kept process to adopt, once (None: none was found)."""
        return self.adoptable.pop(engine, None)

    def forget(self, engine: str, pid: int) -> None:
        """The process has ended and been reaped: remove its state file."""
        self.live.pop(pid, None)
        self.records.pop(pid, None)
        if self.dir is not None:
            with self._part.guard(), contextlib.suppress(FileNotFoundError):
                self._path(engine, pid).unlink()


# -- at start: what a previous nvpair left -------------------------------------------------


class Stop(msgspec.Struct, frozen=True):
    """How to stop an engine's orphan: its manifest's stop signal and grace period."""

    signal: str = "SIGTERM"
    grace_s: float = DEFAULT_GRACE_S


async def reclaim(procs: EngineProcs, engines: Iterable[EngineSpec] = (), *,
                  adopt: bool = True) -> list[Record]:
    """Stop the engine processes a dead nvpair left running (in parallel, each with its
    engine's stop signal and grace period); remove the state files of processes that have
    ended. Returns the records of the orphans it stopped.

    ``adopt``: a process of a kept engine (``on_exit = "keep"``, in its record and in
    ``engines``) is not stopped but put in ``procs.adoptable`` once it is proven the same
    process (pid, start time and command line; else its record is dropped, and the
    process, someone else's, left alone)."""
    engines = list(engines)
    stops = {e.name: Stop(e.manifest.stop.signal, e.stop_grace_s) for e in engines}
    keep = {e.name for e in engines if e.managed and e.on_exit == "keep"} if adopt else set()
    part = Part("orphans")
    paths: list[Path] = []
    with part.guard():  # an unreadable directory is logged; nvpair starts regardless
        if procs.dir is not None and procs.dir.is_dir():
            paths = sorted(procs.dir.glob("*.json"))
    found: list[tuple[Path, Record]] = []
    for path in paths:
        with part.guard():
            record = _read(path, procs)
            if record is None:
                continue
            if (record.on_exit == "keep" and record.engine in keep
                    and _adoptable(path, record, procs)):
                continue
            found.append((path, record))
    stopped: list[Record] = []

    async def stop_one(path: Path, record: Record) -> None:
        with part.guard():
            stop = stops.get(record.engine, Stop())
            await _stop_orphan(record, stop, procs.kill_now)
            stopped.append(record)
            _remove(path)

    async with trio.open_nursery() as nursery:
        for path, record in found:
            nursery.start_soon(stop_one, path, record)
    return stopped


def _read(path: Path, procs: EngineProcs) -> Record | None:
    """The record in ``path`` if its process is an orphan to stop; else the file is removed
    (its process has ended, or the file is not ours) or left (a live nvpair's)."""
    try:
        with path.open("rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except FileNotFoundError:  # its nvpair removed it meanwhile
        return None
    try:
        record = parse_record(data, str(path))
    except StateFileError as exc:
        log.warning("%s; removed", exc)
        path.unlink(missing_ok=True)
        return None
    same_boot = record.boot_id == procs._boot
    if same_boot and running(record.nvpair_pid, record.nvpair_start_time):
        return None  # a running nvpair's engine (this one's, or another sharing the dir)
    if not same_boot or not running(record.pid, record.start_time):
        # ended (or the pid is another process now: its start time differs)
        if same_boot:
            _warn_leftovers(record)
        log.info("engine %s: process %d of a previous nvpair has ended; state file removed",
                 record.engine, record.pid)
        path.unlink(missing_ok=True)
        return None
    now = cmdline(record.pid)
    if now is not None and not same_command(record.argv, now):  # (same pid, boot, start)
        log.info("engine %s: process %d shows another command line than it was started with "
                 "(%s); it is still the process nvpair started (same pid and start time)",
                 record.engine, record.pid, json.dumps(list(now))[:200])
    return record


def _adoptable(path: Path, record: Record, procs: EngineProcs) -> bool:
    """Whether ``record``'s process (running: same pid, boot and start time) is adopted:
    also its command line must be the one on record, else it is not the engine (its record
    is dropped: True, and it is neither adopted nor signalled). A second record of one
    engine (False) is stopped as an orphan."""
    now = cmdline(record.pid)
    if now is None or not same_command(record.argv, now):
        log.warning("engine %s: process %d runs another command than the one on record; it "
                    "is not that engine: record dropped, process left alone", record.engine,
                    record.pid)
        path.unlink(missing_ok=True)
        return True
    if record.engine in procs.adoptable:
        return False
    procs.adoptable[record.engine] = record
    log.info("engine %s: process %d, left running by nvpair %d (on_exit = keep), is adopted",
             record.engine, record.pid, record.nvpair_pid)
    return True


def same_command(started: Sequence[str], shown: Sequence[str]) -> bool:
    """Whether ``shown`` (``/proc/PID/cmdline`` now) is the command ``started`` ran: the
    same words, or a script's (``nvpair sim ...``) as its interpreter shows it once it runs
    (``python3 /venv/bin/nvpair sim ...``): the script's path in place of its name."""
    if list(shown) == list(started):
        return True
    if not started or len(shown) <= len(started):
        return False
    extra = len(shown) - len(started)  # the interpreter and its options
    return (list(shown[extra + 1:]) == list(started[1:])
            and Path(shown[extra]).name == Path(started[0]).name)


def _remove(path: Path) -> None:
    path.unlink(missing_ok=True)


def _warn_leftovers(record: Record) -> None:
    """The leader has ended, but processes of its session may remain (ranks, helpers). They
    are not signalled: with the leader gone, nothing proves who they are."""
    left = [pid for pid, s in _processes()
            if s.session == record.pid and s.state not in ("Z", "X")]
    if left:
        log.warning("engine %s: process %d of a previous nvpair has ended, but processes of "
                    "its session remain: %s; nvpair does not signal them (stop them if they "
                    "are that engine's)", record.engine, record.pid,
                    ", ".join(map(str, left[:20])))


async def _stop_orphan(record: Record, stop: Stop, kill_now: trio.Event) -> None:
    pid = record.pid
    sig = getattr(signal, stop.signal, signal.SIGTERM)
    with _pidfd(pid) as pidfd:
        if not running(pid, record.start_time):  # checked again with the pidfd held
            return
        log.warning("engine %s: process %d (started by nvpair %d, which is gone) is still "
                    "running; stopping it (%s, then SIGKILL after %g s)", record.engine, pid,
                    record.nvpair_pid, signal.Signals(sig).name, stop.grace_s)
        _killpg(pid, sig)
        with trio.move_on_after(stop.grace_s):  # a second signal to nvpair cuts it
            await unless_killing(partial(until_ended, pid, record.start_time, pidfd), kill_now)
        if running(pid, record.start_time):
            log.warning("engine %s: process %d did not stop within %g s; SIGKILL",
                        record.engine, pid, stop.grace_s)
            _killpg(pid, signal.SIGKILL)
            with trio.move_on_after(KILL_WAIT_S):
                await until_ended(pid, record.start_time, pidfd)
            if running(pid, record.start_time):
                raise OrphanStuck(f"engine {record.engine}: process {pid} did not exit within "
                                  f"{KILL_WAIT_S:g} s of SIGKILL (stuck in the kernel, D "
                                  "state?); its state file is kept")
    # What is left of its process group (ranks, helpers): the pgid cannot have been reused
    # while any of them lives.
    _killpg(pid, signal.SIGKILL)
    log.info("engine %s: orphan process %d stopped", record.engine, pid)


async def unless_killing(wait: Callable[[], Awaitable[object]],
                         kill_now: trio.Event | None) -> None:
    """``wait()``, given up once ``kill_now`` is set (``EngineProcs.kill_now``): how a grace
    period waits for a process to end."""
    if kill_now is None:
        await wait()
        return
    async with trio.open_nursery() as racing:
        async def cut() -> None:
            await kill_now.wait()
            racing.cancel_scope.cancel(reason="killing engines now")

        racing.start_soon(cut)
        await wait()
        racing.cancel_scope.cancel(reason="the process ended")


@contextlib.contextmanager
def _pidfd(pid: int) -> Iterator[int | None]:
    fd = None
    with contextlib.suppress(OSError, AttributeError):
        fd = os.pidfd_open(pid)
    try:
        yield fd
    finally:
        if fd is not None:
            os.close(fd)


async def until_ended(pid: int, start_time: int, pidfd: int | None) -> None:
    """Wait until a process that is not our child has ended (its parent reaps it)."""
    if pidfd is not None:
        await trio.lowlevel.wait_readable(pidfd)
        return
    # a kernel without pidfd_open (before 5.3): nothing to wait on but /proc
    while running(pid, start_time):  # noqa: ASYNC110
        await trio.sleep(POLL_S)


def _killpg(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


# -- the subreaper -------------------------------------------------------------------------


def become_subreaper() -> bool:
    """Make this process a child subreaper (Linux): orphaned descendants are reparented to
    it instead of init. Harmless (False) elsewhere."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
            log.warning("cannot become a child subreaper: %s",
                        os.strerror(ctypes.get_errno()))
            return False
    except (OSError, AttributeError):
        return False
    return True


def strays(procs: EngineProcs) -> list[tuple[int, Stat]]:
    """Our children that nvpair did not start: descendants of engines reparented to us.

    Trio's own children are left to Trio: the engines (on record) and anything started in
    nvpair's own session."""
    own = stat(os.getpid())
    session = None if own is None else own.session
    return [(pid, s) for pid, s in _children()
            if s.session != session and pid not in procs.live]


def reap_once(procs: EngineProcs) -> list[int]:
    """Reap the strays that have ended (zombies); return their pids. During a spawn
    (``EngineProcs.spawning``) nothing is reaped until it ends."""
    if procs._spawning:
        procs._reap_deferred = True
        return []
    reaped = []
    for pid, s in strays(procs):
        if s.state == "Z":
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
                reaped.append(pid)
    if reaped:
        log.info("reaped %d process(es) left behind by engines: %s", len(reaped),
                 ", ".join(map(str, reaped)))
    return reaped


async def reap_strays(procs: EngineProcs, *, task_status: trio.TaskStatus[trio.CancelScope]
                      = trio.TASK_STATUS_IGNORED) -> None:
    """Reap strays as they end (on SIGCHLD), until its started value is cancelled.

    Started value: a cancel scope (cancel it to stop reaping; cancelling the surrounding
    scope works too), at once. Raises: nothing but Cancelled: a failure to reap is the
    ``reaper`` part's, logged and retried with backoff."""
    part = Part("reaper")

    async def loop() -> None:
        with trio.open_signal_receiver(signal.SIGCHLD) as signals:
            reap_once(procs)
            part.ok()
            async for _ in signals:
                reap_once(procs)

    with trio.CancelScope() as scope:
        task_status.started(scope)
        await part.supervise(loop)


async def end_strays(procs: EngineProcs, grace_s: float = 5.0) -> None:
    """At exit: SIGTERM the strays still running, the grace period (cut short by
    ``EngineProcs.kill_now``), then SIGKILL; reap."""
    left = [pid for pid, s in strays(procs) if s.state != "Z"]
    if left:
        log.warning("stopping %d process(es) left behind by engines: %s", len(left),
                    ", ".join(map(str, left)))

    async def end(pid: int) -> None:
        s = stat(pid)
        if s is None:
            return
        with _pidfd(pid) as pidfd:  # our child: its pid cannot be reused until we reap it
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
            with trio.move_on_after(grace_s):  # (a second signal to nvpair cuts it)
                await unless_killing(partial(until_ended, pid, s.start_time, pidfd), procs.kill_now)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            with trio.move_on_after(KILL_WAIT_S):  # stuck in the kernel: nvpair exits anyway
                await until_ended(pid, s.start_time, pidfd)

    async with trio.open_nursery() as nursery:
        for pid in left:
            nursery.start_soon(end, pid)
    reap_once(procs)
