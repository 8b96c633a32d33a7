"""SGLang simulator: phases, the generating /health, /server_info serialization, profiles, auth
and the rank >= 1 stand-in (engine-surfaces §1, §6.1)."""

from __future__ import annotations

import httpx2
import pytest
import trio
from tests.sim.helpers import elapsed

FAST = {"health_tick_s": 0.1, "health_timeout_s": 0.4}


async def test_phases_loading_refused_then_warming_then_ready(start_sim, http):
    with trio.fail_after(10):
        sim = await start_sim("sglang", ready=False, load_s=0.3, warmup_s=0.3, **FAST)
        client = http(sim)
        assert sim.phase == "loading" and not sim.listening
        with pytest.raises(httpx2.ConnectError):
            await client.get("/health")

        await sim.wait_phase("warming")
        await sim.settle()
        for path in ("/health", "/health_generate", "/ready", "/ping"):
            response = await client.get(path)
            assert (response.status_code, response.content) == (503, b""), path
        # the trap: these answer 200 during warm-up
        assert (await client.get("/v1/models")).status_code == 200
        assert (await client.get("/model_info")).status_code == 200
        assert (await client.get("/server_info")).status_code == 200

        await sim.wait_phase("ready")
        for path in ("/ready", "/ping", "/health"):
            response = await client.get(path)
            assert (response.status_code, response.content) == (200, b""), path


async def test_health_generates_for_the_default_tick(start_sim, http):
    with trio.fail_after(10):
        sim = await start_sim("sglang")  # health_tick_s defaults to 1.0
        client = http(sim)
        cheap, cheap_s = await elapsed(client.get("/ping"))
        health, health_s = await elapsed(client.get("/health"))
        generate, generate_s = await elapsed(client.get("/health_generate"))
        assert cheap.status_code == health.status_code == generate.status_code == 200
        assert cheap_s < 0.5
        assert 0.9 <= health_s < 3.0
        assert 0.9 <= generate_s < 3.0


async def test_health_fast_path_when_generation_is_off(start_sim, http):
    with trio.fail_after(10):
        sim = await start_sim("sglang", health_generation=False, health_tick_s=5.0)
        client = http(sim)
        response, seconds = await elapsed(client.get("/health"))
        assert response.status_code == 200 and seconds < 1.0
        sim.set_phase("unhealthy")
        assert (await client.get("/health")).status_code == 200  # UnHealthy too, on this path
        assert (await client.get("/ping")).status_code == 503


async def test_cheap_endpoints_answer_at_once(start_sim, http):
    with trio.fail_after(10):
        sim = await start_sim("sglang", health_tick_s=5.0)
        client = http(sim)
        for path in ("/", "/model_info", "/get_model_info", "/v1/models", "/ready", "/ping",
                     "/v1/loads"):
            response, seconds = await elapsed(client.get(path))
            assert response.status_code == 200, path
            assert seconds < 1.0, path
        assert (await client.get("/")).json() == "SGLang is running"


async def test_bodies(start_sim, http):
    with trio.fail_after(10):
        sim = await start_sim("sglang", served_name="qwen")
        client = http(sim)
        info = (await client.get("/model_info")).json()
        assert info["model_path"] == "Qwen/Qwen2.5-7B-Instruct"
        assert info["served_model_name"] == "qwen"
        assert info["is_generation"] is True
        assert {"weight_version", "architectures", "model_type"} <= info.keys()
        assert (await client.get("/get_model_info")).json() == info  # deprecated alias
        models = (await client.get("/v1/models")).json()
        assert models["object"] == "list"
        card = models["data"][0]
        assert card["id"] == card["root"] == "qwen" and card["owned_by"] == "sglang"
        assert card["parent"] is None and "max_model_len" in card
        assert (await client.get("/v1/models/qwen")).status_code == 200
        missing = await client.get("/v1/models/other")
        assert missing.status_code == 404
        assert missing.json()["error"]["code"] == "model_not_found"
        server = (await client.get("/server_info")).json()
        assert server["status"] == "ready" and server["version"] == "0.5.23"
        assert server["port"] == sim.port
        assert server["internal_states"][0]["last_gen_throughput"] == 0.0
        assert (await client.get("/get_server_info")).status_code == 200
        assert (await client.get("/metrics")).status_code == 404  # no --enable-metrics
        assert (await client.get("/nope")).json() == {"detail": "Not Found"}


async def test_hung_probe_times_out_then_unhealthy_then_recovers(start_sim, http):
    with trio.fail_after(10):
        sim = await start_sim("sglang", **FAST)
        client = http(sim)
        sim.set_phase("hung")
        assert (await client.get("/model_info")).status_code == 200  # cheap still answers
        response, seconds = await elapsed(client.get("/health"))
        assert response.status_code == 503 and response.content == b""
        assert seconds >= 0.35
        assert sim.stats().engine["server_status"] == "UnHealthy"
        assert (await client.get("/ping")).status_code == 503
        assert (await client.get("/ready")).status_code == 503

        sim.set_phase("ready")
        assert sim.stats().engine["server_status"] == "UnHealthy"  # until a probe succeeds
        assert (await client.get("/health_generate")).status_code == 200
        assert sim.stats().engine["server_status"] == "Up"
        assert (await client.get("/ping")).status_code == 200


