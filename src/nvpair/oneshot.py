"""One HTTP/1.1 request on a connection of its own: connect, send, read the answer with h11,
close. What a probe sends when no later probe would reuse its connection.

A connection pool is machinery for reuse: on httpcore2's, a probe on a fresh connection
that is closed after the answer cost about 790 µs of CPU; here it costs about 300 µs, of
which 75 µs are the socket's connect and close (``docs/benchmarks.md``, "Probes on
connections of their own"). With nothing pooled, nothing can leak when a request is
cancelled: the socket is closed in a ``finally``, on every way out.

No timeouts here: the caller's cancel scope bounds the exchange.
"""

from __future__ import annotations

import ipaddress
import socket
from typing import Literal

import h11
import trio

from nvpair.errors import NvpairError

#: the largest answer head taken (status line and headers), as httpcore2 allows.
MAX_HEAD = 100 * 1024
RECEIVE_BYTES = 64 * 1024

Failure = Literal["connect", "write", "read", "protocol", "too_big"]


class ExchangeError(NvpairError):
    """No usable answer. ``failure``: ``connect`` (no connection), ``write`` (the request
    could not be sent), ``read`` (the connection broke while the answer came), ``protocol``
    (the bytes are not an HTTP/1.1 answer, or the head is over MAX_HEAD), ``too_big`` (the
    body is over the caller's cap)."""

    def __init__(self, failure: Failure, message: str) -> None:
        super().__init__(message)
        self.failure: Failure = failure


class Target:
    """Where to connect: an IP literal is connected to directly (no resolver, no
    happy-eyeballs nursery: most of ``trio.open_tcp_stream``'s 230 µs); a name goes
    through ``trio.open_tcp_stream``."""

    __slots__ = ("family", "host", "port")

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        try:
            version = ipaddress.ip_address(host).version
        except ValueError:
            self.family: socket.AddressFamily | None = None
        else:
            self.family = socket.AF_INET if version == 4 else socket.AF_INET6

    async def connect(self) -> trio.SocketStream:
        """A connected stream (closed by the caller); raises ExchangeError("connect")."""
        try:
            if self.family is None:
                return await trio.open_tcp_stream(self.host, self.port)
            sock = trio.socket.socket(self.family, socket.SOCK_STREAM)
            try:
                await sock.connect((self.host, self.port))
            except BaseException:
                sock.close()
                raise
            return trio.SocketStream(sock)
        except OSError as exc:  # (refused, unreachable, no such name: all are OSError)
            raise ExchangeError("connect", reason(exc)) from None


async def exchange(target: Target, method: str, path: str,
                   headers: list[tuple[bytes, bytes]], *, max_body: int) -> tuple[int, bytes]:
    """Send ``method path`` with ``headers`` (``Host`` among them; ``Connection: close`` is
    added) on a new connection and return the answer's status and body. The connection
    is closed however this ends. Raises ExchangeError."""
    stream = await target.connect()
    try:
        return await exchange_on(stream, method, path, headers, max_body=max_body)
    finally:
        stream.socket.close()  # (synchronous: nothing to wait for, nothing to shield)


async def exchange_on(stream: trio.abc.Stream, method: str, path: str,
                      headers: list[tuple[bytes, bytes]], *, max_body: int
                      ) -> tuple[int, bytes]:
    """The exchange on a connected stream (which the caller closes)."""
    conn = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD)
    try:
        request = conn.send(h11.Request(method=method, target=path,
                                        headers=[*headers, (b"connection", b"close")]))
        conn.send(h11.EndOfMessage())  # (no body: nothing more to send)
    except h11.LocalProtocolError as exc:  # (a header value of ours that is not legal)
        raise ExchangeError("protocol", f"cannot send the request: {reason(exc)}") from None
    try:
        await stream.send_all(request or b"")
    except (trio.BrokenResourceError, OSError) as exc:
        raise ExchangeError("write", reason(exc)) from None
    status: int | None = None
    chunks: list[bytes] = []
    size = 0
    received = closed = False
    while True:
        try:
            event = conn.next_event()
        except h11.RemoteProtocolError as exc:
            if not closed:
                raise ExchangeError("protocol", reason(exc)) from None
            if not received:
                raise ExchangeError("protocol", "the engine closed the connection without "
                                                "answering") from None
            raise ExchangeError("protocol", "the engine closed the connection before its "
                                            f"answer was complete ({reason(exc)})") from None
        if event is h11.NEED_DATA:
            try:
                data = await stream.receive_some(RECEIVE_BYTES)
            except (trio.BrokenResourceError, OSError) as exc:
                raise ExchangeError("read", reason(exc)) from None
            received, closed = received or bool(data), not data
            conn.receive_data(bytes(data))  # (b"": the engine closed its side)
        elif isinstance(event, h11.Response):
            status = event.status_code
        elif isinstance(event, h11.Data):
            size += len(event.data)
            if size > max_body:
                raise ExchangeError("too_big", f"more than {max_body} bytes")
            chunks.append(bytes(event.data))
        elif isinstance(event, h11.EndOfMessage) and status is not None:
            return status, b"".join(chunks)
        elif not isinstance(event, h11.InformationalResponse):  # (a 1xx: skipped)
            # (ConnectionClosed or PAUSED: h11 turns both into errors above for a client
            # waiting for its answer; kept so that no event can loop here)
            raise ExchangeError("protocol", f"unexpected {type(event).__name__}")


def reason(exc: BaseException) -> str:
    """An exception's message as one short line (its type's name when it has none)."""
    text = str(exc) or type(exc).__name__
    return text.splitlines()[0][:200] if text.strip() else type(exc).__name__
