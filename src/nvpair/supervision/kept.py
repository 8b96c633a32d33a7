"""Engines that outlive nvpair (``on_exit = "keep"``): their output file, and a process
nvpair adopts from a previous nvpair's record.

A kept engine writes its output to a file of its own (``<state_dir>/engines/NAME.out``,
mode 0600: the engine's raw words, secrets unmasked) rather than to a pipe, which would
break, and take the engine with it (SIGPIPE), once nvpair is gone. nvpair follows the
file (``OutputTail``) from an offset kept in the engine's record, and its lines go through
the same pump as a pipe's (``nvpair.base.logs.EngineLog.pump``): the rate cap, the masking
and the bounded steps all apply as nvpair reads. Lines the engine wrote while nvpair was
down are in the file past the recorded offset, so the next nvpair shows them.

An adopted process is not nvpair's child: nvpair cannot wait for it nor learn its exit
status. ``AdoptedProcess`` waits on a pidfd (``nvpair.supervision.orphans``), signals its
group only while it is still the process on record (pid and start time), and its exit
status reads ``UNKNOWN_EXIT``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path

import trio

from nvpair.runtime import wakes
from nvpair.supervision.orphans import running, until_ended

#: how often a kept engine's output file is looked at for new bytes: a line shows in
#: ``nvpair logs`` at most this late (a pipe shows it at once). The looks of every kept
#: engine fall on one grid point (``nvpair.runtime.wakes``): 1,024 tails of idle files
#: in one process took 1.7 % of a core, against 11.7 % with a timer each (10 s of
#: getrusage, this machine's 2 shared cores).
FOLLOW_S = 0.25
#: each look reads at most this much (the pump's own read size: its steps stay bounded)
READ_BYTES = 65536
#: once read to its end past this size, the output file is emptied (the engine appends:
#: its next write lands at the start). A line written between the last read and the
#: emptying, a few microseconds, is lost.
OUTPUT_MAX_BYTES = 64 * 1024 * 1024
#: how often, at most, the offset read so far is written into the engine's record: after
#: nvpair is killed, the next one reads again at most this much of output
OFFSET_EVERY_S = 2.0
#: the exit status of an adopted process that ended: not nvpair's child, it is not known
UNKNOWN_EXIT = -(1 << 16)


def output_path(state_dir: Path, engine: str) -> Path:
    """Where a kept engine's output goes (beside its record)."""
    return state_dir / f"{engine}.out"


def open_output(path: Path) -> int:
    """The output file of a kept engine about to start, emptied, as a file descriptor to
    give it as stdout and stderr (appending: nvpair may empty it while the engine runs)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND | os.O_CLOEXEC,
                   0o600)


class OutputTail(trio.abc.ReceiveStream):
    """A kept engine's output file as a stream for the log pump: from ``offset``, a read of
    at most ``READ_BYTES`` each time, ``FOLLOW_S`` apart (on its grid) while there is
    nothing new; the end of the stream once ``ended`` is set and the file is read to its
    end (noticed at the next look).

    Reading a file of the page cache holds the loop a few microseconds (a 64 KiB read):
    it is done on the loop, as a pipe's read is. ``save(offset)`` (blocking: an fsync) is
    run off the loop, at most every ``OFFSET_EVERY_S``."""

    def __init__(self, path: Path, offset: int, ended: trio.Event,
                 save: Callable[[int], None]) -> None:
        self.path, self.offset, self.ended, self.save = path, offset, ended, save
        self._fd: int | None = None
        self._saved = offset
        self._saved_at = -float("inf")

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        size = min(max_bytes or READ_BYTES, READ_BYTES)
        while True:
            ended = self.ended.is_set()  # (before the read: what it writes last is read)
            data = self._read(size)
            if data:
                await self._maybe_save()
                return data
            if ended:
                return b""
            self._empty_if_large()
            await self._maybe_save()
            # every kept engine's look on one grid point: one wake-up for them all
            await wakes.sleep_until(trio.current_time() + FOLLOW_S, FOLLOW_S)

    def _read(self, size: int) -> bytes:
        if self._fd is None:
            try:
                self._fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                return b""
        if os.fstat(self._fd).st_size < self.offset:  # emptied by someone else
            self.offset = 0
        data = os.pread(self._fd, size, self.offset)
        self.offset += len(data)
        return data

    def _empty_if_large(self) -> None:
        """At the end of a file past ``OUTPUT_MAX_BYTES``: empty it, read on from 0."""
        if self._fd is None or self.offset < OUTPUT_MAX_BYTES:
            return
        if os.fstat(self._fd).st_size == self.offset:
            os.truncate(self.path, 0)
            self.offset = 0

    async def _maybe_save(self) -> None:
        now = trio.current_time()
        if self.offset != self._saved and now - self._saved_at >= OFFSET_EVERY_S:
            self._saved, self._saved_at = self.offset, now
            await trio.to_thread.run_sync(self.save, self.offset)

    async def aclose(self) -> None:
        self.close()

    def close(self) -> None:
        """Close the file (sync: also in a cancelled scope, at nvpair's exit)."""
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None


class AdoptedProcess:
    """A kept engine's process, adopted from a previous nvpair's record: the ``Proc`` of
    ``nvpair.supervision.process`` for a process that is not nvpair's child."""

    def __init__(self, pid: int, start_time: int) -> None:
        self._pid, self.start_time = pid, start_time
        self._code: int | None = None
        self._waiting = trio.Lock()  # one waiter on the pidfd at a time
        self._pidfd: int | None = None
        with contextlib.suppress(OSError, AttributeError):
            self._pidfd = os.pidfd_open(pid)
        if not running(pid, start_time):  # (checked with the pidfd held)
            self._gone()

    @property
    def pid(self) -> int:
        return self._pid

    @property
    def returncode(self) -> int | None:
        """None while it runs; ``UNKNOWN_EXIT`` once it has ended."""
        return self._code

    @property
    def stdout(self) -> trio.abc.ReceiveStream | None:
        return None

    async def wait(self) -> int:
        async with self._waiting:
            if self._code is None:
                await until_ended(self._pid, self.start_time, self._pidfd)
                self._gone()
        assert self._code is not None
        return self._code

    def _gone(self) -> None:
        self._code = UNKNOWN_EXIT
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    def signal_group(self, sig: int) -> None:
        # Only while it is the process on record: its pid (and group id) may be another's
        # once it has ended and its parent (not us) has reaped it.
        if running(self._pid, self.start_time):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self._pid, sig)
