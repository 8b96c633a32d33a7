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
  (connection refused); never once bytes were sent. (A reused connection the engine had
  closed is sent again on a new one by ``upstream``, when nothing of the answer came.)
"""

from __future__ import annotations

import logging
import random
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import AsyncExitStack
from functools import partial
from typing import NamedTuple

import httpcore2
import msgspec
import trio

from nvpair.base.boundary import Part
from nvpair.base.decoding import decode_json
from nvpair.base.logformat import About, about
from nvpair.base.streams import close_early
from nvpair.config.settings import ActivationConfig, EngineSpec, RouterConfig
from nvpair.errors import NvpairError
from nvpair.http.asgi import (
    FORWARDED_BY,
    BodyTooLarge,
    Receive,
    Scope,
    Send,
    encoder,
    error_doc,
    header,
    read_body,
    send_error,
    send_wrong_method,
)
from nvpair.http.keys import request_key
from nvpair.router.activation import (
    ActivationRecord,
    Activator,
    QueueFull,
    Ticket,
    Unavailable,
)
from nvpair.router.models import ModelSlots
from nvpair.router.peering import PeerRoute, PeerRouter
from nvpair.router.request import ID_MAX, Routed, current
from nvpair.router.select import Known, choose, order_peers
from nvpair.router.tracing import RequestTrace, Tracer
from nvpair.router.upstream import BODY_ERRORS, SEND_ERRORS, Refused, Upstream
from nvpair.runtime import wakes
from nvpair.state.snapshot import ASLEEP_STATES, Board
from nvpair.state.traffic import Traffic, peer_key
from nvpair.supervision.sleeper import Sleepers

ROUTED_PATHS = frozenset({
    "/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses",
    "/v1/rerank", "/v1/score",
})
#: request headers passed to the engine (others, authorization included, are not);
#: W3C trace context passes through, so an engine's spans join the client's trace.
FORWARD_REQUEST = frozenset({b"content-type", b"accept", b"accept-encoding", b"user-agent",
                             b"openai-organization", b"x-request-id", b"traceparent",
                             b"tracestate"})
#: response headers never passed back (hop-by-hop, or set by our server).
DROP_RESPONSE = frozenset({b"connection", b"keep-alive", b"proxy-authenticate",
                           b"proxy-authorization", b"te", b"trailer", b"transfer-encoding",
                           b"upgrade", b"server", b"date"})


class RequestHead(msgspec.Struct):
    model: str | None = None


_head = msgspec.json.Decoder(RequestHead)
log = logging.getLogger("nvpair.router")
#: how often idle pools are closed (engines close idle connections themselves, llama-server
#: after 5 s; a pool keeps its end of each until it is next used, in CLOSE-WAIT)
REAP_EVERY_S = 2.0


def json_body(scope: Scope) -> bool:
    """The request says its body is JSON (``application/json``, any parameters)."""
    value = header(scope, b"content-type")
    if value is None:
        return False
    return value.partition(b";")[0].strip().lower() == b"application/json"


class Result:
    """How a relayed request ended, for passive health."""

    def __init__(self) -> None:
        self.outcome = "failed"
        self.error: str | None = None
        self.done = False
        #: for /metrics: the status sent to the client (None: none yet), and when
        self.status: int | None = None
        routed = current()  # (from the request's arrival: a wait in a queue included)
        self.started = trio.current_time() if routed is None else routed.arrived
        self.first_byte_at: float | None = None

    def finish(self, outcome: str, error: str | None) -> None:
        self.outcome, self.error, self.done = outcome, error, True


class Target(NamedTuple):
    """Where one attempt goes: a local engine, or a peer node that serves the model."""

    key: str  # traffic counters: the engine's name, or "peer NODE"
    what: str  # for messages: "engine e1", "node b"
    upstream: Upstream
    label: tuple[bytes, bytes]  # added to the answer: x-nvpair-engine or x-nvpair-node
    extra: tuple[tuple[bytes, bytes], ...] = ()  # added to the request
    node: str | None = None  # a peer's node name (None: a local engine)


class BadRequest(NvpairError):
    """The request body is not what the router can route (one line, for the 400)."""


class EngineGone(NvpairError):
    """The engine's answer stopped: it closed, reset or fell silent past the idle gap."""


