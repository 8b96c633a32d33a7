"""Reading HTTP/1.1 requests off a raw socket, for the tests' hand-written servers (stub
engines, an etcd stand-in, scripted engines) that must answer byte by byte as told."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import NamedTuple

import trio


class Request(NamedTuple):
    method: str
    path: str
    headers: dict[str, str]  # names in lower case
    body: bytes


async def read_request(stream: trio.SocketStream, buffer: bytes = b""
                       ) -> tuple[Request | None, bytes]:
    """The next request on ``stream`` (with its body, by Content-Length) and the bytes read
    past it; ``None`` when the client closes first. ``buffer``: bytes left from before."""
    while b"\r\n\r\n" not in buffer:
        data = await stream.receive_some(65536)
        if not data:
            return None, buffer
        buffer += data
    head, _, buffer = buffer.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    method, path, _ = [*lines[0].split(" ", 2), "", ""][:3]
    headers = {name.strip().lower(): value.strip()
               for name, _, value in (line.partition(":") for line in lines[1:]) if name}
    length = int(headers.get("content-length", "0") or 0)
    while len(buffer) < length:
        data = await stream.receive_some(65536)
        if not data:
            return None, buffer
        buffer += data
    return Request(method, path, headers, buffer[:length]), buffer[length:]


async def serve_streams(handler: Callable[[trio.SocketStream], Awaitable[object]], *,
                        task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED
                        ) -> None:
    """``handler`` for every connection to a free port of 127.0.0.1, until cancelled.
    Started value: the port."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.serve_listeners, handler, listeners)
        task_status.started(listeners[0].socket.getsockname()[1])
