"""Fakes for unit tests of one probe or loop: an engine answering by path, on a socket of
127.0.0.1 (``FakeEngine.serve``: the probes reach it as they reach a real engine, a probe
slower than 4 s on a connection of its own, nvpair.probing.oneshot) or as an httpx2.MockTransport
handler (``FakeEngine.transport``: always through the probe client's pool)."""

from __future__ import annotations

import socket
from collections import Counter
from collections.abc import Callable
from http import HTTPStatus

import httpx2
import msgspec
import trio
from tests.raw_http import read_request

from nvpair.config.manifest import BUILTIN_KINDS
from nvpair.config.settings import Config, EngineConfig, EngineSpec, resolve


def engine_spec(kind: str = "vllm", **kw: object) -> EngineSpec:
    assert kind in BUILTIN_KINDS or kind.endswith(".json")
    cfg = Config(engines=(msgspec.convert({"name": kw.pop("name", "e"), "kind": kind, **kw},
                                          EngineConfig),))
    from pathlib import Path

    return resolve(cfg, "test.toml", Path.cwd()).engines[0]


Route = Callable[[httpx2.Request], "httpx2.Response | None"]


async def served(nursery: trio.Nursery, fake: FakeEngine, spec: EngineSpec) -> EngineSpec:
    """``spec`` pointed at ``fake``, which answers on 127.0.0.1 while ``nursery`` runs."""
    port = await nursery.start(fake.serve)
    return msgspec.structs.replace(spec, port=port)


class FakeEngine:
    """Answers by path; ``hang`` paths never answer; counts every request by path;
    ``refuse``: nothing listens (served: the port is closed, and the connections open)."""

    def __init__(self, routes: dict[str, tuple[int, object]] | None = None) -> None:
        self.routes = dict(routes or {})
        self.hang: set[str] = set()
        self._refuse = False
        #: served: the port (the same across ``refuse``), the listening socket while it
        #: listens, the connections open, the nursery they run in
        self.port = 0
        self._listener: trio.socket.SocketType | None = None
        self._open: set[trio.SocketStream] = set()
        self._nursery: trio.Nursery | None = None
        #: served: connections accepted, and the requests by path that asked for their
        #: connection to be closed after the answer (a probe on a connection of its own)
        self.connections = 0
        self.closing: Counter[str] = Counter()
        self.delay: dict[str, float] = {}
        self.counts: Counter[str] = Counter()
        self.times: dict[str, list[float]] = {}  # when each request came, by path
        self.in_flight = 0
        self.max_in_flight = 0

    async def handle(self, request: httpx2.Request) -> httpx2.Response:
        path = request.url.path
        self.counts[path] += 1
        self.times.setdefault(path, []).append(trio.current_time())
        if self.refuse:
            raise httpx2.ConnectError("connection refused", request=request)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if path in self.hang:
                await trio.sleep_forever()
            if path in self.delay:
                await trio.sleep(self.delay[path])
            status, body = self.routes.get(path, (404, "404 page not found"))
            if isinstance(body, str):
                return httpx2.Response(status, text=body)
            return httpx2.Response(status, content=msgspec.json.encode(body))
        finally:
            self.in_flight -= 1

    def transport(self) -> httpx2.MockTransport:
        return httpx2.MockTransport(self.handle)

    @property
    def refuse(self) -> bool:
        return self._refuse

    @refuse.setter
    def refuse(self, value: bool) -> None:
        """Served: closes the port and every open connection at once (a process gone), or
        listens again on the same port."""
        self._refuse = value
        if self._nursery is None:
            return
        if value:
            if self._listener is not None:
                self._listener.close()  # (Trio wakes its accept with ClosedResourceError)
                self._listener = None
            for stream in list(self._open):
                stream.socket.close()
        elif self._listener is None:
            self._listen()

    async def serve(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED
                    ) -> None:
        """Answer on a free port of 127.0.0.1 until cancelled, HTTP/1.1 with keep-alive.
        Started value: the port."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            self._listen()  # (a port of its own even when refusing: kept for later)
            if self._refuse:
                self.refuse = True
            task_status.started(self.port)
            try:
                await trio.sleep_forever()
            finally:
                self._nursery = None
                if self._listener is not None:
                    self._listener.close()

    def _listen(self) -> None:
        """Listen on ``port`` (a free one the first time), sync: connections queue from now."""
        assert self._nursery is not None
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", self.port))
        sock.listen(128)
        self.port = sock.getsockname()[1]
        self._listener = listener = trio.socket.from_stdlib_socket(sock)
        self._nursery.start_soon(self._accept, listener)

    async def _accept(self, listener: trio.socket.SocketType) -> None:
        while True:
            try:
                conn, _ = await listener.accept()
            except (trio.ClosedResourceError, OSError):
                return  # (refusing, or the end)
            assert self._nursery is not None
            self.connections += 1
            self._nursery.start_soon(self._connection, trio.SocketStream(conn))

    async def _answer(self, stream: trio.SocketStream, request: httpx2.Request
                      ) -> httpx2.Response | None:
        """``handle``'s answer; None when the client closed meanwhile, which cuts it short
        (as an engine's work for a request ends when its client goes)."""
        response = None
        async with trio.open_nursery() as nursery:

            async def until_closed() -> None:
                try:
                    data = await stream.receive_some(65536)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    data = b""
                if not data:  # (a client sends nothing more before the answer, or closes)
                    nursery.cancel_scope.cancel()

            nursery.start_soon(until_closed)
            response = await self.handle(request)
            nursery.cancel_scope.cancel()
        return response

    async def _connection(self, stream: trio.SocketStream) -> None:
        self._open.add(stream)
        buffer = b""
        try:
            while True:
                request, buffer = await read_request(stream, buffer)
                if request is None:
                    return
                close = request.headers.get("connection", "").lower() == "close"
                if close:
                    self.closing[request.path] += 1
                response = await self._answer(stream, httpx2.Request(
                    request.method, f"http://127.0.0.1:{self.port}{request.path}",
                    headers=request.headers))
                if response is None:
                    return
                body = response.content
                try:
                    phrase = HTTPStatus(response.status_code).phrase
                except ValueError:
                    phrase = "Other"
                headers = "".join(f"{k}: {v}\r\n" for k, v in response.headers.items()
                                  if k.lower() != "content-length")
                await stream.send_all(
                    f"HTTP/1.1 {response.status_code} {phrase}\r\n{headers}"
                    f"content-length: {len(body)}\r\n\r\n".encode("latin-1") + body)
                if close:
                    return
        except (trio.BrokenResourceError, trio.ClosedResourceError, httpx2.ConnectError):
            return  # (the client went, or the engine "refuses": the connection is cut)
        finally:
            self._open.discard(stream)
            stream.socket.close()


def vllm_routes(model: str = "m") -> dict[str, tuple[int, object]]:
    return {
        "/health": (200, ""),
        "/version": (200, {"version": "0.33.0"}),
        "/v1/models": (200, {"object": "list", "data": [
            {"id": model, "object": "model", "created": 1, "owned_by": "vllm"}]}),
    }
