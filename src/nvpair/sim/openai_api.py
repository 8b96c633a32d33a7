"""OpenAI-compatible inference: chat completions, completions (streamed or not) and embeddings.

Bodies have the shapes vLLM and SGLang send. Streams are server-sent events, one
``data: {...}`` chunk per token at ``token_rate``, a final chunk with ``finish_reason``, a
usage chunk when ``stream_options.include_usage`` is set, and ``data: [DONE]``. The client
going away cancels the generation and the request is accounted as aborted.
"""

from __future__ import annotations

import hashlib
import math
import time
import uuid
from typing import Any

from nvpair.sim.engine import Engine, Router, dumps
from nvpair.sim.http import Reply, Request

_WORDS = ("Hello", " from", " a", " simulated", " engine", ".")
_SSE = "text/event-stream"


#: a token of an engine that generates nonsense (``Engine.garbled``)
GARBAGE = "\ufffd"


def token_text(i: int, garbled: bool = False) -> str:
    return GARBAGE if garbled else _WORDS[i % len(_WORDS)]


def count_words(value: object) -> int:
    """A rough token count of a prompt, messages or inputs (at least 1)."""
    if isinstance(value, str):
        return max(len(value.split()), 1)
    if isinstance(value, list):
        return max(sum(count_words(v) for v in value), 1)
    if isinstance(value, dict):
        return count_words(value.get("content") or value.get("text") or "")
    return 1


def sse(obj: object) -> bytes:
    return b"data: " + dumps(obj) + b"\n\n"


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


