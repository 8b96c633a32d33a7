"""What tracing costs per routed request: the OpenTelemetry SDK against nvpair's own spans.

``python -m benchmarks.tracing_cost [--requests N]``

Each "request" is what the router records for a cold routed request: a server span with
its thirteen attributes and four children (queue, activation, eviction, upstream), each
with two or three attributes. Two costs are timed apart, as they fall apart:

* on the event loop: making and ending the spans and handing them to the exporter (the
  SDK: ``start_span``/``set_attribute``/``end`` with a ``BatchSpanProcessor``, whose
  ``on_end`` queues the span; nvpair: ``nvpair.router.tracing.RequestTrace`` and
  ``SpanExporter.add``);
* in the exporter's thread: encoding the batch as OTLP protobuf (the SDK's
  ``encode_spans(...).SerializeToString()``, which is what its OTLP/HTTP exporter sends;
  nvpair: ``nvpair.base.otlp``). It holds the interpreter (the GIL) while it runs, so it
  is CPU the loop does not have either.

Needs ``opentelemetry-sdk`` and ``opentelemetry-exporter-otlp-proto-http`` (not nvpair's
dependencies: ``pip install`` them into the venv to measure). The SDK's exporter points at
a closed port and its processor is shut down before it would send: only encoding is timed.
"""

from __future__ import annotations

import argparse
import secrets
import statistics
import time
from typing import Any

import trio

from nvpair.base.otlp import encode_request, encode_span
from nvpair.router.tracing import RequestTrace, Tracer, server_attrs

SERVER_ATTRS: dict[str, Any] = {
    "http.request.method": "POST", "http.route": "/v1/chat/completions",
    "http.response.status_code": 200, "nvpair.request_id": "85d0b69333e45a5856d6a09a931d4edf",
    "gen_ai.request.model": "model-b", "gen_ai.operation.name": "chat", "nvpair.key": "team",
    "nvpair.engine": "b", "nvpair.node": "node-1", "nvpair.streaming": False,
    "nvpair.response.bytes": 314, "nvpair.queue_ms": 833, "nvpair.first_chunk_ms": 918}
CHILDREN: list[tuple[str, dict[str, Any]]] = [
    ("queue", {"nvpair.engine": "b", "nvpair.engine.priority": 2, "nvpair.queue.position": 0}),
    ("activation", {"nvpair.engine": "b", "nvpair.activation": "start",
                    "nvpair.engine.startup_s": 0.808}),
    ("eviction", {"nvpair.engine": "a", "nvpair.eviction.in_flight": 0,
                  "nvpair.eviction.bytes": 6_000_000_000}),
    ("upstream", {"nvpair.engine": "b", "http.response.status_code": 200})]


class Kept:
    """A sink that keeps what it gets (the buffer's append, without the thread)."""

    def __init__(self) -> None:
        self.spans: list[Any] = []

    def add(self, spans: list[Any]) -> None:
        self.spans.extend(spans)


def best_of(runs: list[float]) -> float:
    return statistics.median(runs)


def server_values(i: int) -> dict[str, Any]:
    """The server span's attributes of request ``i``: its id, size and times its own."""
    return {**SERVER_ATTRS, "nvpair.request_id": secrets.token_hex(16),
            "nvpair.response.bytes": 300 + i % 5000, "nvpair.queue_ms": 800 + i % 700,
            "nvpair.first_chunk_ms": 900 + i % 900}


async def lean(requests: int) -> tuple[float, float]:
    """(µs on the loop, µs encoding) per request, nvpair's own spans."""
    sink = Kept()
    tracer = Tracer(sink, 1.0, node="node-1")
    loop_us: list[float] = []
    for _ in range(5):
        sink.spans.clear()
        values = [server_values(i) for i in range(requests)]
        began = time.perf_counter()
        for i in range(requests):
            trace = RequestTrace(tracer, tracer.new_id(16), b"", "POST /v1/chat/completions")
            for name, attrs in CHILDREN:
                span = trace.start(name, attrs=list(attrs.items()))
                trace.end(span)
            trace.finish(server_attrs(values[i].items()), 200)
        loop_us.append((time.perf_counter() - began) / requests * 1e6)
    spans = sink.spans[-requests * 5:]
    encode_us: list[float] = []
    for _ in range(5):
        began = time.perf_counter()
        for i in range(0, len(spans), 512):
            encode_request([("service.name", "nvpair")], "nvpair",
                           [encode_span(s) for s in spans[i:i + 512]])
        encode_us.append((time.perf_counter() - began) / requests * 1e6)
    return best_of(loop_us), best_of(encode_us)


def sdk(requests: int) -> tuple[float, float]:
    """(µs on the loop, µs encoding) per request, the OpenTelemetry SDK's."""
    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

    class Keep(SpanExporter):
        def __init__(self) -> None:
            self.spans: list[ReadableSpan] = []

        def export(self, spans: Any) -> SpanExportResult:
            self.spans.extend(spans)
            return SpanExportResult.SUCCESS

    OTLPSpanExporter(endpoint="http://127.0.0.1:9/v1/traces")  # (its import and set-up)
    keep = Keep()
    provider = TracerProvider(resource=Resource.create({"service.name": "nvpair"}))
    # the batch processor's queue is what on_end costs the loop; its thread hands the
    # spans to Keep, which holds them for the encoding below
    provider.add_span_processor(BatchSpanProcessor(keep, max_queue_size=1 << 20,
                                                   schedule_delay_millis=50))
    tracer = provider.get_tracer("nvpair")
    loop_us: list[float] = []
    for _ in range(5):
        values = [server_values(i) for i in range(requests)]
        began = time.perf_counter()
        for i in range(requests):
            server = tracer.start_span("POST /v1/chat/completions",
                                       kind=trace.SpanKind.SERVER)
            context = trace.set_span_in_context(server)
            for name, attrs in CHILDREN:
                child = tracer.start_span(name, context=context)
                for k, v in attrs.items():
                    child.set_attribute(k, v)
                child.end()
            for k, v in values[i].items():
                server.set_attribute(k, v)
            server.end()
        loop_us.append((time.perf_counter() - began) / requests * 1e6)
    provider.shutdown()
    spans = keep.spans[-requests * 5:]
    encode_us: list[float] = []
    for _ in range(5):
        began = time.perf_counter()
        for i in range(0, len(spans), 512):
            encode_spans(spans[i:i + 512]).SerializeToString()
        encode_us.append((time.perf_counter() - began) / requests * 1e6)
    return best_of(loop_us), best_of(encode_us)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.tracing_cost")
    p.add_argument("--requests", type=int, default=5000)
    args = p.parse_args(argv)
    mine = trio.run(lean, args.requests)
    theirs = sdk(args.requests)
    print(f"per request of 5 spans ({args.requests} requests, median of 5 runs)")
    print(f"  {'':28} {'on the loop':>12} {'encoding':>10}")
    for name, (loop, enc) in (("OpenTelemetry SDK + OTLP", theirs), ("nvpair (lean)", mine)):
        print(f"  {name:28} {loop:>9.1f} µs {enc:>7.1f} µs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
