"""llama.cpp ``llama-server`` (engine-surfaces §3 and §6.3): listening at once with 503
"Loading model" on every path, a cheap /health, and /slots and /metrics queued behind the
current decode step.
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import trio

from nvpair.sim.engine import Engine, Router
from nvpair.sim.http import Reply, Request
from nvpair.sim.openai_api import OpenAIApi

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 500: "server_error", 501: "not_supported_error",
          503: "unavailable_error"}
_PUBLIC = frozenset({"/health", "/v1/health", "/", "/index.html", "/favicon.ico"})
_UI = b"<!doctype html><html><head><title>llama.cpp</title></head><body></body></html>"


class LlamaCpp(Engine):
    kind = "llamacpp"
    port_open_while_loading = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._slots = trio.Semaphore(max(self.options.np, 1))
        self.deferred = 0
        self._started_unix = int(time.time())

    def add_routes(self, router: Router) -> None:
        router.add("GET", "/health", self.health)
        router.add("GET", "/v1/health", self.health)
        router.add("GET", "/v1/models", self.models)
        router.add("GET", "/models", self.models)
        router.add("GET", "/props", self.props)
        router.add("GET", "/slots", self.slots)
        router.add("GET", "/metrics", self.metrics)
        router.add("GET", "/", self.ui)
        router.add("GET", "/index.html", self.ui)
        OpenAIApi(self).add_routes(router)

    @property
    def model_id(self) -> str:
        if self.state.fault("mismatch") is not None or self.options.served_name is not None:
            return self.served_model
        return os.path.basename(self.options.model_name)

    @property
    def processing(self) -> int:
        """Slots processing now: the running generations, or one long prefill when busy."""
        forced = 1 if self.state.phase == "busy" else 0
        return min(max(self.state.active, forced), self.options.np)

    def status(self) -> dict[str, Any]:
        return {"slots_processing": self.processing, "deferred": self.deferred}

    async def error(self, reply: Reply, status: int, message: str) -> None:
        await reply.send_json(status, {"error": {
            "code": status, "message": message, "type": _TYPES.get(status, "server_error"),
        }})

    async def unauthorized(self, reply: Reply) -> None:
        await reply.send_json(401, {"error": {
            "message": "Invalid API Key", "type": "authentication_error", "code": 401,
        }})

    async def not_found(self, request: Request, reply: Reply) -> None:
        await self.error(reply, 404, "File Not Found")

    async def method_not_allowed(self, request: Request, reply: Reply) -> None:
        await self.error(reply, 404, "File Not Found")

    def auth_exempt(self, path: str) -> bool:
        return path in _PUBLIC

    async def before_route(self, request: Request, reply: Reply) -> bool:
        await trio.lowlevel.checkpoint()
        if self.state.phase == "loading":
            await self.error(reply, 503, "Loading model")
            return True
        return False

    async def admit(self, request: Request, reply: Reply, model: object) -> str | None:
        await trio.lowlevel.checkpoint()
        return self.model_id

    @asynccontextmanager
    async def inference_slot(self) -> AsyncIterator[None]:
        deferred = self._slots.value == 0
        if deferred:
            self.deferred += 1
        try:
            await self._slots.acquire()
        finally:
            if deferred:
                self.deferred -= 1
        try:
            yield
        finally:
            self._slots.release()

    async def health(self, request: Request, reply: Reply) -> None:
        await reply.send_json(200, {"status": "ok"})

    async def ui(self, request: Request, reply: Reply) -> None:
        await reply.send(200, _UI, content_type="text/html; charset=utf-8")

    async def models(self, request: Request, reply: Reply) -> None:
        name = self.model_id
        await reply.send_json(200, {
            "models": [{
                "name": name, "model": name, "modified_at": "", "size": "", "digest": "",
                "type": "model", "description": "", "tags": [""],
                "capabilities": ["completion"], "parameters": "",
                "details": {"parent_model": "", "format": "gguf", "family": "",
                            "families": [""], "parameter_size": "", "quantization_level": ""},
            }],
            "object": "list",
            "data": [{
                "id": name, "aliases": [name], "tags": [], "object": "model",
                "created": int(time.time()), "owned_by": "llamacpp",
                "meta": {"vocab_type": 2, "n_vocab": 152064, "n_ctx": self.options.context_length,
                         "n_ctx_train": 32768, "n_embd": 3584, "n_params": 7615616512,
                         "size": 4683073536, "ftype": "Q4_K - Medium"},
            }],
        })

    async def props(self, request: Request, reply: Reply) -> None:
        opts = self.options
        await reply.send_json(200, {
            "default_generation_settings": {
                "params": {"n_predict": -1, "temperature": 0.8, "top_k": 40, "top_p": 0.95},
                "n_ctx": opts.context_length,
            },
            "total_slots": opts.np,
            "model_alias": self.model_id,
            "model_ftype": "Q4_K - Medium",
            "model_path": opts.model_name,
            "modalities": {"vision": False, "video": False, "audio": False},
            "endpoint_slots": not opts.no_slots,
            "endpoint_props": False,
            "endpoint_metrics": opts.metrics,
            "chat_template": "{{ messages }}",
            "bos_token": "<|endoftext|>",
            "eos_token": "<|im_end|>",
            "build_info": opts.engine_version,
            "is_sleeping": False,
        })

    async def slots(self, request: Request, reply: Reply) -> None:
        if self.options.no_slots:
            await self.error(reply, 501, "This server does not support slots endpoint.")
            return
        await self.state.wait_step_end()
        busy = self.processing
        if request.query.get("fail_on_no_slot") in ("1", "true") and busy >= self.options.np:
            await self.error(reply, 503, "no slot available")
            return
        await reply.send_json(200, [
            {"id": i, "id_task": i if i < busy else -1, "n_ctx": self.options.context_length,
             "speculative": False, "is_processing": i < busy}
            for i in range(self.options.np)
        ])

    async def metrics(self, request: Request, reply: Reply) -> None:
        if not self.options.metrics:
            await self.error(reply, 501, "This server does not support metrics endpoint. "
                                         "Start it with `--metrics`")
            return
        await self.state.wait_step_end()
        state = self.state
        lines = []
        for name, kind, value in (
            ("prompt_tokens_total", "counter", 0),
            ("tokens_predicted_total", "counter", state.tokens_generated),
            ("requests_processing", "gauge", self.processing),
            ("requests_deferred", "gauge", self.deferred),
        ):
            lines += [f"# HELP llamacpp:{name} {name}", f"# TYPE llamacpp:{name} {kind}",
                      f"llamacpp:{name} {value}"]
        await reply.send(200, ("\n".join(lines) + "\n").encode(),
                         content_type="text/plain; version=0.0.4",
                         headers=[("process-start-time-unix", str(self._started_unix))])