class OpenAIApi:
    """The OpenAI routes of one engine."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def add_routes(self, router: Router, *, embeddings: bool = True) -> None:
        router.add("POST", "/v1/chat/completions", self.chat_completions)
        router.add("POST", "/v1/completions", self.completions)
        if embeddings:
            router.add("POST", "/v1/embeddings", self.embeddings)

    async def _begin(
        self, request: Request, reply: Reply
    ) -> tuple[dict[str, Any], str, int, bool] | None:
        """Parse and admit: (body, model, max tokens, whether max_tokens was set)."""
        body = await self.engine.read_json_object(request, reply)
        if body is None:
            return None
        limit = body.get("max_completion_tokens", body.get("max_tokens"))
        if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool)
                                  or limit < 0):
            await self.engine.error(reply, 400, "max_tokens must be a non-negative integer")
            return None
        model = await self.engine.admit(request, reply, body.get("model"))
        if model is None:
            return None
        n = self.engine.options.max_tokens if limit is None else limit
        return body, model, n, limit is not None

    async def chat_completions(self, request: Request, reply: Reply) -> None:
        begun = await self._begin(request, reply)
        if begun is None:
            return
        body, model, n, limited = begun
        prompt = count_words(body.get("messages", []))
        base = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
                "created": int(time.time()), "model": model}
        finish = "length" if limited else "stop"
        state = self.engine.state
        async with self.engine.inference_slot():
            with state.generating():
                if not body.get("stream"):
                    await state.decode(n, _nothing)
                    await reply.send_json(200, {
                        **base,
                        "choices": [{
                            "index": 0, "logprobs": None, "finish_reason": finish,
                            "message": {"role": "assistant",
                                        "content": _text(n, self.engine.garbled())},
                        }],
                        "usage": _usage(prompt, n),
                    })
                    return
                usage = _wants_usage(body)
                chunk = {**base, "object": "chat.completion.chunk"}
                if usage:
                    chunk["usage"] = None

                def choice(delta: dict[str, str], finish_reason: str | None) -> dict[str, Any]:
                    return {**chunk, "choices": [{
                        "index": 0, "delta": delta, "logprobs": None,
                        "finish_reason": finish_reason,
                    }]}

                stream = _Stream(reply, sse(choice({"role": "assistant", "content": ""}, None)))

                async def on_token(i: int) -> None:
                    await stream.write(sse(choice(
                        {"content": token_text(i, self.engine.garbled())}, None)))

                await state.decode(n, on_token)
                await stream.write(sse(choice({}, finish)))
                if usage:
                    await stream.write(sse({**chunk, "choices": [], "usage": _usage(prompt, n)}))
                await stream.finish()

    async def completions(self, request: Request, reply: Reply) -> None:
        begun = await self._begin(request, reply)
        if begun is None:
            return
        body, model, n, limited = begun
        prompt = count_words(body.get("prompt", ""))
        base = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
                "created": int(time.time()), "model": model}
        finish = "length" if limited else "stop"
        state = self.engine.state
        async with self.engine.inference_slot():
            with state.generating():
                if not body.get("stream"):
                    await state.decode(n, _nothing)
                    await reply.send_json(200, {
                        **base,
                        "choices": [{"index": 0, "text": _text(n, self.engine.garbled()),
                                     "logprobs": None, "finish_reason": finish}],
                        "usage": _usage(prompt, n),
                    })
                    return
                usage = _wants_usage(body)
                chunk = {**base, "usage": None} if usage else base

                def choice(text: str, finish_reason: str | None) -> dict[str, Any]:
                    return {**chunk, "choices": [{
                        "index": 0, "text": text, "logprobs": None,
                        "finish_reason": finish_reason,
                    }]}

                stream = _Stream(reply, b"")

                async def on_token(i: int) -> None:
                    await stream.write(sse(choice(token_text(i, self.engine.garbled()), None)))

                await state.decode(n, on_token)
                await stream.write(sse(choice("", finish)))
                if usage:
                    await stream.write(sse({**chunk, "choices": [], "usage": _usage(prompt, n)}))
                await stream.finish()

    async def embeddings(self, request: Request, reply: Reply) -> None:
        body = await self.engine.read_json_object(request, reply)
        if body is None:
            return
        raw = body.get("input")
        if raw is None or raw == [] or raw == "":
            await self.engine.error(reply, 400, "input must not be empty")
            return
        model = await self.engine.admit(request, reply, body.get("model"))
        if model is None:
            return
        items: list[object] = raw if isinstance(raw, list) and not _is_ids(raw) else [raw]
        await self.engine.state.wait_not_hung()
        dim = self.engine.options.embedding_dim
        await reply.send_json(200, {
            "object": "list",
            "data": [{"object": "embedding", "index": i, "embedding": embed(item, dim)}
                     for i, item in enumerate(items)],
            "model": model,
            "usage": {"prompt_tokens": count_words(items), "total_tokens": count_words(items)},
        })


class _Stream:
    """A streamed answer whose head goes out with its first chunk."""

    def __init__(self, reply: Reply, first: bytes) -> None:
        self._reply = reply
        self._first = first
        self._started = False

    async def write(self, data: bytes) -> None:
        if not self._started:
            self._started = True
            await self._reply.start(200, content_type=_SSE,
                                    headers=[("cache-control", "no-cache")])
            await self._reply.write(self._first)
        await self._reply.write(data)

    async def finish(self) -> None:
        await self.write(b"data: [DONE]\n\n")
        await self._reply.end()


def embed(item: object, dim: int) -> list[float]:
    """A deterministic unit vector for ``item``."""
    digest = hashlib.sha256(repr(item).encode()).digest()
    raw = [(digest[i % len(digest)] - 127.5) / 127.5 for i in range(dim)]
    norm = math.sqrt(sum(v * v for v in raw)) or 1.0
    return [round(v / norm, 6) for v in raw]


def _is_ids(raw: list[object]) -> bool:
    return bool(raw) and all(isinstance(v, int) for v in raw)


def _wants_usage(body: dict[str, Any]) -> bool:
    options = body.get("stream_options")
    return isinstance(options, dict) and bool(options.get("include_usage"))


def _text(n: int, garbled: bool = False) -> str:
    return "".join(token_text(i, garbled) for i in range(n))


async def _nothing(i: int) -> None:
    pass


class ModelCardRoutes:
    """``GET /v1/models`` and ``/v1/models/{model}`` of an engine that serves one model card
    (SGLang, plain OpenAI servers); the engine supplies ``served_model`` and ``_card()``."""

    served_model: str

    def _card(self) -> dict[str, Any]:
        raise NotImplementedError

    async def models(self, request: Request, reply: Reply) -> None:
        await reply.send_json(200, {"object": "list", "data": [self._card()]})

    async def model(self, request: Request, reply: Reply) -> None:
        if request.params["model"] != self.served_model:
            await reply.send_json(404, {"error": {
                "message": f"The model '{request.params['model']}' does not exist",
                "type": "invalid_request_error", "param": "model", "code": "model_not_found",
            }})
            return
        await reply.send_json(200, self._card())
