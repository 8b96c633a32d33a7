"""The relay: one ASGI handler that passes an OpenAI request to an engine and its answer back.

* Bytes pass through untouched: the body is parsed once for ``model`` and forwarded as it
  came; the answer's chunks are sent to the client as they arrive, each flushed.
* The task that answers the client owns the upstream response from send to close. A
  client that goes away (before the first byte, mid-stream, or during a non-streaming
  answer) cancels it at once, which closes the engine connection.
* No total timeout: the first byte may take ``first_byte_timeout_s`` (prefill), then only
  an idle gap longer than ``idle_timeout_s`` ends a response, with an OpenAI-shaped error
  event and never ``[DONE]``. An engine that dies mid-stream ends it the same way.
* Retry on another engine only when the first provably never got the request
  (connection refused); never once bytes were sent.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterable
from contextlib import AsyncExitStack

import httpx2
import msgspec
import trio

from nvpair.asgi import (
    BodyTooLarge,
    Receive,
    Scope,
    Send,
    encoder,
    error_doc,
    read_body,
    send_error,
)
from nvpair.config import EngineSpec, RouterConfig
from nvpair.router.select import Known, choose
from nvpair.router.traffic import Traffic
from nvpair.snapshot import Board
from nvpair.streams import close_early
from nvpair.tls import client_tls

log = logging.getLogger("nvpair.router")

ROUTED_PATHS = frozenset({
    "/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses",
    "/v1/rerank", "/v1/score",
})
#: request headers passed to the engine (others, authorization included, are not).
FORWARD_REQUEST = frozenset({b"content-type", b"accept", b"accept-encoding", b"user-agent",
                             b"openai-organization", b"x-request-id"})
#: response headers never passed back (hop-by-hop, or set by our server).
DROP_RESPONSE = frozenset({"connection", "keep-alive", "proxy-authenticate",
                           "proxy-authorization", "te", "trailer", "transfer-encoding",
                           "upgrade", "server", "date"})


class RequestHead(msgspec.Struct):
    model: str | None = None
    stream: bool = False


_head = msgspec.json.Decoder(RequestHead)


class Result:
    """How a relayed request ended, for passive health."""

    def __init__(self) -> None:
        self.outcome = "failed"
        self.error: str | None = None
        self.done = False

    def finish(self, outcome: str, error: str | None) -> None:
        self.outcome, self.error, self.done = outcome, error, True


class EngineGone(Exception):
    """The engine's answer stopped: it closed, reset or fell silent past the idle gap."""


