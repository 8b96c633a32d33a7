"""A small HTTP/1.1 server on Trio and h11, with keep-alive and wire-level control.

The simulators need what a framework hides: answering with headers and then never with a
body, resetting a connection, and noticing a client that went away in the middle of a
request. While a handler runs, a watcher task reads the socket: end of file (or a reset)
cancels the handler and marks the reply ``aborted``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import struct
from collections.abc import Awaitable, Callable, Iterable
from http import HTTPStatus
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import h11
import trio

log = logging.getLogger("nvpair.sim")

JSON = "application/json"
TEXT = "text/plain; charset=utf-8"
MAX_BODY = 64 * 1024 * 1024
_RECV = 65536
#: a request that started arriving must finish arriving within this long.
_READ_TIMEOUT_S = 60.0

Handler = Callable[["Request", "Reply"], Awaitable[None]]
#: rewrites the header fields of an answer: (status, fields, streamed) -> fields.
HeadFields = Callable[[int, list[tuple[str, str]], bool], list[tuple[str, str]]]


class Request:
    """One request, read in full."""

    __slots__ = ("body", "headers", "http_version", "method", "params", "path", "query", "seq",
                 "target")

    def __init__(
        self, method: str, target: str, headers: list[tuple[str, str]], body: bytes,
        http_version: str = "1.1", seq: int = 1,
    ) -> None:
        self.method = method
        self.target = target
        split = urlsplit(target)
        self.path = split.path or "/"
        self.query = dict(parse_qsl(split.query, keep_blank_values=True))
        self.headers = {name: value for name, value in headers}
        self.body = body
        self.http_version = http_version
        #: this request's number on its connection (1 for the first).
        self.seq = seq
        #: path parameters filled in by the router.
        self.params: dict[str, str] = {}

    def header(self, name: str) -> str | None:
        return self.headers.get(name.lower())

    def json(self) -> Any:
        """The body as JSON; raises ValueError when it is not."""
        return json.loads(self.body or b"null")


class Reply:
    """The answer to one request, sent through h11 by the handler.

    ``send`` answers in one go; ``start``/``write``/``end`` stream. With ``stall`` set, the
    status line and headers go out and then nothing more. ``reset()`` asks for the
    connection to be closed with a TCP reset once the handler returns. ``on_complete`` runs
    just before the last bytes of the answer go out, so whoever reads the answer can already
    see what it was accounted as. ``head_fields`` lets the engine shape the header fields
    (names, order, keep-alive headers); ``close_after`` closes the connection once the answer
    is complete, whatever the headers announced.
    """

    def __init__(self, conn: _Connection, request: Request, scope: trio.CancelScope) -> None:
        self._conn = conn
        self._request = request
        self._scope = scope
        self.status: int | None = None
        self.stall = False
        self.finished = False
        self.aborted = False
        self.reset_requested = False
        self.on_complete: Callable[[Reply], None] = lambda reply: None
        self.head_fields: HeadFields = _same_fields
        self.close_after = False

    @property
    def headers_sent(self) -> bool:
        return self.status is not None

    async def send(
        self, status: int, body: bytes = b"", *, content_type: str | None = JSON,
        headers: Iterable[tuple[str, str]] = (),
    ) -> None:
        fields = [("content-length", str(len(body))), *headers]
        if content_type is not None:
            fields.insert(0, ("content-type", content_type))
        await self._head(status, fields, streamed=False)
        if body and self._request.method != "HEAD":
            self.on_complete(self)
            await self._send(h11.Data(data=body))
        await self.end()

    async def send_json(self, status: int, obj: object) -> None:
        await self.send(status, json.dumps(obj, separators=(",", ":")).encode())

    async def send_text(self, status: int, text: str, *, content_type: str = TEXT) -> None:
        await self.send(status, text.encode(), content_type=content_type)

    async def start(
        self, status: int, *, content_type: str, headers: Iterable[tuple[str, str]] = ()
    ) -> None:
        """Send the head of a streamed answer (chunked for HTTP/1.1 clients)."""
        await self._head(status, [("content-type", content_type), *headers], streamed=True)

    async def write(self, data: bytes) -> None:
        await trio.lowlevel.checkpoint()
        if data and self._request.method != "HEAD":
            await self._send(h11.Data(data=data))

    async def end(self) -> None:
        self.on_complete(self)
        await self._send(h11.EndOfMessage())
        self.finished = True

    def reset(self) -> None:
        self.reset_requested = True

    async def send_raw(self, data: bytes, *, status: int = 0) -> None:
        """Write ``data`` to the socket as it is, past h11 (bytes that are not HTTP, or an
        answer sent piece by piece); ``status`` is what it counts as. The connection is
        closed afterwards (h11 no longer knows where the exchange stands)."""
        self.status = status
        self.close_after = True
        try:
            await self._conn.stream.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self._conn.gone = True
            self.client_gone()
            await trio.lowlevel.checkpoint()

    def client_gone(self) -> None:
        """The client went away: abandon the request."""
        if not self.finished:
            self.aborted = True
        self._scope.cancel()

    async def _head(self, status: int, fields: list[tuple[str, str]], *, streamed: bool) -> None:
        self.status = status
        fields = self.head_fields(status, fields, streamed)
        response = h11.Response(status_code=status, headers=fields, reason=_reason(status))
        # h11 moves framing headers (Transfer-Encoding, Connection) to the end: put them back
        if not await self._conn.send(response, order=[name.lower() for name, _ in fields]):
            self.client_gone()
            await trio.lowlevel.checkpoint()
        if self.stall:
            await trio.sleep_forever()

    async def _send(self, event: h11.Event) -> None:
        if not await self._conn.send(event):
            self.client_gone()
            await trio.lowlevel.checkpoint()  # raises Cancelled: the handler unwinds


def _same_fields(
    status: int, fields: list[tuple[str, str]], streamed: bool
) -> list[tuple[str, str]]:
    return fields


def _reorder_head(data: bytes, order: list[str]) -> bytes:
    """Sort a response head's header lines by ``order`` (stable; others go last)."""
    head, sep, rest = data.partition(b"\r\n\r\n")
    status, *lines = head.split(b"\r\n")
    rank = {name: i for i, name in enumerate(order)}
    lines.sort(key=lambda line: rank.get(
        line.partition(b":")[0].decode("latin-1").lower(), len(order)))
    return b"\r\n".join([status, *lines]) + sep + rest


