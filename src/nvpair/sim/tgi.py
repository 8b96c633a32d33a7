"""Hugging Face TGI (engine-surfaces §5 and §6.5): refused until warmed, and a /health that is
a round trip to the shards (waiting behind a running forward pass) and turns into a one-token
model probe after a generation error.
"""

from __future__ import annotations

from typing import Any

import trio

from nvpair.sim.engine import Engine, Router
from nvpair.sim.http import Reply, Request
from nvpair.sim.openai_api import OpenAIApi, token_text

_GENERATION = ("/v1/chat/completions", "/v1/completions", "/generate")


class TGI(Engine):
    kind = "tgi"
    serves_while_dead = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        #: TGI's backend_health flag; false after a generation error.
        self.backend_healthy = True
        super().__init__(*args, **kwargs)

    def add_routes(self, router: Router) -> None:
        for path in ("/health", "/", "/ping"):
            router.add("GET", path, self.health)
        router.add("GET", "/info", self.info)
        router.add("GET", "/v1/models", self.models)
        router.add("GET", "/metrics", self.metrics)
        router.add("POST", "/generate", self.generate)
        OpenAIApi(self).add_routes(router, embeddings=False)

    def status(self) -> dict[str, Any]:
        return {"backend_healthy": self._flag}

    @property
    def _flag(self) -> bool:
        return self.backend_healthy and self.state.phase not in ("unhealthy", "dead")

    async def not_found(self, request: Request, reply: Reply) -> None:
        await reply.send(404, content_type=None)

    async def method_not_allowed(self, request: Request, reply: Reply) -> None:
        await reply.send(405, content_type=None)

    async def error(self, reply: Reply, status: int, message: str) -> None:
        kind = "overloaded" if status == 429 else "generation"
        await reply.send_json(status, {"error": message, "error_type": kind})

    async def unhealthy(self, request: Request, reply: Reply) -> None:
        await reply.send_json(503, {"error": "unhealthy", "error_type": "healthcheck"})

    def on_injected_error(self, path: str) -> None:
        if path in _GENERATION:
            self.backend_healthy = False
            self.state.touch()

    async def admit(self, request: Request, reply: Reply, model: object) -> str | None:
        await trio.lowlevel.checkpoint()
        if self.state.active >= self.options.max_concurrent:
            await self.error(reply, 429, "Model is overloaded")
            return None
        return self.served_model

    async def health(self, request: Request, reply: Reply) -> None:
        """Device health when the flag is up, else a one-token model probe; both are shard
        round trips, so they wait for the current forward step (and forever while hung)."""
        state = self.state
        await state.wait_step_end()
        if self._flag:
            if self.options.device_probe_s > 0:
                await trio.sleep(self.options.device_probe_s)
            await reply.send(200, content_type=None)
            return
        if self.options.prefill_s > 0:
            await trio.sleep(self.options.prefill_s)
        if state.phase == "dead":
            await self.unhealthy(request, reply)
            return
        self.backend_healthy = True
        if state.phase == "unhealthy":
            state.set_phase("ready")
        state.touch()
        await reply.send(200, content_type=None)

    def _info(self) -> dict[str, Any]:
        opts = self.options
        return {
            "model_id": self.served_model, "model_sha": "0e9e39f249a16976918f6564b8830bc894c89659",
            "model_pipeline_tag": "text-generation", "max_concurrent_requests": opts.max_concurrent,
            "max_best_of": 2, "max_stop_sequences": 4, "max_input_tokens": opts.context_length - 1,
            "max_total_tokens": opts.context_length, "validation_workers": 2,
            "max_client_batch_size": 4, "router": "text-generation-router",
            "version": opts.engine_version, "sha": "db931fcf42da018a3657580c64bf2720f167f9ab",
            "docker_label": "sha-db931fc",
        }

    async def info(self, request: Request, reply: Reply) -> None:
        await reply.send_json(200, self._info())

    async def models(self, request: Request, reply: Reply) -> None:
        name = self.served_model
        await reply.send_json(200, {"object": "list", "data": [
            {"id": name, "object": "model", "created": 0, "owned_by": name},
        ]})

    async def metrics(self, request: Request, reply: Reply) -> None:
        state = self.state
        lines = []
        for name, kind, value in (
            ("tgi_request_count", "counter", state.accounting.snapshot()[0].count),
            ("tgi_queue_size", "gauge", 0), ("tgi_batch_current_size", "gauge", state.active),
            ("tgi_request_generated_tokens_sum", "counter", state.tokens_generated),
        ):
            lines += [f"# TYPE {name} {kind}", f"{name} {value}"]
        await self.send_prometheus(reply, "\n".join(lines) + "\n")

    async def generate(self, request: Request, reply: Reply) -> None:
        """TGI's native ``POST /generate``: ``{"inputs": ..., "parameters": {...}}``."""
        body = await self.read_json_object(request, reply)
        if body is None:
            return
        if await self.admit(request, reply, None) is None:
            return
        params = body.get("parameters") if isinstance(body.get("parameters"), dict) else {}
        limit = params.get("max_new_tokens") if params else None
        n = limit if isinstance(limit, int) and limit >= 0 else self.options.max_tokens
        with self.state.generating():
            await self.state.decode(n, _nothing)
        await reply.send_json(200, {"generated_text": "".join(token_text(i) for i in range(n))})


async def _nothing(i: int) -> None:
    pass
