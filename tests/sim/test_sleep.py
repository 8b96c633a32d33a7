"""The simulators' sleep (docs/simulators.md, "Sleep"): llama.cpp's idle sleep, vLLM's sleep
routes and their abort trap, SGLang's release that refuses while requests run."""

from __future__ import annotations

import re
from functools import partial
from pathlib import Path

import httpx2
import trio

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


def counts(sim) -> dict[str, object]:  # type: ignore[no-untyped-def]
    return sim.stats().engine["sleep"]


def asleep(stats) -> bool:  # type: ignore[no-untyped-def]
    return bool(stats.engine["sleep"]["asleep"])


def rss_anon_mib() -> float:
    text = Path("/proc/self/status").read_text()
    match = re.search(r"RssAnon:\s+(\d+) kB", text)
    assert match is not None
    return int(match[1]) / 1024


async def test_llamacpp_sleeps_when_idle_and_only_a_task_wakes_it(start_sim, http):
    with trio.fail_after(20):
        sim = await start_sim("llamacpp", sleep_idle_s=0.5, wake_s=0.3)
        client = http(sim)
        assert (await client.get("/props")).json()["is_sleeping"] is False
        await sim.wait_until(asleep)
        assert (await client.get("/props")).json()["is_sleeping"] is True
        for path in ("/health", "/v1/models", "/props", "/metrics"):
            await client.get(path)
        assert counts(sim) == {"asleep": True, "waking": False, "sleeps": 1, "wakes": 0}
        started = trio.current_time()
        assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200
        assert trio.current_time() - started >= 0.3  # (the wake)
        assert counts(sim)["wakes"] == 1
        await sim.wait_until(asleep)
        assert (await client.get("/slots")).status_code == 200
        assert counts(sim) == {"asleep": False, "waking": False, "sleeps": 2, "wakes": 2}


async def test_a_sleeping_simulator_frees_its_resident_memory(start_sim, http):
    with trio.fail_after(20):
        sim = await start_sim("llamacpp", sleep_idle_s=0.5, resident_mb=96)
        awake = rss_anon_mib()
        await sim.wait_until(asleep)
        slept = rss_anon_mib()
        assert awake - slept > 80, (awake, slept)
        assert (await http(sim).get("/slots")).status_code == 200
        assert rss_anon_mib() - slept > 80


async def test_vllm_sleep_routes_need_sleep_mode_and_dev_mode(start_sim, http):
    with trio.fail_after(10):
        for options in ({}, {"enable_sleep_mode": True}, {"dev_mode": True}):
            client = http(await start_sim("vllm", **options))
            assert (await client.get("/is_sleeping")).status_code == 404
            assert (await client.post("/sleep")).status_code == 404
        client = http(await start_sim("vllm", enable_sleep_mode=True, dev_mode=True))
        assert (await client.get("/is_sleeping")).json() == {"is_sleeping": False}


async def test_vllm_sleep_defaults_to_abort_and_wait_lets_a_stream_finish(start_sim, http):
    with trio.fail_after(20):
        sim = await start_sim("vllm", enable_sleep_mode=True, dev_mode=True, token_rate=20,
                              wake_s=0.2)
        client = http(sim)
        body = {**CHAT, "max_tokens": 20, "stream": True}

        async def stream(out: list[bytes], started: trio.Event) -> None:
            try:
                async with client.stream("POST", "/v1/chat/completions", json=body) as answer:
                    async for chunk in answer.aiter_bytes():
                        started.set()
                        out.append(chunk)
            except httpx2.HTTPError as exc:
                out.append(f"error: {type(exc).__name__}".encode())

        for mode, whole in (("", False), ("&mode=wait", True)):
            out: list[bytes] = []
            async with trio.open_nursery() as nursery:
                started = trio.Event()
                nursery.start_soon(stream, out, started)
                await started.wait()
                assert (await client.post(f"/sleep?level=1{mode}")).status_code == 200
            text = b"".join(out)
            assert text.endswith(b"data: [DONE]\n\n") is whole, (mode, text[-80:])
            assert (await client.get("/is_sleeping")).json() == {"is_sleeping": True}
            refused = await client.post("/v1/chat/completions", json=CHAT)
            assert refused.status_code == 503
            assert (await client.post("/wake_up")).status_code == 200
            assert (await client.get("/is_sleeping")).json() == {"is_sleeping": False}
        assert counts(sim)["sleeps"] == 2


async def test_vllm_level_2_discards_the_weights_until_reload_weights(start_sim, http):
    """vLLM's level-2 trap: a plain ``/wake_up`` leaves the weights it discarded unloaded
    (vLLM answers garbage, the simulator 500); the three-call wake (weights,
    ``collective_rpc reload_weights``, kv_cache) serves. Level 1 keeps them."""
    with trio.fail_after(20):
        sim = await start_sim("vllm", enable_sleep_mode=True, dev_mode=True)
        client = http(sim)
        assert (await client.post("/sleep?level=1&mode=wait")).status_code == 200
        assert (await client.post("/wake_up")).status_code == 200
        assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200
        assert (await client.post("/sleep?level=2&mode=wait")).status_code == 200
        assert (await client.post("/wake_up")).status_code == 200
        garbage = await client.post("/v1/chat/completions", json=CHAT)
        assert garbage.status_code == 500 and "reload_weights" in garbage.text
        assert (await client.post("/collective_rpc", json={})).status_code == 400
        assert (await client.post("/sleep?level=2&mode=wait")).status_code == 200
        assert (await client.post("/wake_up?tags=weights")).status_code == 200
        reload = await client.post("/collective_rpc", json={"method": "reload_weights"})
        assert reload.status_code == 200
        assert (await client.post("/wake_up?tags=kv_cache")).status_code == 200
        assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200
        assert sim.stats().engine["wake_tags"] == ["", "", "weights", "kv_cache"]


async def test_sglang_release_refuses_while_a_request_runs(start_sim, http):
    with trio.fail_after(20):
        sim = await start_sim("sglang", enable_memory_saver=True, token_rate=20)
        client = http(sim)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(partial(client.post, "/v1/chat/completions",
                                       json={**CHAT, "max_tokens": 10}))
            await sim.wait_until(lambda stats: stats.active_generations > 0)
            refused = await client.post("/release_memory_occupation", json={})
            assert refused.status_code == 500
        assert counts(sim)["asleep"] is False
        assert (await client.post("/release_memory_occupation", json={})).status_code == 200
        assert counts(sim)["asleep"] is True
        assert (await client.post("/resume_memory_occupation", json={})).status_code == 200
        assert counts(sim)["asleep"] is False
