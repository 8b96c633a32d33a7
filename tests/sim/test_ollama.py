"""Ollama simulator: no /health, /v1/models data null, /api/tags cost, load and unload
through /api/generate, /api/ps, the queue limit and hung inference (engine-surfaces §4, §6.4)."""

from __future__ import annotations

import json
from functools import partial

import httpx2
import pytest
import trio
from tests.sim.helpers import elapsed

MODELS = ("llama3.2:latest", "qwen2.5:7b")


async def test_cheap_routes_and_the_missing_health(start_sim, http):
    with trio.fail_after(10):
        sim = await start_sim("ollama", models=MODELS, version="0.33.0")
        client = http(sim)
        root = await client.get("/")
        assert (root.status_code, root.text) == (200, "Ollama is running")
        assert root.headers["content-type"].startswith("text/plain")
        assert (await client.head("/")).status_code == 200
        assert (await client.get("/api/version")).json() == {"version": "0.33.0"}
        missing = await client.get("/health")
        assert (missing.status_code, missing.text) == (404, "404 page not found")


async def test_v1_models_data_null_without_models(start_sim, http):
    with trio.fail_after(10):
        sim = await start_sim("ollama", models=())
        client = http(sim)
        assert (await client.get("/v1/models")).json() == {"object": "list", "data": None}
        assert (await client.get("/api/tags")).json() == {"models": []}


async def test_tags_and_v1_models(start_sim, http):
    with trio.fail_after(10):
        sim = await start_sim("ollama", models=(*MODELS, "user/custom:1b"), tags_scan_s=0.5)
        client = http(sim)
        tags, seconds = await elapsed(client.get("/api/tags"))
        assert seconds >= 0.5
        names = [m["name"] for m in tags.json()["models"]]
        assert names == [*MODELS, "user/custom:1b"]
        entry = tags.json()["models"][0]
        assert {"model", "modified_at", "size", "digest", "details"} <= entry.keys()
        data = (await client.get("/v1/models")).json()["data"]
        assert [(d["id"], d["owned_by"]) for d in data] == [
            ("llama3.2:latest", "library"), ("qwen2.5:7b", "library"), ("user/custom:1b", "user")]
        _, ps_s = await elapsed(client.get("/api/ps"))
        assert ps_s < 0.4


async def test_generate_loads_and_unloads(start_sim, http):
    with trio.fail_after(10):
        sim = await start_sim("ollama", models=MODELS, model_load_s=0.2)
        client = http(sim)
        assert (await client.get("/api/ps")).json() == {"models": []}
        loaded, seconds = await elapsed(client.post("/api/generate", json={"model": MODELS[1]}))
        body = loaded.json()
        assert seconds >= 0.15
        assert (body["model"], body["response"], body["done"], body["done_reason"]) == (
            MODELS[1], "", True, "load")
        ps = (await client.get("/api/ps")).json()["models"]
        assert [m["name"] for m in ps] == [MODELS[1]] and "expires_at" in ps[0]
        unloaded = await client.post("/api/generate", json={"model": MODELS[1], "keep_alive": 0})
        assert unloaded.json()["done_reason"] == "unload"
        assert (await client.get("/api/ps")).json() == {"models": []}


async def test_unknown_model(start_sim, http):
    with trio.fail_after(10):
        sim = await start_sim("ollama", models=MODELS)
        response = await http(sim).post("/api/generate", json={"model": "nope"})
        assert response.status_code == 404
        assert response.json() == {"error": 'model "nope" not found, try pulling it first'}
        show = await http(sim).post("/api/show", json={"model": "nope"})
        assert show.status_code == 404
        assert (await http(sim).post("/api/show", json={"model": MODELS[0]})).status_code == 200


async def test_generate_streams_ndjson(start_sim, http):
    with trio.fail_after(10):
        sim = await start_sim("ollama", models=MODELS, token_rate=500)
        client = http(sim)
        response = await client.post("/api/generate", json={
            "model": MODELS[0], "prompt": "hi", "options": {"num_predict": 3}})
        lines = [json.loads(line) for line in response.text.splitlines()]
        assert [line["done"] for line in lines] == [False, False, False, True]
        assert lines[-1]["done_reason"] == "length" and lines[-1]["eval_count"] == 3
        whole = await client.post("/api/chat", json={
            "model": MODELS[0], "messages": [{"role": "user", "content": "hi"}],
            "stream": False, "options": {"num_predict": 2}})
        assert whole.json()["message"]["content"] and whole.json()["done"] is True


async def test_queue_limit(start_sim, http):
    with trio.fail_after(10):
        sim = await start_sim("ollama", models=MODELS, max_queue=1, token_rate=1)
        client = http(sim)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(partial(client.post, "/api/generate",
                                       json={"model": MODELS[0], "prompt": "x"}))
            await sim.wait_until(lambda s: s.active_generations == 1)
            busy = await client.post("/api/generate", json={"model": MODELS[0], "prompt": "y"})
            assert busy.status_code == 503
            assert busy.json() == {
                "error": "server busy, please try again.  maximum pending requests exceeded"}
            nursery.cancel_scope.cancel()


async def test_hung_inference_while_root_answers(start_sim, http):
    with trio.fail_after(10):
        sim = await start_sim("ollama", models=MODELS)
        client = http(sim, timeout=0.4)
        sim.set_phase("hung")
        assert (await client.get("/")).status_code == 200
        assert (await client.get("/api/version")).status_code == 200
        with pytest.raises(httpx2.ReadTimeout):
            await client.post("/api/generate", json={"model": MODELS[0], "prompt": "hi"})
