"""llama.cpp ``llama-server`` (engine-surfaces §3 and §6.3): listening at once with 503
"Loading model" on every path, a cheap /health, and /slots and /metrics queued behind the
current decode step.

Held to the real server by the conformance tests in ``tests/integration`` (the same assertions
run against a real llama-server and against this simulator), so the details are the real
one's: ``Server: llama.cpp`` and ``Access-Control-Allow-Origin`` on every answer;
``Keep-Alive: timeout=5, max=100`` on a plain answer, and the 100th request on a connection
answered with ``Connection: close``; every error (status >= 400) answered with
``Connection: close`` and the connection closed; a streamed answer announces keep-alive and
the connection is closed after it anyway; the API key checked before routing (401 on unknown
paths too) with ``Authorization: Bearer <key>``, ``Authorization: <key>`` or ``X-Api-Key``;
the error bodies' key order, which differs between the HTTP layer (503 loading, 401, 404:
message, type, code) and the handlers (400, 501, 503 no slot: code, message, type); ``n_ctx``
per slot; an idle keep-alive connection closed after 5 s. Inference lives in
:mod:`nvpair.sim.llamacpp_api`.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager, nullcontext
from typing import Any

import trio

from nvpair.sim.engine import Engine, Router, dumps
from nvpair.sim.http import Reply, Request
from nvpair.sim.llamacpp_api import LlamaCppApi, random_id
from nvpair.sim.sleep import SimSleep

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 500: "server_error", 501: "not_supported_error",
          503: "unavailable_error"}
_PUBLIC = frozenset({"/health", "/v1/health", "/"})
_UI = b"<!doctype html><html><head><title>llama.cpp</title></head><body></body></html>"
JSON_TYPE = "application/json; charset=utf-8"
KEEP_ALIVE_MAX = 100
#: llama-server's slot count with ``-np`` auto (-1).
AUTO_SLOTS = 4

#: ``/props`` default_generation_settings.params (and a slot's params before overrides).
DEFAULT_PARAMS: dict[str, Any] = {
    "seed": 4294967295, "temperature": 0.800000011920929, "dynatemp_range": 0.0,
    "dynatemp_exponent": 1.0, "top_k": 40, "top_p": 0.949999988079071,
    "min_p": 0.05000000074505806, "top_n_sigma": -1.0, "xtc_probability": 0.0,
    "xtc_threshold": 0.10000000149011612, "typical_p": 1.0, "repeat_last_n": 64,
    "repeat_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
    "dry_multiplier": 0.0, "dry_base": 1.75, "dry_allowed_length": 2, "dry_penalty_last_n": 64,
    "mirostat": 0, "mirostat_tau": 5.0, "mirostat_eta": 0.10000000149011612,
    "adaptive_target": -1.0, "adaptive_decay": 0.8999999761581421, "max_tokens": -1,
    "n_predict": -1, "n_keep": 0, "n_discard": 0, "ignore_eos": False, "stream": False,
    "n_probs": 0, "min_keep": 0, "chat_format": "Content-only", "reasoning_format": "none",
    "reasoning_in_content": False, "generation_prompt": "",
    "samplers": ["penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc",
                 "temperature"],
    "speculative.types": "none", "timings_per_token": False, "post_sampling_probs": False,
    "backend_sampling": False, "lora": [],
}
_CHAT_TEMPLATE = ("{%- for message in messages -%}\n  {{- '<|im_start|>' + message.role + '\\n' + "
                  "message.content + '<|im_end|>\\n' -}}\n{%- endfor -%}\n"
                  "{%- if add_generation_prompt -%}\n  {{- '<|im_start|>assistant\\n' -}}\n"
                  "{%- endif -%}")
_TEMPLATE_CAPS = {
    "supports_object_arguments": False, "supports_parallel_tool_calls": False,
    "supports_preserve_reasoning": False, "supports_reasoning_effort": False,
    "supports_string_content": True, "supports_system_role": True,
    "supports_tool_calls": False, "supports_tools": False, "supports_typed_content": False,
}
#: /metrics: name, type, help, in llama-server's order.
_METRICS = (
    ("prompt_tokens_total", "counter",
     "Number of prompt tokens processed, excluding cached tokens"),
    ("prompt_tokens_cached_total", "counter", "Number of prompt tokens reused from the cache"),
    ("prompt_seconds_total", "counter", "Total time spent processing prompts"),
    ("tokens_predicted_total", "counter", "Number of generation tokens processed"),
    ("tokens_predicted_seconds_total", "counter", "Total time spent generating tokens"),
    ("n_decode_total", "counter", "Total number of llama_decode() calls, excluding speculative "
                                  "decoding and multimodal decoding"),
    ("n_tokens_max", "counter", "Largest observed sequence length (prompt + generation)"),
    ("spec_decode_num_draft_tokens_total", "counter",
     "Speculative: Total draft tokens generated"),
    ("spec_decode_num_accepted_tokens_total", "counter",
     "Speculative: Total draft tokens accepted by the target model"),
    ("spec_decode_num_drafts_total", "counter",
     "Speculative: Total speculative decoding verification steps"),
    ("prompt_tokens_seconds", "gauge", "Average prompt throughput in tokens/s"),
    ("predicted_tokens_seconds", "gauge", "Average generation throughput in tokens/s"),
    ("requests_processing", "gauge", "Number of requests processing"),
    ("requests_deferred", "gauge", "Number of requests deferred"),
    ("n_busy_slots_per_decode", "gauge", "Average number of busy slots per llama_decode() call"),
)


class Slot:
    """One of llama-server's ``-np`` slots: idle or processing, and its last task."""

    def __init__(self, slot_id: int) -> None:
        self.id = slot_id
        self.processing = False
        #: the last task's fields (None until the slot has run one).
        self.task: dict[str, Any] | None = None
        self.last_used = 0.0
        self.n_decoded = 0
        #: tokens still to generate; -1 when unlimited.
        self.n_remain = -1

    def view(self, n_ctx: int, processing: bool) -> dict[str, Any]:
        view: dict[str, Any] = {"id": self.id, "n_ctx": n_ctx, "speculative": False,
                                "is_processing": processing}
        if self.task is not None:
            view |= self.task
            view["next_token"] = [{
                "has_next_token": self.processing, "has_new_line": False,
                "n_remain": self.n_remain, "n_decoded": self.n_decoded,
            }]
        return view


