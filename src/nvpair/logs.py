"""A managed engine's output: a bounded ring of recent lines and a size-capped log file."""

from __future__ import annotations

import itertools
import os
from collections import deque
from pathlib import Path
from typing import NamedTuple

import trio

RING_LINES = 2000
FILE_MAX_BYTES = 16 * 1024 * 1024
LINE_MAX = 8192


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
        self._file = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = path.open("ab")
        self.changed = trio.Event()
        self.written = 0

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

    def write(self, line: str) -> None:
        for secret in self.redact:
            line = line.replace(secret, "***")
        line = line[:LINE_MAX]
        self.lines.append(line)
        self.written += 1
        if self._file is not None:
            self._file.write(line.encode("utf-8", "replace") + b"\n")
            self._file.flush()
            if self._file.tell() > self.max_bytes:
                self._rotate()
        self.changed.set()
        self.changed = trio.Event()

    def _rotate(self) -> None:
        assert self._file is not None and self.path is not None
        self._file.close()
        os.replace(self.path, self.path.with_name(self.path.name + ".1"))
        self._file = self.path.open("ab")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    async def pump(self, stream: trio.abc.ReceiveStream) -> None:
        """Copy ``stream`` line by line until EOF."""
        pending = b""
        while True:
            try:
                data = await stream.receive_some(65536)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                data = b""
            if not data:
                if pending:
                    self.write(pending.decode("utf-8", "replace"))
                return
            pending += data
            *complete, pending = pending.split(b"\n")
            for raw in complete:
                self.write(raw.rstrip(b"\r").decode("utf-8", "replace"))
            if len(pending) > LINE_MAX:
                self.write(pending.decode("utf-8", "replace"))
                pending = b""
