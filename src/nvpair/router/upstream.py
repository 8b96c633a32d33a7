"""One engine's connection pool for relayed requests, on httpx2's transport core (httpcore2).

httpx2's ``AsyncClient`` merges URLs, builds header maps and walks its auth and redirect
machinery on every request, and wraps every body chunk in two more generators: about 10 %
of nvpair's CPU per relayed request (docs/benchmarks.md, "Router"). The relay needs none
of it: a POST of bytes it already has, raw headers back, raw chunks out. So it talks to
the pool underneath, ``httpcore2.AsyncConnectionPool``, which is the part that carries
the fix this project chose httpx2 for (no pool slot leaked when a request is cancelled).
"""

from __future__ import annotations

from typing import Any

import httpcore2

from nvpair.config import EngineSpec, RouterConfig

#: errors of a response body being read (the engine cut it, or broke the protocol).
BODY_ERRORS = (httpcore2.NetworkError, httpcore2.ProtocolError)
#: errors before an answer: cannot connect / no pool slot / nothing came back in time.
SEND_ERRORS = (httpcore2.NetworkError, httpcore2.ProtocolError, httpcore2.TimeoutException)
Refused = httpcore2.ConnectError
Headers = list[tuple[bytes, bytes]]


class Upstream:
    """Keep-alive connections to one engine (opened on demand, closed by ``aclose``)."""

    def __init__(self, spec: EngineSpec, config: RouterConfig, *,
                 max_connections: int = 256) -> None:
        self.pool = httpcore2.AsyncConnectionPool(
            max_connections=max_connections, max_keepalive_connections=32,
            keepalive_expiry=4.0)
        host = f"[{spec.host}]" if ":" in spec.host else spec.host
        self._host = spec.host.encode("idna")
        self._port = spec.port
        self._host_header = (b"host", f"{host}:{spec.port}".encode("idna"))
        self._auth = ((b"authorization", f"Bearer {spec.api_key}".encode()),) \
            if spec.api_key else ()
        self._extensions: dict[str, Any] = {"timeout": {
            "connect": config.connect_timeout_s, "read": None, "write": 60.0,
            "pool": config.first_byte_timeout_s}}

    async def send(self, path: str, query: bytes, headers: Headers, body: bytes
                   ) -> httpcore2.Response:
        """POST ``body``; returns once the answer's head is in (its body is a stream).

        Adds Host, Content-Length and the engine's API key (never the user's token).
        """
        target = path.encode() + (b"?" + query if query else b"")
        request = httpcore2.Request(
            b"POST", httpcore2.URL(scheme=b"http", host=self._host, port=self._port,
                                   target=target),
            headers=[self._host_header, *headers, *self._auth,
                     (b"content-length", b"%d" % len(body))],
            content=body, extensions=self._extensions)
        return await self.pool.handle_async_request(request)

    async def aclose(self) -> None:
        await self.pool.aclose()
