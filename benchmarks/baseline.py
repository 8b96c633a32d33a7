"""The design that failed: a small reference implementation of what the report describes.

This is the earlier engine manager's read path, rebuilt only as far as the report describes
it, on the same server stack as nvpair (a plain ASGI app on hypercorn's trio worker, probes
with httpx2), so that what differs is the design and nothing else:

* ``status(name)`` (``StatusAtPort``) takes the engine's lifecycle lock (``st.opMu``) and,
  holding it, re-runs the readiness probe and then the identity probe on every call, with
  no caching and no deadline (``context.Background()``). The report's readiness probe was
  SGLang's ``GET /health``, which runs a generation (~1 s); identity was
  ``GET /get_model_info``.
* ``GET /v1/models`` (``ModelsResult``) first calls ``status`` for each engine, with an
  unbounded wait for the lock, and only then starts its 5 s budget to list the engines.
* Work started for a request goes on when its client gives up, as a Go handler running
  on ``context.Background()`` does: the probes run in a service-wide nursery and the
  request only waits for their result.

``python -m benchmarks.baseline --listen 127.0.0.1:PORT --engine NAME=URL ...``
serves ``/healthz``, ``/v1/models``, ``/v1/engines`` and ``/v1/engines/{name}``, and
``/debug/backlog`` (status calls queued behind each engine's lock, for the bench).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import Any, TypeVar

import httpx2
import msgspec
import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve

from nvpair.http.asgi import Receive, Scope, Send, lifespan, send_json

T = TypeVar("T")

READY_PATH = "/health"  # the report's readiness probe: SGLang's generating /health
IDENTITY_PATH = "/get_model_info"
MODELS_PATH = "/v1/models"
MODELS_BUDGET_S = 5.0  # ModelsResult's action budget, started after the status calls
NO_DEADLINE_S = 600.0  # context.Background(): in effect no deadline


class Engine:
    def __init__(self, name: str, url: str, client: httpx2.AsyncClient) -> None:
        self.name = name
        self.url = url
        self.client = client
        self.op_mu = trio.Lock()  # the lifecycle lock, also taken by the read path
        self.probes = 0


class Baseline:
    def __init__(self, engines: dict[str, str]) -> None:
        self.engine_urls = engines
        self.engines: dict[str, Engine] = {}
        self._nursery: trio.Nursery | None = None

    async def detached(self, fn: Callable[[], Awaitable[T]]) -> T:
        """Run ``fn`` in the service's nursery and wait for its result; if this request is
        cancelled (its client went away) the work still runs to its end."""
        assert self._nursery is not None
        done = trio.Event()
        box: list[Any] = []

        async def work() -> None:
            try:
                box.append(("ok", await fn()))
            except Exception as exc:
                box.append(("error", exc))
            finally:
                done.set()

        self._nursery.start_soon(work)
        await done.wait()
        kind, value = box[0]
        if kind == "error":
            raise value
        result: T = value
        return result

    async def probe(self, engine: Engine, path: str) -> tuple[bool, int | None, bytes]:
        engine.probes += 1
        try:
            r = await engine.client.get(path, timeout=NO_DEADLINE_S)
        except httpx2.HTTPError:
            return False, None, b""
        return r.status_code == 200, r.status_code, r.content

    async def status(self, name: str) -> dict[str, Any]:
        """StatusAtPort: under opMu, reconcilePresence runs probe(ready) and probe(identity)."""
        engine = self.engines[name]
        async with engine.op_mu:
            ready, code, _ = await self.probe(engine, READY_PATH)
            ident_ok, _, body = await self.probe(engine, IDENTITY_PATH)
        model = None
        if ident_ok:
            try:
                doc = msgspec.json.decode(body)
                model = doc.get("served_model_name") or doc.get("model_path")
            except (msgspec.DecodeError, AttributeError):
                model = None
        return {"name": name, "url": engine.url, "state": "ready" if ready else "unhealthy",
                "ready_status": code, "model": model}

    async def models(self) -> dict[str, Any]:
        """ModelsResult: Status per engine first (unbounded), then the 5 s budget."""
        statuses = {}
        for name in self.engines:
            statuses[name] = await self.status(name)
        data: list[dict[str, Any]] = []

        async def list_one(engine: Engine) -> None:
            try:
                r = await engine.client.get(MODELS_PATH, timeout=NO_DEADLINE_S)
                items = r.json().get("data") or []
            except (httpx2.HTTPError, ValueError, AttributeError):
                return
            for item in items:
                data.append({"id": item.get("id"), "object": "model",
                             "created": item.get("created", 0), "owned_by": engine.name})

        with trio.move_on_after(MODELS_BUDGET_S):
            async with trio.open_nursery() as nursery:
                for name, engine in self.engines.items():
                    if statuses[name]["state"] == "ready":
                        nursery.start_soon(list_one, engine)
        return {"object": "list", "data": data}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        path: str = scope["path"].rstrip("/")
        if path == "/healthz":
            await send_json(send, 200, {"status": "ok"})
        elif path == "/debug/backlog":  # for the bench: status calls queued behind each lock
            await send_json(send, 200, {
                name: {"waiting_for_lock": e.op_mu.statistics().tasks_waiting,
                       "lock_held": e.op_mu.locked(), "probes_sent": e.probes}
                for name, e in self.engines.items()})
        elif path == "/v1/models":
            await send_json(send, 200, await self.detached(self.models))
        elif path == "/v1/engines":
            docs = [await self.detached(partial(self.status, n)) for n in self.engines]
            await send_json(send, 200, {"engines": docs})
        elif path.startswith("/v1/engines/") and path[12:] in self.engines:
            name = path[12:]
            await send_json(send, 200, await self.detached(partial(self.status, name)))
        else:
            await send_json(send, 404, {"error": "not found"})

    async def run(self, listen: str) -> None:
        cfg = HypercornConfig()
        cfg.bind = [listen]
        cfg.keep_alive_timeout = 5.0
        cfg.accesslog = None
        cfg.include_server_header = False
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            clients = []
            for name, url in self.engine_urls.items():
                client = httpx2.AsyncClient(base_url=url, trust_env=False)
                clients.append(client)
                self.engines[name] = Engine(name, url, client)
            try:
                await serve(self, cfg)  # type: ignore[arg-type]
            finally:
                with trio.CancelScope(shield=True):
                    for client in clients:
                        await client.aclose()
                nursery.cancel_scope.cancel()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.baseline")
    p.add_argument("--listen", required=True)
    p.add_argument("--engine", action="append", default=[], metavar="NAME=URL")
    args = p.parse_args(argv)
    engines = dict(e.split("=", 1) for e in args.engine)
    logging.basicConfig(level=logging.WARNING)
    try:
        trio.run(Baseline(engines).run, args.listen)
    except KeyboardInterrupt:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
