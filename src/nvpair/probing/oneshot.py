"""One HTTP/1.1 request on a connection of its own: connect, send, read the answer, close.
What a probe sends when no later probe would reuse its connection.

A connection pool is machinery for reuse: on httpcore2's, a probe on a fresh connection
that is closed after the answer cost about 790 µs of CPU. Here the socket is a plain
non-blocking one, waited on with Trio's ``wait_readable``/``wait_writable`` directly, the
request's bytes are made once per engine and path (``ProbeClient``), and the answer is
read by ``nvpair.probing.answer`` (h11 for any answer out of the plain shape); see
``docs/benchmarks.md``, "Probes with less bookkeeping". With nothing pooled, nothing can
leak when a request is cancelled: the socket is closed in a ``finally``, on every way out.

No timeouts here: the caller's cancel scope bounds the exchange.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
from typing import Protocol

import h11
import trio

from nvpair.probing.answer import MAX_HEAD, AnswerReader, ExchangeError, Failure, reason

__all__ = ["MAX_HEAD", "ExchangeError", "Failure", "Target", "encode_request", "exchange",
           "exchange_on", "reason", "send_request"]

RECEIVE_BYTES = 64 * 1024


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

    def connect(self) -> socket.socket:
        """A non-blocking socket of an IP literal's, its connection under way (closed by
        the caller): the request is sent as soon as it is made, without a wait of its own
        (``_Socket``). Raises ExchangeError("connect") when the kernel refuses at once."""
        assert self.family is not None
        sock = socket.socket(self.family, socket.SOCK_STREAM)
        try:
            sock.setblocking(False)
            code = sock.connect_ex((self.host, self.port))
            if code not in (0, errno.EINPROGRESS):
                raise ExchangeError("connect", f"[Errno {code}] {os.strerror(code)}")
        except OSError as exc:  # (an address the kernel will not take)
            sock.close()
            raise ExchangeError("connect", reason(exc)) from None
        except BaseException:
            sock.close()
            raise
        return sock

    async def open_stream(self) -> trio.SocketStream:
        """A connected stream to a name (closed by the caller); raises
        ExchangeError("connect")."""
        try:
            return await trio.open_tcp_stream(self.host, self.port)
        except OSError as exc:  # (refused, unreachable, no such name: all are OSError)
            raise ExchangeError("connect", reason(exc)) from None


class _Socket:
    """A non-blocking socket as the two stream methods the exchange needs, each a plain
    system call, and a wait on Trio's I/O manager only when it would block.

    Its connection may still be under way (``Target.connect``): the first send waits for
    it when it has to (on loopback it is mostly made by then), and an error there is the
    connection's (``connect``), not the send's."""

    __slots__ = ("connecting", "sock")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.connecting = True

    async def send_all(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            try:
                sent = self.sock.send(view)
            except BlockingIOError:
                await trio.lowlevel.wait_writable(self.sock)
                continue
            except OSError as exc:
                if self.connecting:  # (refused, unreachable: the connection's error)
                    raise ExchangeError("connect", reason(exc)) from None
                raise
            self.connecting = False
            view = view[sent:]

    async def receive_some(self, max_bytes: int) -> bytes:
        """Bytes as they come; a checkpoint at every call, as Trio's streams have: bytes
        that were already waiting are taken, then the loop is let in (an engine that
        never stops sending would otherwise hold it, its deadline included)."""
        try:
            data = self.sock.recv(max_bytes)
        except BlockingIOError:
            pass
        else:
            await trio.lowlevel.checkpoint()
            return data
        while True:
            await trio.lowlevel.wait_readable(self.sock)
            try:
                return self.sock.recv(max_bytes)
            except BlockingIOError:
                continue


class Wire(Protocol):
    """What an exchange talks through: a Trio stream, or ``_Socket``."""

    async def send_all(self, data: bytes) -> None: ...

    async def receive_some(self, max_bytes: int) -> bytes | bytearray: ...


def encode_request(method: str, path: str, headers: list[tuple[bytes, bytes]]) -> bytes:
    """The request's bytes, with ``Connection: close`` added; ExchangeError("protocol") for
    a header or path that HTTP does not allow (h11 checks them)."""
    conn = h11.Connection(h11.CLIENT)
    try:
        return conn.send(h11.Request(method=method, target=path,
                                     headers=[*headers, (b"connection", b"close")])) or b""
    except h11.LocalProtocolError as exc:  # (a header value of ours that is not legal)
        raise ExchangeError("protocol", f"cannot send the request: {reason(exc)}") from None


async def exchange(target: Target, method: str, path: str,
                   headers: list[tuple[bytes, bytes]], *, max_body: int) -> tuple[int, bytes]:
    """Send ``method path`` with ``headers`` (``Host`` among them; ``Connection: close`` is
    added) on a new connection and return the answer's status and body. The connection
    is closed however this ends. Raises ExchangeError."""
    return await send_request(target, encode_request(method, path, headers), method,
                              max_body=max_body)


async def send_request(target: Target, request: bytes, method: str, *, max_body: int
                       ) -> tuple[int, bytes]:
    """``exchange`` of a request already encoded (``encode_request``)."""
    if target.family is None:
        stream = await target.open_stream()
        try:
            return await _exchange(stream, request, method, max_body)
        finally:
            stream.socket.close()  # (synchronous: nothing to wait for, nothing to shield)
    sock = target.connect()
    try:
        return await _exchange(_Socket(sock), request, method, max_body)
    finally:
        # (no task waits on it, so Trio's I/O manager holds nothing of it: a plain close)
        sock.close()


async def exchange_on(stream: trio.abc.Stream, method: str, path: str,
                      headers: list[tuple[bytes, bytes]], *, max_body: int
                      ) -> tuple[int, bytes]:
    """The exchange on a connected stream (which the caller closes)."""
    return await _exchange(stream, encode_request(method, path, headers), method, max_body)


async def _exchange(wire: Wire, request: bytes, method: str, max_body: int
                    ) -> tuple[int, bytes]:
    try:
        await wire.send_all(request)
    except (trio.BrokenResourceError, OSError) as exc:
        raise ExchangeError("write", reason(exc)) from None
    reader = AnswerReader(method, max_body)
    while True:
        try:
            data = await wire.receive_some(RECEIVE_BYTES)
        except (trio.BrokenResourceError, OSError) as exc:
            raise ExchangeError("read", reason(exc)) from None
        answer = reader.feed(bytes(data))  # (b"": the engine closed its side)
        if answer is not None:
            return answer
        if not data:  # (the readers decide at a close: kept so that nothing can loop here)
            raise ExchangeError("protocol", "the engine closed the connection before its "
                                            "answer was complete")
