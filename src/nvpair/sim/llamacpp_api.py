"""llama.cpp's inference routes, in llama-server's shapes (not vLLM's).

* ``/v1/chat/completions`` (and ``/chat/completions``): a choice has no ``logprobs``; the body
  ends with ``timings``; ``system_fingerprint`` is the build_info; ids are ``chatcmpl-`` and
  32 letters or digits; the answer names the model ``admit`` gives (a single-model server: its
  alias, whatever the request asked; router mode: the model asked for).
  Streamed: the first delta is ``{"role": "assistant", "content": null}``, the last chunk has
  the finish_reason, an empty delta and ``timings`` (moved to a final ``choices: []`` chunk
  with ``usage`` when ``stream_options.include_usage`` is set), then ``data: [DONE]``.
* ``/v1/completions`` (and ``/completions``): ids are ``chatcmpl-`` too; streamed, no role
  chunk, and the last chunk carries ``usage`` and ``timings`` unasked.
* ``/v1/embeddings`` (and ``/embeddings``): 501 without ``--embeddings``, 400 unless it pools.

A generation holds one of the engine's slots (queued, counted as deferred, while all are
busy); a client that goes away cancels it and frees the slot at once. Streams are
``text/event-stream`` with ``X-Accel-Buffering: no``; the connection is closed after them.
"""

from __future__ import annotations

import json
import secrets
import string
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import trio

from nvpair.sim.engine import Router, dumps
from nvpair.sim.http import Reply, Request
from nvpair.sim.openai_api import count_words, embed, token_text

if TYPE_CHECKING:
    from nvpair.sim.llamacpp import LlamaCpp

_ALNUM = string.ascii_letters + string.digits
_INT32_MAX = 2**31 - 1
#: request fields that show in a slot's params.
_PARAM_FIELDS = ("temperature", "top_k", "top_p", "min_p", "seed", "ignore_eos", "n_probs")


def random_id(n: int = 32) -> str:
    return "".join(secrets.choice(_ALNUM) for _ in range(n))


class _Invalid:
    """The body was refused (already answered)."""


_INVALID = _Invalid()


class _Events:
    """A streamed answer: its head goes out with the first event."""

    def __init__(self, reply: Reply) -> None:
        self._reply = reply
        self.started = False

    async def send(self, obj: object) -> None:
        if not self.started:
            self.started = True
            await self._reply.start(200, content_type="text/event-stream",
                                    headers=[("X-Accel-Buffering", "no")])
        await self._reply.write(b"data: " + dumps(obj) + b"\n\n")

    async def done(self) -> None:
        await self._reply.write(b"data: [DONE]\n\n")
        await self._reply.end()


class _Run:
    """What one generation produced."""

    def __init__(self, n_prompt: int, n_predicted: int, finish: str,
                 prompt_s: float, predicted_s: float) -> None:
        self.n_prompt = n_prompt
        self.n_predicted = n_predicted
        self.finish = finish
        self.prompt_s = prompt_s
        self.predicted_s = predicted_s

    @property
    def usage(self) -> dict[str, Any]:
        return {"completion_tokens": self.n_predicted, "prompt_tokens": self.n_prompt,
                "total_tokens": self.n_prompt + self.n_predicted,
                "prompt_tokens_details": {"cached_tokens": 0}}

    @property
    def timings(self) -> dict[str, Any]:
        prompt_ms, predicted_ms = self.prompt_s * 1000, self.predicted_s * 1000
        return {
            "cache_n": 0, "prompt_n": self.n_prompt, "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_ms / max(self.n_prompt, 1),
            "prompt_per_second": _per_second(self.n_prompt, prompt_ms),
            "predicted_n": self.n_predicted, "predicted_ms": predicted_ms,
            "predicted_per_token_ms": predicted_ms / max(self.n_predicted, 1),
            "predicted_per_second": _per_second(self.n_predicted, predicted_ms),
        }


