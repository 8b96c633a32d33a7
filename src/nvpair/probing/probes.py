"""One probe request and what its answer means. No loops and no timeouts here: the loop that
owns a probe's policy applies its deadline (see prober.py)."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from types import TracebackType
from typing import Any, Protocol
from urllib.parse import urlsplit

import httpcore2
import httpx2
import msgspec
import trio

from nvpair.base.decoding import decode_json, excerpt, is_digits
from nvpair.base.streams import close_early
from nvpair.base.tls import client_tls
from nvpair.config.manifest import ModelsFormat, ProbeSpec
from nvpair.errors import ProbeError
from nvpair.probing.oneshot import ExchangeError, Target, encode_request, reason, send_request
from nvpair.state.snapshot import Identity, Model, ModelState

MAX_BODY = 4 * 1024 * 1024
#: at most this many models of one engine are listed; the rest are counted as left out.
MAX_MODELS = 10_000
#: what peers accept (src/nvpair/peers/advert.py: ids are ``Text``, 512 characters); a
#: longer id is left out, so one odd model never makes peers refuse the node's advert.
MAX_ID_CHARS = 512
#: the most slots an engine's identity answer is believed to have (llama-server's -np)
MAX_SLOTS = 65_536
#: ``owned_by`` is cut to this many characters (peers accept 512).
MAX_OWNER_CHARS = 128
INT64 = (-(2**63), 2**63 - 1)
#: how long a probe connection is kept open idle for the next probe: under the 5 s after
#: which uvicorn (vLLM, SGLang) and llama-server close an idle connection themselves. A
#: probe that comes back later than this asks the engine to close after answering
#: (``Connection: close``) instead of keeping a connection no probe will reuse.
KEEPALIVE_S = 4.0
#: C0 and C1 control characters, DEL, and the Unicode line and paragraph separators.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")


class Answer(msgspec.Struct, frozen=True):
    status: int
    body: bytes
    latency_ms: float


class Pool(Protocol):
    """What a probe client sends through: ``httpcore2.AsyncConnectionPool``'s one method
    (and its ``aclose``)."""

    async def handle_async_request(self, request: httpcore2.Request) -> httpcore2.Response: ...

    async def aclose(self) -> None: ...


class ProbeClient:
    """How one engine's probes reach it: a probe that comes back within KEEPALIVE_S goes
    through keep-alive connections on a bare httpcore2 pool; any other probe of a plain
    ``http://`` engine goes on a connection of its own (``nvpair.probing.oneshot``, ``target``),
    a third of the CPU of a pooled request that is closed after it.

    httpx2's ``AsyncClient`` merges URLs, builds header maps and wraps every body in more
    generators on each request: a probe cost about 355 µs of CPU on it against 248 µs on
    the pool underneath (and a client is 3.2 KB against 0.5 KB), at 1,000 engines a good
    part of the event loop. The pool is the part that carries the fix this project chose
    httpx2 for (no pool slot leaked when a request is cancelled; tests/test_http_client.py).

    ``transport``: an httpx2 transport to send through instead of sockets (tests use
    ``httpx2.MockTransport``); its errors become httpcore2's of the same name.
    """

    __slots__ = ("_extensions", "_headers", "_host", "_port", "_requests", "_scheme", "closed",
                 "pool", "target", "timeout_s")

    def __init__(self, url: str, *, timeout_s: float, max_connections: int = 4,
                 transport: httpx2.AsyncBaseTransport | None = None) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s)://HOST:PORT URL: {url!r}")
        self.pool: Pool = (
            httpcore2.AsyncConnectionPool(
                ssl_context=client_tls(), max_connections=max_connections,
                max_keepalive_connections=2, keepalive_expiry=KEEPALIVE_S)
            if transport is None else _Transported(transport))
        self.closed = False
        self._scheme = parts.scheme.encode()
        self._host = parts.hostname.encode("idna")
        self._port = parts.port or (443 if parts.scheme == "https" else 80)
        #: where one-shot probes connect (None: every probe goes through the pool, as
        #: for https or a test's transport)
        self.target = (Target(parts.hostname, self._port)
                       if transport is None and parts.scheme == "http" else None)
        self._headers = ((b"host", parts.netloc.rpartition("@")[2].encode("idna")),
                         (b"accept", b"*/*"), (b"user-agent", b"nvpair-probe"))
        self.timeout_s = timeout_s
        #: one-shot requests' bytes, made once per method, path and authorization (a
        #: probe's path and its fallback: a few entries)
        self._requests: dict[tuple[str, str, str | None], bytes] = {}
        self._extensions = {"timeout": dict.fromkeys(("connect", "read", "write", "pool"),
                                                     timeout_s)}

    async def send(self, method: str, path: str, auth: str | None, *,
                   keep_alive: bool = True) -> httpcore2.Response:
        """Send one request without a body; returns once the answer's head is in (close
        the answer with ``aclose``). ``keep_alive=False``: the connection is closed after
        this answer (``Connection: close``)."""
        headers = self.headers(method, auth)
        if not keep_alive:
            headers.append((b"connection", b"close"))
        request = httpcore2.Request(
            method.encode(), httpcore2.URL(scheme=self._scheme, host=self._host,
                                           port=self._port, target=path.encode()),
            headers=headers, extensions=self._extensions)
        return await self.pool.handle_async_request(request)

    def encoded(self, method: str, path: str, auth: str | None) -> bytes:
        """The bytes of a one-shot request (``Connection: close``), made once; raises
        ExchangeError("protocol") for a path or header HTTP does not allow."""
        key = (method, path, auth)
        request = self._requests.get(key)
        if request is None:
            request = self._requests[key] = encode_request(method, path,
                                                           self.headers(method, auth))
        return request

    def headers(self, method: str, auth: str | None) -> list[tuple[bytes, bytes]]:
        """The request's header fields (``Host`` first)."""
        headers = list(self._headers)
        if auth is not None:
            headers.append((b"authorization", auth.encode()))
        if method == "POST":
            headers.append((b"content-length", b"0"))
        return headers

    async def drop_idle(self) -> None:
        """Close the pool's connections when none is in use. A probe that goes on a
        connection of its own calls it: the connections of the probes before it (``ready``
        every 2 s while the engine loaded) would otherwise stay open for good, since no
        pooled request comes to reap them, and sit in CLOSE-WAIT once the engine closes
        its side."""
        pool = self.pool
        if not isinstance(pool, httpcore2.AsyncConnectionPool):
            return
        connections = pool.connections
        if connections and all(c.is_idle() for c in connections):
            with trio.CancelScope(shield=True):  # (closing sockets: nothing to wait for)
                await pool.aclose()  # (the pool stays usable: it only drops connections)

    async def aclose(self) -> None:
        self.closed = True
        await self.pool.aclose()

    async def __aenter__(self) -> ProbeClient:
        return self

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()