#: the most of a multi-model engine's control answer read (its model list: about 600 bytes
#: a model)
CONTROL_BODY_MAX = 4 * 1024 * 1024


class Router:
    """Serves ROUTED_PATHS. Run ``run()`` in the service nursery: it owns the pools."""

    def __init__(self, board: Board, engines: Iterable[EngineSpec], config: RouterConfig,
                 traffic: Traffic, *, node: str = "nvpair", peers: PeerRouter | None = None,
                 cluster_token: str | None = None, activator: Activator | None = None,
                 sleepers: Sleepers | None = None, queue: ActivationConfig | None = None,
                 tracer: Tracer | None = None) -> None:
        self.board = board
        #: traces of routed requests (docs/observability.md); None: off
        self.tracer = tracer
        #: engines' wake (docs/sleep.md): a sleeping vLLM is woken before a request
        self.sleepers = sleepers
        #: engines on demand (nvpair.router.activation); None: none configured
        self.activator = activator
        #: the boundary of the router's own tasks: the reaper and the closing of pools
        self._pools = Part("router: connection pools", logger=log)
        self.node = node
        self.peers = peers
        self.cluster_token = cluster_token
        self.specs = {e.name: e for e in engines}
        self.config = config
        self.traffic = traffic
        self.known = Known(engines)
        #: multi-model engines' slots: never evict a model with requests in flight
        #: (whose requests waiting for a slot have ``queue``'s limits, as a queue has)
        self.models = ModelSlots(board, {name: spec.manifest.startup_budget_s
                                         for name, spec in self.specs.items()}, queue=queue)
        self.rng = random.Random()
        self._targets: dict[str, Target] = {}
        self._stack: AsyncExitStack | None = None
        self._nursery: trio.Nursery | None = None

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Own the engines' and peers' connection pools until cancelled.

        Started value: None, once requests may be routed (a request before it, or after
        the end, is a RuntimeError). Every ``REAP_EVERY_S`` the pools no request uses are
        closed. Cancellation closes every pool (shielded, at most 2 s), after the requests
        using them have ended (the service cancels it last). Raises: nothing but
        Cancelled."""
        async with AsyncExitStack() as stack, trio.open_nursery() as nursery:
            self._stack, self._nursery = stack, nursery
            stack.push_async_callback(self._close_all)
            self.models.attach(nursery, self._control)  # (its model lists read again)
            task_status.started()
            try:
                ticker = wakes.Ticker(REAP_EVERY_S)
                while True:
                    await ticker.tick()
                    with self._pools.guard():  # a bug here is the pools', not the node's
                        self.reap()
                        self._pools.ok()
            finally:
                self._stack = self._nursery = None
                self.models.attach(None, None)

    def reconfigure(self, engines: Iterable[EngineSpec], config: RouterConfig,
                    moved: Iterable[str]) -> None:
        """A reload: the engines as configured now and the router's settings. The pools of
        the engines in ``moved`` (restarted, removed: their address or key may differ) are
        retired, and every pool when ``config`` changed (its timeouts are the pool's);
        a request in flight keeps its own until it ends. Sync."""
        engines = tuple(engines)
        self.specs = {e.name: e for e in engines}
        self.known = Known(engines)
        self.models.load_budgets = {name: spec.manifest.startup_budget_s
                                    for name, spec in self.specs.items()}
        retired = set(moved)
        if config != self.config:
            self.config = config
            retired |= {key for key in self._targets if not key.startswith("peer ")}
        for key in retired:
            target = self._targets.pop(key, None)
            if target is not None:
                target.upstream.retired = True
                self._release(target.upstream)

    async def _close_all(self) -> None:
        targets, self._targets = list(self._targets.values()), {}
        with trio.CancelScope(shield=True), trio.move_on_after(2.0):
            for target in targets:
                await target.upstream.aclose()

    def reap(self) -> None:
        """Close the pools no request has used for ``REAP_EVERY_S`` (they are made again on
        the next request): those of idle engines, and of peers that left the peer table
        (nothing routes to them). An engine closes its idle keep-alive connections on its
        own (llama-server after 5 s); an unused pool would hold its end of each in
        CLOSE-WAIT until the next request or until nvpair stops. A pool in use prunes its
        own expired connections on each request."""
        now = trio.current_time()
        for key, target in list(self._targets.items()):
            upstream = target.upstream
            if upstream.users == 0 and now - upstream.used_at >= REAP_EVERY_S:
                del self._targets[key]
                upstream.retired = True
                self._release(upstream)

    def _target(self, pool_key: str, make: Callable[[], Target]) -> Target:
        """A target with its pool, made on first use and again after the reaper closed it
        (every pool closes when ``run`` ends)."""
        target = self._targets.get(pool_key)
        if target is None:
            if self._stack is None:
                raise RuntimeError("the router is not running")
            target = self._targets[pool_key] = make()
        return target

    def _engine(self, name: str) -> Target:
        spec = self.specs[name]
        return self._target(name, lambda: Target(
            name, f"engine {name}", Upstream.engine(spec, self.config),
            (b"x-nvpair-engine", name.encode())))

    def _peer(self, route: PeerRoute) -> Target | None:
        """The target of a peer, or None when its advert's URL cannot be used (a bad port,
        a broken IPv6 literal): the route is skipped, never a 500."""
        node = route.node
        token = route.token or self.cluster_token  # the peer's own, when one is configured
        key = f"peer {node}"
        old = self._targets.get(key)
        if old is not None and old.upstream.end != (route.url, token):
            del self._targets[key]  # the peer moved (or its token changed)
            old.upstream.retired = True
            self._release(old.upstream)
        try:
            return self._target(key, lambda: Target(
                peer_key(node), f"node {node}", Upstream(route.url, self.config, token=token),
                (b"x-nvpair-node", node.encode()), ((FORWARDED_BY, self.node.encode()),),
                node))
        except ValueError as exc:
            log.debug("node %s: its advertised URL %r cannot be used: %s", node, route.url, exc)
            return None

    def _release(self, upstream: Upstream) -> None:
        """Close a replaced pool once no request uses it (its idle connections would
        otherwise sit in CLOSE-WAIT until nvpair stops)."""
        if upstream.retired and upstream.users == 0 and self._nursery is not None:
            self._nursery.start_soon(self._close, upstream)

    async def _close(self, upstream: Upstream) -> None:
        """Close one pool inside the pools' boundary: an error while closing (a bug, or the
        transport's) is logged, and the router's nursery, so the service, goes on."""
        with self._pools.guard():
            await upstream.aclose()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Route one request under its id (``nvpair.router.request``): the id goes to the
        engine, back to the client and into every log line about it; then its access line."""
        request = Routed(scope)
        if self.tracer is not None:
            request.begin_trace(self.tracer, scope)
        entered, told = request.enter(), about.set(About(request.id))
        try:
            if request.replaced:
                log.debug("the client's x-request-id was not kept (empty, over %d "
                          "characters, or not printable ASCII)", ID_MAX)
            await self._route(request.scope(scope), receive, request.sender(send))
        finally:
            request.log_access()  # (if the answer's end did not: a client gone, a cut)
            request.end_trace()
            about.reset(told)
            Routed.leave(entered)

    async def _route(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["method"] != "POST":
            await send_wrong_method(send, "POST", scope["path"])
            return
        if not json_body(scope):
            await send_error(send, 415, f"POST {scope['path']} takes a JSON body: send "
                                        "Content-Type: application/json", "unsupported_media_type")
            return
        try:
            body = await read_body(receive, self.config.max_body_bytes)
        except BodyTooLarge:
            await send_error(send, 413, f"request body over {self.config.max_body_bytes} bytes",
                             "request_too_large")
            return
        try:  # any failure (nested past msgspec's depth too) is a one-line 400
            head: RequestHead = decode_json(body, "the request body", decoder=_head,
                                            error=BadRequest)
        except BadRequest as exc:
            await send_error(send, 400, str(exc), "invalid_json")
            return
        if not head.model:
            await send_error(send, 400, "the request names no model", "model_required")
            return
        if (routed := current()) is not None:
            routed.model = head.model
        key = request_key(scope)
        if key is None:
            await self._dispatch(scope, receive, send, body, head)
            return
        if routed is not None:
            routed.key = key.name
        refusal = key.admit(head.model, trio.current_time())  # its models and limits
        if refusal is not None:
            await send_error(send, refusal.status, refusal.message, refusal.code,
                             refusal.headers)
            return
        try:
            await self._dispatch(scope, receive, send, body, head)
        finally:
            key.release()

    async def _dispatch(self, scope: Scope, receive: Receive, send: Send, body: bytes,
                        head: RequestHead) -> None:
        """Route a request for ``head.model``: a local engine, a peer, or an on-demand
        engine's queue; else 503 (known, not ready) or 404."""
        assert head.model
        now = trio.current_time()
        choice = choose(self.board.current, head.model, self.traffic, self.known, now, self.rng)
        if (self.activator is not None and choice.engines
                and (self.activator.holds(choice.engines[0])  # behind those waiting for it
                     or self.activator.asleep(choice.engines[0]))):  # room first, then wake
            await self._queued(scope, receive, send, body, choice.engines[0], head.model)
            return
        targets = [self._engine(name) for name in choice.engines[:2]]
        reason, known = choice.reason, choice.known
        loadable: list[Target] = []  # peers that load the model for it: after our own
        if not targets and self.peers is not None and header(scope, FORWARDED_BY) is None:
            routes = self.peers.routes(head.model, now)
            others = list(routes.others)
            for found, ordered in ((targets, routes.ready), (loadable, routes.loadable)):
                for route in order_peers(ordered, self.traffic, now, self.rng):
                    target = self._peer(route)
                    if target is None:
                        others.append(f"node {route.node} advertises a URL that cannot be used")
                        continue
                    found.append(target)
                    if len(found) == 2:
                        break
            if others and not targets and not loadable:
                known = True
                reason = "; ".join(([reason] if choice.known and reason else [])
                                   + [f"no node serving {head.model!r} is ready: "
                                      + ", ".join(others)])
        if not targets and self.activator is not None:
            cold = self.activator.candidate(choice.owners)
            if cold is not None:  # hot nowhere: start it, wait in its queue
                await self._queued(scope, receive, send, body, cold, head.model)
                return
        if not targets and loadable:  # a peer's multi-model engine loads it for this one
            targets, known = loadable, True
        if not targets:
            if known:
                await send_error(send, 503, reason or "no engine ready", "engine_not_ready",
                                 [(b"retry-after", b"2")])
            else:
                await send_error(send, 404, f"The model `{head.model}` does not exist.",
                                 "model_not_found")
            return
        if choice.engines and (why := await self._woken(choice.engines[0])) is not None:
            await send_error(send, 503, why, "engine_not_ready", [(b"retry-after", b"5")])
            return
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_cancel_on_disconnect, receive, nursery.cancel_scope)
            # (a multi-model engine's request may wait here for a slot: docs/multi-model.md)
            held = choice.engines[0] if choice.engines else None
            try:
                async with self.models.held(held, head.model, self._control):
                    await self._forward(scope, body, targets, send, on_answer=partial(
                        self.models.answered, held, head.model))
            except QueueFull as exc:  # (waiting for a model slot: before anything was sent)
                await send_error(send, 429, str(exc), "queue_full", [(b"retry-after", b"5")])
            except Unavailable as exc:
                await send_error(send, 503, str(exc), "engine_not_ready",
                                 [(b"retry-after", b"5")])
            nursery.cancel_scope.cancel(reason="answer complete")

    async def _woken(self, name: str) -> str | None:
        """A sleeping engine that does not wake by itself for a request (vLLM answers 503
        while asleep) is woken first, one wake for every request waiting (docs/sleep.md):
        None once it is awake (or needs no wake), else why not."""
        e = self.board.current.engine(name)
        if (self.sleepers is None or e is None or e.state not in ASLEEP_STATES
                or self.sleepers.wakes_by_itself(name)):
            return None
        began = trio.current_time()
        why = await self.sleepers.awake(name)
        if (trace := _trace()) is not None:
            trace.span("wake", began, trio.current_time(), attrs=[("nvpair.engine", name)],
                       error=why)
        return None if why is None else f"engine {name} was asleep and did not wake: {why}"

    async def _control(self, name: str, path: str, model: str | None) -> tuple[int, bytes]:
        """POST ``{"model": model}`` to a multi-model engine's ``path``
        (``/models/load``, ``/models/unload``), or GET ``path`` with ``model`` None: its
        HTTP status and body (capped), (0, b"") when it did not answer in the first-byte
        timeout."""
        body = b"" if model is None else msgspec.json.encode({"model": model})
        upstream = self._engine(name).upstream
        upstream.users += 1  # (the reaper leaves a pool in use alone)
        try:
            with trio.move_on_after(self.config.first_byte_timeout_s):
                try:
                    response = await upstream.send(
                        path, b"", [(b"content-type", b"application/json")], body,
                        b"GET" if model is None else b"POST")
                except SEND_ERRORS:
                    return 0, b""
                data = b""
                stream = response.stream
                assert hasattr(stream, "__aiter__")
                try:
                    async for chunk in stream:
                        data += chunk
                        if len(data) > CONTROL_BODY_MAX:
                            break
                except BODY_ERRORS:
                    pass
                finally:
                    with trio.CancelScope(shield=True):
                        await response.aclose()
                return response.status, data
            return 0, b""
        finally:
            upstream.users -= 1
            upstream.used_at = trio.current_time()
            self._release(upstream)

    async def _queued(self, scope: Scope, receive: Receive, send: Send, body: bytes,
                      name: str, model: str) -> None:
        """Wait in the on-demand engine's queue (it starts once), then forward; nothing
        goes on the wire before the engine answers. A client that leaves leaves the queue."""
        assert self.activator is not None
        ticket: Ticket | None = None
        key, routed = request_key(scope), current()
        trace = None if routed is None else routed.trace
        waiting = None if trace is None else trace.start("queue", attrs=[
            ("nvpair.engine", name),
            ("nvpair.engine.priority", self.activator.specs[name].priority),
            ("nvpair.queue.position", len(self.activator.queue(name).waiting)),
            *([] if key is None else [("nvpair.key.priority", key.spec.priority)])])
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_cancel_on_disconnect, receive, nursery.cancel_scope)
            try:
                came, full = trio.current_time(), False
                failure: str | None = "the client went away"
                activation: ActivationRecord | None = None
                try:
                    try:
                        ticket = await self.activator.admit(
                            name, None if key is None else key.name,
                            0 if key is None else key.spec.priority)
                        failure, activation = None, ticket.activation
                    except QueueFull as exc:
                        full = True  # (refused at once: it never waited)
                        failure = str(exc)
                        raise
                    except Unavailable as exc:
                        failure, activation = str(exc), exc.activation
                        raise
                    finally:  # waited, whatever the end: its turn, a 503, the client gone
                        if not full:
                            self._waited(routed, trio.current_time() - came)
                        if trace is not None and waiting is not None:
                            trace.end(waiting, error=failure)
                            _trace_activation(trace, activation)
                except QueueFull as exc:
                    await send_error(send, 429, str(exc), "queue_full", [(b"retry-after", b"5")])
                except Unavailable as exc:
                    await send_error(send, 503, str(exc), "engine_not_ready",
                                     [(b"retry-after", b"5")])
                if key is not None:  # (for /metrics: the queue's wait, per key)
                    key.waited(trio.current_time() - came)
                why = None if ticket is None else await self._woken(name)
                if why is not None:
                    await send_error(send, 503, why, "engine_not_ready",
                                     [(b"retry-after", b"5")])
                elif ticket is not None:  # (its turn: to the engine it waited for)
                    await self._forward(scope, body, [self._engine(name)], send,
                                        on_start=ticket.started)
            finally:
                if ticket is not None:
                    ticket.leave()
            nursery.cancel_scope.cancel(reason="answer complete")

    def _waited(self, routed: Routed | None, seconds: float) -> None:
        """A request waited ``seconds`` in an on-demand queue: the histogram, its header."""
        self.traffic.queue_wait.observe(seconds)
        if routed is not None:
            routed.queue_s = seconds

    async def _forward(self, scope: Scope, body: bytes, targets: list[Target],
                       send: Send, *, on_start: Callable[[], None] | None = None,
                       on_answer: Callable[[int], None] | None = None) -> None:
        headers = [(k, v) for k, v in scope.get("headers", ()) if k in FORWARD_REQUEST]
        last_error = "no engine"
        for target in targets:  # held from now (the reaper leaves a pool with users alone)
            target.upstream.users += 1
        try:
            for target in targets:  # the first, and one retry if it never got the request
                if (routed := current()) is not None:
                    routed.engine = target.key
                trace = None if routed is None else routed.trace
                sent = [*headers, *target.extra]
                if trace is not None:  # the attempt's span is the parent the next hop sees
                    span, parent = trace.client(
                        "upstream" if target.node is None else "peer",
                        [("nvpair.engine", target.key)] if target.node is None
                        else [("nvpair.peer", target.node)])
                    sent = [(k, v) for k, v in sent if k != b"traceparent"]
                    sent.append((b"traceparent", parent))
                if (lines := about.get()) is not None:
                    lines.engine = target.key
                self.traffic.started(target.key)
                if on_start is not None:  # (counted in flight now: its queue's slot is this)
                    on_start()
                if self.activator is not None:
                    self.activator.used(target.key)  # (routed requests only, never probes)
                result = Result()
                try:
                    await self._relay(target, scope, sent, body, send, result)
                except Refused as exc:
                    result.outcome = "failed"
                    result.error = f"{target.what}: cannot connect: {exc}"
                    last_error = result.error
                    continue  # nothing reached the engine: the next one may take it
                except trio.Cancelled:
                    if not result.done:  # the client left before the answer was complete
                        result.outcome = "client_gone"
                    raise
                finally:
                    if trace is not None:
                        trace.end(span, error=result.error, attrs=[] if result.status is None
                                  else [("http.response.status_code", result.status)])
                    self.traffic.finished(target.key, result.outcome, result.error)
                    self.traffic.answered(target.key, result.status, result.started,
                                          result.first_byte_at)
                    if on_answer is not None and target.key == targets[0].key:
                        on_answer(result.status or 0)
                return
        finally:
            now = trio.current_time()
            for target in targets:
                if self.activator is not None:  # idle from the end of the last one; a slot
                    self.activator.ended(target.key)  # is free for the next in its queue
                target.upstream.users -= 1
                target.upstream.used_at = now
                self._release(target.upstream)
        await send_error(send, 503, f"no engine could take the request ({last_error})",
                         "engine_unreachable", [(b"retry-after", b"2")])

    async def _relay(self, target: Target, scope: Scope, headers: list[tuple[bytes, bytes]],
                     body: bytes, send: Send, result: Result) -> None:
        """Send the request and pass the answer to the client; the outcome goes in ``result``
        as soon as it is known (before cleanup, which a client leaving may interrupt)."""
        failed = None
        first_by = trio.current_time() + self.config.first_byte_timeout_s
        with trio.move_on_at(first_by) as first:
            try:
                response = await target.upstream.send(
                    scope["path"], scope.get("query_string", b""), headers, body)
            except Refused:
                raise
            except SEND_ERRORS as exc:
                failed = f"{target.what} failed before answering: {exc}"
        if failed is not None:  # answered outside the first-byte scope: one answer only
            result.finish("failed", failed)
            result.status = 502
            await send_error(send, 502, failed, "engine_error")
            return
        if first.cancelled_caught:
            result.finish("failed", f"{target.what} sent nothing within "
                                    f"{self.config.first_byte_timeout_s:g} s")
            result.status = 504
            await send_error(send, 504, result.error or "", "engine_timeout")
            return
        try:
            sse = False
            out = [target.label]
            for key, value in response.headers:
                key = key.lower()
                if key not in DROP_RESPONSE:
                    out.append((key, value))
                    sse = sse or (key == b"content-type"
                                  and value.startswith(b"text/event-stream"))
            result.status = response.status
            if sse and (routed := current()) is not None:
                routed.streamed = True
            await send({"type": "http.response.start", "status": response.status,
                        "headers": out})
            chunks = _Chunks(response, first_by, self.config)
            gone: EngineGone | None = None
            try:
                while (chunk := await chunks.next()) is not None:
                    if result.first_byte_at is None:
                        result.first_byte_at = trio.current_time()
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            except EngineGone as exc:
                gone = exc
            finally:
                await chunks.aclose()
            if gone is None:
                result.finish(answer_outcome(response.status), None)
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                return
            result.finish("failed", f"{target.what}: {gone}")
            if not sse:  # a plain body: end without its end, so the client sees it cut
                return  # (hypercorn closes a connection whose answer did not finish)
            # An SSE client can tell: an error event, and never [DONE].
            doc = error_doc(502, result.error or "", "engine_error")
            await send({"type": "http.response.body", "more_body": False,
                        "body": b"data: " + encoder.encode(doc) + b"\n\n"})
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(2.0):
                await response.aclose()


