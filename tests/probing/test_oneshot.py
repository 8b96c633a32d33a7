"""One request on a connection of its own (nvpair.probing.oneshot): answers read right in every
framing HTTP/1.1 has, every hostile answer one ExchangeError, and the connection closed
however the exchange ends (cancelled included)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Awaitable, Callable

import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tests.raw_http import Request, read_request, serve_streams

from nvpair.probing import oneshot
from nvpair.probing.oneshot import ExchangeError, Target

Answer = Callable[[trio.SocketStream, Request], Awaitable[None]]
HEADERS = [(b"host", b"e"), (b"user-agent", b"nvpair-probe")]


class Scripted:
    """A raw engine on 127.0.0.1 that reads one request per connection, answers with
    ``answer``, and records the request and when it saw the client close."""

    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self.seen: list[Request] = []
        self.client_closed = trio.Event()

    async def handle(self, stream: trio.SocketStream) -> None:
        try:
            request, _ = await read_request(stream)
            if request is None:
                return
            self.seen.append(request)
            await self.answer(stream, request)
            while await stream.receive_some(65536):  # until the client closes
                pass
            self.client_closed.set()
        except trio.BrokenResourceError:
            self.client_closed.set()  # (reset by the client: closed too)
        except trio.ClosedResourceError:
            self.client_closed.set()  # (the engine closed it itself: nothing to wait for)
        finally:
            await stream.aclose()


async def start(nursery: trio.Nursery, answer: Answer) -> tuple[Scripted, Target]:
    engine = Scripted(answer)
    port = await nursery.start(serve_streams, engine.handle)
    return engine, Target("127.0.0.1", port)


def send(data: bytes, *, close: bool = False) -> Answer:
    async def answer(stream: trio.SocketStream, request: Request) -> None:
        await stream.send_all(data)
        if close:
            await stream.aclose()
    return answer


async def test_an_answer_by_content_length_and_the_request_it_answers(nursery) -> None:
    engine, target = await start(nursery, send(
        b"HTTP/1.1 200 OK\r\ncontent-length: 15\r\n\r\n{\"status\":\"ok\"}"))
    with trio.fail_after(10):
        status, body = await oneshot.exchange(
            target, "POST", "/health", [*HEADERS, (b"content-length", b"0")],
            max_body=1024)
        await engine.client_closed.wait()  # (the connection is closed after the answer)
    assert (status, body) == (200, b'{"status":"ok"}')
    (request,) = engine.seen
    assert (request.method, request.path) == ("POST", "/health")
    assert request.headers["connection"] == "close"
    assert request.headers["host"] == "e" and request.headers["user-agent"] == "nvpair-probe"


@pytest.mark.parametrize("answer", [
    # chunked, with a chunk extension and a trailer
    b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
    b"3;x=y\r\n[1,\r\n2\r\n2]\r\n0\r\nx-trailer: t\r\n\r\n",
    # no length: the body runs until the engine closes (HTTP/1.0 style)
    b"HTTP/1.0 200 OK\r\n\r\n[1,2]",
    # a 1xx before the answer
    b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n[1,2]",
], ids=["chunked", "until_close", "informational_first"])
async def test_every_framing_gives_the_same_body(answer: bytes, nursery) -> None:
    _, target = await start(nursery, send(answer, close=b"HTTP/1.0" in answer))
    with trio.fail_after(10):
        assert await oneshot.exchange(target, "GET", "/", HEADERS, max_body=64) == (200, b"[1,2]")


async def reset(stream: trio.SocketStream, request: Request) -> None:
    await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n{")
    stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\0\0\0\0\0\0\0")
    await stream.aclose()  # (linger 0: a reset, not a close)


@pytest.mark.parametrize(("answer", "failure", "words"), [
    (send(b"", close=True), "protocol", "closed the connection without answering"),
    (send(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\n{}", close=True), "protocol",
     "closed the connection before its answer was complete"),
    (send(b"HTTP/1.1 200 OK\r\ncontent-le", close=True), "protocol",
     "closed the connection before its answer was complete"),
    (send(b"SSH-2.0-OpenSSH_9.6\r\n\x00\xff\r\n\r\n"), "protocol", "illegal status line"),
    (send(b"HTTP/1.1 200 OK\r\n" + b"x-filler: " + b"x" * (oneshot.MAX_HEAD + 1)),
     "protocol", "Receive buffer too long"),
    (send(b"HTTP/1.1 200 OK\r\ncontent-length: 1\r\ncontent-length: 2\r\n\r\n"),
     "protocol", "content-length"),
    (send(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n"), "protocol", ""),
    (send(b"HTTP/1.1 200 OK\r\ncontent-length: 2000\r\n\r\n" + b"x" * 2000), "too_big",
     "more than 1024 bytes"),
    (reset, "read", "Connection reset"),
], ids=["nothing", "short_body", "short_head", "not_http", "big_head", "two_lengths",
        "bad_chunk", "too_big", "reset"])
async def test_a_hostile_answer_is_one_error_and_the_connection_is_closed(
        answer: Answer, failure: str, words: str, nursery) -> None:
    engine, target = await start(nursery, answer)
    with trio.fail_after(10):
        with pytest.raises(ExchangeError) as caught:
            await oneshot.exchange(target, "GET", "/v1/models", HEADERS, max_body=1024)
        await engine.client_closed.wait()
    assert caught.value.failure == failure
    assert words.lower() in str(caught.value).lower() and "\n" not in str(caught.value)


async def test_a_refused_connection_is_a_connect_failure() -> None:
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    await listeners[0].aclose()  # nothing listens there now
    with trio.fail_after(10), pytest.raises(ExchangeError) as caught:
        await oneshot.exchange(Target("127.0.0.1", port), "GET", "/", HEADERS, max_body=1)
    assert caught.value.failure == "connect" and "refused" in str(caught.value).lower()


async def test_a_cancelled_exchange_closes_its_connection(nursery) -> None:
    """Cancelled in the middle of the body (a probe's deadline): the socket is closed at
    once, so the engine sees the close; no pool slot or socket is left behind."""
    engine, target = await start(nursery, send(
        b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n{\"half\""))
    with trio.fail_after(10):
        with trio.move_on_after(0.3) as scope:
            await oneshot.exchange(target, "GET", "/", HEADERS, max_body=1024)
        assert scope.cancelled_caught
        await engine.client_closed.wait()


async def test_a_name_is_resolved_and_connected(nursery) -> None:
    _, target = await start(nursery, send(b"HTTP/1.1 204 No Content\r\n\r\n"))
    named = Target("localhost", target.port)
    assert named.family is None and target.family == socket.AF_INET
    assert Target("::1", 1).family == socket.AF_INET6
    with trio.fail_after(10):
        try:
            answer = await oneshot.exchange(named, "GET", "/", HEADERS, max_body=1)
        except ExchangeError as exc:  # (localhost may resolve to ::1 first, not listened on)
            pytest.skip(f"localhost does not reach 127.0.0.1 here: {exc}")
    assert answer == (204, b"")


def test_the_request_is_encoded_with_connection_close() -> None:
    request = oneshot.encode_request("GET", "/health", [(b"host", b"e")])
    assert request == b"GET /health HTTP/1.1\r\nhost: e\r\nconnection: close\r\n\r\n"
    with pytest.raises(ExchangeError) as caught:
        oneshot.encode_request("GET", "/", [(b"host", b"e"), (b"authorization", b"a\r\nb")])
    assert caught.value.failure == "protocol" and "cannot send" in str(caught.value)


# -- any bytes an engine sends: an answer or one ExchangeError, never anything else ------------

def over_memory(answer: bytes, cuts: list[int], max_body: int) -> tuple[int, bytes] | str:
    """``answer`` sent in pieces cut at ``cuts``, then the engine's side closed."""
    async def main() -> tuple[int, bytes] | str:
        ours, theirs = trio.testing.memory_stream_pair()

        async def engine() -> None:
            await theirs.receive_some()
            at = 0
            try:
                for cut in [*sorted({c % (len(answer) + 1) for c in cuts}), len(answer)]:
                    await theirs.send_all(answer[at:cut])
                    at = cut
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass  # (the client stopped reading: an error, or the answer is complete)
            await theirs.aclose()

        result: tuple[int, bytes] | str
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(engine)
                try:
                    result = await oneshot.exchange_on(ours, "GET", "/", HEADERS,
                                                       max_body=max_body)
                except ExchangeError as exc:
                    assert str(exc) and "\n" not in str(exc)
                    result = exc.failure
                finally:
                    await ours.aclose()
        return result
    return trio.run(main)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(st.binary(max_size=300),
                 st.builds(lambda head, rest: b"HTTP/1.1 " + head + b"\r\n" + rest,
                           st.binary(max_size=40), st.binary(max_size=200))),
       st.lists(st.integers(0, 400), max_size=4), st.integers(0, 64))
