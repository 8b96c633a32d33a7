"""A managed engine's output: a bounded ring of recent lines and a size-capped log file."""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
from collections import deque
from pathlib import Path
from typing import NamedTuple

import trio

from nvpair.changes import Changes

RING_LINES = 2000
FILE_MAX_BYTES = 16 * 1024 * 1024
LINE_MAX = 8192
CUT_MARK = " [nvpair: line cut at 8192 characters]"

log = logging.getLogger("nvpair.logs")


class Lines(NamedTuple):
    """A piece of the log: ``lines`` from number ``first`` on; ``next`` is the number the
    next line will get; ``missed`` lines fell out of the ring before they were asked for."""

    lines: list[str]
    first: int
    next: int
    missed: int


class EngineLog:
    """Lines from an engine; the file rotates once to ``NAME.log.1`` past its size cap.

    Every line gets a number (0, 1, 2, ... for the life of this log), so that a follower
    asks for the lines after the last one it has, whatever their text (engines repeat
    lines: ``GET /health 200`` every few seconds)."""

    def __init__(self, path: Path | None, *, ring: int = RING_LINES,
                 max_bytes: int = FILE_MAX_BYTES, redact: tuple[str, ...] = ()) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.lines: deque[str] = deque(maxlen=ring)
        self.redact = tuple(s for s in redact if s)
        #: bytes of an unfinished line kept before it is cut: enough for LINE_MAX
        #: characters and a secret across the cut, whole, however wide the characters
        #: (UTF-8: up to 4 bytes each)
        self._keep = 4 * (LINE_MAX + max((len(s) for s in self.redact), default=0))
        self._file = None
        #: moves with every line written (a reader waits on it for the next line)
        self.changes = Changes()
        self.written = 0
        if path is not None:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                self._file = path.open("ab")
            except OSError as exc:
                self._file_failed(exc)

    @property
    def changed(self) -> trio.Event:
        """An event set when the next line is written."""
        return self.changes.event

    def tail(self, n: int) -> Lines:
        """The last ``n`` lines."""
        start = max(0, len(self.lines) - n)
        return Lines(list(itertools.islice(self.lines, start, None)),
                     self.written - len(self.lines) + start, self.written, 0)

    def after(self, number: int) -> Lines:
        """Lines numbered ``number`` and on, as far as the ring still has them."""
        if not 0 <= number <= self.written:
            raise ValueError(f"line {number} is not in this log (it has 0-{self.written})")
        oldest = self.written - len(self.lines)
        start = max(number, oldest)
        return Lines(list(itertools.islice(self.lines, start - oldest, None)), start,
                     self.written, start - number)

    def write(self, line: str, *, cut: bool = False) -> None:
        if cut or len(line) > LINE_MAX:
            line = self._masked_head(line) + CUT_MARK
        else:
            for secret in self.redact:
                line = line.replace(secret, "***")
        self.lines.append(line)
        self.written += 1
        if self._file is not None:
            try:
                self._file.write(line.encode("utf-8", "replace") + b"\n")
                self._file.flush()
                if self._file.tell() > self.max_bytes:
                    self._rotate()
            except OSError as exc:  # a full disk must not take the engine (or nvpair) down
                self._file_failed(exc)
        self.changes.bump()

    def _masked_head(self, line: str) -> str:
        """The first LINE_MAX characters, masked; a secret across the cut is masked whole."""
        out: list[str] = []
        i = 0
        while i < min(len(line), LINE_MAX):
            secret = next((s for s in self.redact if line.startswith(s, i)), None)
            out.append(line[i] if secret is None else "***")
            i += 1 if secret is None else len(secret)
        return "".join(out)

    def _file_failed(self, exc: OSError) -> None:
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.close()
            self._file = None
        message = f"cannot write {self.path}: {exc.strerror or exc}; keeping lines in memory only"
        log.warning("%s", message)
        self.write(f"[nvpair] {message}")  # to the ring only: the file is closed

    def _rotate(self) -> None:
        assert self._file is not None and self.path is not None
        self._file.close()
        self._file = None
        os.replace(self.path, self.path.with_name(self.path.name + ".1"))
        self._file = self.path.open("ab")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    async def pump(self, stream: trio.abc.ReceiveStream) -> None:
        """Copy ``stream`` line by line until EOF (an unfinished last line too, also when
        cancelled). A line longer than LINE_MAX is cut there; the rest of it is dropped."""
        pending = b""
        dropping = False  # in the rest of a line that was cut
        try:
            while data := await _receive(stream):
                pending += data
                *complete, pending = pending.split(b"\n")
                for raw in complete:
                    if not dropping:
                        self.write(raw.rstrip(b"\r").decode("utf-8", "replace"))
                    dropping = False
                if dropping:
                    pending = b""
                elif len(pending) > self._keep:
                    self.write(pending[:self._keep].decode("utf-8", "replace"), cut=True)
                    pending, dropping = b"", True
        finally:
            if pending and not dropping:
                self.write(pending.decode("utf-8", "replace"))


async def _receive(stream: trio.abc.ReceiveStream) -> bytes:
    try:
        return bytes(await stream.receive_some(65536))
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        return b""
