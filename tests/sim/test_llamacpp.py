"""llama.cpp simulator: 503 "Loading model" on every path, cheap /health, queued /slots and
/metrics, auth and bodies (engine-surfaces §3, §6.3)."""

from __future__ import annotations

import trio
from tests.sim.helpers import elapsed

LOADING = {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}


async def test_listening_at_once_with_loading_503_everywhere(start_sim, http):
    with trio.fail_after(10):
        sim = await start_sim("llamacpp", ready=False, load_s=30)
        assert sim.listening and sim.phase == "loading"
        client = http(sim)
        for path in ("/health", "/v1/health", "/v1/models", "/props", "/slots", "/nope"):
            response = await client.get(path)
            assert (response.status_code, response.json()) == (503, LOADING), path
        sim.set_phase("ready")
        assert (await client.get("/health")).json() == {"status": "ok"}


async def test_load_failure_exits_1(start_sim):
    with trio.fail_after(10):
        sim = await start_sim("llamacpp", ready=False, load_s=0.1, fail_on_load=1)
        assert await sim.wait_exited() == 1


async def test_bodies(start_sim, http):
    with trio.fail_after(10):
        sim = await start_sim("llamacpp", np=2, version="b7000-abcdef1")
        client = http(sim)
        models = (await client.get("/v1/models")).json()
        assert models["object"] == "list"
        assert models["data"][0]["id"] == "qwen2.5-7b-instruct-q4_k_m.gguf"
        assert models["data"][0]["owned_by"] == "llamacpp"
        assert models["models"][0]["name"] == models["data"][0]["id"]
        assert (await client.get("/models")).json()["data"][0]["id"] == models["data"][0]["id"]
        props = (await client.get("/props")).json()
        assert props["build_info"] == "b7000-abcdef1" and props["total_slots"] == 2
        assert props["model_path"].endswith(".gguf")
        assert {"default_generation_settings", "model_alias", "modalities"} <= props.keys()
        slots = (await client.get("/slots")).json()
        assert [s["id"] for s in slots] == [0, 1]
        assert not any(s["is_processing"] for s in slots)
        missing = await client.get("/nope")
        assert missing.status_code == 404
        assert missing.json()["error"]["type"] == "not_found_error"


async def test_alias_is_the_model_id(start_sim, http):
    with trio.fail_after(10):
        sim = await start_sim("llamacpp", served_name="qwen")
        client = http(sim)
        assert (await client.get("/v1/models")).json()["data"][0]["id"] == "qwen"
        assert (await client.get("/props")).json()["model_alias"] == "qwen"


async def test_slots_and_metrics_wait_for_the_decode_step_when_busy(start_sim, http):
    with trio.fail_after(10):
        sim = await start_sim("llamacpp", metrics=True, decode_step_s=0.6)
        client = http(sim)
        _, idle_s = await elapsed(client.get("/slots"))
        assert idle_s < 0.5
        busy_at = trio.current_time()
        sim.set_phase("busy")  # a step of 0.6 s starts now
        for path in ("/health", "/props", "/v1/models"):
            response, seconds = await elapsed(client.get(path))
            assert response.status_code == 200 and seconds < 0.5, path
        slots = await client.get("/slots")
        assert slots.status_code == 200 and slots.json()[0]["is_processing"]
        assert trio.current_time() - busy_at >= 0.6  # waited for the end of the first step
        metrics = await client.get("/metrics")
        assert metrics.status_code == 200 and "llamacpp:requests_processing 1" in metrics.text
        assert "process-start-time-unix" in metrics.headers
        assert trio.current_time() - busy_at >= 1.2  # and this one for the next


async def test_metrics_and_slots_switches(start_sim, http):
    with trio.fail_after(10):
        sim = await start_sim("llamacpp", no_slots=True)
        client = http(sim)
        metrics = await client.get("/metrics")
        assert metrics.status_code == 501
        assert metrics.json()["error"]["type"] == "not_supported_error"
        assert (await client.get("/slots")).status_code == 501


async def test_fail_on_no_slot(start_sim, http):
    with trio.fail_after(10):
        sim = await start_sim("llamacpp", np=1)
        client = http(sim)
        assert (await client.get("/slots?fail_on_no_slot=1")).status_code == 200
        sim.set_phase("busy")
        response = await client.get("/slots?fail_on_no_slot=1")
        assert response.status_code == 503
        assert response.json()["error"]["message"] == "no slot available"


async def test_api_key(start_sim, http):
    with trio.fail_after(10):
        sim = await start_sim("llamacpp", api_key="k")
        client = http(sim)
        denied = await client.get("/v1/models")
        assert denied.status_code == 401
        assert denied.json() == {"error": {"message": "Invalid API Key",
                                           "type": "authentication_error", "code": 401}}
        assert (await client.get("/props")).status_code == 401
        assert (await client.get("/health")).status_code == 200
        assert (await client.get("/v1/health")).status_code == 200
        ok = await client.get("/props", headers={"Authorization": "Bearer k"})
        assert ok.status_code == 200
