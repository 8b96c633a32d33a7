"""An OTLP/HTTP trace receiver on a real socket, for the tests: it decodes each POST with
``opentelemetry-proto``'s ``ExportTraceServiceRequest`` and keeps the spans; or, hung, it
reads each request and never answers (a collector that accepts and stalls)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import trio
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
)
from opentelemetry.proto.trace.v1.trace_pb2 import Span
from tests.raw_http import read_request, serve_streams


def value(any_value: object) -> object:
    """An ``AnyValue``'s Python value."""
    kind = any_value.WhichOneof("value")  # type: ignore[attr-defined]
    return None if kind is None else getattr(any_value, kind)


def attrs(span: Span) -> dict[str, object]:
    return {kv.key: value(kv.value) for kv in span.attributes}


@dataclass
class Receiver:
    """The spans received (``spans``), each export's resource attributes and headers."""

    hang: bool = False
    spans: list[Span] = field(default_factory=list)
    resources: list[dict[str, object]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    posts: int = 0
    port: int = 0
    _changed: trio.Event = field(default_factory=trio.Event)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1/traces"

    async def serve(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED
                    ) -> None:
        """Serve until cancelled (on ``port`` if set, else a free one). Started value: the
        port."""
        async with trio.open_nursery() as nursery:
            if self.port:
                listeners = await trio.open_tcp_listeners(self.port, host="127.0.0.1")
                nursery.start_soon(trio.serve_listeners, partial(_handle, self), listeners)
            else:
                self.port = await nursery.start(serve_streams, partial(_handle, self))
            task_status.started(self.port)

    def take(self, body: bytes, headers: dict[str, str]) -> None:
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        self.headers.append(headers)
        for resource_spans in request.resource_spans:
            self.resources.append({kv.key: value(kv.value)
                                   for kv in resource_spans.resource.attributes})
            for scope_spans in resource_spans.scope_spans:
                self.spans.extend(scope_spans.spans)
        self.posts += 1
        self.changed()

    def changed(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def wait_for(self, done: Callable[[list[Span]], bool]) -> list[Span]:
        """Wait until the spans received so far satisfy ``done``; then return them."""
        while not done(self.spans):
            await self._changed.wait()
        return self.spans

    async def wait_posts(self, n: int) -> None:
        """Wait until ``n`` POSTs came (answered or, hung, not)."""
        while self.posts < n:
            await self._changed.wait()

    def trace(self, trace_id: bytes) -> list[Span]:
        return [s for s in self.spans if s.trace_id == trace_id]


async def _handle(receiver: Receiver, stream: trio.SocketStream) -> None:
    buffer = b""
    try:
        while True:
            request, buffer = await read_request(stream, buffer)
            if request is None:
                return
            if receiver.hang:  # accepted, read, never answered
                receiver.posts += 1
                receiver.changed()
                while await stream.receive_some(65536):
                    pass
                return
            assert request.path == "/v1/traces", request.path
            assert request.headers["content-type"] == "application/x-protobuf"
            receiver.take(request.body, request.headers)
            await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-type: application/x-protobuf"
                                  b"\r\ncontent-length: 0\r\n\r\n")
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        return
    finally:
        await stream.aclose()


def tree(spans: list[Span]) -> str:
    """The spans of one trace as an indented tree: name, then a few attributes."""
    by_parent: dict[bytes, list[Span]] = {}
    ids = {s.span_id for s in spans}
    for s in sorted(spans, key=lambda s: s.start_time_unix_nano):
        parent = s.parent_span_id if s.parent_span_id in ids else b""
        by_parent.setdefault(parent, []).append(s)
    lines: list[str] = []

    def walk(parent: bytes, depth: int) -> None:
        for s in by_parent.get(parent, []):
            ms = (s.end_time_unix_nano - s.start_time_unix_nano) / 1e6
            shown = {k: v for k, v in attrs(s).items() if not k.startswith("http.request")}
            lines.append(f"{'    ' * depth}{s.name}  {ms:.1f} ms  {shown}")
            walk(s.span_id, depth + 1)

    walk(b"", 0)
    return "\n".join(lines)