def _reason(status: int) -> bytes:
    try:
        return HTTPStatus(status).phrase.encode()
    except ValueError:
        return b""


async def receive_or_eof(stream: trio.SocketStream) -> bytes:
    """The next bytes from ``stream``; b"" at end of file or when it broke."""
    await trio.lowlevel.checkpoint()
    try:
        return await stream.receive_some(_RECV)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        return b""


class _Connection:
    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.h11 = h11.Connection(h11.SERVER)
        self.gone = False

    async def send(self, event: h11.Event, order: list[str] | None = None) -> bool:
        """Send one event; False when the peer is gone. ``order``: header names (lowercase)
        in the order a response head must have them."""
        await trio.lowlevel.checkpoint()
        if self.gone:
            return False
        data = self.h11.send(event)
        if order and data:
            data = _reorder_head(data, order)
        if data:
            try:
                await self.stream.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                self.gone = True
                return False
        return True

    async def _receive(self) -> bytes:
        return await receive_or_eof(self.stream)

    async def read_request(self, idle_timeout_s: float, seq: int = 1) -> Request | None:
        """The next request, or None when the connection ends (closed, idle, bad request)."""
        head: h11.Request | None = None
        body = bytearray()
        while True:
            await trio.lowlevel.checkpoint()
            try:
                event = self.h11.next_event()
            except h11.RemoteProtocolError as exc:
                await self._refuse(exc.error_status_hint, "bad request")
                return None
            if event is h11.NEED_DATA:
                timeout = idle_timeout_s if head is None else _READ_TIMEOUT_S
                with trio.move_on_after(timeout) as idle:
                    data = await self._receive()
                if idle.cancelled_caught:
                    return None
                if not data:
                    self.gone = True
                self.h11.receive_data(data)
            elif isinstance(event, h11.Request):
                head = event
            elif isinstance(event, h11.Data):
                body += event.data
                if len(body) > MAX_BODY:
                    await self._refuse(413, "request body too large")
                    return None
            elif isinstance(event, h11.EndOfMessage) and head is not None:
                return Request(
                    head.method.decode(), head.target.decode("latin-1"),
                    [(n.decode("latin-1"), v.decode("latin-1")) for n, v in head.headers],
                    bytes(body), head.http_version.decode(), seq,
                )
            else:  # ConnectionClosed, or PAUSED after a protocol switch we never accept
                return None

    async def _refuse(self, status: int, message: str) -> None:
        await trio.lowlevel.checkpoint()
        if self.h11.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
            return
        body = message.encode()
        await self.send(h11.Response(status_code=status, headers=[
            ("content-type", TEXT), ("content-length", str(len(body))), ("connection", "close"),
        ]))
        await self.send(h11.Data(data=body))
        await self.send(h11.EndOfMessage())

    async def watch(self, reply: Reply) -> None:
        """Read while the handler runs; end of file means the client went away."""
        while True:
            data = await self._receive()
            if not data:
                self.gone = True
                reply.client_gone()
                return
            self.h11.receive_data(data)  # a pipelined request: h11 keeps it for later

    def reset(self) -> None:
        """Close with a TCP reset instead of a FIN."""
        self.gone = True
        sock = self.stream.socket
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()


