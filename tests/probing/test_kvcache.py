"""An engine's KV-cache use from its own /metrics: the gauge parser on any bytes, and the
opt-in reading through a real nvpair and a vLLM simulator whose use moves with its load."""

from __future__ import annotations

import math

import httpx2
import msgspec
import trio
from hypothesis import given
from hypothesis import strategies as st
from tests.managed import wait_state
from tests.router.script_engine import JSON

from nvpair import service
from nvpair.config.settings import load_settings
from nvpair.probing.kvcache import gauge_value
from nvpair.sim import SimOptions, serve_sim

NAME = "vllm:kv_cache_usage_perc"


@given(st.binary(max_size=2000))
def test_any_body_gives_a_finite_number_or_none(body: bytes) -> None:
    value = gauge_value(body, NAME)
    assert value is None or math.isfinite(value)


@given(st.lists(st.floats(min_value=0, max_value=1), min_size=1, max_size=5),
       st.lists(st.sampled_from([
           "# HELP vllm:kv_cache_usage_perc KV-cache usage.",
           "# TYPE vllm:kv_cache_usage_perc gauge",
           "vllm:kv_cache_usage_perc_total 9", "vllm:num_requests_waiting 7",
           'vllm:kv_cache_usage_perc{model_name="x"} NaN', "vllm:kv_cache_usage_perc{broken 3",
           "vllm:kv_cache_usage_perc"]), max_size=8))
def test_the_largest_series_of_the_gauge_is_taken(values: list[float], noise: list[str]) -> None:
    lines = [f'{NAME}{{engine="{i}",model_name="m \\"q\\""}} {v!r}' for i, v in enumerate(values)]
    body = "\n".join(noise + lines + noise).encode()
    assert gauge_value(body, NAME) == max(values)
    assert gauge_value(f"{NAME} 0.25\n".encode(), NAME) == 0.25  # (no labels)


def payload(tokens: int) -> bytes:
    return msgspec.json.encode({"model": "m", "max_tokens": tokens, "stream": False,
                                "messages": [{"role": "user", "content": "hi"}]})


async def test_an_engine_that_opts_in_has_its_kv_cache_use_in_metrics(nursery, tmp_path) -> None:
    """The simulator's use is 1 % per request running: idle 0, one request 0.01, and the
    gauge follows it within a reading (1 s here); an engine that does not opt in has no
    series, and is not asked for its /metrics."""
    sim = await nursery.start(serve_sim, SimOptions(kind="vllm", model="m"))
    other = await nursery.start(serve_sim, SimOptions(kind="vllm", model="n"))
    conf = tmp_path / "nvpair.toml"
    conf.write_text(f"listen = '127.0.0.1:0'\n"
                    f"[[engines]]\nname = 'e'\nkind = 'vllm'\nport = {sim.port}\n"
                    f"kv_cache_probe_s = 1\n"
                    f"[[engines]]\nname = 'quiet'\nkind = 'vllm'\nport = {other.port}\n")
    with trio.fail_after(30):
        running = await nursery.start(service.run, load_settings(str(conf)))
        await wait_state(running.board, "e", "ready",
                         where=lambda e: e.kv_cache_usage == 0 and bool(e.models))
        async with httpx2.AsyncClient(headers=JSON, base_url=running.url, timeout=30) as client:
            async with trio.open_nursery() as n:
                n.start_soon(lambda: client.post("/v1/chat/completions", content=payload(2000)))
                await wait_state(running.board, "e", "ready",
                                 where=lambda e: e.kv_cache_usage == 0.01)
                text = (await client.get("/metrics")).text
                one = (await client.get("/v1/engines/e")).json()
                listed = (await client.get("/v1/engines")).json()
                n.cancel_scope.cancel()
            await wait_state(running.board, "e", "ready", where=lambda e: e.kv_cache_usage == 0)
    assert 'nvpair_kv_cache_usage_ratio{engine="e",model="m"} 0.01\n' in text
    assert 'engine="quiet"' not in "".join(
        line for line in text.splitlines() if line.startswith("nvpair_kv_cache"))
    quiet = running.board.current.engine("quiet")
    assert quiet is not None and quiet.kv_cache_usage is None
    # the engine's status shows it too (its own, and in the list); null where not read
    assert one["kv_cache_usage"] == 0.01
    assert {e["name"]: e["kv_cache_usage"] for e in listed["engines"]} == {
        "e": 0.01, "quiet": None}
