"""SGLang (engine-surfaces §1 and §6.1): a generating /health, a warm-up in which /v1/models
already answers, /server_info serialized behind the scheduler, and the rank >= 1 stand-in.

Profiles: ``current`` (0.5.2x), ``mid-2025`` (generating /health with the Starting state but
no /ready, /ping, /model_info or /server_info) and ``legacy`` (2025h1: /health an immediate
200 always, only /health_generate generates, /get_model_info with three fields).
"""

from __future__ import annotations

import time
from typing import Any

import trio

from nvpair.sim.engine import Engine, Router
from nvpair.sim.http import Reply, Request
from nvpair.sim.openai_api import ModelCardRoutes, OpenAIApi
from nvpair.sim.sleep import SimSleep

_RUNNING = "SGLang is running"
_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
          503: "ServiceUnavailableError"}


class SGLang(ModelCardRoutes, Engine):
    kind = "sglang"
    listen_while_stopping = True
    has_warmup = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        #: set when a generating probe times out; the next successful probe clears it.
        self.unhealthy_flag = False
        self.paused = False
        self._scheduler = trio.Lock()
        super().__init__(*args, **kwargs)

    def add_routes(self, router: Router) -> None:
        profile = self.options.profile
        router.add("GET", "/health", self.health)
        router.add("GET", "/health_generate", self.health_generate)
        router.add("GET,HEAD", "/", self.root)
        router.add("GET", "/get_model_info", self.model_info)
        router.add("GET", "/get_server_info", self.server_info)
        router.add("GET", "/v1/models", self.models)
        router.add("GET", "/v1/models/{model}", self.model)
        router.add("GET", "/metrics", self.metrics)
        if profile == "current":
            router.add("GET", "/ready", self.ready)
            router.add("GET", "/ping", self.ping)
            router.add("GET", "/model_info", self.model_info)
            router.add("GET", "/server_info", self.server_info)
            router.add("GET", "/v1/loads", self.loads)
            router.add("POST", "/pause_generation", self.pause)
            router.add("POST", "/continue_generation", self.resume)
        if self.sleep is not None:
            router.add("POST", "/release_memory_occupation", self.release)
            router.add("POST", "/resume_memory_occupation", self.resume_memory)
        OpenAIApi(self).add_routes(router)

    def make_sleep(self) -> SimSleep | None:
        """``--enable-memory-saver``: memory released when told, resumed when told."""
        if not self.options.enable_memory_saver:
            return None
        return SimSleep(idle_s=None, wake_s=self.options.wake_s, on_change=self.state.touch)

    async def release(self, request: Request, reply: Reply) -> None:
        """SGLang asserts that nothing runs (pause with ``retract`` first): a 500 else."""
        assert self.sleep is not None
        if self.state.active:
            await self.error(reply, 500, "release_memory_occupation: requests are running "
                                         f"({self.state.active}); pause generation first")
            return
        self.sleep.fall_asleep()
        await reply.send_json(200, {"success": True, "message": "Success."})

    async def resume_memory(self, request: Request, reply: Reply) -> None:
        assert self.sleep is not None
        await self.sleep.wake()
        await reply.send_json(200, {"success": True, "message": "Success."})

    # -- status --------------------------------------------------------------------------------

    @property
    def server_status(self) -> str:
        """SGLang's ServerStatus: Starting, Up or UnHealthy."""
        if self.state.phase in ("loading", "warming"):
            return "Starting"
        if self.unhealthy_flag or self.state.phase == "unhealthy":
            return "UnHealthy"
        return "Up"

    @property
    def _healthy(self) -> bool:
        return self.server_status == "Up" and self.state.phase != "stopping"

    def status(self) -> dict[str, Any]:
        return {"server_status": self.server_status, "paused": self.paused,
                "profile": self.options.profile}

    def auth_exempt(self, path: str) -> bool:
        return path.startswith(("/health", "/ready", "/metrics"))

    async def error(self, reply: Reply, status: int, message: str) -> None:
        await reply.send_json(status, {
            "object": "error", "message": message,
            "type": _TYPES.get(status, "InternalServerError"), "param": None,
            "code": status,
        })

    async def unhealthy(self, request: Request, reply: Reply) -> None:
        if request.path.startswith(("/health", "/ready", "/ping")):
            await reply.send(503, content_type=None)
        else:
            await super().unhealthy(request, reply)

    async def shutdown(self) -> None:
        await trio.lowlevel.checkpoint()
        if self.server_status == "UnHealthy":  # SIGTERM while UnHealthy: force exit
            self.state.set_phase("stopping")
            self.state.request_exit(0)
            return
        await super().shutdown()

    # -- health --------------------------------------------------------------------------------

    async def health(self, request: Request, reply: Reply) -> None:
        legacy = self.options.profile == "legacy"
        if legacy or (not self.options.health_generation and self.state.phase != "stopping"
                      and self.server_status != "Starting"):
            await reply.send(200, content_type=None)
            return
        await self._generating_probe(reply)

    async def health_generate(self, request: Request, reply: Reply) -> None:
        await self._generating_probe(reply)

    async def _generating_probe(self, reply: Reply) -> None:
        """The real loop: every tick, check for output from the scheduler; 503 on timeout."""
        state = self.state
        if state.phase == "stopping" or (
            self.server_status == "Starting" and self.options.profile != "legacy"
        ):
            await reply.send(503, content_type=None)
            return
        opts = self.options
        deadline = trio.current_time() + opts.health_timeout_s
        while trio.current_time() < deadline:
            await trio.sleep(opts.health_tick_s)
            if state.phase not in ("hung", "stopping"):
                self.unhealthy_flag = False
                if state.phase == "unhealthy":
                    state.set_phase("ready")
                state.touch()
                await reply.send(200, content_type=None)
                return
        self.unhealthy_flag = True
        state.touch()
        await reply.send(503, content_type=None)

    async def ready(self, request: Request, reply: Reply) -> None:
        ok = self._healthy and not self.paused
        await reply.send(200 if ok else 503, content_type=None)

    async def ping(self, request: Request, reply: Reply) -> None:
        await reply.send(200 if self._healthy else 503, content_type=None)

    async def pause(self, request: Request, reply: Reply) -> None:
        self.paused = True
        self.state.touch()
        await reply.send(200, content_type=None)

    async def resume(self, request: Request, reply: Reply) -> None:
        self.paused = False
        self.state.touch()
        await reply.send(200, content_type=None)

    # -- identity ------------------------------------------------------------------------------

    async def root(self, request: Request, reply: Reply) -> None:
        await reply.send_json(200, _RUNNING)

    async def model_info(self, request: Request, reply: Reply) -> None:
        opts = self.options
        body: dict[str, Any] = {
            "model_path": opts.model_name, "tokenizer_path": opts.model_name,
            "is_generation": True,
        }
        if opts.profile == "legacy":
            await reply.send_json(200, body)
            return
        body |= {"preferred_sampling_params": None, "weight_version": "default"}
        if opts.profile == "current":
            body = {
                "model_path": opts.model_name, "served_model_name": self.served_model,
                **{k: v for k, v in body.items() if k != "model_path"},
                "load_format": "auto", "reasoning_parser": None, "tool_call_parser": None,
                "disaggregation_mode": "null", "has_image_understanding": False,
                "has_audio_understanding": False, "model_type": "qwen2",
                "architectures": ["Qwen2ForCausalLM"],
            }
        await reply.send_json(200, body)

    async def server_info(self, request: Request, reply: Reply) -> None:
        """Serialized round trip to the scheduler: one at a time, waits for the step end."""
        async with self._scheduler:
            await self.state.wait_step_end()
        opts = self.options
        await reply.send_json(200, {
            "model_path": opts.model_name, "served_model_name": self.served_model,
            "tp_size": 1, "dp_size": 1, "nnodes": opts.nnodes, "node_rank": opts.node_rank,
            "host": opts.host, "port": self.port, "api_key": None,
            "launch_command": f"python -m sglang.launch_server --model-path {opts.model_name}",
            "status": "ready", "max_total_num_tokens": 65536,
            "max_req_input_len": opts.context_length - 1, "startup_time": 0.0,
            "kv_events": None,
            "internal_states": [{"last_gen_throughput": 0.0, "memory_usage": {},
                                 "avg_spec_accept_length": None, "step_time_dict": {}}],
            "version": opts.engine_version, "frontend": "python",
        })

    def _card(self) -> dict[str, Any]:
        name = self.served_model
        return {"id": name, "object": "model", "created": int(time.time()), "owned_by": "sglang",
                "root": name, "parent": None, "max_model_len": self.options.context_length}

    async def loads(self, request: Request, reply: Reply) -> None:
        state = self.state
        await reply.send_json(200, {
            "timestamp": time.time(), "dp_rank_count": 1,
            "loads": [{"dp_rank": 0, "num_running_reqs": state.active, "num_waiting_reqs": 0,
                       "num_used_tokens": 0, "token_usage": 0.0}],
        })

    async def metrics(self, request: Request, reply: Reply) -> None:
        if not self.options.metrics:
            await self.not_found(request, reply)
            return
        await self.send_prometheus(reply, sglang_metrics(self.served_model, self.state.active))


