"""vLLM simulator: refused while loading, the cheap /health that stays 200 while hung, dead,
auth, bodies and metrics (engine-surfaces §2, §6.2)."""

from __future__ import annotations

import httpx2
import pytest
import trio
from tests.sim.helpers import elapsed


async def test_refused_while_loading_then_health_200(start_sim, http):
    with trio.fail_after(10):
        sim = await start_sim("vllm", ready=False, load_s=0.3)
        client = http(sim)
        with pytest.raises(httpx2.ConnectError):
            await client.get("/health")
        await sim.wait_phase("ready")
        await sim.settle()
        response, seconds = await elapsed(client.get("/health"))
        assert (response.status_code, response.content) == (200, b"")
        assert seconds < 0.5
        assert (await client.post("/ping")).status_code == 200
        assert (await client.get("/ping")).status_code == 200


async def test_bodies(start_sim, http):
    with trio.fail_after(10):
        sim = await start_sim("vllm", served_name="qwen", version="0.33.0")
        client = http(sim)
        assert (await client.get("/version")).json() == {"version": "0.33.0"}
        assert (await client.get("/load")).json() == {"server_load": 0}
        card = (await client.get("/v1/models")).json()["data"][0]
        assert card["id"] == "qwen" and card["root"] == "Qwen/Qwen2.5-7B-Instruct"
        assert card["owned_by"] == "vllm" and card["object"] == "model"
        permission = card["permission"][0]
        assert permission["object"] == "model_permission"
        assert permission["id"].startswith("modelperm-")
        metrics = (await client.get("/metrics")).text
        for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                     "vllm:kv_cache_usage_perc", "vllm:iteration_tokens_total_count"):
            assert name in metrics
        assert (await client.get("/nope")).json() == {"detail": "Not Found"}


async def test_api_key_guards_v1_only(start_sim, http):
    with trio.fail_after(10):
        sim = await start_sim("vllm", api_key="k")
        client = http(sim)
        denied = await client.get("/v1/models")
        assert (denied.status_code, denied.json()) == (401, {"error": "Unauthorized"})
        for path in ("/health", "/version", "/metrics", "/load"):
            assert (await client.get(path)).status_code == 200, path
        ok = await client.get("/v1/models", headers={"Authorization": "Bearer k"})
        assert ok.status_code == 200


async def test_hung_health_stays_200_while_inference_never_completes(start_sim, http):
    with trio.fail_after(10):
        sim = await start_sim("vllm", token_rate=1000)
        client = http(sim, timeout=0.5)
        sim.set_phase("hung")
        assert (await client.get("/health")).status_code == 200
        with pytest.raises(httpx2.ReadTimeout):
            await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert sim.stats().tokens_generated == 0
        assert (await client.get("/health")).status_code == 200


async def test_dead_answers_503_then_exits(start_sim, http):
    with trio.fail_after(10):
        sim = await start_sim("vllm", exit_after_dead_s=0.5)
        client = http(sim)
        sim.set_phase("dead")
        response = await client.get("/health")
        assert (response.status_code, response.content) == (503, b"")
        assert (await client.get("/ping")).status_code == 503
        assert await sim.wait_exited() == 1


async def test_busy_loop_lag(start_sim, http):
    with trio.fail_after(10):
        sim = await start_sim("vllm", loop_lag_s=0.5)
        client = http(sim)
        _, idle_s = await elapsed(client.get("/health"))
        sim.set_phase("busy")
        response, busy_s = await elapsed(client.get("/health"))
        assert response.status_code == 200
        assert idle_s < 0.4 and busy_s >= 0.5


async def test_unknown_model_is_404(start_sim, http):
    with trio.fail_after(10):
        sim = await start_sim("vllm")
        response = await http(sim).post("/v1/chat/completions", json={
            "model": "other", "messages": [{"role": "user", "content": "hi"}]})
        assert response.status_code == 404
        assert response.json()["error"]["type"] == "NotFoundError"


async def test_stop_closes_the_port_and_exits_0(start_sim, http):
    with trio.fail_after(10):
        sim = await start_sim("vllm")
        sim.stop()
        assert await sim.wait_exited() == 0


async def test_headless_worker_has_no_listener(start_sim):
    with trio.fail_after(10):
        sim = await start_sim("vllm", ready=False, headless=True, nnodes=2, node_rank=1)
        await sim.wait_phase("ready")
        assert sim.port == 0 and not sim.listening
        assert sim.stats().phase == "ready"