class Router:
    """Serves ROUTED_PATHS. Run ``open()`` in the service nursery: it owns the clients."""

    def __init__(self, board: Board, engines: Iterable[EngineSpec], config: RouterConfig,
                 traffic: Traffic) -> None:
        self.board = board
        self.specs = {e.name: e for e in engines}
        self.config = config
        self.traffic = traffic
        self.known = Known()
        for spec in self.specs.values():
            names = {*spec.aliases, *([spec.model] if spec.model else [])}
            if names:
                self.known.names[spec.name] = set(names)
        self.rng = random.Random()
        self._clients: dict[str, httpx2.AsyncClient] = {}
        self._stack: AsyncExitStack | None = None

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Own the engines' traffic clients until cancelled (then close them)."""
        async with AsyncExitStack() as stack:
            self._stack = stack
            task_status.started()
            try:
                await trio.sleep_forever()
            finally:
                self._stack = None
                self._clients.clear()

    async def _client(self, name: str) -> httpx2.AsyncClient:
        client = self._clients.get(name)
        if client is None:
            if self._stack is None:
                raise RuntimeError("the router is not running")
            spec = self.specs[name]
            cfg = self.config
            client = httpx2.AsyncClient(
                base_url=spec.url, trust_env=False, verify=client_tls(),
                timeout=httpx2.Timeout(connect=cfg.connect_timeout_s, read=None, write=60.0,
                                       pool=cfg.first_byte_timeout_s),
                limits=httpx2.Limits(max_connections=256, max_keepalive_connections=32,
                                     keepalive_expiry=4.0),
            )
            self._clients[name] = await self._stack.enter_async_context(client)
        return client

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["method"] != "POST":
            await send_error(send, 405, f"use POST {scope['path']}")
            return
        try:
            body = await read_body(receive, self.config.max_body_bytes)
        except BodyTooLarge:
            await send_error(send, 413, f"request body over {self.config.max_body_bytes} bytes",
                             "request_too_large")
            return
        try:
            head = _head.decode(body)
        except msgspec.DecodeError as exc:
            await send_error(send, 400, f"the body is not a valid OpenAI request: {exc}",
                             "invalid_json")
            return
        if not head.model:
            await send_error(send, 400, "the request names no model", "model_required")
            return
        now = trio.current_time()
        choice = choose(self.board.current, head.model, self.traffic, self.known, now, self.rng)
        if not choice.engines:
            if choice.known:
                await send_error(send, 503, choice.reason or "no engine ready", "engine_not_ready",
                                 [(b"retry-after", b"2")])
            else:
                await send_error(send, 404, f"The model `{head.model}` does not exist.",
                                 "model_not_found")
            return
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_cancel_on_disconnect, receive, nursery.cancel_scope)
            await self._forward(scope, body, choice.engines, send)
            nursery.cancel_scope.cancel(reason="answer complete")

    async def _forward(self, scope: Scope, body: bytes, engines: tuple[str, ...],
                       send: Send) -> None:
        headers = [(k, v) for k, v in scope.get("headers", ()) if k in FORWARD_REQUEST]
        last_error = "no engine"
        for name in engines[:2]:  # the first, and one retry if it never got the request
            spec = self.specs.get(name)
            if spec is None:
                continue
            request_headers = list(headers)
            if spec.api_key:
                request_headers.append((b"authorization", f"Bearer {spec.api_key}".encode()))
            client = await self._client(name)
            request = client.build_request("POST", scope["path"], content=body,
                                           headers=request_headers,
                                           params=scope.get("query_string", b"").decode())
            self.traffic.started(name)
            result = Result()
            try:
                await self._relay(client, request, name, send, result)
            except httpx2.ConnectError as exc:
                result.outcome, result.error = "failed", f"{name}: cannot connect: {exc}"
                last_error = result.error
                continue  # nothing reached the engine: the next one may take it
            except trio.Cancelled:
                if not result.done:  # the client left before the answer was complete
                    result.outcome = "client_gone"
                raise
            finally:
                self.traffic.finished(name, result.outcome, result.error)
            return
        await send_error(send, 503, f"no engine could take the request ({last_error})",
                         "engine_unreachable", [(b"retry-after", b"2")])

    async def _relay(self, client: httpx2.AsyncClient, request: httpx2.Request, name: str,
                     send: Send, result: Result) -> None:
        """Send ``request`` and pass the answer to the client; the outcome goes in ``result``
        as soon as it is known (before cleanup, which a client leaving may interrupt)."""
        with trio.move_on_after(self.config.first_byte_timeout_s) as first:
            try:
                response = await client.send(request, stream=True)
            except (httpx2.TimeoutException, httpx2.NetworkError, httpx2.RemoteProtocolError) \
                    as exc:
                if isinstance(exc, httpx2.ConnectError):
                    raise
                result.finish("failed", f"engine {name} failed before answering: {exc}")
                await send_error(send, 502, result.error or "", "engine_error")
                return
        if first.cancelled_caught:
            result.finish("failed", f"engine {name} sent nothing within "
                                    f"{self.config.first_byte_timeout_s:g} s")
            await send_error(send, 504, result.error or "", "engine_timeout")
            return
        try:
            headers = [(k.encode("latin-1"), v.encode("latin-1"))
                       for k, v in response.headers.multi_items() if k.lower() not in DROP_RESPONSE]
            headers.append((b"x-nvpair-engine", name.encode()))
            await send({"type": "http.response.start", "status": response.status_code,
                        "headers": headers})
            sse = response.headers.get("content-type", "").startswith("text/event-stream")
            chunks = _Chunks(response, self.config.idle_timeout_s)
            gone: EngineGone | None = None
            try:
                while (chunk := await chunks.next()) is not None:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            except EngineGone as exc:
                gone = exc
            finally:
                await chunks.aclose()
            if gone is None:
                result.finish("failed" if response.status_code >= 500 else "ok", None)
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                return
            result.finish("failed", f"engine {name}: {gone}")
            if not sse:
                raise gone  # a plain body: abort the connection so the truncation is visible
            # An SSE client can tell: an error event, and never [DONE].
            doc = error_doc(502, result.error or "", "engine_error")
            await send({"type": "http.response.body", "more_body": False,
                        "body": b"data: " + encoder.encode(doc) + b"\n\n"})
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(2.0):
                await response.aclose()


class _Chunks:
    """The raw body chunks as they come (no async generator: it is always closed here)."""

    def __init__(self, response: httpx2.Response, idle_s: float) -> None:
        self._raw = response.aiter_raw()
        self._idle_s = idle_s

    async def next(self) -> bytes | None:
        """The next non-empty chunk, None at the end; EngineGone on a cut or a long silence."""
        while True:
            with trio.move_on_after(self._idle_s) as idle:
                try:
                    chunk = await self._raw.__anext__()
                except StopAsyncIteration:
                    return None
                except (httpx2.NetworkError, httpx2.RemoteProtocolError) as exc:
                    raise EngineGone(f"the engine cut the answer ({exc})") from None
            if idle.cancelled_caught:
                raise EngineGone(f"no data from the engine for {self._idle_s:g} s")
            if chunk:
                return chunk

    async def aclose(self) -> None:
        await close_early(self._raw)


async def _cancel_on_disconnect(receive: Receive, scope: trio.CancelScope) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            scope.cancel(reason="the client went away")
            return
