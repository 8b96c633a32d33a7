"""etcd's v3 JSON gateway over httpx2: the few calls the etcd backend needs, no gRPC.

The gateway's gotchas (measured on etcd 3.4, see the reference):

* keys and values are base64; every int64 (revision, lease ID, TTL) is a JSON *string*, so
  answers are decoded with ``strict=False``; proto3 defaults are omitted (a PUT event has no
  ``type``; a keepalive for an unknown lease answers 200 with no ``TTL``);
* a keepalive is a one-message stream: ``{"result": {...}}``;
* a watch is one POST per create_request (httpx2 sends the whole body before reading), and
  answers newline-delimited ``{"result": ...}`` objects until EOF; a watch from a compacted
  revision answers ``created`` then ``canceled`` with ``compact_revision``.

Deadlines belong to the caller. Errors: ``EtcdError`` (and ``LeaseNotFound``,
``WatchCanceled``) for etcd's answers, ``BadAnswer`` for anything that is not what the
gateway sends (HTML from a proxy, truncated or deeply nested JSON, wrong types, missing
fields, bad base64), each one line; httpx2's own errors pass through.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable
from contextlib import aclosing
from typing import Any, TypeVar

import httpx2
import msgspec

from nvpair.base.decoding import decode_json, is_digits
from nvpair.errors import NvpairError

T = TypeVar("T")
#: the largest answer read from etcd (a range holds every node's advert: up to 64 KiB
#: each, base64-encoded; this is room for about 750 of the largest)
ANSWER_MAX_BYTES = 64 * 1024 * 1024


class EtcdError(NvpairError):
    """etcd answered with an error."""


class BadAnswer(EtcdError):
    """An answer that is not what etcd's v3 gateway sends (a proxy's page, a wrong port...)."""


class LeaseNotFound(EtcdError):
    """The lease expired or was revoked: grant a new one and put the advert again."""


class WatchCanceled(EtcdError):
    """etcd ended the watch (compaction or another reason): range again, then watch again."""


class Header(msgspec.Struct):
    revision: int = 0


def unb64(text: str, what: str) -> bytes:
    """etcd's base64; anything else is ``BadAnswer``."""
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise BadAnswer(f"etcd sent a {what} that is not base64 ({exc})") from None


class KV(msgspec.Struct):
    key: str
    value: str = ""
    mod_revision: int = 0
    lease: int = 0

    @property
    def key_text(self) -> str:
        return unb64(self.key, "key").decode("utf-8", "replace")

    @property
    def value_bytes(self) -> bytes:
        return unb64(self.value, "value")

    def check(self) -> None:
        """Raise ``BadAnswer`` now, not where the key is used, if it is not base64."""
        unb64(self.key, "key")
        unb64(self.value, "value")


class Event(msgspec.Struct):
    kv: KV
    type: str = "PUT"
    prev_kv: KV | None = None


class WatchResult(msgspec.Struct):
    header: Header = msgspec.field(default_factory=Header)
    created: bool = False
    canceled: bool = False
    compact_revision: int = 0
    cancel_reason: str = ""
    events: list[Event] = msgspec.field(default_factory=list)


class _WatchLine(msgspec.Struct):
    result: WatchResult | None = None
    error: Any = None


class _Range(msgspec.Struct):
    header: Header  # always sent: its revision is where the watch starts
    kvs: list[KV] = msgspec.field(default_factory=list)


class _Grant(msgspec.Struct):
    ID: int = 0
    TTL: int = 0
    error: str = ""


class _KeepaliveResult(msgspec.Struct):
    ID: int = 0
    TTL: int = 0


class _Keepalive(msgspec.Struct):
    result: _KeepaliveResult | None = None
    error: Any = None


class _Put(msgspec.Struct):
    header: Header


class _Auth(msgspec.Struct):
    token: str = ""


def b64(data: str | bytes) -> str:
    raw = data.encode() if isinstance(data, str) else data
    return base64.b64encode(raw).decode()


def prefix_end(prefix: str) -> str:
    """The range_end that covers every key starting with ``prefix`` (base64)."""
    raw = bytearray(prefix.encode())
    while raw and raw[-1] == 0xFF:
        raw.pop()
    if not raw:
        return b64(b"\0")  # every key
    raw[-1] += 1
    return b64(bytes(raw))