class LlamaCpp(Engine):
    kind = "llamacpp"
    port_open_while_loading = True
    keep_alive_s = 5.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.slots = [Slot(i) for i in range(self.n_slots)]
        self.deferred = 0
        self._tasks = 0
        self._started_unix = int(time.time())
        self._media_marker = f"<__media_{random_id()}__>"
        # /metrics counters
        self.prompt_tokens = 0
        self.prompt_seconds = 0.0
        self.predicted_tokens = 0
        self.predicted_seconds = 0.0
        self.n_decode = 0
        self.busy_slots_decoded = 0
        self.n_tokens_max = 0

    def add_routes(self, router: Router) -> None:
        for path, route in (("/health", self.health), ("/v1/health", self.health),
                            ("/v1/models", self.models), ("/models", self.models),
                            ("/props", self.props), ("/slots", self.slots_route),
                            ("/metrics", self.metrics)):
            router.add("GET,HEAD", path, route)
        if self.options.webui:
            router.add("GET,HEAD", "/", self.ui)
        LlamaCppApi(self).add_routes(router)

    # -- identity and sizes ------------------------------------------------------------------

    @property
    def model_id(self) -> str:
        """``--alias``, else the model path as given (the mismatch fault's name if set)."""
        return self.served_model

    @property
    def n_slots(self) -> int:
        return self.options.np if self.options.np is not None else AUTO_SLOTS

    @property
    def slot_ctx(self) -> int:
        """Each slot's context: the whole one with a unified KV cache, else a share."""
        opts = self.options
        unified = opts.kv_unified if opts.kv_unified is not None else opts.np is None
        return opts.context_length if unified else max(opts.context_length // self.n_slots, 1)

    @property
    def processing(self) -> int:
        """Slots processing now: the running generations, or one long prefill when busy."""
        running = sum(slot.processing for slot in self.slots)
        forced = 1 if self.state.phase == "busy" else 0
        return min(max(running, forced), self.n_slots)

    def status(self) -> dict[str, Any]:
        return {"slots_processing": self.processing, "deferred": self.deferred}

    def make_sleep(self) -> SimSleep | None:
        """``--sleep-idle-seconds``: asleep after that long without a task."""
        idle = self.options.sleep_idle_s
        if idle is None:
            return None
        return SimSleep(idle_s=idle, wake_s=self.options.wake_s, on_change=self.state.touch)

    def task(self) -> AbstractAsyncContextManager[None]:
        """A task of the queue (a generation, ``/slots``): it wakes a sleeping server and
        restarts its idle timer; nothing else does (docs/simulators.md, "Sleep")."""
        return nullcontext() if self.sleep is None else self.sleep.task()

    # -- the HTTP layer ----------------------------------------------------------------------

    def prepare(self, request: Request, reply: Reply) -> None:
        origin = request.header("origin") or ""
        close_asked = "close" in (request.header("connection") or "").lower()
        last = request.seq >= KEEP_ALIVE_MAX

        def head_fields(
            status: int, fields: list[tuple[str, str]], streamed: bool
        ) -> list[tuple[str, str]]:
            closing = status >= 400 or close_asked or last
            connection = (("Connection", "close") if closing
                          else ("Keep-Alive", f"timeout={self.keep_alive_s:g}, max="
                                              f"{KEEP_ALIVE_MAX}"))
            if request.method == "OPTIONS":
                cors = [f for f in fields if f[0].lower() != "content-length"]
                return [("Server", "llama.cpp"), *cors, connection, ("Content-Length", "0")]
            if streamed:
                reply.close_after = True  # announced keep-alive, closes anyway
            out = [("Server", "llama.cpp"), ("Access-Control-Allow-Origin", origin)]
            ctype = length = None
            for name, value in fields:
                low = name.lower()
                if low == "content-type":
                    ctype = value
                elif low == "content-length":
                    length = value
                else:
                    out.append((name, value))
            if ctype is not None:
                out.append(("Content-Type", ctype))
            if streamed:
                out.append(("Transfer-Encoding", "chunked"))
            elif length is not None:
                out.append(("Content-Length", length))
            out.append(connection)
            if request.method == "HEAD":
                out.append(("Accept-Ranges", "bytes"))
            return out

        reply.head_fields = head_fields

    async def send_json(self, reply: Reply, status: int, obj: object) -> None:
        await reply.send(status, dumps(obj), content_type=JSON_TYPE)

    async def error(self, reply: Reply, status: int, message: str) -> None:
        """A handler's error: ``{"error": {"code", "message", "type"}}``."""
        await self.send_json(reply, status, {"error": {
            "code": status, "message": message, "type": _TYPES.get(status, "server_error"),
        }})

    async def layer_error(self, reply: Reply, status: int, message: str) -> None:
        """An error of the HTTP layer (loading, API key, no route): another key order."""
        await self.send_json(reply, status, {"error": {
            "message": message, "type": _TYPES.get(status, "server_error"), "code": status,
        }})

    async def unauthorized(self, reply: Reply) -> None:
        await self.layer_error(reply, 401, "Invalid API Key")

    async def not_found(self, request: Request, reply: Reply) -> None:
        await self.layer_error(reply, 404, "File Not Found")

    async def method_not_allowed(self, request: Request, reply: Reply) -> None:
        await self.layer_error(reply, 404, "File Not Found")

    def auth_exempt(self, path: str) -> bool:
        return path in _PUBLIC

    def authorized(self, request: Request, key: str) -> bool:
        """``Authorization`` (else ``X-Api-Key``), less a ``Bearer `` prefix, is one of the
        comma-separated keys. A lowercase ``bearer`` is not stripped, so it fails."""
        given = request.header("authorization") or request.header("x-api-key") or ""
        given = given.removeprefix("Bearer ")
        return given in {k for k in key.split(",") if k}

    async def before_route(self, request: Request, reply: Reply) -> bool:
        await trio.lowlevel.checkpoint()
        if request.method == "OPTIONS":  # CORS preflight: no key, even while loading
            await reply.send(200, b"", content_type=None, headers=[
                ("Access-Control-Allow-Origin", request.header("origin") or ""),
                ("Access-Control-Allow-Credentials", "true"),
                ("Access-Control-Allow-Methods", "GET, POST, DELETE, OPTIONS"),
                ("Access-Control-Allow-Headers", "*"),
                ("Content-Type", "text/html"),
            ])
            return True
        if self.state.phase == "loading":
            await self.layer_error(reply, 503, "Loading model")
            return True
        return False

    async def admit(self, request: Request, reply: Reply, model: object) -> str | None:
        """A single-model server: the request's ``model`` is ignored."""
        await trio.lowlevel.checkpoint()
        return self.model_id

    # -- slots ---------------------------------------------------------------------------------

    def _idle_slot(self) -> Slot | None:
        idle = [slot for slot in self.slots if not slot.processing]
        return min(idle, key=lambda s: (s.last_used, s.id)) if idle else None

    @asynccontextmanager
    async def slot_for(
        self, params: dict[str, Any], n_prompt: int, n_predict: int
    ) -> AsyncIterator[Slot]:
        """Hold a slot (the least recently used idle one) while a task runs; wait, counted
        as deferred, while every slot is busy."""
        async with self.task(), self._slot(params, n_prompt, n_predict) as slot:
            yield slot

    @asynccontextmanager
    async def _slot(
        self, params: dict[str, Any], n_prompt: int, n_predict: int
    ) -> AsyncIterator[Slot]:
        slot = self._idle_slot()
        if slot is None:
            self.deferred += 1
            self.state.touch()
            try:
                await self.state.wait_until(lambda: self._idle_slot() is not None)
            finally:
                self.deferred -= 1
            slot = self._idle_slot()
            assert slot is not None
        self._tasks += 1
        slot.processing = True
        slot.n_decoded = 0
        slot.n_remain = n_predict
        slot.task = {
            "id_task": self._tasks, "n_prompt_tokens": n_prompt,
            "n_prompt_tokens_processed": n_prompt, "n_prompt_tokens_cache": 0,
            "params": {**DEFAULT_PARAMS, **params},
        }
        self.state.touch()
        try:
            yield slot
        finally:
            slot.processing = False
            slot.last_used = trio.current_time()
            self.state.touch()

    def count_token(self, slot: Slot) -> None:
        slot.n_decoded += 1
        if slot.n_remain > 0:
            slot.n_remain -= 1
        self.n_decode += 1
        self.busy_slots_decoded += sum(s.processing for s in self.slots)

    def count_task(self, n_prompt: int, prompt_s: float, n_predicted: int,
                   predicted_s: float) -> None:
        self.prompt_tokens += n_prompt
        self.prompt_seconds += prompt_s
        self.predicted_tokens += n_predicted
        self.predicted_seconds += predicted_s
        self.n_tokens_max = max(self.n_tokens_max, n_prompt + n_predicted)

    # -- routes --------------------------------------------------------------------------------

    async def health(self, request: Request, reply: Reply) -> None:
        await self.send_json(reply, 200, {"status": "ok"})

    async def ui(self, request: Request, reply: Reply) -> None:
        await reply.send(200, _UI, content_type="text/html; charset=utf-8")

    async def models(self, request: Request, reply: Reply) -> None:
        name = self.model_id
        await self.send_json(reply, 200, {
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
                "architecture": {"input_modalities": ["text"], "output_modalities": ["text"]},
                "created": int(time.time()), "owned_by": "llamacpp",
                "meta": {"vocab_type": 2, "n_vocab": 152064, "n_ctx": self.slot_ctx,
                         "n_ctx_train": 32768, "n_embd": self.options.embedding_dim,
                         "n_params": 7615616512, "size": 4683073536, "ftype": "Q4_K - Medium"},
            }],
        })

    async def props(self, request: Request, reply: Reply) -> None:
        opts = self.options
        await self.send_json(reply, 200, {
            "default_generation_settings": {"params": DEFAULT_PARAMS, "n_ctx": self.slot_ctx},
            "total_slots": self.n_slots,
            "model_alias": self.model_id,
            "model_ftype": "Q4_K - Medium",
            "model_path": opts.model_name,
            "modalities": {"vision": False, "video": False, "audio": False},
            "media_marker": self._media_marker,
            "endpoint_slots": not opts.no_slots,
            "endpoint_props": False,
            "endpoint_metrics": opts.metrics,
            "ui": opts.webui,
            "ui_settings": {},
            "chat_template": _CHAT_TEMPLATE,
            "chat_template_caps": _TEMPLATE_CAPS,
            "bos_token": "<|endoftext|>",
            "eos_token": "<|im_end|>",
            "build_info": opts.engine_version,
            "is_sleeping": self.sleep is not None and self.sleep.asleep,
            "cors_proxy_enabled": False,
        })

    async def slots_route(self, request: Request, reply: Reply) -> None:
        if self.options.no_slots:
            await self.error(reply, 501, "This server does not support slots endpoint. "
                                         "Start it with `--slots`")
            return
        async with self.task():  # (a SLOT_GET task: it wakes a sleeping server)
            await self.state.wait_step_end()
        busy = self.processing
        if request.query.get("fail_on_no_slot") in ("1", "true") and busy >= self.n_slots:
            await self.error(reply, 503, "no slot available")
            return
        # the busy phase (one long prefill) shows on the first idle slot
        forced = busy - sum(slot.processing for slot in self.slots)
        views = []
        for slot in self.slots:
            shown = slot.processing
            if not shown and forced > 0:
                shown, forced = True, forced - 1
            views.append(slot.view(self.slot_ctx, shown))
        await self.send_json(reply, 200, views)

    async def metrics(self, request: Request, reply: Reply) -> None:
        if not self.options.metrics:
            await self.error(reply, 501, "This server does not support metrics endpoint. "
                                         "Start it with `--metrics`")
            return
        await self.state.wait_step_end()
        values: dict[str, float] = {
            "prompt_tokens_total": self.prompt_tokens,
            "prompt_seconds_total": self.prompt_seconds,
            "tokens_predicted_total": self.predicted_tokens,
            "tokens_predicted_seconds_total": self.predicted_seconds,
            "n_decode_total": self.n_decode,
            "n_tokens_max": self.n_tokens_max,
            "prompt_tokens_seconds": _rate(self.prompt_tokens, self.prompt_seconds),
            "predicted_tokens_seconds": _rate(self.predicted_tokens, self.predicted_seconds),
            "requests_processing": self.processing,
            "requests_deferred": self.deferred,
            "n_busy_slots_per_decode": _rate(self.busy_slots_decoded, self.n_decode),
        }
        lines = []
        for name, kind, text in _METRICS:
            lines += [f"# HELP llamacpp:{name} {text}", f"# TYPE llamacpp:{name} {kind}",
                      f"llamacpp:{name} {values.get(name, 0):g}"]
        await reply.send(200, ("\n".join(lines) + "\n").encode(),
                         content_type="text/plain; version=0.0.4",
                         headers=[("Process-Start-Time-Unix", str(self._started_unix))])


def _rate(amount: float, seconds: float) -> float:
    return amount / seconds if seconds > 0 else 0.0