class _Chunks:
    """The raw body chunks as they come (no async generator: it is always closed here).

    Until the first chunk, the wait is bounded by the first-byte deadline (an engine may
    send its headers at once and its first token after prefill or a queue); after it,
    only by the idle gap between chunks."""

    def __init__(self, response: httpcore2.Response, first_by: float,
                 config: RouterConfig) -> None:
        stream = response.stream
        assert hasattr(stream, "__aiter__")
        self._raw: AsyncIterator[bytes] = stream.__aiter__()
        self._first_by: float | None = first_by
        self._first_s = config.first_byte_timeout_s
        self._idle_s = config.idle_timeout_s
        self._ended = False

    async def next(self) -> bytes | None:
        """The next non-empty chunk, None at the end; EngineGone on a cut or a long silence."""
        while True:
            deadline = (trio.current_time() + self._idle_s if self._first_by is None
                        else self._first_by)
            with trio.move_on_at(deadline) as idle:
                try:
                    chunk = await self._raw.__anext__()
                except StopAsyncIteration:
                    self._ended = True
                    return None
                except BODY_ERRORS as exc:
                    raise EngineGone(f"the engine cut the answer ({exc})") from None
            if idle.cancelled_caught:
                if self._first_by is not None:
                    raise EngineGone(f"no data from the engine within {self._first_s:g} s "
                                     "(first_byte_timeout_s)")
                raise EngineGone(f"no data from the engine for {self._idle_s:g} s")
            if chunk:
                self._first_by = None
                return chunk

    async def aclose(self) -> None:
        if not self._ended:  # read to the end: every generator below has finished already
            await close_early(self._raw)


