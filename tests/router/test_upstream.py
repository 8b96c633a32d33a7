"""The router's engine pool (httpcore2 directly) under cancellation: the guarantee httpx2 was
chosen for (no pool slot lost when a request is cancelled) holds on this path too."""

from __future__ import annotations

import contextlib
import random
from pathlib import Path

import pytest
import trio
from tests.test_http_client import fd_count, sockets

from nvpair.config.settings import Config, EngineConfig, RouterConfig, resolve
from nvpair.router.upstream import SEND_ERRORS, Upstream


def upstream(port: int, connections: int, **router: float) -> Upstream:
    cfg = Config(engines=(EngineConfig(name="e", kind="openai", port=port),))
    spec = resolve(cfg, "t", Path.cwd()).engines[0]
    return Upstream.engine(spec, RouterConfig(**router),  # type: ignore[arg-type]
                           max_connections=connections)


async def post_ok(up: Upstream, path: str = "/fast") -> int:
    response = await up.send(path, b"", [], b"")
    try:
        body = b"".join([chunk async for chunk in response.stream])  # type: ignore[union-attr]
    finally:
        await response.aclose()
    assert body == b"ok"
    return response.status


async def test_cancelled_requests_free_their_slots_then_a_request_succeeds(
        stub_port: int) -> None:
    """8 tasks on 4 connections, 1,200 requests cancelled at random points (while waiting for
    a connection too: httpcore #1093's case). A slot lost per cancellation would leave none,
    and the last requests would fail with PoolTimeout after 2 s."""
    rng = random.Random(11)
    baseline = fd_count()
    up = upstream(stub_port, 4, first_byte_timeout_s=2.0)
    with trio.fail_after(60):
        try:
            async def worker() -> None:
                for _ in range(150):
                    with trio.move_on_after(rng.choice((0.0, 0.001, 0.01, 0.05))):
                        with contextlib.suppress(SEND_ERRORS):  # /close: no answer at all
                            await post_ok(up, rng.choice(("/hang", "/hang", "/fast", "/close")))

            async with trio.open_nursery() as nursery:
                for _ in range(8):
                    nursery.start_soon(worker)
            for _ in range(5):
                assert await post_ok(up) == 200
            assert sum(not c.is_idle() for c in up.pool.connections) == 0
        finally:
            await up.aclose()
        assert sockets(stub_port, "established") == 0
    assert fd_count() <= baseline


class ClosingEngine:
    """A raw HTTP/1.1 engine that answers a connection's first request and then judges it
    idle: the connection's next request is met with ``then`` (the bytes it sends, if any)
    and a close, as an engine whose keep-alive timer fired just as the request came."""

    def __init__(self, then: bytes = b"") -> None:
        self.then = then
        self.requests = 0  # every request read, on any connection
        self.connections = 0

    async def handle(self, stream: trio.SocketStream) -> None:
        from tests.raw_http import read_request

        self.connections += 1
        buffer = b""
        async with stream:
            for turn in range(2):
                request, buffer = await read_request(stream, buffer)
                if request is None:
                    return
                self.requests += 1
                if turn == 0:
                    await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                elif self.then:
                    await stream.send_all(self.then)


async def closing_engine(nursery: trio.Nursery, then: bytes = b"") -> tuple[ClosingEngine, int]:
    from tests.raw_http import serve_streams

    engine = ClosingEngine(then)
    port = await nursery.start(serve_streams, engine.handle)
    return engine, port


async def test_a_reused_connection_the_engine_closed_is_sent_again_on_a_new_one(
        nursery) -> None:
    """The second request goes on the kept-alive connection, which the engine closes
    without a byte of answer: it is sent once more on a new connection and answered.
    Before, the pool's error (server disconnected without a response) reached the relay,
    a 502 for a request the engine never took."""
    engine, port = await closing_engine(nursery)
    up = upstream(port, 4)
    with trio.fail_after(10):
        try:
            assert await post_ok(up) == 200
            assert await post_ok(up) == 200  # on the reused connection, then a new one
        finally:
            await up.aclose()
    assert (engine.requests, engine.connections) == (3, 2)


async def test_no_second_send_once_a_byte_of_the_answer_came(nursery) -> None:
    """The engine began its answer (one byte) and closed: the request may have been taken,
    so it is never sent again; the error reaches the caller."""
    engine, port = await closing_engine(nursery, then=b"H")
    up = upstream(port, 4)
    with trio.fail_after(10):
        try:
            assert await post_ok(up) == 200
            with pytest.raises(SEND_ERRORS):
                await post_ok(up)
        finally:
            await up.aclose()
    assert (engine.requests, engine.connections) == (2, 1)


async def test_no_second_send_when_a_new_connection_fails(nursery) -> None:
    """A new connection the engine closes without answering is no stale keep-alive: the
    engine had the request, so it is not sent twice."""
    from tests.raw_http import read_request, serve_streams

    requests = 0

    async def close_at_once(stream: trio.SocketStream) -> None:
        nonlocal requests
        async with stream:
            request, _ = await read_request(stream)
            requests += request is not None

    port = await nursery.start(serve_streams, close_at_once)
    up = upstream(port, 4)
    with trio.fail_after(10):
        try:
            with pytest.raises(SEND_ERRORS):
                await post_ok(up)
        finally:
            await up.aclose()
    assert requests == 1
