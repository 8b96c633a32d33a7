"""Fixtures for the simulator tests: start a simulator in the test's nursery and talk to it
over real HTTP on 127.0.0.1 (plain helpers are in helpers.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx2
import pytest
import trio

from nvpair.sim import SimHandle, SimOptions, serve_sim

StartSim = Callable[..., Awaitable[SimHandle]]


@pytest.fixture
def start_sim(nursery: trio.Nursery) -> StartSim:
    """``await start_sim("sglang", ...)``: a simulator in the test nursery, ready and listening
    unless ``ready=False`` (then just started: the port is reserved, maybe not listening)."""

    async def start(kind: str, *, ready: bool = True, **options: Any) -> SimHandle:
        handle: SimHandle = await nursery.start(serve_sim, SimOptions(kind=kind, **options))
        if ready:
            await handle.wait_phase("ready")
            await handle.settle()
        return handle

    return start


@pytest.fixture
async def http() -> AsyncIterator[Callable[[SimHandle], httpx2.AsyncClient]]:
    """``http(handle)``: an AsyncClient on the engine port (closed after the test)."""
    clients: list[httpx2.AsyncClient] = []

    def make(handle: SimHandle, **kwargs: Any) -> httpx2.AsyncClient:
        kwargs.setdefault("timeout", 10.0)
        client = httpx2.AsyncClient(base_url=handle.url, **kwargs)
        clients.append(client)
        return client

    yield make
    for client in clients:
        await client.aclose()
