"""TGI simulator: refused until warm, /health as a shard round trip, the model probe after a
generation error, dead, overload (engine-surfaces §5, §6.5)."""

from __future__ import annotations

from functools import partial

import httpx2
import pytest
import trio
from tests.sim.helpers import elapsed

UNHEALTHY = {"error": "unhealthy", "error_type": "healthcheck"}


async def test_refused_while_loading_then_ready(start_sim, http):
    with trio.fail_after(10):
        sim = await start_sim("tgi", ready=False, load_s=0.3)
        client = http(sim)
        with pytest.raises(httpx2.ConnectError):
            await client.get("/health")
        await sim.wait_phase("ready")
        await sim.settle()
        for path in ("/health", "/", "/ping"):
            response = await client.get(path)
            assert (response.status_code, response.content) == (200, b""), path


async def test_bodies(start_sim, http):
    with trio.fail_after(10):
        sim = await start_sim("tgi")
        client = http(sim)
        info = (await client.get("/info")).json()
        assert info["model_id"] == "meta-llama/Llama-3.1-8B-Instruct"
        assert info["router"] == "text-generation-router" and info["version"] == "3.3.7"
        card = (await client.get("/v1/models")).json()["data"][0]
        assert card == {"id": info["model_id"], "object": "model", "created": 0,
                        "owned_by": info["model_id"]}
        assert "tgi_request_count" in (await client.get("/metrics")).text
        generated = await client.post("/generate", json={
            "inputs": "hi", "parameters": {"max_new_tokens": 2}})
        assert generated.json()["generated_text"]


async def test_health_waits_for_the_forward_step_when_busy(start_sim, http):
    with trio.fail_after(10):
        sim = await start_sim("tgi", decode_step_s=0.5)
        client = http(sim)
        busy_at = trio.current_time()
        sim.set_phase("busy")  # a forward step of 0.5 s starts now
        response = await client.get("/health")
        assert response.status_code == 200 and trio.current_time() - busy_at >= 0.5
        _, info_s = await elapsed(client.get("/info"))
        assert info_s < 0.4


async def test_generation_error_turns_health_into_a_model_probe(start_sim, http):
    with trio.fail_after(10):
        sim = await start_sim("tgi", prefill_s=0.5)
        client = http(sim)
        sim.set_fault("error", paths=["/v1/chat/completions"])
        failed = await client.post("/v1/chat/completions", json={"messages": []})
        assert failed.status_code == 500
        sim.clear_faults()
        assert sim.stats().engine["backend_healthy"] is False
        response, seconds = await elapsed(client.get("/health"))
        assert response.status_code == 200 and seconds >= 0.5
        assert sim.stats().engine["backend_healthy"] is True
        _, again = await elapsed(client.get("/health"))
        assert again < 0.4


async def test_dead_answers_the_healthcheck_error_then_exits(start_sim, http):
    with trio.fail_after(10):
        sim = await start_sim("tgi", exit_after_dead_s=0.5)
        client = http(sim)
        sim.set_phase("dead")
        response = await client.get("/health")
        assert (response.status_code, response.json()) == (503, UNHEALTHY)
        assert await sim.wait_exited() == 1


async def test_overloaded(start_sim, http):
    with trio.fail_after(10):
        sim = await start_sim("tgi", max_concurrent=1, token_rate=1)
        client = http(sim)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(partial(client.post, "/v1/completions", json={"prompt": "x"}))
            await sim.wait_until(lambda s: s.active_generations == 1)
            response = await client.post("/v1/completions", json={"prompt": "y"})
            assert (response.status_code, response.json()) == (
                429, {"error": "Model is overloaded", "error_type": "overloaded"})
            nursery.cancel_scope.cancel()