_DECODERS: dict[type, msgspec.json.Decoder[Any]] = {}


def parse(raw: bytes, type_: type[T], what: str) -> T:
    """``raw`` as the gateway's ``type_`` (int64s as strings); anything else, any decode
    failure at all, is ``BadAnswer``: ``etcd's answer to POST /v3/kv/range is not JSON:
    <html>...``."""
    decoder = _DECODERS.get(type_)
    if decoder is None:
        decoder = _DECODERS[type_] = msgspec.json.Decoder(type_, strict=False)
    value: T = decode_json(raw, f"etcd's answer to {what}", decoder=decoder,
                           error=BadAnswer)
    return value


async def _read_capped(r: httpx2.Response, where: str) -> bytes:
    """The body of ``r``, at most ``ANSWER_MAX_BYTES`` (BadAnswer past it; the rest is
    never read, and a declared length over it reads nothing)."""
    length = r.headers.get("content-length", "")
    if is_digits(length) and int(length) > ANSWER_MAX_BYTES:
        raise BadAnswer(f"{where}: an answer of {int(length)} bytes, over the "
                        f"{ANSWER_MAX_BYTES} read from etcd")
    chunks, size = [], 0
    async with aclosing(r.aiter_bytes()) as stream:  # closed here, not when collected
        async for chunk in stream:
            size += len(chunk)
            if size > ANSWER_MAX_BYTES:
                raise BadAnswer(f"{where}: an answer over the {ANSWER_MAX_BYTES} bytes read "
                                "from etcd")
            chunks.append(chunk)
    return b"".join(chunks)


def _error(body: bytes, status: int) -> EtcdError:
    try:
        doc = msgspec.json.decode(body)
    except (msgspec.DecodeError, RecursionError):
        text = body[:200].decode("utf-8", "replace")
        return EtcdError(f"HTTP {status}: {' '.join(text.split())!r}")
    err = doc.get("error") if isinstance(doc, dict) else None
    message = (err.get("message") if isinstance(err, dict) else None) or \
        (doc.get("message") if isinstance(doc, dict) else None) or err or doc
    message = " ".join(str(message).split())[:300]  # whatever it is, one line of text
    if "lease not found" in message:
        return LeaseNotFound(message)
    return EtcdError(f"HTTP {status}: {message}")


