"""The router's engine pool (httpcore2 directly) under cancellation: the guarantee httpx2 was
chosen for (no pool slot lost when a request is cancelled) holds on this path too."""

from __future__ import annotations

import contextlib
import random
from pathlib import Path

import trio
from tests.test_http_client import fd_count, sockets

from nvpair.config import Config, EngineConfig, RouterConfig, resolve
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
