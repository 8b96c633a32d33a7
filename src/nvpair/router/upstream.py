"""A connection pool for relayed requests (to an engine or a peer), on httpcore2.

httpcore2 is httpx2's own transport core. httpx2's ``AsyncClient`` merges URLs, builds
header maps and walks its auth and redirect machinery on every request, and wraps every
body chunk in two more generators: about 10 % of nvpair's CPU per relayed request
(docs/router.md). The relay needs none of it: a POST of bytes it already has, raw headers
back, raw chunks out. So it talks to the pool underneath, ``httpcore2.AsyncConnectionPool``,
which is the part that carries the fix this project chose httpx2 for (no pool slot leaked
when a request is cancelled).
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

import httpcore2
import trio

from nvpair.config import EngineSpec, RouterConfig
from nvpair.tls import client_tls

#: errors of a response body being read (the engine cut it, or broke the protocol).
BODY_ERRORS = (httpcore2.NetworkError, httpcore2.ProtocolError)
#: errors before an answer: cannot connect / no pool slot / nothing came back in time.
SEND_ERRORS = (httpcore2.NetworkError, httpcore2.ProtocolError, httpcore2.TimeoutException)
Refused = httpcore2.ConnectError
Headers = list[tuple[bytes, bytes]]


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
        self.pool = httpcore2.AsyncConnectionPool(
            ssl_context=client_tls() if https else None, max_connections=max_connections,
            max_keepalive_connections=32, keepalive_expiry=4.0)
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

    async def send(self, path: str, query: bytes, headers: Headers, body: bytes
                   ) -> httpcore2.Response:
        """POST ``body``; returns once the answer's head is in (its body is a stream).

        Adds Host, Content-Length and the upstream's token (never the user's).
        """
        target = path.encode() + (b"?" + query if query else b"")
        request = httpcore2.Request(
            b"POST", httpcore2.URL(scheme=self._scheme, host=self._host, port=self._port,
                                   target=target),
            headers=[self._host_header, *headers, *self._auth,
                     (b"content-length", b"%d" % len(body))],
            content=body, extensions=self._extensions)
        return await self.pool.handle_async_request(request)

    async def aclose(self) -> None:
        await self.pool.aclose()