#: no answer: the engine refused, or broke the protocol, or timed out (httpx2 maps these
#: same httpcore2 errors to its own; the kinds and messages are those of before).
_FAILED = (httpcore2.NetworkError, httpcore2.ProtocolError, httpcore2.TimeoutException,
           httpcore2.ProxyError, httpcore2.UnsupportedProtocol)


async def request(client: ProbeClient, spec: ProbeSpec, path: str, *, api_key: str | None
                  ) -> Answer:
    """Send one probe request; raise ProbeError for no answer or an unexpected status.

    The connection is kept for the next probe only when it comes within KEEPALIVE_S (at
    1,024 engines, connections kept 4 s for a probe 5 s later were most of the objects
    the garbage collector walked)."""
    auth = f"Bearer {api_key}" if api_key and spec.needs_api_key else None
    if client.closed:
        raise ProbeError("error", "the engine's probe client is closed (engine stopping)")
    started = trio.current_time()
    if spec.interval_s > KEEPALIVE_S and client.target is not None:
        status, body = await _one_shot(client, client.target, spec.method, path, auth)
    else:
        status, body = await _pooled(client, spec, path, auth)
    latency_ms = (trio.current_time() - started) * 1000
    if status not in spec.expect_status:
        raise ProbeError(
            "status",
            f"{spec.method} {path} answered {status}{_excerpt(body)}",
            http_status=status,
        )
    return Answer(status=status, body=body, latency_ms=latency_ms)


async def _one_shot(client: ProbeClient, target: Target, method: str, path: str,
                    auth: str | None) -> tuple[int, bytes]:
    """The request on a connection of its own (closed after the answer); its failures as
    the pool's would be named. Bounded by the caller's deadline (every caller sets one)."""
    what = f"{method} {path}"
    await client.drop_idle()
    try:
        return await send_request(target, client.encoded(method, path, auth), method,
                                  max_body=MAX_BODY)
    except ExchangeError as exc:
        if exc.failure == "connect":
            raise ProbeError("refused", f"cannot connect: {exc}") from None
        if exc.failure == "too_big":
            raise ProbeError("error", f"{what} answered more than {MAX_BODY // 2**20} MiB"
                             ) from None
        name = {"write": "WriteError: ", "read": "ReadError: "}.get(exc.failure, "")
        raise ProbeError("error", f"{what}: {name or 'protocol error: '}{exc}") from None


