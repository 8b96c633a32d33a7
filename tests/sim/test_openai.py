"""OpenAI inference on the simulators: body shapes, SSE streams at the token rate, usage,
embeddings, and client disconnects accounted as aborted generations."""

from __future__ import annotations

import json

import trio
from tests.sim.helpers import elapsed, post_head, raw_request, wait_aborted, wait_in_flight

CHAT = {"messages": [{"role": "user", "content": "say hello"}]}


def events(text: str) -> list[str]:
    assert text.endswith("\n\n")
    return [block.removeprefix("data: ") for block in text.split("\n\n") if block]


async def test_chat_completion_body(start_sim, http):
    with trio.fail_after(10):
        sim = await start_sim("vllm", served_name="m", token_rate=1000)
        response = await http(sim).post("/v1/chat/completions", json={**CHAT, "max_tokens": 3})
        body = response.json()
        assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
        assert body["model"] == "m" and isinstance(body["created"], int)
        choice = body["choices"][0]
        assert choice["message"]["role"] == "assistant" and choice["message"]["content"]
        assert choice["finish_reason"] == "length"
        assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}


async def test_chat_stream_shape_with_usage(start_sim, http):
    with trio.fail_after(10):
        sim = await start_sim("sglang", token_rate=1000)
        response = await http(sim).post("/v1/chat/completions", json={
            **CHAT, "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}})
        assert response.headers["content-type"].startswith("text/event-stream")
        data = events(response.text)
        assert data[-1] == "[DONE]"
        chunks = [json.loads(d) for d in data[:-1]]
        assert all(c["object"] == "chat.completion.chunk" for c in chunks)
        assert len({c["id"] for c in chunks}) == 1
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        contents = [c["choices"][0]["delta"].get("content") for c in chunks[1:4]]
        assert all(contents) and len(contents) == 3
        assert chunks[4]["choices"][0]["finish_reason"] == "length"
        assert chunks[5]["choices"] == [] and chunks[5]["usage"]["completion_tokens"] == 3
        assert all(c["usage"] is None for c in chunks[:5])


async def test_completions_stream_without_usage(start_sim, http):
    with trio.fail_after(10):
        sim = await start_sim("vllm", token_rate=1000)
        response = await http(sim).post("/v1/completions", json={
            "prompt": "hi", "max_tokens": 2, "stream": True})
        data = events(response.text)
        chunks = [json.loads(d) for d in data[:-1]]
        assert data[-1] == "[DONE]" and len(chunks) == 3
        assert all(c["object"] == "text_completion" and "usage" not in c for c in chunks)
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        whole = await http(sim).post("/v1/completions", json={"prompt": "hi"})
        assert whole.json()["choices"][0]["finish_reason"] == "stop"
        assert whole.json()["usage"]["completion_tokens"] == 16


async def test_stream_paced_by_token_rate(start_sim, http):
    with trio.fail_after(10):
        sim = await start_sim("openai", token_rate=20)
        response, seconds = await elapsed(http(sim).post("/v1/chat/completions", json={
            **CHAT, "max_tokens": 10, "stream": True}))
        assert response.status_code == 200
        assert 0.45 <= seconds < 3.0  # 10 tokens at 20/s
        assert sim.stats().tokens_generated == 10


async def test_embeddings(start_sim, http):
    with trio.fail_after(10):
        sim = await start_sim("vllm", embedding_dim=4)
        response = await http(sim).post("/v1/embeddings", json={"input": ["a", "b c"]})
        body = response.json()
        assert body["object"] == "list" and len(body["data"]) == 2
        assert body["data"][1]["index"] == 1 and len(body["data"][0]["embedding"]) == 4
        again = await http(sim).post("/v1/embeddings", json={"input": "a"})
        assert again.json()["data"][0]["embedding"] == body["data"][0]["embedding"]
        assert (await http(sim).post("/v1/embeddings", json={})).status_code == 400


async def test_bad_json_is_400(start_sim, http):
    with trio.fail_after(10):
        sim = await start_sim("vllm")
        response = await http(sim).post("/v1/chat/completions", content=b"{nope")
        assert response.status_code == 400


async def test_openai_kind_auth_and_models(start_sim, http):
    with trio.fail_after(10):
        sim = await start_sim("openai", api_key="k", served_name="gpt")
        client = http(sim)
        denied = await client.get("/v1/models")
        assert denied.status_code == 401
        assert denied.json()["error"]["code"] == "invalid_api_key"
        ok = await client.get("/v1/models", headers={"Authorization": "Bearer k"})
        assert ok.json()["data"][0]["id"] == "gpt"


async def test_disconnect_mid_stream_aborts_generation(start_sim):
    with trio.fail_after(10):
        sim = await start_sim("vllm", token_rate=50)
        body = json.dumps({**CHAT, "max_tokens": 1000, "stream": True}).encode()
        stream = await raw_request(sim, post_head("/v1/chat/completions", body), body)
        received = b""
        while received.count(b"data: ") < 3:
            received += await stream.receive_some(65536)
        assert received.startswith(b"HTTP/1.1 200")
        await stream.aclose()
        await wait_aborted(sim, "/v1/chat/completions")
        stats = sim.stats()
        path = stats.path("/v1/chat/completions")
        assert (path.count, path.in_flight, path.aborted) == (1, 0, 1)
        assert stats.active_generations == 0
        assert stats.tokens_generated < 1000


async def test_disconnect_before_the_first_byte(start_sim):
    with trio.fail_after(10):
        sim = await start_sim("sglang", prefill_s=30)
        body = json.dumps({**CHAT, "stream": True}).encode()
        stream = await raw_request(sim, post_head("/v1/chat/completions", body), body)
        await wait_in_flight(sim, "/v1/chat/completions")
        await sim.wait_until(lambda s: s.active_generations == 1)
        await stream.aclose()
        await wait_aborted(sim, "/v1/chat/completions")
        assert sim.stats().active_generations == 0


async def test_disconnect_during_a_non_streaming_generation(start_sim):
    with trio.fail_after(10):
        sim = await start_sim("llamacpp", token_rate=1)
        body = json.dumps({"prompt": "x", "max_tokens": 100}).encode()
        stream = await raw_request(sim, post_head("/v1/completions", body), body)
        await sim.wait_until(lambda s: s.active_generations == 1)
        await stream.aclose()
        await wait_aborted(sim, "/v1/completions")
        path = sim.stats().path("/v1/completions")
        assert path.statuses == {} and path.in_flight == 0
