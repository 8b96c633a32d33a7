"""A minimal HTTP/1.1 stub engine on a real socket: /fast, /slow, /hang, /close (keep-alive).

``serve_stub(body=...)`` answers every other path with that body as JSON (a hostile engine).
"""

from __future__ import annotations

from functools import partial

import trio
from tests.raw_http import read_request, serve_streams


async def _handle(stream: trio.SocketStream, body: bytes | None = None) -> None:
    buffer = b""
    try:
        while True:
            request, buffer = await read_request(stream, buffer)
            if request is None:
                return
            path = request.path
            if path == "/hang":  # never answer; close when the client goes
                while await stream.receive_some(65536):
                    pass
                return
            if path == "/slow":
                await trio.sleep(1.0)
            if path == "/close":
                return
            if body is not None and path not in ("/fast", "/slow"):
                await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                                      b"content-length: %d\r\n\r\n%s" % (len(body), body))
                continue
            await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        return
    finally:
        await stream.aclose()


async def serve_stub(*, body: bytes | None = None,
                     task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve until cancelled. Started value: the port."""
    async with trio.open_nursery() as nursery:
        task_status.started(await nursery.start(serve_streams, partial(_handle, body=body)))


async def _main() -> None:
    async with trio.open_nursery() as nursery:
        port = await nursery.start(serve_stub)
        print(port, flush=True)


if __name__ == "__main__":
    trio.run(_main)
