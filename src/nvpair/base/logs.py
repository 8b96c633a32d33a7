"""A managed engine's output: a bounded ring of recent lines and a size-capped log file,
filled by a pump that works in bounded steps and drops lines above a rate cap.

The pump never holds the event loop for long, whatever the engine writes: each read is at
most 64 KiB, the lines of a read are counted in C (``bytes.count``) before any is
decoded, only the lines the rate cap keeps are split and decoded (the newest of the read),
they are written ``LINES_PER_STEP`` at a time with a checkpoint between, and the file gets
one write per read. Masking a secret is one ``str.find`` walk per secret over a window of
``LINE_MAX`` characters plus the secret: linear in the line, bounded by the cap.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import os
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import trio

from nvpair.base.changes import Changes

RING_LINES = 2000
FILE_MAX_BYTES = 16 * 1024 * 1024
LINE_MAX = 8192
CUT_MARK = " [nvpair: line cut at 8192 characters]"
#: lines the pump writes before it lets other tasks run. A line of 70 characters costs
#: ~0.5 us (decode, mask check, ring, its share of the file's write; measured), so a step
#: of 256 is ~0.15 ms, and a read of 64 KiB holds at most ~97 KiB of lines in all.
LINES_PER_STEP = 256
#: the default rate cap: lines above it in any second are dropped (and counted). The
#: bucket holds one second's worth, so a burst (a traceback, the start-up banner) passes.
LINES_PER_S = 5000
BYTES_PER_S = 2 * 1024 * 1024
#: while lines are being dropped, the pump waits this long after each read: a flooding
#: engine then waits on its full pipe (64 KiB) for a moment instead of nvpair reading it
#: at full speed on a core of its own. It still drains up to 32 MB/s.
DROP_PAUSE_S = 0.002
#: an episode of drops: said in words once it has lasted this long (or at its end),
#: reported at most this often, and over after this long without a drop
EPISODE_S = 1.0

log = logging.getLogger("nvpair.logs")


class Lines(NamedTuple):
    """A piece of the log: ``lines`` from number ``first`` on; ``next`` is the number the
    next line will get; ``missed`` lines fell out of the ring before they were asked for."""

    lines: list[str]
    first: int
    next: int
    missed: int


class RateCap(NamedTuple):
    """Lines and bytes of output a second kept at most (the config's ``log_lines_per_s``
    and ``log_bytes_per_s``)."""

    lines_per_s: int = LINES_PER_S
    bytes_per_s: int = BYTES_PER_S


class Drops(NamedTuple):
    """What the rate cap has done: lines dropped since the log began, and the episode in
    progress in words (None when nothing is being dropped)."""

    dropped: int
    episode: str | None


#: the rate cap when none is given
DEFAULT_RATE = RateCap()


def masked(line: str, secrets: tuple[str, ...], limit: int) -> str:
    """The first ``limit`` characters of ``line``, every secret that starts within them
    replaced by ``***`` whole (also one that runs past ``limit``). Leftmost first; where
    two start at one place, the first of ``secrets``. Linear: each secret's ``find``
    only moves forward, over at most ``limit + len(secret)`` characters."""
    out: list[str] = []
    i = 0
    found = {s: line.find(s, 0, limit + len(s) - 1) for s in secrets}
    while True:
        best, where = "", -1
        for s in secrets:
            at = found[s]
            if 0 <= at < i:  # inside a secret masked already: look again from here
                at = found[s] = line.find(s, i, limit + len(s) - 1)
            if at >= 0 and (where < 0 or at < where):
                best, where = s, at
        if where < 0:
            break
        out += (line[i:where], "***")
        i = where + len(best)
    if i < limit:
        out.append(line[i:limit])
    return "".join(out)


class _Bucket:
    """Tokens refilled at ``rate`` a second, holding at most one second's worth."""

    def __init__(self, rate: int) -> None:
        self.rate = rate
        self.tokens = float(rate)
        self.at: float | None = None

    def refill(self, now: float) -> None:
        if self.at is not None:
            self.tokens = min(float(self.rate), self.tokens + (now - self.at) * self.rate)
        self.at = now


class _Episode:
    """One stretch of drops: from its first drop to ``EPISODE_S`` after its last."""

    def __init__(self, now: float) -> None:
        self.start = self.last_drop = now
        self.lines = self.bytes = self.dropped = 0
        self.words: str | None = None  # once said
        self.reported = now


