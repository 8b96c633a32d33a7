"""vLLM (engine-surfaces §2 and §6.2): refused while loading, a /health that only reads a dead
flag (so it stays 200 while the engine is hung), and the headless worker with no listener.

Sleep (landscape-3 §4): ``POST /sleep?level=1|2&mode=abort|wait``, ``POST /wake_up`` and
``GET /is_sleeping`` exist only with ``--enable-sleep-mode`` and ``VLLM_SERVER_DEV_MODE=1``
(404 otherwise). ``/sleep`` defaults to ``mode=abort``: the generations in flight end with
an error (a 500, or a stream cut before its end), the trap a manager must not fall into;
``mode=wait`` sleeps once they have finished. A sleeping engine answers inference with 503
(one documented version's behaviour; unverified on others); ``/health``, ``/v1/models`` and
``/is_sleeping`` answer as usual and wake nothing.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import trio

from nvpair.sim.engine import Engine, Router
from nvpair.sim.http import Reply, Request
from nvpair.sim.openai_api import OpenAIApi
from nvpair.sim.sleep import SimSleep

#: paths the API key guards (prefixes); /health, /version, /metrics and /load stay open.
_GUARDED = ("/v1", "/v2", "/inference", "/cohere")


class RequestAborted(Exception):
    """A generation cut by ``POST /sleep`` in its default ``mode=abort``."""


class VLLM(Engine):
    kind = "vllm"
    serves_while_dead = True

    def make_sleep(self) -> SimSleep | None:
        """``--enable-sleep-mode``: asleep when told, awake when told."""
        #: the cancel scopes of the generations in flight (``mode=abort`` cancels them)
        self.running: set[trio.CancelScope] = set()
        #: the level and mode of the last ``POST /sleep`` (None: none yet)
        self.last_sleep: dict[str, str] | None = None
        #: a level-2 sleep discarded the weights: until ``POST /collective_rpc
        #: {"method": "reload_weights"}`` they are not there (vLLM then answers garbage;
        #: the simulator answers 500, so the trap is seen)
        self.weights_discarded = False
        #: the ``tags`` of each ``POST /wake_up``, in order ("" for none)
        self.wake_tags: list[str] = []
        if not self.options.enable_sleep_mode:
            return None
        return SimSleep(idle_s=None, wake_s=self.options.wake_s, on_change=self.state.touch)

    def status(self) -> dict[str, Any]:
        if self.last_sleep is None:
            return {}
        return {"last_sleep": self.last_sleep, "weights_discarded": self.weights_discarded,
                "wake_tags": self.wake_tags}

    def add_routes(self, router: Router) -> None:
        if self.sleep is not None and self.options.dev_mode:
            router.add("POST", "/sleep", self.sleep_route)
            router.add("POST", "/wake_up", self.wake_up)
            router.add("GET", "/is_sleeping", self.is_sleeping)
            router.add("POST", "/collective_rpc", self.collective_rpc)
            router.add("POST", "/reset_prefix_cache", self.reset_prefix_cache)
        router.add("GET", "/health", self.health)
        router.add("GET,POST", "/ping", self.health)
        router.add("GET", "/version", self.version)
        router.add("GET", "/v1/models", self.models)
        router.add("GET", "/load", self.load)
        router.add("GET", "/metrics", self.metrics)
        OpenAIApi(self).add_routes(router)

    def auth_exempt(self, path: str) -> bool:
        return not path.startswith(_GUARDED)

    async def before_route(self, request: Request, reply: Reply) -> bool:
        lag = self.options.loop_lag_s if self.state.busy else 0.0
        await trio.sleep(lag)
        return False

    async def unhealthy(self, request: Request, reply: Reply) -> None:
        if request.path in ("/health", "/ping"):
            await reply.send(503, content_type=None)
        else:
            await super().unhealthy(request, reply)

    async def admit(self, request: Request, reply: Reply, model: object) -> str | None:
        if self.sleep is not None and (self.sleep.asleep or self.sleep.waking):
            await self.error(reply, 503, "the engine is sleeping; POST /wake_up first")
            return None
        if self.weights_discarded:
            await self.error(reply, 500, "the weights a level-2 sleep discarded were not "
                                         "reloaded (POST /collective_rpc reload_weights); "
                                         "vLLM would answer garbage")
            return None
        return await admit_served_name(self, reply, model)

    @asynccontextmanager
    async def inference_slot(self) -> AsyncIterator[None]:
        scope = trio.CancelScope()
        self.running.add(scope)
        try:
            with scope:
                yield
        finally:
            self.running.discard(scope)
            self.state.touch()
        if scope.cancelled_caught:
            raise RequestAborted("aborted: the engine was put to sleep (POST /sleep, mode=abort)")

    async def sleep_route(self, request: Request, reply: Reply) -> None:
        sleep = self.sleep
        assert sleep is not None
        level, mode = request.query.get("level", "1"), request.query.get("mode", "abort")
        if level not in ("1", "2") or mode not in ("abort", "wait"):
            await self.error(reply, 400, f"level must be 1 or 2 and mode abort or wait "
                                         f"(got level={level!r}, mode={mode!r})")
            return
        self.last_sleep = {"level": level, "mode": mode}
        if mode == "abort":
            for scope in list(self.running):
                scope.cancel()
        await self.state.wait_until(lambda: not self.running)
        await sleep.wake()  # (a wake in progress ends first)
        if sleep.fall_asleep() and level == "2":
            self.weights_discarded = True
        await reply.send(200, content_type=None)

    async def wake_up(self, request: Request, reply: Reply) -> None:
        """``POST /wake_up[?tags=weights|kv_cache]``: the simulated memory comes back
        whole at the first (its sleep is one block); the tags are recorded."""
        assert self.sleep is not None
        self.wake_tags.append(request.query.get("tags", ""))
        await self.sleep.wake()
        await reply.send(200, content_type=None)

    async def collective_rpc(self, request: Request, reply: Reply) -> None:
        """``POST /collective_rpc {"method": ...}``: ``reload_weights`` loads the weights
        a level-2 sleep discarded (vLLM's level-2 wake); other methods answer 200."""
        try:
            body = request.json()
        except ValueError:
            body = None
        method = body.get("method") if isinstance(body, dict) else None
        if method is None:
            await self.error(reply, 400, 'the body must be JSON {"method": ...}')
            return
        if method == "reload_weights":
            self.weights_discarded = False
        await reply.send_json(200, {"results": [None]})

    async def reset_prefix_cache(self, request: Request, reply: Reply) -> None:
        await reply.send(200, content_type=None)

    async def is_sleeping(self, request: Request, reply: Reply) -> None:
        assert self.sleep is not None
        await reply.send_json(200, {"is_sleeping": self.sleep.asleep})

    async def health(self, request: Request, reply: Reply) -> None:
        await reply.send(503 if self.state.phase == "dead" else 200, content_type=None)

    async def version(self, request: Request, reply: Reply) -> None:
        await reply.send_json(200, {"version": self.options.engine_version})

    async def load(self, request: Request, reply: Reply) -> None:
        await reply.send_json(200, {"server_load": self.state.active})

    async def models(self, request: Request, reply: Reply) -> None:
        name, created = self.served_model, int(time.time())
        await reply.send_json(200, {"object": "list", "data": [{
            "id": name, "object": "model", "created": created, "owned_by": "vllm",
            "root": self.options.model_name, "parent": None,
            "max_model_len": self.options.context_length,
            "permission": [{
                "id": f"modelperm-{uuid.uuid4().hex}", "object": "model_permission",
                "created": created, "allow_create_engine": False, "allow_sampling": True,
                "allow_logprobs": True, "allow_search_indices": False, "allow_view": True,
                "allow_fine_tuning": False, "organization": "*", "group": None,
                "is_blocking": False,
            }],
        }]})

    async def metrics(self, request: Request, reply: Reply) -> None:
        state = self.state
        label = f'{{engine="0",model_name="{self.served_model}"}}'
        tokens = state.tokens_generated
        lines = [
            "# HELP vllm:num_requests_running Number of requests in model execution batches.",
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{label} {float(state.active)}",
            "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.",
            "# TYPE vllm:num_requests_waiting gauge",
            f"vllm:num_requests_waiting{label} 0.0",
            "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.",
            "# TYPE vllm:kv_cache_usage_perc gauge",
            f"vllm:kv_cache_usage_perc{label} {0.01 * state.active}",
            "# HELP vllm:iteration_tokens_total Histogram of number of tokens per engine_step.",
            "# TYPE vllm:iteration_tokens_total histogram",
            f"vllm:iteration_tokens_total_sum{label} {float(tokens)}",
            f"vllm:iteration_tokens_total_count{label} {float(tokens)}",
            "# HELP vllm:generation_tokens_total Number of generation tokens processed.",
            "# TYPE vllm:generation_tokens_total counter",
            f"vllm:generation_tokens_total{label} {float(tokens)}",
        ]
        await self.send_prometheus(reply, "\n".join(lines) + "\n")


class VLLMHeadless(VLLM):
    """``--headless``: the workers of a node with rank >= 1; no HTTP surface at all."""

    headless = True


async def admit_served_name(engine: Engine, reply: Reply, model: object) -> str | None:
    """vLLM-style model check: the served name or nothing; 404 otherwise."""
    await trio.lowlevel.checkpoint()
    served = engine.served_model
    if model is None or model == served:
        return served
    body: dict[str, Any] = {"error": {
        "message": f"The model `{model}` does not exist.", "type": "NotFoundError",
        "param": "model", "code": 404,
    }}
    await reply.send_json(404, body)
    return None
