"""A routed request's trace: its server span and the spans of what it waited for.

``Tracer.begin`` decides whether a request is traced: a client's valid ``traceparent``
(``nvpair.base.traceparent``) is continued, its sampled flag followed; without one,
``sample_ratio`` of requests start a trace. A traced request (``RequestTrace``) gets a
server span, ended when the request ends, and children the relay opens and ends as
things happen:

    POST /v1/chat/completions          server: route, model, key, status, bytes, gen_ai.*
    ├── queue                          the wait in an on-demand engine's queue
    ├── activation                     the engine's start, with its own startup time
    │   └── eviction                   each engine stopped to make room
    ├── wake                           a sleeping engine woken
    └── upstream | peer                the call to the engine, or the hop to a peer node

Every span is kept on the request until it ends, then all go to the exporter in one call
(``SpanSink.add``): the loop's whole cost of a traced request is making these few objects.
The client span of each attempt is the parent the engine or the peer sees in the
``traceparent`` nvpair sends it, so their spans join the same trace.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterable
from typing import Protocol

import trio

from nvpair.base.otlp import CLIENT, ERROR, INTERNAL, SERVER, Attrs, AttrValue, Span
from nvpair.base.traceparent import header, parse

#: how often the offset of trio's clock to the wall clock is read again
OFFSET_EVERY_S = 10.0
#: ``gen_ai.operation.name`` of the routed paths that have one
OPERATIONS = {"/v1/chat/completions": "chat", "/v1/completions": "text_completion",
              "/v1/embeddings": "embeddings", "/v1/responses": "chat"}


class SpanSink(Protocol):
    """Where finished spans go (``nvpair.runtime.spanexport.SpanExporter``)."""

    def add(self, spans: list[Span]) -> None: ...


class Tracer:
    """Whether to trace a request, and where its spans go."""

    def __init__(self, sink: SpanSink, sample_ratio: float = 1.0, *,
                 node: str = "nvpair") -> None:
        self.sink = sink
        self.sample_ratio = sample_ratio
        self.node = node
        self.rng = random.Random()
        self._offset_ns = 0
        self._offset_at = -OFFSET_EVERY_S

    def offset_ns(self, now: float) -> int:
        """Trio time to Unix nanoseconds: read from the wall clock every OFFSET_EVERY_S
        (each read costs ~1 µs; a wall clock's step shows in the spans within that)."""
        if now - self._offset_at >= OFFSET_EVERY_S:
            self._offset_ns = time.time_ns() - int(now * 1e9)
            self._offset_at = now
        return self._offset_ns

    def begin(self, traceparent: bytes | None, method: str, path: str
              ) -> RequestTrace | None:
        """The trace of a request that arrived now (None: not sampled)."""
        incoming = parse(traceparent)
        if incoming is not None:
            if not incoming.sampled:
                return None
            trace_id, parent = incoming.trace_id, incoming.parent_id
        else:
            if self.sample_ratio < 1.0 and self.rng.random() >= self.sample_ratio:
                return None
            trace_id, parent = self.new_id(16), b""
        return RequestTrace(self, trace_id, parent, f"{method} {path}")

    def new_id(self, size: int = 8) -> bytes:
        """A random id of ``size`` bytes, never all zeros (W3C calls that invalid)."""
        return (self.rng.getrandbits(size * 8) or 1).to_bytes(size, "big")


class RequestTrace:
    """One traced request's spans; times are trio times, sent as Unix nanoseconds."""

    def __init__(self, tracer: Tracer, trace_id: bytes, parent: bytes, name: str) -> None:
        self.tracer = tracer
        self.trace_id = trace_id
        now = trio.current_time()
        self._offset_ns = tracer.offset_ns(now)  # (one for the whole request)
        self.server = Span(trace_id, tracer.new_id(), parent, name, SERVER,
                           self.ns(now), 0)
        self.spans: list[Span] = []

    def ns(self, at: float) -> int:
        return self._offset_ns + int(at * 1e9)

    def start(self, name: str, kind: int = INTERNAL, *, parent: Span | None = None,
              at: float | None = None, attrs: Attrs | None = None) -> Span:
        """A child span begun at ``at`` (now by default): end it with ``end``."""
        start = trio.current_time() if at is None else at
        return Span(self.trace_id, self.tracer.new_id(), (parent or self.server).span_id,
                    name, kind, self.ns(start), 0, attrs if attrs is not None else [])

    def end(self, span: Span, *, at: float | None = None, error: str | None = None,
            attrs: Attrs | None = None) -> None:
        """End ``span`` at ``at`` (now by default), as an error if ``error`` says why."""
        span.end_ns = self.ns(trio.current_time() if at is None else at)
        if attrs:
            span.attrs.extend(attrs)
        if error is not None:
            span.status, span.message = ERROR, error
        self.spans.append(span)

    def span(self, name: str, began: float, ended: float, *, parent: Span | None = None,
             attrs: Attrs | None = None, error: str | None = None) -> Span:
        """A child span of something already over (from ``began`` to ``ended``)."""
        span = self.start(name, parent=parent, at=began, attrs=attrs)
        self.end(span, at=ended, error=error)
        return span

    def client(self, name: str, attrs: Attrs) -> tuple[Span, bytes]:
        """A client span begun now, and the ``traceparent`` that names it the parent."""
        span = self.start(name, CLIENT, attrs=attrs)
        return span, header(self.trace_id, span.span_id)

    def finish(self, attrs: Attrs, status: int | None) -> None:
        """End the server span now (a 5xx is an error) and hand every span over."""
        server = self.server
        server.end_ns = self.ns(trio.current_time())
        server.attrs = attrs
        if status is not None and status >= 500:
            server.status = ERROR
        self.spans.append(server)
        self.tracer.sink.add(self.spans)


def server_attrs(values: Iterable[tuple[str, AttrValue | None]]) -> Attrs:
    """The attributes that have a value (a request that ended early lacks some)."""
    return [(k, v) for k, v in values if v is not None]
