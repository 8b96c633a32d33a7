"""One routed request as nvpair tracks it: its id, its times, its answer, its access line.

* The id is the client's ``x-request-id`` when it is one line of at most ``ID_MAX``
  printable ASCII characters (no spaces), else one made here (32 hex digits). It goes to
  the engine in place of the client's, back to the client on every answer (the engine's
  own ``x-request-id``, if it sends one, is replaced), and into every log line about the
  request (``nvpair.base.logformat.about``).
* ``Routed.sender`` wraps the ASGI ``send``: it adds ``x-request-id`` and, to an answer
  that waited in an on-demand queue, ``x-nvpair-queue-ms``; it counts the body's bytes
  and notes the first one.
* ``Routed.log_access`` writes the access log's line (docs/observability.md), once: just
  before the answer's last bytes go, or when the request ends without them.

The relay makes one per request, in one place (``nvpair.router.relay.Router.__call__``);
the parts below it find it with ``current()``.
"""

from __future__ import annotations

import contextvars
import logging
import secrets

import trio

from nvpair.base.logformat import ACCESS
from nvpair.http.asgi import Message, Scope, Send, header
from nvpair.router.tracing import OPERATIONS, RequestTrace, Tracer, server_attrs

#: the longest client id kept (a longer one is replaced): a UUID is 36, a W3C trace id 32
ID_MAX = 128
REQUEST_ID = b"x-request-id"
QUEUE_MS = b"x-nvpair-queue-ms"

access_log = logging.getLogger(ACCESS)
_current: contextvars.ContextVar[Routed | None] = contextvars.ContextVar(
    "nvpair_routed", default=None)


def valid_id(raw: bytes | None) -> str | None:
    """The client's id if nvpair may pass it on and log it: 1 to ``ID_MAX`` characters
    from ``!`` to ``~`` (printable ASCII, no spaces, nothing that could break a header or
    a log line); else None."""
    if raw is None or not 0 < len(raw) <= ID_MAX:
        return None
    if any(b < 0x21 or b > 0x7E for b in raw):
        return None
    return raw.decode("ascii")


def new_id() -> str:
    """A fresh id: 128 random bits as 32 hex digits."""
    return secrets.token_hex(16)


def current() -> Routed | None:
    """The routed request the calling task is handling (None: none)."""
    return _current.get()


class Routed:
    """One routed request, from its arrival to its last byte."""

    def __init__(self, scope: Scope) -> None:
        given = None
        for k, v in scope.get("headers", ()):
            if k == REQUEST_ID:
                given = bytes(v)
                break
        self.id = valid_id(given) or new_id()
        #: the client sent an id that was not kept (for the log: once, at debug)
        self.replaced = given is not None and self.id != given.decode("latin-1")
        self.method: str = scope.get("method", "")
        self.path: str = scope.get("path", "")
        self.arrived = trio.current_time()
        self.model: str | None = None
        self.engine: str | None = None
        #: the API key's name, where keys are configured
        self.key: str | None = None
        #: seconds waited in an on-demand engine's queue (None: it did not wait)
        self.queue_s: float | None = None
        self.status: int | None = None
        self.first_byte_at: float | None = None
        self.bytes = 0
        #: the answer was an event stream (text/event-stream)
        self.streamed = False
        #: its trace (None: tracing is off, or this request is not sampled)
        self.trace: RequestTrace | None = None
        self._logged = False

    def begin_trace(self, tracer: Tracer, scope: Scope) -> None:
        """Start this request's trace, continuing the client's ``traceparent`` if valid."""
        self.trace = tracer.begin(header(scope, b"traceparent"), self.method, self.path)

    def end_trace(self) -> None:
        """End the server span with what the request came to, and export its spans."""
        trace, self.trace = self.trace, None
        if trace is None:
            return
        attrs = server_attrs((
            ("http.request.method", self.method), ("http.route", self.path),
            ("http.response.status_code", self.status), ("nvpair.request_id", self.id),
            ("gen_ai.request.model", self.model),
            ("gen_ai.operation.name", OPERATIONS.get(self.path)),
            ("nvpair.key", self.key), ("nvpair.engine", self.engine),
            ("nvpair.node", trace.tracer.node), ("nvpair.streaming", self.streamed),
            ("nvpair.response.bytes", self.bytes)))
        if self.queue_s is not None:
            attrs.append(("nvpair.queue_ms", round(self.queue_s * 1000)))
        if self.first_byte_at is not None:
            attrs.append(("nvpair.first_chunk_ms",
                          round((self.first_byte_at - self.arrived) * 1000)))
        trace.finish(attrs, self.status)

    def enter(self) -> contextvars.Token[Routed | None]:
        """Make this the request ``current()`` returns in this task (and those it starts)."""
        return _current.set(self)

    @staticmethod
    def leave(token: contextvars.Token[Routed | None]) -> None:
        _current.reset(token)

    def scope(self, scope: Scope) -> Scope:
        """``scope`` with this id as its only ``x-request-id`` (what the engine gets)."""
        headers = [(k, v) for k, v in scope.get("headers", ()) if k != REQUEST_ID]
        headers.append((REQUEST_ID, self.id.encode()))
        return {**scope, "headers": headers}

    def sender(self, send: Send) -> Send:
        """``send``, adding this request's headers to the answer and counting its body."""
        async def wrapped(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.status = message["status"]
                headers = [(k, v) for k, v in message.get("headers", ()) if k != REQUEST_ID]
                headers.append((REQUEST_ID, self.id.encode()))
                if self.queue_s is not None:
                    headers.append((QUEUE_MS, str(round(self.queue_s * 1000)).encode()))
                message = {**message, "headers": headers}
            elif message["type"] == "http.response.body":
                size = len(message.get("body", b""))
                if size and self.first_byte_at is None:
                    self.first_byte_at = trio.current_time()
                self.bytes += size
                if not message.get("more_body", False):  # (its line before the client
                    self.log_access()                     # has the end: none is missed)
            await send(message)
        return wrapped

    def log_access(self) -> None:
        """Write the access line, once (at the answer's end, or when it ends otherwise)."""
        if self._logged or not access_log.isEnabledFor(logging.INFO):
            return
        self._logged = True
        access_log.info("access", extra={"access": self.access(trio.current_time())})

    def access(self, now: float) -> dict[str, object]:
        """The access log's fields (times in milliseconds, None: it did not happen)."""
        def ms(seconds: float | None) -> int | None:
            return None if seconds is None else round(seconds * 1000)

        return {
            "request_id": self.id, "method": self.method, "path": self.path,
            "model": self.model, "engine": self.engine, "key": self.key,
            "status": self.status, "queue_ms": ms(self.queue_s),
            "first_byte_ms": ms(None if self.first_byte_at is None
                                else self.first_byte_at - self.arrived),
            "total_ms": ms(now - self.arrived), "bytes": self.bytes,
        }
