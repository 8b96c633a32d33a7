"""A connection pool for relayed requests (to an engine or a peer), on httpcore2.

httpcore2 is httpx2's own transport core. httpx2's ``AsyncClient`` merges URLs, builds
header maps and walks its auth and redirect machinery on every request, and wraps every
body chunk in two more generators: about 10 % of nvpair's CPU per relayed request
(docs/router.md). The relay needs none of it: a POST of bytes it already has, raw headers
back, raw chunks out. So it talks to the pool underneath, ``httpcore2.AsyncConnectionPool``,
which is the part that carries the fix this project chose httpx2 for (no pool slot leaked
when a request is cancelled).

An engine closes a keep-alive connection it has kept idle long enough (llama-server after
5 s): a request the pool sends on it just then meets a closed socket and gets nothing back.
Such a request is sent once more on a connection of its own, as browsers and httpx do,
but only when the connection was a reused one and not one byte of the answer came; a
request on a new connection, or whose answer had begun, is never sent twice.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from contextvars import ContextVar
from typing import Any
from urllib.parse import urlsplit

import httpcore2
import trio

from nvpair.base.tls import client_tls
from nvpair.config.settings import EngineSpec, RouterConfig

#: errors of a response body being read (the engine cut it, or broke the protocol).
BODY_ERRORS = (httpcore2.NetworkError, httpcore2.ProtocolError)
#: errors before an answer: cannot connect / no pool slot / nothing came back in time.
SEND_ERRORS = (httpcore2.NetworkError, httpcore2.ProtocolError, httpcore2.TimeoutException)
Refused = httpcore2.ConnectError
Headers = list[tuple[bytes, bytes]]
#: what a reused connection the engine had closed fails with (a reset, a write to a closed
#: socket, or an end of file before any answer): sent again when nothing came back
STALE_ERRORS = (httpcore2.ReadError, httpcore2.WriteError, httpcore2.RemoteProtocolError)


class Exchange:
    """What one attempt of a request saw on the wire: whether it opened its connection,
    and how many bytes of the answer came."""

    __slots__ = ("connected", "received")

    def __init__(self) -> None:
        self.connected = False
        self.received = 0


#: the attempt under way in this task (set by ``Upstream.send``; the pool sends and reads in
#: the caller's task, so the streams below find it here)
_EXCHANGE: ContextVar[Exchange | None] = ContextVar("nvpair_upstream_exchange", default=None)


class _CountedStream(httpcore2.AsyncNetworkStream):
    """A connection's stream that counts what it reads into the attempt under way. (Its
    methods take httpcore2's ``timeout`` arguments: the pool calls them so, ASYNC109.)"""

    __slots__ = ("_inner",)

    def __init__(self, inner: httpcore2.AsyncNetworkStream) -> None:
        self._inner = inner

    async def read(self, max_bytes: int, timeout: float | None = None  # noqa: ASYNC109
                   ) -> bytes:
        data = await self._inner.read(max_bytes, timeout)
        exchange = _EXCHANGE.get()
        if exchange is not None:
            exchange.received += len(data)
        return data

    async def write(self, buffer: bytes, timeout: float | None = None  # noqa: ASYNC109
                    ) -> None:
        await self._inner.write(buffer, timeout)

    async def aclose(self) -> None:
        await self._inner.aclose()

    async def start_tls(self, ssl_context: Any, server_hostname: str | None = None,
                        timeout: float | None = None  # noqa: ASYNC109
                        ) -> httpcore2.AsyncNetworkStream:
        return _CountedStream(await self._inner.start_tls(ssl_context, server_hostname,
                                                          timeout))

    def get_extra_info(self, info: str) -> Any:
        return self._inner.get_extra_info(info)


class _CountedBackend(httpcore2.AsyncNetworkBackend):
    """Trio's network, its streams counted, and each new connection noted in the attempt
    that opened it."""

    def __init__(self) -> None:
        self._inner = httpcore2.TrioBackend()

    async def connect_tcp(self, host: str, port: int,
                          timeout: float | None = None,  # noqa: ASYNC109
                          local_address: str | None = None,
                          socket_options: Iterable[Any] | None = None
                          ) -> httpcore2.AsyncNetworkStream:
        stream = await self._inner.connect_tcp(host, port, timeout=timeout,
                                               local_address=local_address,
                                               socket_options=socket_options)
        exchange = _EXCHANGE.get()
        if exchange is not None:
            exchange.connected = True
        return _CountedStream(stream)

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)


