"""nvpair's HTTP API. Reads serve the latest snapshot: no lock, never a wait on another
reader's work, never a call to an engine; no await before the answer is encoded, but for
a ``/v1/models`` build, which yields to the loop at checkpoints while it reads the one
version it took (``nvpair.state.listing``). Encoded bodies are cached per snapshot version, and
the model lists per listing version."""

from __future__ import annotations

import contextlib
import hmac
import ipaddress
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple, Protocol
from urllib.parse import parse_qs

import trio

from nvpair.base.decoding import is_digits
from nvpair.base.logs import EngineLog, Lines
from nvpair.http import sse, views
from nvpair.http.asgi import (
    FORWARDED_BY,
    JSON,
    Message,
    Mount,
    Receive,
    Scope,
    Send,
    bearer,
    encoder,
    header,
    lifespan,
    send_bytes,
    send_error,
    send_json,
    send_wrong_method,
)
from nvpair.http.keys import KEY, Key, Keyring, request_key, route_kind
from nvpair.http.metrics import CONTENT_TYPE, Metrics
from nvpair.state.events import Journal
from nvpair.state.listing import ModelsBody
from nvpair.state.snapshot import Board, Snapshot

log = logging.getLogger("nvpair.api")

#: Ages in cached answers are at most this old; the cache also turns over with each version.
AGE_RESOLUTION_S = 0.5
#: pieces of an answer this large are sent as they are, never joined (see models_chunks)
CHUNK_BYTES = 256 * 1024


