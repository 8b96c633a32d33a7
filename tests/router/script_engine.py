"""A scripted OpenAI-compatible engine on a real socket, for router tests.

GET /v1/models lists ``model``. POST answers with a fixed byte script: a list of
(delay_s, bytes) writes, then close (the body is delimited by the close, so chunks reach
the client exactly as written). It records every request and the moment it saw each
client connection close, so tests can measure how fast an abort reaches the engine.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec
import trio
from tests.raw_http import read_request

Script = list[tuple[float, bytes]]
#: what a client of the router sends (it refuses a POST whose body is not said to be JSON)
JSON = {"content-type": "application/json"}

SSE_HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"cache-control: no-cache\r\nconnection: close\r\n\r\n")


def sse_script(n: int, gap: float = 0.0, model: str = "m") -> Script:
    events: Script = [(0.0, SSE_HEAD)]
    for i in range(n):
        chunk = {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": model,
                 "choices": [{"index": 0, "delta": {"content": f"t{i} "}, "finish_reason": None}]}
        events.append((gap, b"data: " + msgspec.json.encode(chunk) + b"\n\n"))
    events.append((gap, b"data: [DONE]\n\n"))
    return events


def json_script(doc: object, delay: float = 0.0, status: bytes = b"200 OK") -> Script:
    body = msgspec.json.encode(doc)
    head = (b"HTTP/1.1 " + status + b"\r\ncontent-type: application/json\r\ncontent-length: "
            + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n")
    return [(delay, head + body)]


class ScriptEngine:
    def __init__(self, model: str = "m") -> None:
        self.model = model
        self.port = 0
        #: the status GET /v1/models answers (its probes fail with another one)
        self.models_status = b"200 OK"
        self.script: Callable[[str, bytes], Script] = lambda path, body: json_script({"ok": 1})
        self.requests: list[tuple[str, bytes, dict[str, str]]] = []
        self.closed_at: list[float] = []
        self.connections = 0
        self.posts = 0
        self.in_flight = 0
        self.closed = trio.Event()
        self.refusing = trio.Event()

    async def serve(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
                    port: int = 0) -> None:
        listeners = await trio.open_tcp_listeners(port, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        self._accepting = trio.CancelScope()
        async with trio.open_nursery() as nursery:
            self._handlers = nursery
            nursery.start_soon(self._accept, listeners)
            task_status.started(self.port)

    async def _accept(self, listeners: list[trio.SocketListener]) -> None:
        with self._accepting:
            await trio.serve_listeners(self._handle, listeners, handler_nursery=self._handlers)
        for listener in listeners:
            await listener.aclose()
        self.refusing.set()

    async def close_listener(self) -> None:
        """Refuse new connections from now on (as a dead engine's port does)."""
        self._accepting.cancel()
        await self.refusing.wait()

    async def _handle(self, stream: trio.SocketStream) -> None:
        self.connections += 1
        buffer = b""
        try:
            request, _ = await read_request(stream, buffer)
            if request is None:
                return
            method, path, headers, rest = request
            if method == "GET" and path.startswith("/v1/models"):
                doc = {"object": "list", "data": [{"id": self.model, "object": "model",
                                                   "created": 1, "owned_by": "script"}]}
                for _, data in json_script(doc, status=self.models_status):
                    await stream.send_all(data)
                return
            self.posts += 1
            self.in_flight += 1
            self.requests.append((path, rest, headers))
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._watch_close, stream, nursery.cancel_scope)
                    for delay, data in self.script(path, rest):
                        if delay:
                            await trio.sleep(delay)
                        await stream.send_all(data)
                    nursery.cancel_scope.cancel()
            finally:
                self.in_flight -= 1
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            await stream.aclose()

    async def _watch_close(self, stream: trio.SocketStream, scope: trio.CancelScope) -> None:
        try:
            while await stream.receive_some(65536):
                pass
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        self.closed_at.append(trio.current_time())
        self.closed.set()
        scope.cancel()
