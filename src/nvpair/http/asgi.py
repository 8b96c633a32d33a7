"""Small ASGI helpers: JSON answers, OpenAI-shaped errors, lifespan, reading a capped body.

nvpair serves its API as a plain ASGI app on hypercorn's trio worker. The read path is a
dictionary lookup and a write of cached bytes; a framework would cost more than it gives
here (see docs/benchmarks.md for the measured difference).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, Protocol

import msgspec

from nvpair.base.logformat import about
from nvpair.errors import BodyTooLarge as BodyTooLarge  # read_body raises it

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

JSON = [(b"content-type", b"application/json")]
#: on a request one node passes to another: the sender's node name. The receiver serves it
#: from its own engines only (never passes it on), and accepts the cluster token on it.
FORWARDED_BY = b"x-nvpair-forwarded-by"
encoder = msgspec.json.Encoder()

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",  # (OpenAI's clients go by the status; code: rate_limit_exceeded)
    500: "server_error",
    502: "server_error",  # the engine failed
    503: "unavailable_error",
    504: "server_error",  # the engine was too slow
}


class Handler(Protocol):
    """An ASGI handler for the paths of a ``Mount``."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None: ...


class Mount(msgspec.Struct, frozen=True):
    """Routes served by another part of nvpair (router, peers): exact paths or a prefix.

    ``own_auth``: the handler checks its own credentials (e.g. the cluster token of peer
    adverts), so the user token is not asked for. ``peer_auth``: a request another node
    passes on (``x-nvpair-forwarded-by``) may present the cluster token instead of the
    user token (the router's paths: peers route requests to each other's engines).
    ``routed``: its requests use models (the router's paths): a user key may make them
    (``nvpair.http.keys.route_kind``).
    """

    handler: Handler
    paths: frozenset[str] = frozenset()
    prefix: str | None = None
    own_auth: bool = False
    peer_auth: bool = False
    routed: bool = False

    def matches(self, path: str) -> bool:
        return path in self.paths or (self.prefix is not None and path.startswith(self.prefix))


async def send_bytes(
    send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    hdrs = list(headers if headers is not None else JSON)
    hdrs.append((b"content-length", str(len(body)).encode()))
    await send({"type": "http.response.start", "status": status, "headers": hdrs})
    await send({"type": "http.response.body", "body": body})


async def send_json(send: Send, status: int, doc: object,
                    extra: list[tuple[bytes, bytes]] | None = None) -> None:
    await send_bytes(send, status, encoder.encode(doc), JSON + (extra or []))


def error_doc(status: int, message: str, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape; made while a routed request is handled, it names its id
    (``request_id``, also in the answer's ``x-request-id``) so a report can be traced."""
    error = {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"),
             "code": code, "param": None}
    if (now := about.get()) is not None:
        error["request_id"] = now.request_id
    return {"error": error}


async def send_error(send: Send, status: int, message: str, code: str | None = None,
                     extra: list[tuple[bytes, bytes]] | None = None) -> None:
    await send_json(send, status, error_doc(status, message, code), extra)


async def send_wrong_method(send: Send, allowed: str, path: str) -> None:
    """The 405 of a request whose method ``path`` does not take: ``Allow`` names the one it
    does (RFC 9110, 15.5.6: a 405 must have it), and the message says so."""
    await send_error(send, 405, f"use {allowed} {path}", None, [(b"allow", allowed.encode())])


async def read_body(receive: Receive, limit: int) -> bytes:
    chunks = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


async def lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


def header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return bytes(value)
    return None


def bearer(scope: Scope) -> bytes | None:
    """The credentials of ``Authorization: Bearer <token>``; the scheme's name is matched in
    any case (RFC 9110, 11.1), the token as it is. None without such a header."""
    given = header(scope, b"authorization")
    if given is None:
        return None
    scheme, _, token = given.partition(b" ")
    if scheme.lower() != b"bearer":
        return None
    return token.lstrip(b" ")