async def send_chunks(send: Send, status: int, chunks: Sequence[bytes]) -> None:
    """A JSON answer sent in pieces (one Content-Length; the bytes as if sent at once)."""
    headers = [*JSON, (b"content-length", str(sum(map(len, chunks))).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    for chunk in chunks[:-1]:
        await send({"type": "http.response.body", "body": chunk, "more_body": True})
    await send({"type": "http.response.body", "body": chunks[-1] if chunks else b""})


def _chunked(parts: Sequence[bytes]) -> list[bytes]:
    """``{"object":"list","data":[`` the parts, comma-separated ``]}``, in pieces: the
    small parts between two large ones joined, each large part (CHUNK_BYTES or more) a
    piece of its own (never copied)."""
    opening = b'{"object":"list","data":['
    chunks: list[bytes] = []
    start = 0
    for i in [i for i, part in enumerate(parts) if len(part) >= CHUNK_BYTES]:
        run = parts[start:i]
        chunks += ((opening if start == 0 else b",") + b",".join(run) + (b"," if run else b""),
                   parts[i])
        start = i + 1
    rest = parts[start:]
    if start == 0:
        chunks.append(opening + b",".join(rest) + b"]}")
    else:
        chunks.append((b"," + b",".join(rest) if rest else b"") + b"]}")
    return chunks


class Controller(Protocol):
    """The write side (lifecycle), when there is one. Its methods never block a read."""

    async def command(self, name: str, action: str) -> tuple[int, dict[str, Any]]: ...

    async def wake_model(self, model: str) -> tuple[int, dict[str, Any]]: ...

    def log(self, name: str) -> EngineLog | None: ...


class ClusterView(Protocol):
    """Peers' models, kept in memory by the peers broker (never fetched on a read)."""

    @property
    def version(self) -> int: ...

    def models(self, now: float) -> list[dict[str, Any]]:
        """OpenAI model items of every listed peer, each with an ``nvpair`` object."""
        ...


class Api:
    """The ASGI app of nvpair's HTTP API: ``/healthz``, ``/v1/models``, ``/v1/engines`` and
    the mounts (router, peers, ``/v1/router``), behind the keys' bearer tokens (``keys``,
    or one admin ``token``) or, without any, the browser checks (``browser_refusal``).

    Reads take ``board.current`` once and answer from it, never waiting on another reader
    (a large ``/v1/models`` is built in steps of the loop, from the version it took at its
    start); writes go to
    the ``controller``. Any exception while answering is a 500 for that request (logged
    with its traceback), never the server's."""

    def __init__(self, board: Board, *, node: str, token: str | None = None,
                 controller: Controller | None = None, mounts: Sequence[Mount] = (),
                 cluster: ClusterView | None = None, cluster_token: str | None = None,
                 allowed_hosts: Iterable[str] = (), events: Journal | None = None,
                 metrics: Metrics | None = None, spec: bytes | None = None,
                 keys: Keyring | None = None) -> None:
        self.board = board
        #: ``GET /openapi.json``: this API's OpenAPI document (nvpair.openapi; none: 404)
        self.spec = spec
        #: ``/metrics`` (none: 404); every answer is counted by (route, code) in ``requests``
        self.metrics = metrics
        self.requests: dict[tuple[str, int], int] = metrics.api if metrics else {}
        #: the change journal of GET /v1/events and the long-poll (nvpair.state.events)
        self.events = events
        self.node = node
        #: who may ask: every key's token and role (None, or none in it: no token, this
        #: machine only); a reload may give an empty ring keys, or take them all away
        self.keys = Keyring.single(token) if token and (keys is None or not keys.on) else keys
        self.cluster_token = cluster_token.encode() if cluster_token else None
        #: names besides loopback that mean this machine (``allowed_hosts``), lower-case
        self.allowed_hosts = frozenset(h.lower() for h in allowed_hosts)
        self.controller = controller
        self.mounts = tuple(mounts)
        self.cluster = cluster
        self._cache: dict[str, tuple[tuple[int, int], int, bytes]] = {}
        self._chunks: dict[str, tuple[tuple[int, int], int, tuple[bytes, ...]]] = {}
        #: the listing versions whose next bucket a reader is building now, per key
        self._building: dict[str, tuple[int, int]] = {}
        #: the lists of keys with model patterns, by (key name, cluster scope)
        self._key_chunks: dict[tuple[str, bool],
                               tuple[tuple[int, int], int, tuple[bytes, ...]]] = {}
        #: this node's /v1/models, encoded per engine (see nvpair.state.listing)
        self._models = ModelsBody(node)

    def cached(self, key: str, build: Callable[[Snapshot, float], object]) -> bytes:
        snap = self.board.current
        now = trio.current_time()
        version = (snap.version, self.cluster.version if self.cluster else 0)
        bucket = int(now / AGE_RESOLUTION_S)
        hit = self._cache.get(key)
        if hit is not None and hit[0] == version and hit[1] == bucket:
            return hit[2]
        body = encoder.encode(build(snap, now))
        self._cache[key] = (version, bucket, body)
        return body

    async def models_chunks(self, cluster: bool) -> tuple[bytes, ...]:
        """``/v1/models`` as the pieces it is sent in, cached per listing version and age
        bucket: probe counters do not re-encode it, and a changed engine re-encodes only its
        own items. An engine's part of 256 KiB or more stays a piece of its own, so a list
        of tens of MB is never copied into one buffer on the event loop.

        On a miss the reader builds it, in steps of the loop
        (``ModelsBody.parts_stepwise``), from the one catalog version it took at the
        start; it never waits for another reader's build. A reader that misses while
        another reader builds the very answer it needs (this listing version, this or the
        next age bucket) answers the newest whole body there is, at once: the listing as
        it was one build ago (milliseconds), its ages at most a bucket older. Without that,
        eight clients at a listing's change or a bucket's turn made eight builds of the
        same bytes (at K = 1,024 the p99 over the floor went from 1.5x to 2.2x). A reader
        that finds no one building its listing builds it. A build of an older version
        never replaces a newer one in the cache."""
        now = trio.current_time()
        version = (self.board.listed(now),
                   self.cluster.version if cluster and self.cluster else 0)
        bucket = int(now / AGE_RESOLUTION_S)
        key = "cluster-models" if cluster else "models"
        hit = self._chunks.get(key)
        if hit is not None and ((hit[0] == version and hit[1] == bucket)
                                or self._building.get(key) == version):
            return hit[2]
        self._building[key] = version
        try:
            # ages as at the start of the bucket (so at most AGE_RESOLUTION_S old, as
            # before): an engine neither changed nor probed since the last answer is not
            # joined again
            parts = await self._models.parts_stepwise(self.board, now,
                                                      ages_at=bucket * AGE_RESOLUTION_S)
        finally:
            if self._building.get(key) == version:
                del self._building[key]
        if cluster and self.cluster is not None and (peers := self.cluster.models(now)):
            parts.append(encoder.encode(peers)[1:-1])
        body = tuple(_chunked(parts))
        cached = self._chunks.get(key)
        if cached is None or (cached[0], cached[1]) <= (version, bucket):
            self._chunks[key] = (version, bucket, body)
        return body

    async def key_models_chunks(self, key: Key, cluster: bool) -> tuple[bytes, ...]:
        """``/v1/models`` as ``key`` sees it: the items its model patterns match, cached
        per key, listing version and age bucket (built from the catalog by the reader, as
        ``models_chunks``)."""
        now = trio.current_time()
        version = (self.board.listed(now),
                   self.cluster.version if cluster and self.cluster else 0)
        bucket = int(now / AGE_RESOLUTION_S)
        hit = self._key_chunks.get((key.name, cluster))
        if hit is not None and hit[0] == version and hit[1] == bucket:
            return hit[2]
        parts = await self._models.parts_where(self.board, now, key.sees,
                                               ages_at=bucket * AGE_RESOLUTION_S)
        if cluster and self.cluster is not None and (peers := [
                item for item in self.cluster.models(now) if key.sees(str(item.get("id")))]):
            parts.append(encoder.encode(peers)[1:-1])
        body = tuple(_chunked(parts))
        cached = self._key_chunks.get((key.name, cluster))
        if cached is None or (cached[0], cached[1]) <= (version, bucket):
            self._key_chunks[(key.name, cluster)] = (version, bucket, body)
        return body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        counts, path, mounts = self.requests, scope["path"], self.mounts

        async def counted(message: Message) -> None:  # per (route, code), for /metrics
            if message["type"] == "http.response.start":
                key = (route_label(path, mounts), message["status"])
                counts[key] = counts.get(key, 0) + 1
            await send(message)

        try:
            await self.route(scope, receive, counted)
        except Exception:
            log.exception("error answering %s %s", scope.get("method"), scope.get("path"))
            # If the answer had begun, the server refuses a second one: it then ends cut,
            # which the client sees (no per-message bookkeeping on the hot path for this).
            with contextlib.suppress(Exception):
                await send_error(counted, 500, "internal error in nvpair; see its log",
                                 "internal_error")

    async def route(self, scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope["path"]
        method: str = scope["method"]
        if path == "/healthz":
            await send_json(send, 200, {"status": "ok", "node": self.node})
            return
        if path == "/openapi.json" and self.spec is not None:  # (no data in it: no token)
            if method != "GET":
                await send_wrong_method(send, "GET", "/openapi.json")
                return
            await send_bytes(send, 200, self.spec)
            return
        mount = next((m for m in self.mounts if m.matches(path)), None)
        if mount is not None and mount.own_auth:
            await mount.handler(scope, receive, send)
            return
        if self.keys is not None and self.keys.on:
            key = self.keys.identify(bearer(scope))
            if key is None:
                if not self._peer_forwarded(scope, mount):
                    await send_error(send, 401, "missing or wrong bearer token",
                                     "invalid_api_key", [(b"www-authenticate", b"Bearer")])
                    return
            else:
                kind = route_kind(method, path, mount is not None and mount.routed)
                if not key.may(kind):
                    await send_error(send, 403, f"key {key.name!r} (role {key.role}) may not "
                                                f"{KIND_WORDS[kind]}", "forbidden_role")
                    return
                scope[KEY] = key
        elif not self._peer_forwarded(scope, mount):
            # No token: anyone who can reach the port is trusted, so only this machine's own
            # programs may: not a web page that rebinds a name to 127.0.0.1, nor one posting
            # cross-site (docs/api.md, "Browsers and cross-site requests").
            refusal = browser_refusal(scope, self.allowed_hosts)
            if refusal is not None:
                await send_error(send, 403, refusal[1], refusal[0])
                return
        if path == "/metrics" and self.metrics is not None:
            if method != "GET":
                await send_wrong_method(send, "GET", "/metrics")
                return
            await send_bytes(send, 200, self.metrics.body(), [(b"content-type", CONTENT_TYPE)])
            return
        parts = path.rstrip("/").split("/")
        if path in ("/v1/models", "/v1/cluster/models"):
            if method != "GET":
                await send_wrong_method(send, "GET", path)
                return
            query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
            cluster = path == "/v1/cluster/models" or "cluster" in query.get("scope", ())
            key = request_key(scope)
            await send_chunks(send, 200, await (
                self.models_chunks(cluster) if key is None or key.spec.models is None
                else self.key_models_chunks(key, cluster)))
            return
        if (path.startswith("/v1/models/") and path.endswith(WAKE)
                and len(path) > len("/v1/models/") + len(WAKE) and method != "GET"):
            # (a GET there retrieves a model whose id ends in /wake; ids may hold slashes)
            if method != "POST":
                await send_wrong_method(send, "GET, POST", path)
                return
            await self.model_wake_route(send, path[len("/v1/models/"):-len(WAKE)])
            return
        if len(parts) >= 4 and parts[:3] == ["", "v1", "models"] and path != "/v1/models/":
            await self.model_route(scope, send, path.removeprefix("/v1/models/"),
                                   request_key(scope))
            return
        if path.rstrip("/") == "/v1/engines":
            if method != "GET":
                await send_wrong_method(send, "GET", "/v1/engines")
                return
            await self.engines_route(scope, send)
            return
        if path == "/v1/events" and self.events is not None:
            await sse.serve_events(self.events, scope, receive, send)
            return
        if len(parts) >= 4 and parts[:3] == ["", "v1", "engines"]:
            await self.engine_route(scope, receive, send, parts[3], parts[4:])
            return
        if mount is not None:
            await mount.handler(scope, receive, send)
            return
        await send_error(send, 404, f"no route {method} {path}", "not_found")

    async def engines_route(self, scope: Scope, send: Send) -> None:
        """``GET /v1/engines``; with ``?after=SEQ&wait_s=S``, answers when the events' seq
        (the answer's ``seq``) has moved past ``SEQ``, or at ``S`` seconds as it is."""
        journal = self.events
        if journal is not None:  # the seq of the content answered (its task may not have
            # run since the board changed: the answer showed a change its seq did not
            # count, and a long-poll after that seq woke at once for what it had)
            journal.refresh(trio.current_time())
        if journal is not None and scope.get("query_string"):
            try:
                after, wait_s = engines_query(
                    parse_qs(scope["query_string"].decode("latin-1")))
            except ValueError as exc:
                await send_error(send, 400, str(exc))
                return
            if after is not None and after == journal.seq and wait_s:
                with trio.move_on_after(wait_s):
                    await journal.changes.wait_changed(after)
        body = self.cached("engines", lambda s, n: views.engines_doc(s, n, self.node))
        if journal is not None:  # the seq to wait after next (the body is cached without)
            body = b'%s,"seq":%d,"boot_id":"%s"}' % (body[:-1], journal.seq,
                                                     journal.boot_id.encode())
        await send_bytes(send, 200, body)

    async def model_route(self, scope: Scope, send: Send, model: str,
                          key: Key | None = None) -> None:
        """OpenAI's retrieve-model: the item ``GET /v1/models`` lists for ``model`` (ids may
        hold slashes: ``org/name``); 404 for a model ``key``'s patterns do not match."""
        if scope["method"] != "GET":
            await send_wrong_method(send, "GET", scope["path"])
            return
        item = (None if key is not None and not key.sees(model)
                else self._models.item(self.board, trio.current_time(), model))
        if item is None:
            await send_error(send, 404, f"The model `{model}` does not exist.",
                             "model_not_found")
            return
        await send_json(send, 200, item)

    async def model_wake_route(self, send: Send, model: str) -> None:
        """``POST /v1/models/{model}/wake`` (docs/sleep.md): 202 with the status of the
        engine that serves it and the operation, 409 with why not, 404 for a model no
        engine here lists."""
        if self.controller is None:
            await send_error(send, 503, "this nvpair has no lifecycle controller")
            return
        status, doc = await self.controller.wake_model(model)
        await send_json(send, status, doc)

    async def engine_route(self, scope: Scope, receive: Receive, send: Send, name: str,
                           rest: list[str]) -> None:
        method = scope["method"]
        snap = self.board.current
        engine = snap.engine(name)
        if engine is None:
            await send_error(send, 404, f"no engine named {name!r}", "engine_not_found")
            return
        if not rest:
            if method != "GET":
                await send_wrong_method(send, "GET", f"/v1/engines/{name}")
                return
            now = trio.current_time()
            await send_json(send, 200, views.engine_status(engine, snap, now, self.node))
            return
        action = rest[0]
        if action in ENGINE_COMMANDS and len(rest) == 1:
            if method != "POST":
                await send_wrong_method(send, "POST", f"/v1/engines/{name}/{action}")
                return
            if self.controller is None:
                await send_error(send, 503, "this nvpair has no lifecycle controller")
                return
            status, doc = await self.controller.command(name, action)
            await send_json(send, status, doc)
            return
        if action == "logs" and len(rest) == 1:
            if method != "GET":
                await send_wrong_method(send, "GET", scope["path"])
                return
            await self.logs_route(scope, send, name)
            return
        await send_error(send, 404, f"no route {method} {scope['path']}", "not_found")

    async def logs_route(self, scope: Scope, send: Send, name: str) -> None:
        try:
            query = log_query(parse_qs(scope.get("query_string", b"").decode("latin-1")))
        except ValueError as exc:
            await send_error(send, 400, str(exc))
            return
        engine_log = self.controller.log(name) if self.controller else None
        if engine_log is None:
            await send_error(send, 404, f"engine {name!r} has no logs (it is not managed)",
                             "no_logs")
            return
        try:
            lines = await read_log(engine_log, query)
        except ValueError as exc:
            await send_error(send, 400, str(exc))
            return
        await send_chunks(send, 200, await log_page(name, lines))

    def _peer_forwarded(self, scope: Scope, mount: Mount | None) -> bool:
        """A request a peer passes on, with the cluster token, on a path peers route to."""
        if mount is None or not mount.peer_auth or self.cluster_token is None:
            return False
        given = bearer(scope)
        return (given is not None and header(scope, FORWARDED_BY) is not None
                and hmac.compare_digest(given, self.cluster_token))


#: what each kind of route is, for the 403 of a key whose role does not allow it
KIND_WORDS = {"read": "read status (a reader's or an admin's)",
              "use": "list or use models (a user's or an admin's)",
              "control": "control engines or groups (an admin's)"}
#: routes counted under their own path; others by their shape (``route_label``)
FIXED_ROUTES = frozenset({"/healthz", "/openapi.json", "/metrics", "/v1/models",
                          "/v1/cluster/models", "/v1/engines", "/v1/events"})
#: the end of a model's wake route (``POST /v1/models/{model}/wake``; ids may hold slashes)
WAKE = "/wake"
#: the engine routes that ask the controller for something (POST)
ENGINE_COMMANDS = frozenset({"start", "stop", "restart", "drain", "wake", "sleep"})
ENGINE_ACTIONS = ENGINE_COMMANDS | {"logs"}
#: the reload of the config (an admin's POST; the service serves it: docs/lifecycle.md)
RELOAD_PATH = "/v1/admin/reload"


def route_label(path: str, mounts: Sequence[Mount] = ()) -> str:
    """The ``route`` label of a request's count: a fixed path, a shape
    (``/v1/engines/{name}/logs``), a mount's path or prefix, else ``other``, so neither
    engine names nor a client's made-up paths become series of their own."""
    if path in FIXED_ROUTES:
        return path
    if path.startswith("/v1/engines/"):
        rest = path[12:].rstrip("/").split("/")
        if len(rest) == 1:
            return "/v1/engines/{name}"
        return (f"/v1/engines/{{name}}/{rest[1]}" if len(rest) == 2 and rest[1] in ENGINE_ACTIONS
                else "other")
    if path.startswith("/v1/models/"):
        return "/v1/models/{model}/wake" if path.endswith(WAKE) else "/v1/models/{model}"
    for mount in mounts:
        if path in mount.paths:
            return path
        if mount.prefix is not None and path.startswith(mount.prefix):
            return f"{mount.prefix}*"
    return "other"


def local_host(host: str, allowed: frozenset[str]) -> bool:
    """``host`` (a Host header's or an Origin's, without the port) names this machine:
    a loopback address, ``localhost`` or a name from ``allowed_hosts``; a fully qualified
    name's trailing dot (``mybox.lan.``) names the same host."""
    host = host.lower()
    if host.endswith(".") and not host.endswith(".."):
        host = host[:-1]
    if host == "localhost" or host in allowed:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def split_authority(authority: str) -> str | None:
    """The host of ``host[:port]`` or ``[v6][:port]``; None when it is not that shape."""
    if authority.startswith("["):
        host, found, rest = authority[1:].partition("]")
        if not found:
            return None
    else:
        host, colon, port = authority.partition(":")
        rest = colon + port
    if rest and not (rest.startswith(":") and is_digits(rest[1:]) and len(rest) <= 6):
        return None
    return host or None


def browser_refusal(scope: Scope, allowed: frozenset[str]) -> tuple[str, str] | None:
    """(code, message) when a request may come from a web page that is not this machine's:
    a ``Host`` that is not a local name (DNS rebinding), an ``Origin`` that is not local
    (``null`` included) or ``Sec-Fetch-Site: cross-site`` (a cross-site request). None
    when it may be served. Programs other than browsers send none of these but ``Host``."""
    raw_host = header(scope, b"host")
    if raw_host is not None:
        text = raw_host.decode("latin-1")
        host = split_authority(text)
        if host is None or not local_host(host, allowed):
            return ("forbidden_host",
                    f"Host {text[:100]!r} is not this machine (loopback, localhost or "
                    "allowed_hosts): refused, as nvpair has no token_file")
    origin = header(scope, b"origin")
    if origin is not None:
        text = origin.decode("latin-1")
        scheme, sep, authority = text.partition("://")
        host = split_authority(authority) if sep and scheme in ("http", "https") else None
        if host is None or not local_host(host, allowed):
            return ("forbidden_origin",
                    f"Origin {text[:100]!r} is not a page of this machine: cross-site "
                    "request refused, as nvpair has no token_file")
    if header(scope, b"sec-fetch-site") == b"cross-site":
        return ("forbidden_origin", "a cross-site request (Sec-Fetch-Site: cross-site): "
                                    "refused, as nvpair has no token_file")
    return None


#: The longest a log read waits for a new line (``wait_s``).
LOG_WAIT_MAX_S = 30


def _whole(query: dict[str, list[str]], key: str, low: int, high: int) -> int | None:
    raw = query.get(key, [None])[0]
    if raw is None:
        return None
    if not is_digits(raw) or not low <= int(raw) <= high:
        raise ValueError(f"{key}: expected a whole number {low}-{high}, got {raw!r}")
    return int(raw)


def engines_query(query: dict[str, list[str]]) -> tuple[int | None, int]:
    """``?after=SEQ&wait_s=S`` of ``GET /v1/engines`` (the long-poll)."""
    return (_whole(query, "after", 0, 2**62),
            _whole(query, "wait_s", 0, LOG_WAIT_MAX_S) or 0)


class LogQuery(NamedTuple):
    tail: int | None
    after: int | None
    wait_s: int


def log_query(query: dict[str, list[str]]) -> LogQuery:
    """``?tail=N`` (default 100): the last lines. ``?after=N``: the lines numbered N and on
    (``next`` of the previous answer); with ``wait_s=S``, wait up to S seconds for one."""
    tail = _whole(query, "tail", 1, 100_000)
    after = _whole(query, "after", 0, 2**62)
    if tail is not None and after is not None:
        raise ValueError("tail and after: give one of them")
    return LogQuery(tail, after, _whole(query, "wait_s", 0, LOG_WAIT_MAX_S) or 0)


async def read_log(log: EngineLog, query: LogQuery) -> Lines:
    if query.after is None:
        return log.tail(100 if query.tail is None else query.tail)
    lines = log.after(query.after)
    if not lines.lines and query.wait_s:
        with trio.move_on_after(query.wait_s):
            await log.changes.wait_changed(log.changes.version)
        lines = log.after(query.after)
    return lines


#: The most bytes of lines one log answer holds (2,000 lines of 8,192 wide characters
#: are 32 MB); a client asks for the rest with ``after=`` the answer's ``next``.
LOG_PAGE_BYTES = 4 * 1024 * 1024
#: Encoded lines between two checkpoints while an answer is built, sent as one piece:
#: ~0.6 ms of encoding (2-byte characters: ~40 us a line of 8,000).
LOG_STEP_BYTES = 64 * 1024


async def log_page(name: str, lines: Lines, max_bytes: int = LOG_PAGE_BYTES) -> list[bytes]:
    """The answer to a log read, in pieces for ``send_chunks`` (never joined whole: a copy
    of 4 MB is ~2 ms): the first of ``lines`` that fit in ``max_bytes`` (one at least),
    encoded a line at a time, a checkpoint every ``LOG_STEP_BYTES``. ``next`` is the
    number of the first line left out when ``more`` (else the log's next line)."""
    pieces = [b'{"engine":' + encoder.encode(name) + b',"lines":[']
    group: list[bytes] = []
    size = step = count = 0
    for line in lines.lines:
        part = encoder.encode(line)
        if count and size + len(part) + 1 > max_bytes:
            break
        group.append(part)
        count += 1
        size += len(part) + 1
        step += len(part) + 1
        if step >= LOG_STEP_BYTES:
            pieces.append((b"," if len(pieces) > 1 else b"") + b",".join(group))
            group, step = [], 0
            await trio.lowlevel.checkpoint()
    if group:
        pieces.append((b"," if len(pieces) > 1 else b"") + b",".join(group))
    more = count < len(lines.lines)
    following = lines.first + count if more else lines.next
    pieces.append(b'],"first":%d,"next":%d,"missed":%d,"more":%s}' % (
        lines.first, following, lines.missed, b"true" if more else b"false"))
    return pieces