class LlamaCppApi:
    def __init__(self, engine: LlamaCpp) -> None:
        self.engine = engine

    def add_routes(self, router: Router) -> None:
        for path in ("/v1/chat/completions", "/chat/completions"):
            router.add("POST", path, self.chat)
        for path in ("/v1/completions", "/completions"):
            router.add("POST", path, self.completions)
        for path in ("/v1/embeddings", "/embeddings"):
            router.add("POST", path, self.embeddings)

    # -- requests ------------------------------------------------------------------------------

    async def _body(self, request: Request, reply: Reply) -> Any:
        """The JSON body, or ``_INVALID`` after a 400."""
        await trio.lowlevel.checkpoint()
        try:
            return json.loads(request.body)
        except (ValueError, UnicodeDecodeError) as exc:
            await self.engine.error(
                reply, 400, f"[json.exception.parse_error.101] parse error: {exc}")
            return _INVALID

    async def _limit(self, body: dict[str, Any], reply: Reply) -> int | None:
        """``max_tokens`` (else ``n_predict``), -1 when unset; None after a 400."""
        await trio.lowlevel.checkpoint()
        for field in ("max_tokens", "n_predict"):
            value = body.get(field)
            if value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or not (
                    -1 <= value <= _INT32_MAX):
                await self.engine.error(reply, 400, (
                    f"Field '{field}': Value must be between -1 <= value <= {_INT32_MAX}, "
                    f"but got {value}"))
                return None
            return value
        return -1

    def _base(self, model: str) -> dict[str, Any]:
        return {"created": int(time.time()), "model": model,
                "system_fingerprint": self.engine.options.engine_version}

    def _chunk_base(self, cid: str, model: str) -> dict[str, Any]:
        return {"created": int(time.time()), "id": cid, "model": model,
                "system_fingerprint": self.engine.options.engine_version,
                "object": "chat.completion.chunk"}

    async def _run(
        self, body: dict[str, Any], n_prompt: int, limit: int,
        on_token: Callable[[int], Awaitable[None]],
    ) -> _Run:
        """Generate in a slot: ``limit`` tokens (finish "length"), or when unlimited (-1) the
        simulator's natural length (finish "stop"); never past the slot's context."""
        engine = self.engine
        state, opts = engine.state, engine.options
        room = max(engine.slot_ctx - n_prompt, 0)
        wanted = limit if limit >= 0 else opts.max_tokens
        n = min(wanted, room)
        finish = "length" if limit >= 0 or n < wanted else "stop"
        params = {k: body[k] for k in _PARAM_FIELDS if k in body}
        params |= {"max_tokens": limit, "n_predict": limit, "stream": bool(body.get("stream"))}
        async with engine.slot_for(params, n_prompt, n if limit >= 0 else -1) as slot:
            with state.generating():
                started = trio.current_time()

                async def token(i: int) -> None:
                    engine.count_token(slot)
                    await on_token(i)

                await state.decode(n, token)
                elapsed = trio.current_time() - started
        prompt_s = min(opts.prefill_s, elapsed)
        run = _Run(n_prompt, n, finish, prompt_s, elapsed - prompt_s)
        engine.count_task(n_prompt, run.prompt_s, n, run.predicted_s)
        return run

    # -- routes --------------------------------------------------------------------------------

    async def chat(self, request: Request, reply: Reply) -> None:
        body = await self._body(request, reply)
        if body is _INVALID:
            return
        messages = body.get("messages") if isinstance(body, dict) else None
        if messages is None:
            await self.engine.error(reply, 400, "'messages' is required")
            return
        if not isinstance(messages, list):
            await self.engine.error(reply, 400, "Expected 'messages' to be an array")
            return
        limit = await self._limit(body, reply)
        if limit is None:
            return
        model = await self.engine.admit(request, reply, body.get("model"))
        if model is None:
            return
        n_prompt = count_words(messages)
        cid = f"chatcmpl-{random_id()}"
        if not body.get("stream"):
            run = await self._run(body, n_prompt, limit, _nothing)
            text = "".join(token_text(i) for i in range(run.n_predicted))
            await self.engine.send_json(reply, 200, {
                "choices": [{"finish_reason": run.finish, "index": 0,
                             "message": {"role": "assistant", "content": text}}],
                **self._base(model), "object": "chat.completion", "usage": run.usage, "id": cid,
                "timings": run.timings,
            })
            return
        events = _Events(reply)
        usage = _wants_usage(body)

        def chunk(delta: dict[str, Any], finish: str | None) -> dict[str, Any]:
            return {"choices": [{"finish_reason": finish, "index": 0, "delta": delta}],
                    **self._chunk_base(cid, model)}

        async def role() -> None:
            if not events.started:
                await events.send(chunk({"role": "assistant", "content": None}, None))

        async def on_token(i: int) -> None:
            await role()
            await events.send(chunk({"content": token_text(i)}, None))

        run = await self._run(body, n_prompt, limit, on_token)
        await role()
        last = chunk({}, run.finish)
        if usage:
            await events.send(last)
            await events.send({"choices": [], **self._chunk_base(cid, model), "usage": run.usage,
                               "timings": run.timings})
        else:
            await events.send({**last, "timings": run.timings})
        await events.done()

    async def completions(self, request: Request, reply: Reply) -> None:
        body = await self._body(request, reply)
        if body is _INVALID:
            return
        if not isinstance(body, dict) or "prompt" not in body:
            await self.engine.error(
                reply, 400, "[json.exception.out_of_range.403] key 'prompt' not found")
            return
        limit = await self._limit(body, reply)
        if limit is None:
            return
        model = await self.engine.admit(request, reply, body.get("model"))
        if model is None:
            return
        n_prompt = count_words(body["prompt"])
        cid = f"chatcmpl-{random_id()}"

        def choice(text: str, finish: str | None) -> list[dict[str, Any]]:
            return [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish}]

        if not body.get("stream"):
            run = await self._run(body, n_prompt, limit, _nothing)
            text = "".join(token_text(i) for i in range(run.n_predicted))
            await self.engine.send_json(reply, 200, {
                "choices": choice(text, run.finish), **self._base(model),
                "object": "text_completion", "usage": run.usage, "id": cid,
                "timings": run.timings,
            })
            return
        events = _Events(reply)

        async def on_token(i: int) -> None:
            await events.send({"choices": choice(token_text(i), None), **self._base(model),
                               "object": "text_completion", "id": cid})

        run = await self._run(body, n_prompt, limit, on_token)
        await events.send({"choices": choice("", run.finish), **self._base(model),
                           "object": "text_completion", "usage": run.usage, "id": cid,
                           "timings": run.timings})
        await events.done()

    async def embeddings(self, request: Request, reply: Reply) -> None:
        engine = self.engine
        if not engine.options.embeddings:
            await engine.error(reply, 501, "This server does not support embeddings. "
                                           "Start it with `--embeddings`")
            return
        body = await self._body(request, reply)
        if body is _INVALID:
            return
        if (engine.options.pooling or "none") == "none":
            await engine.error(reply, 400, "Pooling type 'none' is not OAI compatible. "
                                           "Please use a different pooling type")
            return
        raw = body.get("input", body.get("content")) if isinstance(body, dict) else None
        if raw is None or raw == [] or raw == "":
            await engine.error(reply, 400, '"input" must be provided')
            return
        model = await engine.admit(request, reply, body.get("model"))
        if model is None:
            return
        items: list[object] = raw if isinstance(raw, list) and not _is_ids(raw) else [raw]
        await engine.state.wait_not_hung()
        n_tokens = count_words(items)
        dim = engine.options.embedding_dim
        await engine.send_json(reply, 200, {
            "model": model, "object": "list",
            "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens},
            "data": [{"embedding": embed(item, dim), "index": i, "object": "embedding"}
                     for i, item in enumerate(items)],
        })


def _per_second(n: int, ms: float) -> float:
    return n * 1000 / ms if ms > 0 else 0.0


def _wants_usage(body: dict[str, Any]) -> bool:
    options = body.get("stream_options")
    return isinstance(options, dict) and bool(options.get("include_usage"))


def _is_ids(raw: list[object]) -> bool:
    return bool(raw) and all(isinstance(v, int) for v in raw)


async def _nothing(i: int) -> None:
    pass