async def test_unhealthy_phase_recovers_on_the_next_probe(start_sim, http):
    with trio.fail_after(10):
        sim = await start_sim("sglang", **FAST)
        client = http(sim)
        sim.set_phase("unhealthy")
        assert (await client.get("/ready")).status_code == 503
        assert (await client.get("/health")).status_code == 200
        assert sim.phase == "ready"


async def test_server_info_is_serialized_behind_the_scheduler(start_sim, http):
    with trio.fail_after(15):
        sim = await start_sim("sglang", decode_step_s=0.4)
        client = http(sim)
        idle, idle_s = await elapsed(client.get("/server_info"))
        assert idle.status_code == 200 and idle_s < 0.35
        busy_at = trio.current_time()
        sim.set_phase("busy")  # steps of 0.4 s from now
        ends: list[float] = []

        async def one() -> None:
            response = await client.get("/server_info")
            assert response.status_code == 200
            ends.append(trio.current_time() - busy_at)

        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(one)
        # one at a time, each answered at the end of its own step
        assert sorted(ends)[0] >= 0.4
        assert sorted(ends)[2] >= 1.2
        assert (await client.get("/ping")).status_code == 200  # cheap while busy


async def test_server_info_hangs_while_hung(start_sim, http):
    with trio.fail_after(10):
        sim = await start_sim("sglang")
        client = http(sim, timeout=0.3)
        sim.set_phase("hung")
        with pytest.raises(httpx2.ReadTimeout):
            await client.get("/server_info")


async def test_api_key(start_sim, http):
    with trio.fail_after(10):
        sim = await start_sim("sglang", api_key="k", health_generation=False, **FAST)
        client = http(sim)
        denied = await client.get("/v1/models")
        assert (denied.status_code, denied.json()) == (401, {"error": "Unauthorized"})
        assert (await client.get("/model_info")).status_code == 401
        for path in ("/health", "/ready", "/health_generate"):
            assert (await client.get(path)).status_code != 401, path
        allowed = await client.get("/v1/models", headers={"Authorization": "Bearer k"})
        assert allowed.status_code == 200


async def test_pause_makes_ready_503_but_not_ping(start_sim, http):
    with trio.fail_after(10):
        sim = await start_sim("sglang")
        client = http(sim)
        assert (await client.post("/pause_generation")).status_code == 200
        assert (await client.get("/ready")).status_code == 503
        assert (await client.get("/ping")).status_code == 200
        await client.post("/continue_generation")
        assert (await client.get("/ready")).status_code == 200


async def test_legacy_profile(start_sim, http):
    with trio.fail_after(10):
        sim = await start_sim("sglang", ready=False, profile="legacy", warmup_s=30,
                              health_tick_s=0.1)
        client = http(sim)
        await sim.wait_phase("warming")
        await sim.settle()
        response, seconds = await elapsed(client.get("/health"))
        assert response.status_code == 200 and seconds < 0.5  # always 200, even warming
        assert (await client.get("/ready")).status_code == 404
        assert (await client.get("/ping")).status_code == 404
        assert (await client.get("/model_info")).status_code == 404
        assert (await client.get("/get_model_info")).json() == {
            "model_path": "Qwen/Qwen2.5-7B-Instruct",
            "tokenizer_path": "Qwen/Qwen2.5-7B-Instruct", "is_generation": True,
        }


async def test_mid_2025_profile(start_sim, http):
    with trio.fail_after(10):
        sim = await start_sim("sglang", ready=False, profile="mid-2025", warmup_s=30, **FAST)
        client = http(sim)
        await sim.wait_phase("warming")
        await sim.settle()
        assert (await client.get("/health")).status_code == 503  # Starting
        assert (await client.get("/ready")).status_code == 404
        info = (await client.get("/get_model_info")).json()
        assert set(info) == {"model_path", "tokenizer_path", "is_generation",
                             "preferred_sampling_params", "weight_version"}


async def test_sigterm_like_stop_serves_503_then_exits_0(start_sim, http):
    with trio.fail_after(10):
        sim = await start_sim("sglang", stop_s=0.5, **FAST)
        client = http(sim)
        sim.stop()
        await sim.wait_phase("stopping")
        for path in ("/health", "/health_generate", "/ready", "/ping"):
            assert (await client.get(path)).status_code == 503, path
        assert await sim.wait_exited() == 0


async def test_stop_while_unhealthy_exits_at_once(start_sim):
    with trio.fail_after(10):
        sim = await start_sim("sglang", stop_s=30)
        sim.set_phase("unhealthy")
        sim.stop()
        assert await sim.wait_exited() == 0


async def test_metrics_when_enabled(start_sim, http):
    with trio.fail_after(10):
        sim = await start_sim("sglang", metrics=True)
        text = (await http(sim).get("/metrics")).text
        assert "sglang:num_running_reqs" in text and "sglang:num_queue_reqs" in text
