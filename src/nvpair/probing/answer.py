"""An HTTP/1.1 answer read from its bytes as they come: its status and body, or one
``ExchangeError``. Pure and synchronous (no sockets here: ``nvpair.probing.oneshot`` feeds it).

Two readers, one verdict. Almost every engine answers a probe the same plain way: a
``HTTP/1.1`` status line, a few headers, a ``Content-Length`` (or none, the body then
running until the engine closes). The lean reader takes exactly that shape, checked as
strictly as h11 checks it, with two regular expressions and no objects per header. Any
other answer (chunked, a 1xx first, ``HTTP/1.0``, a 204, a folded or odd header line,
anything it is not sure of) is handed with every byte seen so far to h11, whose verdict
stands. So the lean reader decides only answers on which h11 would say the same; the
property test in ``tests/test_answer.py`` holds it to that over any bytes.

Why: at 1,024 engines a probe is sent about 200 times a second, and h11's events, header
validation and state machine were about a fifth of a probe's CPU (``docs/benchmarks.md``,
"Probes with less bookkeeping").
"""

from __future__ import annotations

import re
from typing import Final, Literal

import h11

from nvpair.errors import NvpairError

#: the largest answer head taken (status line and headers), as httpcore2 allows.
MAX_HEAD: Final = 100 * 1024

#: what h11 ends a head at (a bare LF is allowed): the lean reader takes CRLF ones only.
_BLANK_LINE = re.compile(rb"\n\r?\n")
_STATUS_LINE = re.compile(rb"HTTP/1\.1 ([0-9]{3})(?: (?:[ \t]|[^\x00\s])*)?")
#: h11's header line (RFC 9110 field syntax), name and value captured
_HEADER = re.compile(rb"([-!#$%&'*+.^_`|~0-9a-zA-Z]+):[ \t]*((?:[^\x00\s]+(?:[ \t]+[^\x00\s]+)*)?)"
                     rb"[ \t]*")
_LENGTH = re.compile(rb"[0-9]{1,18}")

Failure = Literal["connect", "write", "read", "protocol", "too_big"]


class ExchangeError(NvpairError):
    """No usable answer. ``failure``: ``connect`` (no connection), ``write`` (the request
    could not be sent), ``read`` (the connection broke while the answer came), ``protocol``
    (the bytes are not an HTTP/1.1 answer, or the head is over MAX_HEAD), ``too_big`` (the
    body is over the caller's cap)."""

    def __init__(self, failure: Failure, message: str) -> None:
        super().__init__(message)
        self.failure: Failure = failure


