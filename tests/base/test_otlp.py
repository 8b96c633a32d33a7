"""The hand-written OTLP protobuf, decoded by opentelemetry-proto's own messages."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
)
from tests.otlp_receiver import attrs, value

from nvpair.base.otlp import CLIENT, ERROR, SERVER, Span, encode_request, encode_span

values = st.one_of(st.text(max_size=40), st.booleans(),
                   st.integers(min_value=-2**63, max_value=2**63 - 1),
                   st.floats(allow_nan=False))
spans = st.builds(
    Span, trace_id=st.binary(min_size=16, max_size=16), span_id=st.binary(min_size=8, max_size=8),
    parent_id=st.one_of(st.just(b""), st.binary(min_size=8, max_size=8)),
    name=st.text(max_size=60), kind=st.sampled_from([1, 2, 3]),
    start_ns=st.integers(min_value=0, max_value=2**64 - 1),
    end_ns=st.integers(min_value=0, max_value=2**64 - 1),
    attrs=st.lists(st.tuples(st.text(max_size=20), values), max_size=6),
    status=st.sampled_from([0, 1, 2]), message=st.text(max_size=40),
    flags=st.sampled_from([0, 1]))


def decode(body: bytes) -> ExportTraceServiceRequest:
    request = ExportTraceServiceRequest()
    request.ParseFromString(body)
    return request


@given(st.lists(spans, max_size=5), st.text(min_size=1, max_size=30))
def test_every_span_decodes_as_written(written: list[Span], service: str) -> None:
    body = encode_request([("service.name", service), ("n", 3)], "nvpair",
                          [encode_span(s) for s in written])
    [resource_spans] = decode(body).resource_spans
    assert {kv.key: value(kv.value) for kv in resource_spans.resource.attributes} == {
        "service.name": service, "n": 3}
    [scope_spans] = resource_spans.scope_spans
    assert scope_spans.scope.name == "nvpair"
    assert len(scope_spans.spans) == len(written)
    for got, span in zip(scope_spans.spans, written, strict=True):
        assert (got.trace_id, got.span_id, got.parent_span_id) == (
            span.trace_id, span.span_id, span.parent_id)
        assert (got.name, got.kind, got.flags) == (span.name, span.kind, span.flags)
        assert (got.start_time_unix_nano, got.end_time_unix_nano) == (span.start_ns,
                                                                      span.end_ns)
        assert (got.status.code, got.status.message) == (span.status, span.message)
        want = dict(span.attrs)  # (a key given twice: protobuf keeps both, the dict the last)
        have = attrs(got)
        assert have.keys() == want.keys()
        for key, v in want.items():
            assert type(have[key]) is type(v) and (have[key] == v or (
                isinstance(v, float) and math.isclose(have[key], v)))  # type: ignore[arg-type]


def test_a_server_span_with_an_error_reads_as_the_sdk_writes_it() -> None:
    span = Span(b"\x01" * 16, b"\x02" * 8, b"", "POST /v1/chat/completions", SERVER, 10, 20,
                [("http.response.status_code", 502), ("nvpair.streaming", False)], ERROR,
                "engine e1 failed")
    child = Span(b"\x01" * 16, b"\x03" * 8, b"\x02" * 8, "upstream", CLIENT, 11, 19)
    [got, got_child] = decode(encode_request([], "nvpair", [
        encode_span(span), encode_span(child)])).resource_spans[0].scope_spans[0].spans
    assert got.kind == got.SPAN_KIND_SERVER and got_child.kind == got.SPAN_KIND_CLIENT
    assert got.status.code == got.status.STATUS_CODE_ERROR
    assert got.status.message == "engine e1 failed"
    assert attrs(got) == {"http.response.status_code": 502, "nvpair.streaming": False}
    assert got_child.parent_span_id == got.span_id and not got.parent_span_id
