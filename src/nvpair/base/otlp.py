"""Finished spans, and the OTLP protobuf they are exported as, written by hand.

``encode_spans`` writes an ``ExportTraceServiceRequest`` (opentelemetry-proto's
``collector/trace/v1``): one resource (its attributes: ``service.name`` and the node), one
instrumentation scope, the spans. Only what nvpair's spans use is written: ids, parent,
name, kind, times, attributes (string, bool, int, float) and status. The tests decode the
bytes with the ``opentelemetry-proto`` messages.

Why by hand: per routed request of five spans, the OpenTelemetry SDK cost 130 to 230 µs
of the event loop's time and its OTLP encoding ~100 µs more, against 14 µs and 17 µs here
(``python -m benchmarks.tracing_cost``; docs/observability.md).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

AttrValue = str | bool | int | float
Attrs = list[tuple[str, AttrValue]]

#: SpanKind (trace.proto)
INTERNAL, SERVER, CLIENT = 1, 2, 3
#: Status.StatusCode (trace.proto): unset, ok, error
UNSET, OK, ERROR = 0, 1, 2

_double = struct.Struct("<d").pack
_fixed64 = struct.Struct("<Q").pack
_fixed32 = struct.Struct("<I").pack


@dataclass(slots=True)
class Span:
    """One finished span: ids are bytes (16 and 8), times are Unix nanoseconds."""

    trace_id: bytes
    span_id: bytes
    parent_id: bytes  # b"": a root span
    name: str
    kind: int
    start_ns: int
    end_ns: int
    attrs: Attrs = field(default_factory=list)
    status: int = UNSET
    message: str = ""
    #: the W3C trace flags: 1, sampled
    flags: int = 1


def _varint(n: int) -> bytes:
    if n < 0:  # int64: two's complement in ten bytes
        n += 1 << 64
    if n < 0x80:
        return _SMALL[n]
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


_SMALL = [bytes((n,)) for n in range(0x80)]


def _field(tag: bytes, payload: bytes) -> bytes:
    """A length-delimited field (wire type 2) whose tag byte is ``tag``."""
    n = len(payload)
    return tag + (_SMALL[n] if n < 0x80 else _varint(n)) + payload


def _text(tag: bytes, value: str) -> bytes:
    return _field(tag, value.encode("utf-8", "replace"))


# the tags (field number << 3 | wire type) of the fields written
_T1, _T2, _T4, _T5, _T9, _T15 = b"\x0a", b"\x12", b"\x22", b"\x2a", b"\x4a", b"\x7a"


def _any_value(value: AttrValue) -> bytes:
    """An ``AnyValue``: string 1, bool 2, int 3, double 4 (bool before int: a bool is one)."""
    if isinstance(value, str):
        return _text(_T1, value)
    if isinstance(value, bool):
        return b"\x10\x01" if value else b"\x10\x00"
    if isinstance(value, int):
        return b"\x18" + _varint(value)
    return b"\x21" + _double(value)


#: encoded ``KeyValue`` fields by (tag, key, value): most attributes repeat from span to
#: span (engine, route, model, status), and a hit costs a dict lookup, not ~1.5 µs; values
#: that seldom repeat (ids, sizes, times) are never kept, so they do not churn it
_KV: dict[tuple[bytes, str, type, AttrValue], bytes] = {}
_KV_MAX = 4096
#: the keys whose values are ids, unique to a request (nvpair's request id)
UNIQUE_KEYS = frozenset({"nvpair.request_id"})


def _key_value(tag: bytes, key: str, value: AttrValue) -> bytes:
    """One ``KeyValue`` in a repeated field of tag ``tag``."""
    cacheable = (isinstance(value, bool)
                 or (isinstance(value, int) and -1024 <= value < 1024)
                 or (isinstance(value, str) and len(value) <= 64 and key not in UNIQUE_KEYS))
    if cacheable:  # (the type is in the key: True and 1 are equal, not the same value)
        hit = _KV.get((tag, key, type(value), value))
        if hit is not None:
            return hit
    encoded = _field(tag, _text(_T1, key) + _field(_T2, _any_value(value)))
    if cacheable:
        if len(_KV) >= _KV_MAX:
            _KV.clear()
        _KV[(tag, key, type(value), value)] = encoded
    return encoded


def encode_span(span: Span) -> bytes:
    """One ``Span`` message's bytes (without its own tag and length)."""
    out = [_field(_T1, span.trace_id), _field(_T2, span.span_id)]
    if span.parent_id:
        out.append(_field(_T4, span.parent_id))
    out += [_text(_T5, span.name), b"\x30" + _varint(span.kind),
            b"\x39" + _fixed64(span.start_ns), b"\x41" + _fixed64(span.end_ns)]
    out += [_key_value(_T9, key, value) for key, value in span.attrs]
    if span.status or span.message:
        status = (_text(_T2, span.message) if span.message else b"") + (
            b"\x18" + _varint(span.status) if span.status else b"")
        out.append(_field(_T15, status))
    out.append(b"\x85\x01" + _fixed32(span.flags))  # (field 16, fixed32)
    return b"".join(out)


def encode_request(resource: Attrs, scope: str, spans: list[bytes]) -> bytes:
    """An ``ExportTraceServiceRequest`` of spans already encoded (``encode_span``)."""
    scope_spans = _field(_T1, _text(_T1, scope)) + b"".join(_field(_T2, s) for s in spans)
    attributes = b"".join(_key_value(_T1, key, value) for key, value in resource)
    resource_spans = _field(_T1, attributes) + _field(_T2, scope_spans)
    return _field(_T1, resource_spans)