def _trace() -> RequestTrace | None:
    """The trace of the request the calling task routes (None: none, or not traced)."""
    routed = current()
    return None if routed is None else routed.trace


def _trace_activation(trace: RequestTrace, record: ActivationRecord | None) -> None:
    """The spans of the activation a request waited for, and of the evictions it made
    (one that goes on after the request left ends in its span now)."""
    if record is None:
        return
    attrs: list[tuple[str, str | int | float | bool]] = [
        ("nvpair.engine", record.engine), ("nvpair.activation", "start")]
    if record.startup_s is not None:
        attrs.append(("nvpair.engine.startup_s", round(record.startup_s, 3)))
    ended = trio.current_time() if record.ended is None else record.ended
    span = trace.span("activation", record.began, ended, attrs=attrs, error=record.failure)
    for ev in record.evictions:
        trace.span("eviction", ev.began, ev.ended, parent=span, attrs=[
            ("nvpair.engine", ev.victim), ("nvpair.eviction.in_flight", ev.in_flight),
            *([] if ev.footprint is None else [("nvpair.eviction.bytes", ev.footprint)])])


def answer_outcome(status: int) -> str:
    """What a complete answer says of the engine: a 5xx counts against it; a 4xx (the
    request refused: a bad request, a wrong key, 429 too busy) is no proof of health
    either way; anything below 400 is."""
    if status >= 500:
        return "failed"
    return "rejected" if status >= 400 else "ok"


async def _cancel_on_disconnect(receive: Receive, scope: trio.CancelScope) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            scope.cancel(reason="the client went away")
            return