class AnswerReader:
    """Feed it the answer's bytes (``feed``; ``b""`` once the engine closed its side) until
    it returns ``(status, body)``; it raises ExchangeError for an answer that is not one
    (``protocol``) or a body over ``max_body`` (``too_big``). ``method``: the request's (a
    HEAD answer has no body)."""

    __slots__ = ("_body", "_buffer", "_h11", "_have", "_length", "_searched", "_status",
                 "max_body", "method")

    def __init__(self, method: str, max_body: int) -> None:
        self.method, self.max_body = method, max_body
        self._buffer = bytearray()  # (the head, as it comes)
        self._status = 0  # (0: the head is not read yet)
        self._searched = 0  # (where the search for the head's end goes on)
        #: the body's pieces once the head is read, and their size
        self._body: list[bytes] = []
        self._have = 0
        self._length: int | None = None  # (None: the body runs until the engine closes)
        #: h11 once the answer is not the lean reader's to decide (``_hand_over``)
        self._h11: _H11Reader | None = None

    @property
    def by_h11(self) -> bool:
        """Whether h11 decides this answer (it is out of the lean reader's shape)."""
        return self._h11 is not None

    def feed(self, data: bytes) -> tuple[int, bytes] | None:
        """The answer once complete, else None (send more)."""
        if self._h11 is not None:
            return self._h11.feed(data)
        if self._status:
            self._body.append(data)
            self._have += len(data)
        else:
            self._buffer += data
            head = self._read_head()
            if head == "h11" or (head == "more" and not data):  # (closed mid-head: h11's)
                return self._hand_over(closed=not data)
            if head == "more":
                return None
        return self._read_body(closed=not data)

    def _read_head(self) -> Literal["read", "more", "h11"]:
        """Read the head: done, or more bytes are needed, or h11 is to decide."""
        buffer = self._buffer
        if buffer and buffer[0] < 0x21:
            return "h11"  # (h11 refuses these before the head ends)
        end = _BLANK_LINE.search(buffer, self._searched)
        if end is None or end.start() > MAX_HEAD:
            if len(buffer) > MAX_HEAD:  # (whatever the pieces it came in)
                raise ExchangeError("protocol", "Receive buffer too long")
            self._searched = max(0, len(buffer) - 2)
            return "more"
        at = end.start()
        if buffer[at - 1:at] != b"\r":
            return "h11"  # (a bare LF ends it)
        lines = bytes(buffer[:at - 1]).split(b"\r\n")
        status_line = _STATUS_LINE.fullmatch(lines[0])
        if (status_line is None or self.method not in ("GET", "POST")
                or (status := int(status_line[1])) < 200 or status in (204, 304)):
            return "h11"
        length = None
        for line in lines[1:]:
            header = _HEADER.fullmatch(line)
            if header is None:
                return "h11"
            name = header[1].lower()
            if name == b"transfer-encoding" or (name == b"content-length" and (
                    length is not None or not _LENGTH.fullmatch(header[2]))):
                return "h11"  # (chunked, or a length to check h11's way)
            if name == b"content-length":
                length = int(header[2])
        self._status, self._length = status, length
        body = bytes(buffer[end.end():])
        del buffer[end.end():]
        self._body, self._have = [body], len(body)
        return "read"

    def _read_body(self, *, closed: bool) -> tuple[int, bytes] | None:
        length = self._length
        have = self._have if length is None else min(self._have, length)
        if have > self.max_body:
            raise ExchangeError("too_big", f"more than {self.max_body} bytes")
        if have == length or (length is None and closed):
            body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
            return self._status, body if len(body) == have else body[:have]
        if closed:  # (short of its length: h11 says how)
            return self._hand_over(closed=True)
        return None

    def _hand_over(self, *, closed: bool) -> tuple[int, bytes] | None:
        """h11 decides from here: it is given every byte so far (and the close)."""
        reader = self._h11 = _H11Reader(self.method, self.max_body)
        data = b"".join([self._buffer, *self._body])
        self._buffer, self._body = bytearray(), []
        answer = reader.feed(data) if data else None
        if answer is None and closed:
            answer = reader.feed(b"")
        return answer


class _H11Reader:
    """The answer read with h11, event by event."""

    __slots__ = ("_chunks", "_closed", "_conn", "_received", "_size", "_status", "max_body")

    def __init__(self, method: str, max_body: int) -> None:
        self.max_body = max_body
        conn = self._conn = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD)
        # (h11 reads an answer only after a request: this one stands for the one sent,
        # whose method and Connection: close are what matter to the answer's framing)
        conn.send(h11.Request(method=method, target="/",
                              headers=[(b"host", b"-"), (b"connection", b"close")]))
        conn.send(h11.EndOfMessage())
        self._status: int | None = None
        self._chunks: list[bytes] = []
        self._size = 0
        self._received = self._closed = False

    def feed(self, data: bytes) -> tuple[int, bytes] | None:
        self._received = self._received or bool(data)
        self._closed = not data
        self._conn.receive_data(data)  # (b"": the engine closed its side)
        while True:
            try:
                event = self._conn.next_event()
            except h11.RemoteProtocolError as exc:
                raise self._broken(exc) from None
            if event is h11.NEED_DATA:
                return None
            if isinstance(event, h11.Response):
                self._status = event.status_code
            elif isinstance(event, h11.Data):
                self._size += len(event.data)
                if self._size > self.max_body:
                    raise ExchangeError("too_big", f"more than {self.max_body} bytes")
                self._chunks.append(bytes(event.data))
            elif isinstance(event, h11.EndOfMessage) and self._status is not None:
                return self._status, b"".join(self._chunks)
            elif not isinstance(event, h11.InformationalResponse):  # (a 1xx: skipped)
                # (ConnectionClosed or PAUSED: h11 turns both into errors above for a
                # client waiting for its answer; kept so that no event can loop here)
                raise ExchangeError("protocol", f"unexpected {type(event).__name__}")

    def _broken(self, exc: h11.RemoteProtocolError) -> ExchangeError:
        if not self._closed:
            return ExchangeError("protocol", reason(exc))
        if not self._received:
            return ExchangeError("protocol", "the engine closed the connection without "
                                             "answering")
        return ExchangeError("protocol", "the engine closed the connection before its "
                                         f"answer was complete ({reason(exc)})")


def reason(exc: BaseException) -> str:
    """An exception's message as one short line (its type's name when it has none)."""
    text = str(exc) or type(exc).__name__
    return text.splitlines()[0][:200] if text.strip() else type(exc).__name__