async def _pooled(client: ProbeClient, spec: ProbeSpec, path: str, auth: str | None
                  ) -> tuple[int, bytes]:
    """The request through the pool's keep-alive connections."""
    # A generating request may have reached the engine even when the answer broke: it is
    # never sent twice.
    attempts = (1,) if generates(spec, path) else (1, 2)
    for attempt in attempts:
        try:
            response = await client.send(spec.method, path, auth,
                                         keep_alive=spec.interval_s <= KEEPALIVE_S)
            try:
                body = await _read_capped(response, f"{spec.method} {path}")
            finally:  # (the connection goes back to the pool, or is closed)
                with trio.CancelScope(shield=True):
                    await response.aclose()
        except httpcore2.ConnectError as exc:
            raise ProbeError("refused", f"cannot connect: {reason(exc)}") from None
        except httpcore2.RemoteProtocolError as exc:
            # A pooled keep-alive connection the engine closed just as we reused it: the
            # request never reached the engine, so one immediate retry is safe for a probe.
            if attempt < len(attempts):
                continue
            raise ProbeError("error", f"{spec.method} {path}: protocol error: {reason(exc)}"
                             ) from None
        except httpcore2.TimeoutException:
            raise ProbeError("timeout", "no answer within the client's timeout") from None
        except _FAILED as exc:
            raise ProbeError("error", f"{spec.method} {path}: {type(exc).__name__}: "
                                      f"{reason(exc)}") from None
        return response.status, body
    raise AssertionError("unreachable: the last attempt returns or raises")


async def _read_capped(response: httpcore2.Response, what: str) -> bytes:
    """The body, read as it comes and never more than MAX_BODY of it (an answer that big
    is refused without being held in memory)."""
    chunks: list[bytes] = []
    size = 0
    stream = response.stream
    assert hasattr(stream, "__aiter__")
    raw: AsyncIterator[bytes] = stream.__aiter__()
    async for chunk in raw:
        size += len(chunk)
        if size > MAX_BODY:
            await close_early(raw)
            raise ProbeError("error", f"{what} answered more than {MAX_BODY // 2**20} MiB")
        chunks.append(chunk)
    return b"".join(chunks)


class _Transported:
    """An httpx2 transport (``httpx2.MockTransport`` in tests) behind the pool's method:
    requests and answers converted, httpx2's errors raised as httpcore2's."""

    __slots__ = ("transport",)

    def __init__(self, transport: httpx2.AsyncBaseTransport) -> None:
        self.transport = transport

    async def handle_async_request(self, request: httpcore2.Request) -> httpcore2.Response:
        sent = httpx2.Request(request.method.decode(), bytes(request.url).decode(),
                              headers=request.headers)
        with _as_core():
            response = await self.transport.handle_async_request(sent)
        return httpcore2.Response(response.status_code, headers=response.headers.raw,
                                  content=_TransportedBody(response))

    async def aclose(self) -> None:
        await self.transport.aclose()


class _TransportedBody:
    """An httpx2 answer's body as httpcore2's (an iterator, so no generator is left
    suspended when it is closed early)."""

    __slots__ = ("_chunks", "response")

    def __init__(self, response: httpx2.Response) -> None:
        self.response = response
        self._chunks: AsyncIterator[bytes] | None = None

    def __aiter__(self) -> _TransportedBody:
        return self

    async def __anext__(self) -> bytes:
        with _as_core():
            if self._chunks is None:
                stream = self.response.stream
                assert isinstance(stream, httpx2.AsyncByteStream)
                self._chunks = stream.__aiter__()
            return await self._chunks.__anext__()

    async def aclose(self) -> None:
        await self.response.aclose()


@contextmanager
def _as_core() -> Iterator[None]:
    """Raise an httpx2 error as the httpcore2 error of the same name (else a NetworkError)."""
    try:
        yield
    except httpx2.HTTPError as exc:
        core = getattr(httpcore2, type(exc).__name__, None)
        if not (isinstance(core, type) and issubclass(core, Exception)):
            core = httpcore2.NetworkError
        raise core(str(exc)) from exc


