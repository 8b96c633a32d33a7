"""Reading an HTTP/1.1 answer (nvpair.probing.answer): the lean reader decides exactly the plain
answers, and on any bytes in any pieces it says what h11 alone would say, at the same
byte."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nvpair.probing import answer
from nvpair.probing.answer import AnswerReader, ExchangeError

Verdict = tuple[int, "tuple[int, bytes] | str | None"]


def read(reader: AnswerReader | answer._H11Reader, pieces: list[bytes], closed: bool
         ) -> Verdict:
    """(the piece at which it was decided, the answer or "failure: message" or None)."""
    fed = [*pieces, b""] if closed else pieces
    for at, piece in enumerate(fed):
        try:
            got = reader.feed(piece)
        except ExchangeError as exc:
            assert str(exc) and "\n" not in str(exc)
            return at, f"{exc.failure}: {exc}"
        if got is not None:
            return at, got
    return len(fed), None


def both(data: bytes, cuts: list[int], closed: bool, max_body: int, method: str = "GET"
         ) -> tuple[Verdict, Verdict, AnswerReader]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    edges = [0, *points, len(data)]
    pieces = [data[a:b] for a, b in itertools.pairwise(edges) if b > a]
    lean = AnswerReader(method, max_body)
    return (read(lean, pieces, closed),
            read(answer._H11Reader(method, max_body), pieces, closed), lean)


PLAIN_HEADERS = st.lists(st.tuples(
    st.sampled_from([b"content-type", b"Server", b"date", b"x-request-id", b"Connection"]),
    st.sampled_from([b"application/json", b"uvicorn", b"", b"a b", b"close", b"\xc3\xa9"])),
    max_size=4)


def plain(status: int, headers: list[tuple[bytes, bytes]], body: bytes, length: bool,
          ows: bytes = b" ") -> bytes:
    lines = [b"HTTP/1.1 %d OK" % status, *(n + b":" + ows + v for n, v in headers)]
    if length:
        lines.append(b"Content-Length:%s%d" % (ows, len(body)))
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


@settings(max_examples=300, deadline=None)
@given(st.integers(200, 599).filter(lambda s: s not in (204, 304)), PLAIN_HEADERS,
       st.binary(max_size=300), st.booleans(), st.sampled_from([b" ", b"", b"\t "]),
       st.lists(st.integers(0, 400), max_size=5), st.sampled_from(["GET", "POST"]))
def test_the_lean_reader_decides_plain_answers_as_h11_does(
        status: int, headers: list[tuple[bytes, bytes]], body: bytes, length: bool,
        ows: bytes, cuts: list[int], method: str) -> None:
    data = plain(status, headers, body, length, ows)
    lean, ref, reader = both(data, cuts, closed=True, max_body=1000, method=method)
    assert lean == ref == (lean[0], (status, body))
    assert not reader.by_h11


@pytest.mark.parametrize("data", [
    b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\n[]\r\n0\r\n\r\n",
    b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n[]",
    b"HTTP/1.0 200 OK\r\n\r\n[]",
    b"HTTP/1.1 200 OK\ncontent-length: 2\n\n[]",
    b"HTTP/1.1 200 OK\r\nx: a\r\n  folded\r\ncontent-length: 2\r\n\r\n[]",
    b"HTTP/1.1 200 OK\r\ncontent-length: 2, 2\r\n\r\n[]",
], ids=["chunked", "informational", "http10", "bare_lf", "folded", "listed_length"])
def test_any_other_shape_is_h11s_to_read(data: bytes) -> None:
    lean, ref, reader = both(data, [], closed=True, max_body=100)
    assert lean == ref and lean[1] == (200, b"[]")
    assert reader.by_h11


def test_a_head_over_the_limit_is_refused_whatever_its_pieces() -> None:
    data = b"HTTP/1.1 200 OK\r\nx: " + b"a" * answer.MAX_HEAD + b"\r\n\r\n"
    for cuts in ([], [1000], list(range(0, len(data), 4096))):
        _at, verdict = both(data, cuts, closed=True, max_body=10)[0]
        assert verdict == "protocol: Receive buffer too long"


# -- any bytes: the same verdict as h11's, at the same piece --------------------------------

CODES = st.one_of(st.sampled_from([200, 201, 204, 299, 304, 404, 500, 599, 100, 101, 199, 600,
                                   999]), st.integers(100, 999))
STATUS_LINES = st.one_of(
    st.builds(lambda c, r: b"HTTP/1.1 %d%s" % (c, r), CODES,
              st.sampled_from([b" OK", b"", b" ", b" a\tb", b" \xff", b" a\x00", b"  x"])),
    st.sampled_from([b"HTTP/1.0 200 OK", b"http/1.1 200 OK", b"HTTP/1.1 2000 OK",
                     b" HTTP/1.1 200 OK", b"HTTP/2 200", b""]),
    st.binary(max_size=16))
HEADER_LINES = st.one_of(
    st.builds(lambda n, v: n + b":" + v,
              st.sampled_from([b"content-length", b"Content-Length", b"transfer-encoding",
                               b"server", b"x", b"", b"a b", b"\xff"]),
              st.sampled_from([b" 2", b"2", b" 02", b" -1", b" 2 ", b" 2, 2", b" 1, 2",
                               b" 99999999999999999999999", b" chunked", b" gzip", b"",
                               b" a\x00b", b" \x7f", b"\t", b" a\rb"])),
    st.sampled_from([b" folded", b"\tfolded", b"no colon"]),
    st.binary(max_size=12))


@st.composite
def answers(draw: st.DrawFn) -> bytes:
    eol = draw(st.sampled_from([b"\r\n", b"\r\n", b"\r\n", b"\n"]))
    body = draw(st.binary(max_size=40))
    head = [draw(STATUS_LINES), *draw(st.lists(st.one_of(PLAIN_HEADERS.map(
        lambda hs: b"; ".join(n + b": " + v for n, v in hs)), HEADER_LINES), max_size=4))]
    for _ in range(draw(st.integers(0, 2))):  # a length near the body's (or two)
        head.insert(draw(st.integers(1, len(head))), b"content-length: %d" % max(
            0, len(body) + draw(st.integers(-3, 3))))
    data = eol.join(head) + eol + draw(st.sampled_from([b"\r\n", b"\r\n", b"\n", b""]))
    if draw(st.booleans()):  # a chunked body, well or badly framed
        body = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body) + draw(st.binary(max_size=4))
    data += body
    if draw(st.booleans()):  # a byte changed anywhere
        at = draw(st.integers(0, max(0, len(data) - 1)))
        data = data[:at] + bytes([draw(st.integers(0, 255))]) + data[at + 1:]
    return data


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(answers(), st.binary(max_size=200)),
       st.lists(st.integers(0, 300), max_size=5), st.booleans(), st.integers(0, 50),
       st.sampled_from(["GET", "POST", "HEAD"]))
def test_any_bytes_get_h11s_verdict(data: bytes, cuts: list[int], closed: bool,
                                    max_body: int, method: str) -> None:
    lean, ref, _ = both(data, cuts, closed, max_body, method)
    assert lean == ref