class EngineLog:
    """Lines from an engine; the file rotates once to ``NAME.log.1`` past its size cap.

    Every line gets a number (0, 1, 2, ... for the life of this log), so that a follower
    asks for the lines after the last one it has, whatever their text (engines repeat
    lines: ``GET /health 200`` every few seconds)."""

    def __init__(self, path: Path | None, *, ring: int = RING_LINES,
                 max_bytes: int = FILE_MAX_BYTES, redact: tuple[str, ...] = (),
                 rate: RateCap = DEFAULT_RATE, name: str | None = None) -> None:
        self.path = path
        self.name = name or (path.stem if path is not None else "engine")
        self.max_bytes = max_bytes
        self.lines: deque[str] = deque(maxlen=ring)
        self.redact = tuple(dict.fromkeys(s for s in redact if s))
        #: bytes of an unfinished line kept before it is cut: enough for LINE_MAX
        #: characters and a secret across the cut, whole, however wide the characters
        #: (UTF-8: up to 4 bytes each)
        self._keep = 4 * (LINE_MAX + max((len(s) for s in self.redact), default=0))
        self._file = None
        #: moves with every step of lines written (a reader waits on it for new lines)
        self.changes = Changes()
        self.written = 0
        self.rate = rate
        self._line_tokens = _Bucket(rate.lines_per_s)
        self._byte_tokens = _Bucket(rate.bytes_per_s)
        #: lines dropped above the rate cap since this log began
        self.dropped = 0
        self._episode: _Episode | None = None
        #: told of drops: at an episode's words, at most every EPISODE_S during it, and
        #: at its end (the engine's runner puts it on the board)
        self.on_drops: Callable[[Drops], None] | None = None
        if path is not None:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                self._file = path.open("ab")
            except OSError as exc:
                self._file_failed(exc)

    def add_secret(self, secret: str) -> None:
        """A reload's new secret (an engine's API key) is masked too, from now on; the old
        ones stay masked (lines written before may still come from the engine)."""
        if secret and secret not in self.redact:
            self.redact = (*self.redact, secret)
            self._keep = 4 * (LINE_MAX + max(len(s) for s in self.redact))

    def set_rate(self, rate: RateCap) -> None:
        """A reload's new cap, taken from now on: the tokens in hand are kept, up to a
        second's worth of the new cap (a lower cap holds at once)."""
        self.rate = rate
        for bucket, per_s in ((self._line_tokens, rate.lines_per_s),
                              (self._byte_tokens, rate.bytes_per_s)):
            bucket.rate = per_s
            bucket.tokens = min(bucket.tokens, float(per_s))

    def move(self, path: Path) -> None:
        """Lines from now on go to ``path`` (a reload's ``log_dir``), opened at once. The
        file before gets a last line saying where the log went, and is closed and left
        where it is with its lines; the ring is kept (a follower misses nothing). A path
        that cannot be opened is said (a warning, and a line in the ring), and the lines
        stay in memory only, as when the log began."""
        if path == self.path:
            return
        before = self.path
        if self._file is not None:
            self._to_file([f"[nvpair] this log continues in {path}"])
            self.close()
        self.path = path
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = path.open("ab")
        except OSError as exc:
            self._file_failed(exc)
            return
        self.write(f"[nvpair] this log continues here (before: {before})")

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
        """One line, masked, into the ring and the file (cut at LINE_MAX characters)."""
        line = self._masked(line, cut)
        self.lines.append(line)
        self.written += 1
        self._to_file([line])
        self.changes.bump()

    def _masked(self, line: str, cut: bool) -> str:
        if cut or len(line) > LINE_MAX:
            return masked(line, self.redact, LINE_MAX) + CUT_MARK
        if self.redact and any(s in line for s in self.redact):
            return masked(line, self.redact, len(line))
        return line

    def _to_file(self, lines: list[str]) -> None:
        """One write (and flush) for ``lines``; rotates past the size cap."""
        if self._file is None or not lines:
            return
        lines.append("")
        try:
            self._file.write("\n".join(lines).encode("utf-8", "replace"))
            self._file.flush()
            if self._file.tell() > self.max_bytes:
                self._rotate()
        except OSError as exc:  # a full disk must not take the engine (or nvpair) down
            self._file_failed(exc)

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

    # -- the pump --------------------------------------------------------------------------

    async def pump(self, stream: trio.abc.ReceiveStream) -> None:
        """Copy ``stream`` line by line until EOF (an unfinished last line too, also when
        cancelled). A line longer than LINE_MAX is cut there; the rest of it is dropped.
        Lines above the rate cap are dropped, the oldest of a read first, and counted."""
        pending = b""
        skipping = False  # in the rest of a line that was cut
        try:
            while True:
                data = b""
                with trio.move_on_at(self._due()):
                    data = await _receive(stream)
                    if not data:
                        return
                now = trio.current_time()
                if data:  # (pending is in buf now: a cancel inside must not write it again)
                    buf, pending = pending + data, b""
                    pending, skipping = await self._take(buf, len(data), skipping, now)
                self._episode_tick(now)
                if self._episode is not None and data:
                    await trio.sleep(DROP_PAUSE_S)
        finally:
            if pending and not skipping:
                self.write(pending.decode("utf-8", "replace"))
            if self._episode is not None:
                self._episode_end(trio.current_time())

    async def _take(self, buf: bytes, read: int, skipping: bool, now: float
                    ) -> tuple[bytes, bool]:
        """Keep what the rate cap allows of ``buf`` (the unfinished line before and a read
        of ``read`` bytes); returns the unfinished line after, and whether it is the rest
        of a cut line."""
        ends = buf.count(b"\n")
        counted = ends - skipping  # the rest of a cut line is no line of its own
        keep = self._admit(counted, now) if counted else 0
        if ends:
            head, _, pending = buf.rpartition(b"\n")
            pieces = (head.split(b"\n") if keep == ends else
                      head.rsplit(b"\n", keep)[1:] if keep else [])
            skipping = False
        else:
            pieces, pending = [], b"" if skipping else buf
        pieces = self._within_bytes(pieces)
        dropped = counted - len(pieces)
        cut = None
        if len(pending) > self._keep:  # a line too long: cut, the rest of it skipped
            cut, pending, skipping = pending[:self._keep], b"", True
            counted += 1
            if not self._admit(1, now) or not self._within_bytes([cut]):
                cut, dropped = None, dropped + 1
        self._count(counted, read, dropped, now)
        await self._write_lines(pieces, cut)
        return pending, skipping

    def _admit(self, count: int, now: float) -> int:
        """How many of ``count`` lines the line bucket lets through (the newest)."""
        bucket = self._line_tokens
        bucket.refill(now)
        self._byte_tokens.refill(now)
        keep = min(count, math.floor(bucket.tokens))
        bucket.tokens -= keep
        return keep

    def _within_bytes(self, pieces: list[bytes]) -> list[bytes]:
        """The newest of ``pieces`` the byte bucket lets through."""
        bucket = self._byte_tokens
        size = sum(map(len, pieces))
        if size <= bucket.tokens:
            bucket.tokens -= size
            return pieces
        first = len(pieces)
        while first and len(pieces[first - 1]) <= bucket.tokens:
            first -= 1
            bucket.tokens -= len(pieces[first])
        self._line_tokens.tokens += first  # (lines dropped here took no line's place)
        return pieces[first:]

    async def _write_lines(self, pieces: list[bytes], cut: bytes | None) -> None:
        """``pieces`` (and ``cut``, a line cut at its cap), into the ring
        ``LINES_PER_STEP`` at a time, a checkpoint between; the file at the end, once."""
        done: list[str] = []
        try:
            for start in range(0, len(pieces), LINES_PER_STEP):
                if start:
                    await trio.lowlevel.checkpoint()
                for raw in pieces[start:start + LINES_PER_STEP]:
                    line = self._masked(raw.rstrip(b"\r").decode("utf-8", "replace"), False)
                    self.lines.append(line)
                    done.append(line)
                self.written += min(LINES_PER_STEP, len(pieces) - start)
                self.changes.bump()
            if cut is not None:
                line = self._masked(cut.decode("utf-8", "replace"), True)
                self.lines.append(line)
                done.append(line)
                self.written += 1
                self.changes.bump()
        finally:
            self._to_file(done)

    # -- drops ----------------------------------------------------------------------------

    def _count(self, lines: int, read: int, dropped: int, now: float) -> None:
        episode = self._episode
        if episode is None and dropped:
            episode = self._episode = _Episode(now)
        if episode is None:
            return
        episode.lines += lines
        episode.bytes += read
        if dropped:
            episode.dropped += dropped
            episode.last_drop = now
            self.dropped += dropped

    def _due(self) -> float:
        """When the episode in progress is next to be said, reported or ended."""
        episode = self._episode
        if episode is None:
            return math.inf
        said = episode.start if episode.words is None else episode.reported
        return min(said, episode.last_drop) + EPISODE_S

    def _episode_tick(self, now: float) -> None:
        episode = self._episode
        if episode is None:
            return
        over = now - episode.last_drop >= EPISODE_S
        if episode.words is None and (over or now - episode.start >= EPISODE_S):
            self._say(episode, now)
        elif episode.words is not None and now - episode.reported >= EPISODE_S:
            episode.reported = now
            self._report(Drops(self.dropped, episode.words))
        if over:
            self._episode_end(now)

    def _say(self, episode: _Episode, now: float) -> None:
        """The episode in one line, in nvpair's log and the engine's: its rates over its
        first second (or its whole, if longer by the time it is said)."""
        span = max(now - episode.start, EPISODE_S)
        episode.words = (f"engine {self.name} wrote {episode.lines / span:,.0f} lines/s "
                         f"({episode.bytes / span / 1e6:,.1f} MB/s); {episode.dropped:,} "
                         f"dropped; the newest kept")
        episode.reported = now
        log.warning("%s (cap: %s lines/s, %s bytes/s)", episode.words,
                    f"{self.rate.lines_per_s:,}", f"{self.rate.bytes_per_s:,}")
        self.write(f"[nvpair] {episode.words}")
        self._report(Drops(self.dropped, episode.words))

    def _episode_end(self, now: float) -> None:
        episode = self._episode
        assert episode is not None
        if episode.words is None:
            self._say(episode, now)
        self._episode = None
        self._report(Drops(self.dropped, None))

    def _report(self, drops: Drops) -> None:
        if self.on_drops is not None:
            self.on_drops(drops)


async def _receive(stream: trio.abc.ReceiveStream) -> bytes:
    try:
        return bytes(await stream.receive_some(65536))
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        return b""