class Upstream:
    """Keep-alive connections to one engine or peer (opened on demand, closed by
    ``aclose``). ``token``: the bearer token added to every request (the engine's API key,
    or the cluster token towards a peer), never the user's."""

    def __init__(self, url: str, config: RouterConfig, *, token: str | None = None,
                 max_connections: int = 256) -> None:
        #: where it goes and with which token (a peer that moves gets a new pool)
        self.end = (url, token)
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s)://HOST:PORT URL: {url!r}")
        https = parts.scheme == "https"
        self._tls = client_tls() if https else None
        self._network = _CountedBackend()
        self.pool = httpcore2.AsyncConnectionPool(
            ssl_context=self._tls, max_connections=max_connections,
            max_keepalive_connections=32, keepalive_expiry=4.0, network_backend=self._network)
        self._scheme = parts.scheme.encode()
        self._host = parts.hostname.encode("idna")
        self._port = parts.port or (443 if https else 80)
        self._host_header = (b"host", parts.netloc.rpartition("@")[2].encode("idna"))
        self._auth = ((b"authorization", f"Bearer {token}".encode()),) if token else ()
        self._extensions: dict[str, Any] = {"timeout": {
            "connect": config.connect_timeout_s, "read": None, "write": 60.0,
            "pool": config.first_byte_timeout_s}}
        #: relayed requests using the pool now, and whether it is replaced (close it once
        #: the last of them is done)
        self.users = 0
        self.retired = False
        #: when the last request using it ended (the router closes pools idle for long)
        self.used_at = trio.current_time()

    @classmethod
    def engine(cls, spec: EngineSpec, config: RouterConfig, **kw: Any) -> Upstream:
        return cls(spec.url, config, token=spec.api_key, **kw)

    async def send(self, path: str, query: bytes, headers: Headers, body: bytes,
                   method: bytes = b"POST") -> httpcore2.Response:
        """POST ``body`` (or ``method``); returns once the answer's head is in (its body is
        a stream).

        Adds Host, Content-Length and the upstream's token (never the user's). A reused
        connection that fails before one byte of the answer came (the engine had closed
        it) is left, and the request sent once more on a new connection of its own."""
        target = path.encode() + (b"?" + query if query else b"")
        request = httpcore2.Request(
            method, httpcore2.URL(scheme=self._scheme, host=self._host, port=self._port,
                                   target=target),
            headers=[self._host_header, *headers, *self._auth,
                     (b"content-length", b"%d" % len(body))],
            content=body, extensions=self._extensions)
        exchange = Exchange()
        reset = _EXCHANGE.set(exchange)
        try:
            return await self.pool.handle_async_request(request)
        except STALE_ERRORS:
            if exchange.connected or exchange.received:
                raise  # a new connection, or an answer begun: the engine may have it
        finally:
            _EXCHANGE.reset(reset)
        return await self._send_alone(request)

    async def _send_alone(self, request: httpcore2.Request) -> httpcore2.Response:
        """``request`` on a new connection outside the pool, closed with its answer."""
        connection = httpcore2.AsyncHTTPConnection(
            httpcore2.Origin(self._scheme, self._host, self._port), ssl_context=self._tls,
            network_backend=self._network)
        try:
            response = await connection.handle_async_request(request)
        except BaseException:
            with trio.CancelScope(shield=True):
                await connection.aclose()
            raise
        return httpcore2.Response(response.status, headers=response.headers,
                                  content=_Alone(response, connection),
                                  extensions=response.extensions)

    async def aclose(self) -> None:
        await self.pool.aclose()


class _Alone:
    """The body of an answer on a connection of its own: closing it closes the
    connection. Iterating gives the connection's own iterator (no generator between)."""

    __slots__ = ("_connection", "_response")

    def __init__(self, response: httpcore2.Response,
                 connection: httpcore2.AsyncHTTPConnection) -> None:
        self._response = response
        self._connection = connection

    def __aiter__(self) -> AsyncIterator[bytes]:
        stream = self._response.stream
        assert hasattr(stream, "__aiter__")
        iterator: AsyncIterator[bytes] = stream.__aiter__()
        return iterator

    async def aclose(self) -> None:
        try:
            await self._response.aclose()
        finally:
            await self._connection.aclose()