def sglang_metrics(model: str, running: int) -> str:
    label = f'{{model_name="{model}"}}'
    lines = []
    for name, kind, value in (
        ("num_running_reqs", "gauge", running), ("num_queue_reqs", "gauge", 0),
        ("token_usage", "gauge", 0.0), ("gen_throughput", "gauge", 0.0),
    ):
        lines += [f"# HELP sglang:{name} {name}", f"# TYPE sglang:{name} {kind}",
                  f"sglang:{name}{label} {value}"]
    return "\n".join(lines) + "\n"


class SGLangWorker(Engine):
    """Node rank >= 1: once loaded, a dummy health server on the same port (§1.6)."""

    kind = "sglang"

    def add_routes(self, router: Router) -> None:
        for path in ("/health", "/health_generate", "/ping"):
            router.add("GET", path, self.ok)
        router.add("GET", "/metrics", self.metrics)

    async def ok(self, request: Request, reply: Reply) -> None:
        await reply.send(200, content_type=None)

    async def metrics(self, request: Request, reply: Reply) -> None:
        if not self.options.metrics:
            await self.not_found(request, reply)
            return
        await self.send_prometheus(reply, sglang_metrics(self.served_model, 0))

    async def not_found(self, request: Request, reply: Reply) -> None:
        await reply.send(404, content_type=None)

    async def method_not_allowed(self, request: Request, reply: Reply) -> None:
        await reply.send(404, content_type=None)