def generates(spec: ProbeSpec, path: str) -> bool:
    """Whether asking ``path`` for this probe runs a generation on the engine."""
    if path == spec.path:
        return spec.cost == "generating"
    return path == spec.fallback_path and spec.fallback_cost == "generating"


def _excerpt(body: bytes) -> str:
    return excerpt(body)


def _json(body: bytes, what: str) -> Any:
    """``body`` as JSON; any decode failure (nesting past the decoder's depth and bytes that
    are not UTF-8 included) is a one-line ``ProbeError("body")``."""
    return decode_json(body, what)


def pointer(doc: Any, ptr: str) -> Any:
    """Resolve a JSON pointer (RFC 6901); None where the path does not exist."""
    if ptr in ("", "/"):
        return doc
    for raw in ptr.lstrip("/").split("/"):
        key = raw.replace("~1", "/").replace("~0", "~")
        if isinstance(doc, dict):
            doc = doc.get(key)
        elif isinstance(doc, list) and is_digits(key) and int(key) < len(doc):
            doc = doc[int(key)]
        else:
            return None
    return doc


def parse_identity(body: bytes, spec: ProbeSpec, kind: str) -> tuple[Identity, tuple[str, ...]]:
    """The identity an engine reports, and every model name it gave (for matching).

    Raises ProbeError("mismatch") when the body lacks the keys that this kind always has.
    """
    doc = decode_json(body, f"GET {spec.path}", error=lambda message: ProbeError(
        "mismatch", f"does not look like {kind}: {message}"))
    if not isinstance(doc, dict):
        raise ProbeError("mismatch", f"does not look like {kind}: GET {spec.path} is not an object")
    router = bool(spec.router_pointer) and pointer(doc, spec.router_pointer or "") == "router"
    # (a router has no slots of its own: each model's child has its own)
    unneeded = {spec.slots_pointer.lstrip("/")} if router and spec.slots_pointer else set()
    missing = [k for k in spec.require_keys if k not in doc and k not in unneeded]
    if missing:
        raise ProbeError(
            "mismatch",
            f"does not look like {kind}: GET {spec.path} lacks {', '.join(missing)}",
        )
    version = _scalar(pointer(doc, spec.version_pointer)) if spec.version_pointer else None
    if router:  # (its model_alias "llama-server" and model_path "none" are no model)
        models_max = (pointer(doc, spec.models_max_pointer) if spec.models_max_pointer
                      else None)
        autoload = pointer(doc, spec.autoload_pointer) if spec.autoload_pointer else None
        return Identity(version=version or None, router=True,
                        models_max=_slots(models_max), autoload=autoload is not False), ()
    names = tuple(n for p in spec.model_pointers if (n := _scalar(pointer(doc, p))))
    slots = _slots(pointer(doc, spec.slots_pointer)) if spec.slots_pointer else None
    return Identity(model=names[0] if names else None, version=version or None,
                    slots=slots), names


def sleeping(body: bytes, pointer_: str) -> bool | None:
    """Whether a sleeping probe's answer says the engine sleeps (llama-server's
    ``/props.is_sleeping``, vLLM's ``/is_sleeping``): True or False only for a JSON
    boolean there, None for anything else (an answer that does not say)."""
    try:
        doc = decode_json(body, "the sleeping probe")
    except ProbeError:
        return None
    value = pointer(doc, pointer_)
    return value if isinstance(value, bool) else None