def test_any_bytes_are_an_answer_or_one_error(answer: bytes, cuts: list[int],
                                              max_body: int) -> None:
    result = over_memory(answer, cuts, max_body)
    if isinstance(result, tuple):
        status, body = result
        assert 200 <= status < 600 and len(body) <= max_body
    else:
        assert result in ("protocol", "read", "too_big")


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=2000), st.sampled_from(["length", "chunked", "close"]),
       st.integers(200, 599).filter(lambda s: s not in (204, 304)),
       st.lists(st.integers(0, 3000), max_size=5), st.integers(1, 700))
def test_a_well_framed_answer_gives_its_body(body: bytes, framing: str, status: int,
                                             cuts: list[int], chunk: int) -> None:
    if framing == "length":
        answer = b"HTTP/1.1 %d X\r\ncontent-length: %d\r\n\r\n%s" % (status, len(body), body)
    elif framing == "chunked":
        pieces = [body[i:i + chunk] for i in range(0, len(body), chunk)]
        answer = (b"HTTP/1.1 %d X\r\ntransfer-encoding: chunked\r\n\r\n" % status
                  + b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n")
    else:
        answer = b"HTTP/1.0 %d X\r\n\r\n%s" % (status, body)
    assert over_memory(answer, cuts, 2000) == (status, body)
    if body:  # one byte less allowed: refused, not cut
        assert over_memory(answer, cuts, len(body) - 1) == "too_big"


async def test_an_engine_that_never_stops_sending_cannot_hold_the_loop() -> None:
    """An engine that pumps 1xx heads without end (none of them counts toward the body's
    cap) from a thread of its own, as fast as the socket takes them: every read finds
    bytes waiting, yet the exchange yields at each one, so its deadline fires on time and
    the rest of the loop runs meanwhile."""
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def pump() -> None:
        conn, _ = listener.accept()
        conn.settimeout(0.5)
        heads = b"HTTP/1.1 100 Continue\r\n\r\n" * 4096
        until = time.monotonic() + 5.0
        with conn:
            while not stop.is_set() and time.monotonic() < until:
                try:
                    conn.sendall(heads)
                except TimeoutError:
                    continue
                except OSError:
                    return

    thread = threading.Thread(target=pump, daemon=True)
    thread.start()
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            await trio.sleep(0.01)
            ticks += 1

    target = Target("127.0.0.1", listener.getsockname()[1])
    try:
        with trio.fail_after(20):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(tick)
                started = trio.current_time()
                with trio.move_on_after(0.5) as scope:
                    await oneshot.exchange(target, "GET", "/", HEADERS, max_body=1024)
                took = trio.current_time() - started
                nursery.cancel_scope.cancel()
    finally:
        stop.set()
        thread.join(5)
        listener.close()
    assert scope.cancelled_caught
    assert took < 3.0, took  # (held, it ran until the pump stopped: 5 s)
    assert ticks >= 3, ticks  # (held, it would not tick until the exchange ended)