class HttpServer:
    """Serves ``handler`` on the connections handed to :meth:`serve_connection`."""

    def __init__(
        self, handler: Handler, *, idle_timeout_s: float = 30.0,
        on_connection: Callable[[], None] = lambda: None,
    ) -> None:
        self._handler = handler
        self._idle_timeout_s = idle_timeout_s
        self._on_connection = on_connection
        self._open: dict[trio.CancelScope, trio.SocketStream] = {}

    def drop_all(self) -> None:
        """Close every open connection now (the engine stopped listening)."""
        for scope, stream in self._open.items():
            scope.cancel(reason="connections dropped")
            stream.socket.close()

    async def serve_connection(self, stream: trio.SocketStream) -> None:
        """Serve requests on ``stream`` until it closes; always closes it."""
        self._on_connection()
        conn = _Connection(stream)
        scope = trio.CancelScope()
        self._open[scope] = stream
        try:
            with scope:
                seq = 1
                while True:
                    reusable = await self._exchange(conn, seq)
                    if not reusable:
                        break
                    conn.h11.start_next_cycle()
                    seq += 1
        finally:
            self._open.pop(scope, None)
            stream.socket.close()

    async def _exchange(self, conn: _Connection, seq: int) -> bool:
        """Read one request and answer it. True when the connection can be reused."""
        request = await conn.read_request(self._idle_timeout_s, seq)
        if request is None:
            return False
        async with trio.open_nursery() as nursery:
            with trio.CancelScope() as handler_scope:
                reply = Reply(conn, request, handler_scope)
                nursery.start_soon(conn.watch, reply)
                await trio.lowlevel.checkpoint()
                try:
                    await self._handler(request, reply)
                except Exception:
                    log.exception("handler failed on %s %s", request.method, request.target)
                    if not reply.headers_sent:
                        await reply.send_json(500, {"detail": "Internal Server Error"})
            nursery.cancel_scope.cancel()
        if reply.reset_requested:
            conn.reset()
            return False
        if conn.gone or reply.aborted or not reply.finished or reply.close_after:
            return False
        return conn.h11.our_state is h11.DONE and conn.h11.their_state is h11.DONE
