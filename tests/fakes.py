"""Fakes for unit tests of one probe or loop: an engine as an httpx2.MockTransport handler."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import httpx2
import msgspec
import trio

from nvpair.config import Config, EngineConfig, EngineSpec, resolve
from nvpair.manifest import BUILTIN_KINDS


def engine_spec(kind: str = "vllm", **kw: object) -> EngineSpec:
    assert kind in BUILTIN_KINDS or kind.endswith(".json")
    cfg = Config(engines=(msgspec.convert({"name": kw.pop("name", "e"), "kind": kind, **kw},
                                          EngineConfig),))
    from pathlib import Path

    return resolve(cfg, "test.toml", Path.cwd()).engines[0]


Route = Callable[[httpx2.Request], "httpx2.Response | None"]


class FakeEngine:
    """Answers by path; ``hang`` paths never answer; counts every request by path."""

    def __init__(self, routes: dict[str, tuple[int, object]] | None = None) -> None:
        self.routes = dict(routes or {})
        self.hang: set[str] = set()
        self.refuse = False
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


def vllm_routes(model: str = "m") -> dict[str, tuple[int, object]]:
    return {
        "/health": (200, ""),
        "/version": (200, {"version": "0.33.0"}),
        "/v1/models": (200, {"object": "list", "data": [
            {"id": model, "object": "model", "created": 1, "owned_by": "vllm"}]}),
    }
