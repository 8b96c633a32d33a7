"""Ollama (engine-surfaces §4 and §6.4): no /health, models loaded on demand, /api/tags that
walks the model store, and /v1/models with ``"data": null`` when nothing is installed.
"""

from __future__ import annotations

import hashlib
import time
from datetime import UTC, datetime
from typing import Any

import trio

from nvpair.sim.engine import Engine, Router, dumps
from nvpair.sim.http import Reply, Request
from nvpair.sim.openai_api import OpenAIApi, count_words, token_text

_BUSY = "server busy, please try again.  maximum pending requests exceeded"
_NDJSON = "application/x-ndjson"
_SIZE = 2019393189


def _rfc3339(unix: float) -> str:
    return datetime.fromtimestamp(unix, UTC).isoformat().replace("+00:00", "Z")


class Ollama(Engine):
    kind = "ollama"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: loaded model -> unix time its keep-alive ends (inf: forever).
        self.loaded: dict[str, float] = {}
        self._modified = time.time()

    def add_routes(self, router: Router) -> None:
        router.add("GET,HEAD", "/", self.root)
        router.add("GET,HEAD", "/api/version", self.version)
        router.add("GET,HEAD", "/api/tags", self.tags)
        router.add("GET", "/api/ps", self.ps)
        router.add("GET", "/api/status", self.api_status)
        router.add("POST", "/api/show", self.show)
        router.add("POST", "/api/generate", self.generate)
        router.add("POST", "/api/chat", self.chat)
        router.add("GET", "/v1/models", self.v1_models)
        router.add("GET", "/v1/models/{model}", self.v1_model)
        OpenAIApi(self).add_routes(router)

    # -- the model store -----------------------------------------------------------------------

    @property
    def installed(self) -> tuple[str, ...]:
        models = self.options.models
        names = (self.options.model_name,) if models is None else models
        fault = self.state.fault("mismatch")
        if fault is not None and names:
            names = (self.served_model, *names[1:])
        return names

    def _expire(self) -> None:
        now = time.time()
        for name in [n for n, until in self.loaded.items() if until <= now]:
            del self.loaded[name]

    def status(self) -> dict[str, Any]:
        self._expire()
        return {"installed": list(self.installed), "loaded": sorted(self.loaded)}

    def _entry(self, name: str) -> dict[str, Any]:
        family = name.split(":")[0].split("/")[-1].rstrip("0123456789.") or "llama"
        return {
            "name": name, "model": name, "modified_at": _rfc3339(self._modified),
            "size": _SIZE, "digest": hashlib.sha256(name.encode()).hexdigest(),
            "details": {"parent_model": "", "format": "gguf", "family": family,
                        "families": [family], "parameter_size": "3.2B",
                        "quantization_level": "Q4_K_M"},
        }

    # -- answers -------------------------------------------------------------------------------

    async def not_found(self, request: Request, reply: Reply) -> None:
        await reply.send_text(404, "404 page not found")

    async def method_not_allowed(self, request: Request, reply: Reply) -> None:
        await reply.send_text(404, "404 page not found")

    async def error(self, reply: Reply, status: int, message: str) -> None:
        await reply.send_json(status, {"error": message})

    async def admit(self, request: Request, reply: Reply, model: object) -> str | None:
        if not isinstance(model, str) or not model:
            await self.error(reply, 400, "model is required")
            return None
        if model not in self.installed:
            await self.error(reply, 404, f'model "{model}" not found, try pulling it first')
            return None
        if self.state.active >= self.options.max_queue:
            await self.error(reply, 503, _BUSY)
            return None
        await self._load(model, None)
        return model

    async def _load(self, model: str, keep_alive: object) -> None:
        await trio.lowlevel.checkpoint()
        self._expire()
        if model not in self.loaded and self.options.model_load_s > 0:
            await trio.sleep(self.options.model_load_s)
        seconds = _keep_alive_s(keep_alive, self.options.ollama_keep_alive_s)
        self.loaded[model] = float("inf") if seconds < 0 else time.time() + seconds
        self.state.touch()

    # -- routes --------------------------------------------------------------------------------

    async def root(self, request: Request, reply: Reply) -> None:
        await reply.send_text(200, "Ollama is running")

    async def version(self, request: Request, reply: Reply) -> None:
        await reply.send_json(200, {"version": self.options.engine_version})

    async def api_status(self, request: Request, reply: Reply) -> None:
        await reply.send_json(200, {"cloud": {"disabled": True, "source": "default"}})

    async def tags(self, request: Request, reply: Reply) -> None:
        if self.options.tags_scan_s > 0:
            await trio.sleep(self.options.tags_scan_s)
        models = [self._entry(n) | {"capabilities": ["completion"]} for n in self.installed]
        await reply.send_json(200, {"models": models})

    async def ps(self, request: Request, reply: Reply) -> None:
        self._expire()
        ordered = sorted(self.loaded.items(), key=lambda item: -item[1])
        await reply.send_json(200, {"models": [
            self._entry(name) | {
                "expires_at": _rfc3339(min(until, 253402300799.0)), "size_vram": _SIZE,
                "context_length": self.options.context_length,
            } for name, until in ordered
        ]})

    async def v1_models(self, request: Request, reply: Reply) -> None:
        if self.options.tags_scan_s > 0:
            await trio.sleep(self.options.tags_scan_s)
        data = [_card(n, self._modified) for n in self.installed] or None
        await reply.send_json(200, {"object": "list", "data": data})

    async def v1_model(self, request: Request, reply: Reply) -> None:
        name = request.params["model"]
        if name not in self.installed:
            await reply.send_json(404, {"error": {
                "message": f"model '{name}' not found", "type": "api_error", "param": None,
                "code": None,
            }})
            return
        await reply.send_json(200, _card(name, self._modified))

    async def show(self, request: Request, reply: Reply) -> None:
        body = await self.read_json_object(request, reply)
        if body is None:
            return
        name = body.get("model") or body.get("name")
        if name not in self.installed:
            await self.error(reply, 404, f"model '{name}' not found")
            return
        entry = self._entry(str(name))
        await reply.send_json(200, {
            "modelfile": f"FROM {name}\n", "parameters": "", "template": "{{ .Prompt }}",
            "details": entry["details"], "model_info": {"general.architecture": "llama"},
            "capabilities": ["completion"], "modified_at": entry["modified_at"],
        })

    async def generate(self, request: Request, reply: Reply) -> None:
        await self._native(request, reply, chat=False)

    async def chat(self, request: Request, reply: Reply) -> None:
        await self._native(request, reply, chat=True)

    async def _native(self, request: Request, reply: Reply, *, chat: bool) -> None:
        """/api/generate and /api/chat: load, unload, or generate (NDJSON stream by default)."""
        body = await self.read_json_object(request, reply)
        if body is None:
            return
        model = body.get("model")
        prompt = body.get("messages") if chat else body.get("prompt")
        keep_alive = body.get("keep_alive")
        if not prompt and _keep_alive_s(keep_alive, 1.0) == 0 and isinstance(model, str):
            if model not in self.installed:
                await self.error(reply, 404, f'model "{model}" not found, try pulling it first')
                return
            self.loaded.pop(model, None)
            self.state.touch()
            await reply.send_json(200, self._done(model, chat, "unload"))
            return
        name = await self.admit(request, reply, model)
        if name is None:
            return
        if keep_alive is not None:
            await self._load(name, keep_alive)
        if not prompt:
            await reply.send_json(200, self._done(name, chat, "load"))
            return
        await self._generate(reply, body, name, chat=chat, prompt_tokens=count_words(prompt))

    async def _generate(
        self, reply: Reply, body: dict[str, Any], model: str, *, chat: bool, prompt_tokens: int
    ) -> None:
        options = body.get("options") if isinstance(body.get("options"), dict) else {}
        limit = options.get("num_predict") if options else None
        n = limit if isinstance(limit, int) and limit >= 0 else self.options.max_tokens
        reason = "length" if isinstance(limit, int) else "stop"
        stream = body.get("stream", True) is not False
        started = time.monotonic_ns()
        state = self.state

        def piece(text: str) -> dict[str, Any]:
            key = {"message": {"role": "assistant", "content": text}} if chat else {
                "response": text}
            return {"model": model, "created_at": _rfc3339(time.time()), **key, "done": False}

        async def on_token(i: int) -> None:
            await trio.lowlevel.checkpoint()
            if stream:
                if not reply.headers_sent:
                    await reply.start(200, content_type=_NDJSON)
                await reply.write(dumps(piece(token_text(i))) + b"\n")

        with state.generating():
            await state.decode(n, on_token)
        elapsed = time.monotonic_ns() - started
        final = piece("" if stream else "".join(token_text(i) for i in range(n))) | {
            "done": True, "done_reason": reason, "total_duration": elapsed,
            "load_duration": 0, "prompt_eval_count": prompt_tokens,
            "prompt_eval_duration": 0, "eval_count": n, "eval_duration": elapsed,
        }
        if not stream:
            await reply.send_json(200, final)
            return
        if not reply.headers_sent:
            await reply.start(200, content_type=_NDJSON)
        await reply.write(dumps(final) + b"\n")
        await reply.end()

    def _done(self, model: str, chat: bool, reason: str) -> dict[str, Any]:
        key = {"message": {"role": "assistant", "content": ""}} if chat else {"response": ""}
        return {"model": model, "created_at": _rfc3339(time.time()), **key, "done": True,
                "done_reason": reason}


def _card(name: str, created: float) -> dict[str, Any]:
    owner = name.split("/")[0] if "/" in name else "library"
    return {"id": name, "object": "model", "created": int(created), "owned_by": owner}


def _keep_alive_s(value: object, default: float) -> float:
    """Ollama's keep_alive: seconds (number), a duration ("5m", "1h", "30s"), 0 or negative."""
    if value is None:
        return default
    if isinstance(value, bool):
        return default
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        units = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
        for unit in ("ms", "s", "m", "h"):
            if value.endswith(unit):
                try:
                    return float(value[: -len(unit)]) * units[unit]
                except ValueError:
                    return default
        try:
            return float(value)
        except ValueError:
            return default
    return default
