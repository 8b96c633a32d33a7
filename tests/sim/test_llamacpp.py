"""llama.cpp simulator: 503 "Loading model" on every path, cheap /health, queued /slots and
/metrics, auth and bodies (engine-surfaces §3, §6.3).

The surface shared with the real llama-server is held to it by the conformance tests in
tests/integration (their ``[sim]`` variants run with these); the tests here cover what those
cannot reach: phases and faults set from outside, slot bookkeeping, sizes by flags."""

from __future__ import annotations

import httpx2
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
        # without --alias, llama-server names the model by its path, as given
        assert models["data"][0]["id"] == "/models/qwen2.5-7b-instruct-q4_k_m.gguf"
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


async def test_slot_context_follows_np_and_kv_unified(start_sim, http):
    with trio.fail_after(10):
        cases = (({}, 4, 4096), ({"np": 2}, 2, 2048), ({"np": 2, "kv_unified": True}, 2, 4096),
                 ({"kv_unified": False}, 4, 1024))
        for options, n_slots, n_ctx in cases:
            sim = await start_sim("llamacpp", **options)
            client = http(sim)
            slots = (await client.get("/slots")).json()
            assert [s["n_ctx"] for s in slots] == [n_ctx] * n_slots, options
            props = (await client.get("/props")).json()
            assert props["total_slots"] == n_slots
            assert props["default_generation_settings"]["n_ctx"] == n_ctx
            assert (await client.get("/v1/models")).json()["data"][0]["meta"]["n_ctx"] == n_ctx


async def test_web_ui_unless_disabled(start_sim, http):
    with trio.fail_after(10):
        sim = await start_sim("llamacpp", api_key="k")
        client = http(sim)
        page = await client.get("/")  # public, like /health
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        sim = await start_sim("llamacpp", webui=False)
        assert (await http(sim).get("/")).status_code == 404
        assert (await http(sim).get("/props")).json()["ui"] is False


async def test_several_api_keys_and_the_header_forms(start_sim, http):
    with trio.fail_after(10):
        sim = await start_sim("llamacpp", api_key="k1,k2")
        client = http(sim)
        for headers, status in (({"Authorization": "Bearer k2"}, 200),
                                ({"Authorization": "k1"}, 200),
                                ({"X-Api-Key": "Bearer k1"}, 200),
                                ({"Authorization": "bearer k1"}, 401),
                                ({"Authorization": "Bearer k1,k2"}, 401)):
            assert (await client.get("/props", headers=headers)).status_code == status, headers


async def test_slots_show_the_task_and_generations_queue_when_all_are_busy(start_sim, http):
    with trio.fail_after(10):
        sim = await start_sim("llamacpp", np=1, token_rate=20, metrics=True)
        client = http(sim)
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 200,
                "stream": True, "temperature": 0}
        async def chat() -> None:
            await client.post("/v1/chat/completions", json=body)

        async with trio.open_nursery() as nursery:
            for _ in range(2):
                nursery.start_soon(chat)
            stats = await sim.wait_until(lambda s: s.engine["deferred"] == 1
                                         and s.tokens_generated >= 2)
            assert stats.engine["slots_processing"] == 1
            slot = (await client.get("/slots")).json()[0]
            assert slot["is_processing"] and slot["params"]["stream"] is True
            assert slot["params"]["temperature"] == 0 and slot["params"]["n_predict"] == 200
            assert slot["next_token"][0]["has_next_token"] is True
            assert slot["next_token"][0]["n_decoded"] + slot["next_token"][0]["n_remain"] == 200
            metrics = (await client.get("/metrics")).text
            assert "llamacpp:requests_processing 1\n" in metrics
            assert "llamacpp:requests_deferred 1\n" in metrics
            nursery.cancel_scope.cancel()
        await sim.wait_until(lambda s: s.engine["slots_processing"] == 0)
        slot = (await client.get("/slots")).json()[0]
        assert not slot["is_processing"] and slot["next_token"][0]["has_next_token"] is False


async def test_the_least_recently_used_idle_slot_takes_the_next_task(start_sim, http):
    with trio.fail_after(10):
        sim = await start_sim("llamacpp", np=2, token_rate=1000)
        client = http(sim)
        body = {"prompt": "x", "max_tokens": 1}
        for _ in range(3):
            assert (await client.post("/v1/completions", json=body)).status_code == 200
        tasks = [s.get("id_task") for s in (await client.get("/slots")).json()]
        assert tasks == [3, 2]  # slot 0, then slot 1, then slot 0 again


async def test_busy_phase_shows_one_slot_processing(start_sim, http):
    with trio.fail_after(10):
        sim = await start_sim("llamacpp", np=2, decode_step_s=0.05)
        client = http(sim)
        sim.set_phase("busy")
        slots = (await client.get("/slots")).json()
        assert [s["is_processing"] for s in slots] == [True, False]
        assert (await client.get("/health")).status_code == 200


async def test_metrics_count_the_work_done(start_sim, http):
    with trio.fail_after(10):
        sim = await start_sim("llamacpp", metrics=True, token_rate=1000)
        client = http(sim)
        await client.post("/v1/completions", json={"prompt": "one two three", "max_tokens": 5})
        lines = dict(line.rsplit(" ", 1) for line in (await client.get("/metrics")).text
                     .splitlines() if not line.startswith("#"))
        assert lines["llamacpp:prompt_tokens_total"] == "3"
        assert lines["llamacpp:tokens_predicted_total"] == "5"
        assert lines["llamacpp:n_decode_total"] == "5"
        assert lines["llamacpp:n_tokens_max"] == "8"
        assert float(lines["llamacpp:predicted_tokens_seconds"]) > 0


async def test_errors_close_the_connection_and_streams_too(start_sim):
    """What the conformance tests check byte by byte, seen through the accounting: a client
    that keeps its connection needs a new one after an error, or after asking for a close."""
    with trio.fail_after(10):
        sim = await start_sim("llamacpp", token_rate=1000)
        async with httpx2.AsyncClient(base_url=sim.url, timeout=5) as client:
            await client.get("/health")
            await client.get("/props")
            assert sim.stats().connections == 1  # keep-alive
            assert (await client.get("/nope")).status_code == 404
            await client.get("/health")
            assert sim.stats().connections == 2  # closed after the 404
            await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1,
                                                       "stream": True},
                              headers={"Connection": "close"})  # on the second connection
            await client.get("/health")
            assert sim.stats().connections == 3


async def test_idle_keep_alive_is_five_seconds_by_default():
    from nvpair.sim.engine import Engine
    from nvpair.sim.llamacpp import LlamaCpp

    assert LlamaCpp.keep_alive_s == 5.0 and Engine.keep_alive_s == 30.0