def _slots(value: Any) -> int | None:
    """A slot count as the engine gave it: a whole number from 1 to MAX_SLOTS, else None
    (not said, or not believable: the queue then sends every waiting request at once)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_SLOTS:
        return None
    return value


def _scalar(value: Any) -> str | None:
    """A name or version as text: strings and numbers only (a list or an object is not a
    name), at most MAX_ID_CHARS characters; None otherwise."""
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        return None
    text = value if isinstance(value, str) else repr(value)
    return text[:MAX_ID_CHARS]


class Listing(msgspec.Struct, frozen=True):
    """The models an engine listed, and those left out (``left_out``, ``why`` in words)."""

    models: tuple[Model, ...]
    left_out: int = 0
    why: str | None = None


def parse_models(body: bytes, fmt: ModelsFormat, path: str) -> tuple[Model, ...]:
    return parse_listing(body, fmt, path).models


#: a model list is decoded in two steps, so no list costs more than MAX_MODELS entries of
#: work on the event loop: the top level with its entries left as raw JSON (a scan in C),
#: then only as many entries as are needed to list MAX_MODELS (150,000 entries decoded and
#: checked one by one held the loop for about 100 ms; now a few ms).
_TOP = msgspec.json.Decoder(dict[str, msgspec.Raw])
_ENTRIES = msgspec.json.Decoder(list[msgspec.Raw] | None)
_ENTRY = msgspec.json.Decoder()


def parse_listing(body: bytes, fmt: ModelsFormat, path: str) -> Listing:
    """The model list. Entries that peers would refuse are left out one by one and counted
    (an id that is not a string, empty, over MAX_ID_CHARS or with control characters; beyond
    MAX_MODELS); ``created`` that is not an int64 is 0; ``owned_by`` is cut to
    MAX_OWNER_CHARS. Entries past the cap are counted as over it without being looked at.
    Raises ProbeError only for a body that is not a model list at all."""
    what = f"GET {path}"
    try:  # (the raw entries are not checked by the first step)
        body.decode("utf-8")
    except UnicodeDecodeError:
        _json(body, what)  # says "is not UTF-8"
        raise
    key, owner, field = (("name", "ollama", "models") if fmt == "ollama_tags"
                         else ("id", "", "data"))
    try:
        top = _TOP.decode(body)
    except msgspec.ValidationError:  # JSON, but not an object: no list of models in it
        _json(body, what)  # (a body that is not JSON at all says so)
        return Listing(models=())
    except Exception:  # every decode failure is one line (decoding.decode_json)
        _json(body, what)
        raise
    raw = top.get(field)
    if raw is None:
        return Listing(models=())
    try:
        entries = _ENTRIES.decode(raw)
    except msgspec.ValidationError:
        raise ProbeError("body", f"{what}: expected a list of models") from None
    except Exception:
        _json(body, what)
        raise
    if entries is None:  # Ollama answers "data": null when it has no models
        return Listing(models=())
    models: list[Model] = []
    dropped: dict[str, int] = {}
    for index, entry in enumerate(entries):
        if len(models) >= MAX_MODELS:  # the rest is not even looked at
            over = f"over the cap of {MAX_MODELS:,} models"
            dropped[over] = dropped.get(over, 0) + len(entries) - index
            break
        try:
            item = _ENTRY.decode(entry)
        except (RecursionError, msgspec.DecodeError):
            item = None  # an entry nested past the decoder's depth: not an object
        why = _unlistable(item, key)
        if why is not None:
            dropped[why] = dropped.get(why, 0) + 1
            continue
        created = item.get("created")
        owned_by = item.get("owned_by")
        models.append(Model(
            id=item[key],
            created=created if _is_int64(created) else 0,
            owned_by=(owned_by if isinstance(owned_by, str) and owned_by else owner)
            [:MAX_OWNER_CHARS],
            state=_model_state(item.get("status")),
        ))
    if not dropped:
        return Listing(models=tuple(models))
    left_out = sum(dropped.values())
    reasons = ", ".join(f"{n:,} {why}" for why, n in dropped.items())
    return Listing(models=tuple(models), left_out=left_out,
                   why=f"{what}: {left_out:,} of {len(entries):,} models left out ({reasons})")


#: llama-server router mode's ``status.value`` of a model, as nvpair names the state
MODEL_STATES: dict[str, ModelState] = {
    "unloaded": "cold", "loading": "loading", "loaded": "ready", "sleeping": "sleeping"}


def _model_state(status: Any) -> ModelState | None:
    """A model's own state from its entry's ``status`` (router mode: ``{"value":
    "loaded", ...}``): None when the entry has no status object (a single-model engine:
    the engine's state is the model's); ``cold`` for a value not known (a download, a
    state of a later build): not loaded, as far as nvpair can tell."""
    if not isinstance(status, dict):
        return None
    value = status.get("value")
    return MODEL_STATES.get(value, "cold") if isinstance(value, str) else "cold"


def _unlistable(item: Any, key: str) -> str | None:
    """Why a model entry cannot be listed, or None."""
    if not isinstance(item, dict):
        return "not an object"
    name = item.get(key)
    if not isinstance(name, str) or not name:
        return f"without a string {key!r}"
    if len(name) > MAX_ID_CHARS:
        return f"with an {key} over {MAX_ID_CHARS} characters"
    if _CONTROL.search(name):
        return f"with control characters in the {key}"
    return None


def _is_int64(value: Any) -> bool:
    return (isinstance(value, int) and not isinstance(value, bool)
            and INT64[0] <= value <= INT64[1])
