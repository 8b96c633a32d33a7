"""Helpers for the simulator tests (fixtures are in conftest.py)."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any

import trio

from nvpair.sim import SimHandle


async def elapsed(call: Awaitable[Any]) -> tuple[Any, float]:
    """(result, seconds it took)."""
    start = trio.current_time()
    result = await call
    return result, trio.current_time() - start


async def raw_request(handle: SimHandle, head: str, body: bytes = b"") -> trio.SocketStream:
    """Send a request on a fresh socket and return the socket, unread."""
    stream = await trio.open_tcp_stream("127.0.0.1", handle.port)
    data = head.replace("\n", "\r\n").encode()
    if body:
        data += body
    await stream.send_all(data)
    return stream


def post_head(path: str, body: bytes) -> str:
    return (f"POST {path} HTTP/1.1\nHost: sim\nContent-Type: application/json\n"
            f"Content-Length: {len(body)}\n\n")


async def wait_in_flight(handle: SimHandle, path: str, n: int = 1) -> None:
    await handle.wait_until(lambda s: s.path(path).in_flight >= n)


async def wait_aborted(handle: SimHandle, path: str, n: int = 1) -> None:
    await handle.wait_until(lambda s: s.path(path).aborted >= n)