class Gateway:
    """Calls over one ``httpx2.AsyncClient`` whose ``base_url`` is etcd's client URL."""

    def __init__(self, client: httpx2.AsyncClient, *, username: str | None = None,
                 password: str | None = None) -> None:
        self.client = client
        self.username = username
        self.password = password
        self._token: str | None = None
        self.bytes_sent = 0
        self.bytes_received = 0

    def _headers(self) -> dict[str, str]:
        return {"authorization": self._token} if self._token else {}

    async def _post(self, path: str, doc: dict[str, Any]) -> bytes:
        body = msgspec.json.encode(doc)
        if self.username is not None and self._token is None:
            await self.authenticate()
        status, content = await self._call(path, body, self._headers())
        self.bytes_sent += len(body)
        self.bytes_received += len(content)
        if status == 401 and self.username is not None:
            self._token = None  # an expired auth token: once more with a new one
            await self.authenticate()
            status, content = await self._call(path, body, self._headers())
        if status != 200:
            raise _error(content, status)
        return content

    async def _call(self, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
        """POST ``body`` to ``path``: the status and the answer, read up to
        ``ANSWER_MAX_BYTES`` (BadAnswer past it: the rest is never read)."""
        async with self.client.stream("POST", path, content=body, headers=headers) as r:
            return r.status_code, await _read_capped(r, f"POST {path}")

    async def authenticate(self) -> None:
        body = msgspec.json.encode({"name": self.username, "password": self.password})
        status, content = await self._call("/v3/auth/authenticate", body, {})
        if status != 200:
            raise _error(content, status)
        self._token = parse(content, _Auth, "POST /v3/auth/authenticate").token

    async def grant(self, ttl: int) -> tuple[int, int]:
        """A new lease: (ID, granted TTL; etcd rounds up to its minimum)."""
        answer = parse(await self._post("/v3/lease/grant", {"TTL": ttl}), _Grant,
                       "POST /v3/lease/grant")
        if answer.error or not answer.ID:
            raise EtcdError(f"lease grant failed: {answer.error or 'no ID'}")
        return answer.ID, answer.TTL

    async def keepalive(self, lease: int) -> int:
        """Renew ``lease``; its remaining TTL, 0 when etcd no longer has it."""
        raw = await self._post("/v3/lease/keepalive", {"ID": str(lease)})
        line = raw.split(b"\n", 1)[0]
        answer = parse(line, _Keepalive, "POST /v3/lease/keepalive")
        if answer.error is not None:
            raise _error(line, 200)
        return answer.result.TTL if answer.result is not None else 0

    async def put(self, key: str, value: bytes, *, lease: int | None = None,
                  ignore_lease: bool = False) -> int:
        """Put ``value`` under ``key`` (tied to ``lease``); the new revision."""
        doc: dict[str, Any] = {"key": b64(key), "value": b64(value)}
        if lease is not None:
            doc["lease"] = str(lease)
        if ignore_lease:
            doc["ignore_lease"] = True
        answer = parse(await self._post("/v3/kv/put", doc), _Put, "POST /v3/kv/put")
        return answer.header.revision

    async def revoke(self, lease: int) -> None:
        await self._post("/v3/lease/revoke", {"ID": str(lease)})

    async def range(self, prefix: str) -> tuple[int, list[KV]]:
        """Every key under ``prefix``: (the store's revision, the keys)."""
        doc = {"key": b64(prefix), "range_end": prefix_end(prefix)}
        raw = await self._post("/v3/kv/range", doc)
        answer = parse(raw, _Range, "POST /v3/kv/range")
        for kv in answer.kvs:
            kv.check()
        return answer.header.revision, answer.kvs

    async def watch(self, prefix: str, start_revision: int,
                    on_result: Callable[[WatchResult], None]) -> None:
        """Watch ``prefix`` from ``start_revision``, calling ``on_result`` for every message.

        Returns at the end of the stream (etcd going away cleanly); raises
        ``WatchCanceled`` when etcd cancels the watch, ``EtcdError`` for an error message.
        Cancellation closes the stream (and its connection).
        """
        if self.username is not None and self._token is None:
            await self.authenticate()
        body = msgspec.json.encode({"create_request": {
            "key": b64(prefix), "range_end": prefix_end(prefix),
            "start_revision": str(start_revision)}})
        async with self.client.stream("POST", "/v3/watch", content=body,
                                      headers=self._headers()) as r:
            if r.status_code != 200:
                raise _error(await _read_capped(r, "POST /v3/watch"), r.status_code)
            # one message a line; a line is held to ANSWER_MAX_BYTES (the rest is not read)
            pending = bytearray()
            async with aclosing(r.aiter_bytes()) as chunks:  # closed here, not when collected
                async for chunk in chunks:
                    start = len(pending)
                    pending += chunk
                    while (end := pending.find(b"\n", start)) >= 0:
                        line, start = bytes(pending[:end]), 0
                        del pending[:end + 1]
                        self._watch_line(line, on_result)
                    if len(pending) > ANSWER_MAX_BYTES:
                        raise BadAnswer(f"POST /v3/watch: a message over the "
                                        f"{ANSWER_MAX_BYTES} bytes read from etcd")
            self._watch_line(bytes(pending), on_result)  # (the last, without its newline)

    def _watch_line(self, line: bytes, on_result: Callable[[WatchResult], None]) -> None:
        if line.strip():
            self.bytes_received += len(line) + 1
            on_result(self._watch_result(line.decode("utf-8", "replace")))

    def _watch_result(self, line: str) -> WatchResult:
        msg = parse(line.encode(), _WatchLine, "POST /v3/watch")
        if msg.error is not None or msg.result is None:
            if self.username is not None:
                self._token = None  # perhaps an expired token: a new one next time
            raise _error(line.encode(), 200)
        if msg.result.canceled:
            reason = msg.result.cancel_reason or "canceled"
            if msg.result.compact_revision:
                reason = f"compacted at revision {msg.result.compact_revision}"
            raise WatchCanceled(f"etcd ended the watch: {reason}")
        for event in msg.result.events:
            event.kv.check()
        return msg.result
