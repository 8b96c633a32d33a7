"""W3C traceparent: read strictly, written so that it reads back."""

from __future__ import annotations

import re

from hypothesis import given
from hypothesis import strategies as st

from nvpair.base.traceparent import header, parse

VALID = re.compile(rb"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?",
                   re.DOTALL)


def oracle(raw: bytes) -> bool:
    """The specification's rules, written another way."""
    m = VALID.fullmatch(raw)
    if m is None or m[1] == b"ff":
        return False
    if m[5] is not None and m[1] == b"00":
        return False  # version 00 is exactly 55 characters
    return m[2] != b"0" * 32 and m[3] != b"0" * 16


hexes = st.text(alphabet="0123456789abcdefABCDEF-", min_size=0, max_size=70)


@given(st.one_of(st.binary(max_size=80), hexes.map(str.encode), st.builds(
    lambda v, t, p, f, rest: b"-".join([v, t, p, f]) + rest,
    st.sampled_from([b"00", b"01", b"fe", b"ff", b"0g", b"0"]),
    st.sampled_from([b"4bf92f3577b34da6a3ce929d0e0e4736", b"0" * 32,
                     b"4BF92F3577B34DA6A3CE929D0E0E4736",
                     b"4bf92f3577b34da6a3ce929d0e0e473"]),
    st.sampled_from([b"00f067aa0ba902b7", b"0" * 16, b"00f067aa0ba902b"]),
    st.sampled_from([b"01", b"00", b"ff", b"1", b"0x"]),
    st.sampled_from([b"", b"-", b"-x", b"x", b"\n"]))))
def test_only_a_valid_traceparent_is_read(raw: bytes) -> None:
    got = parse(raw)
    assert (got is not None) == oracle(raw), raw
    if got is not None:
        assert got.trace_id.hex().encode() == raw[3:35]
        assert got.parent_id.hex().encode() == raw[36:52]
        assert got.flags == int(raw[53:55], 16)


@given(st.binary(min_size=16, max_size=16).filter(any),
       st.binary(min_size=8, max_size=8).filter(any), st.booleans())
def test_what_is_written_reads_back(trace_id: bytes, span_id: bytes, sampled: bool) -> None:
    got = parse(header(trace_id, span_id, sampled))
    assert got is not None
    assert (got.trace_id, got.parent_id, got.sampled) == (trace_id, span_id, sampled)


def test_the_examples_of_the_specification() -> None:
    example = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    got = parse(example)
    assert got is not None and got.sampled
    assert parse(example.replace(b"-01", b"-00")).sampled is False  # type: ignore[union-attr]
    assert parse(b"01" + example[2:] + b"-what-comes-later") is not None
    assert parse(example + b"-later") is None  # (version 00 has nothing after)
    assert parse(b"ff" + example[2:]) is None
    assert parse(example.upper()) is None
    assert parse(None) is None
