"""nvpair with a multi-model engine: llama-server in router mode (the simulator's, held to
what the real one answered; docs/multi-model.md). Each model it lists is listed with its
own state, and a request for a cold model loads it through nvpair."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx2
import msgspec
import trio
from tests.managed import free_port, wait_state

from nvpair import service
from nvpair.config.manifest import builtin_dir
from nvpair.config.settings import load_settings
from nvpair.sim import SimHandle, SimOptions, serve_sim

JSON = {"content-type": "application/json"}
#: the model list read often, so a model's state change shows within a test's patience
FAST = """
[engines.probes.ready]
interval_s = 0.1
timeout_s = 0.1
[engines.probes.models]
interval_s = 0.2
timeout_s = 0.2
"""


def models_dir(tmp: Path, *names: str) -> str:
    d = tmp / "models"
    d.mkdir()
    (tmp / "one.gguf").write_bytes(b"GGUF")
    for name in names:
        (d / f"{name}.gguf").symlink_to(tmp / "one.gguf")
    return str(d)


def chat(model: str, *, stream: bool = False, max_tokens: int = 2) -> bytes:
    return msgspec.json.encode({"model": model, "stream": stream, "max_tokens": max_tokens,
                                "messages": [{"role": "user", "content": "hi"}]})


async def start(nursery: trio.Nursery, tmp: Path, *, list_s: float = 0.2,  # type: ignore[no-untyped-def]
                extra: str = "", **options: object):
    sim: SimHandle = await nursery.start(serve_sim, SimOptions(
        kind="llamacpp", models_dir=models_dir(tmp, "alpha", "beta"), **options))
    await sim.wait_phase("ready")
    path = tmp / "nvpair.toml"
    path.write_text(f"listen = '127.0.0.1:0'\n{extra}[[engines]]\nname = 'r'\n"
                    f"kind = 'llamacpp'\nport = {sim.port}\n"
                    f"{FAST.replace('interval_s = 0.2', f'interval_s = {list_s}')}")
    running = await nursery.start(service.run, load_settings(str(path)))
    return sim, running


def states(running) -> dict[str, str | None]:  # type: ignore[no-untyped-def]
    e = running.board.current.engine("r")
    return {m.id: m.state for m in e.models}


async def test_a_router_is_ready_and_lists_each_model_in_its_state(nursery, tmp_path) -> None:
    with trio.fail_after(30):
        _, running = await start(nursery, tmp_path, models_max=1, model_load_s=0.3)
        e = await wait_state(running.board, "r", "ready", where=lambda e: len(e.models) == 2)
        assert e.identity is not None and e.identity.router and e.identity.models_max == 1
        assert e.mismatch is None
        async with httpx2.AsyncClient(base_url=running.url, headers=JSON, timeout=20) as client:
            listed = (await client.get("/v1/models")).json()["data"]
            assert {m["id"]: m["nvpair"]["state"] for m in listed} == {
                "alpha": "cold", "beta": "cold"}
            doc = (await client.get("/v1/engines/r")).json()
            assert doc["state"] == "ready"
            assert doc["model_states"] == {"alpha": "cold", "beta": "cold"}
            assert doc["router"] == {"models_max": 1, "autoload": True}
            # a chat to a cold model: routed to the router, which loads it
            answer = await client.post("/v1/chat/completions", content=chat("alpha"))
            assert answer.status_code == 200, answer.text
            assert answer.json()["model"] == "alpha"
            assert answer.headers["x-nvpair-engine"] == "r"
            await wait_state(running.board, "r", "ready",
                             where=lambda e: states(running)["alpha"] == "ready")
            listed = (await client.get("/v1/models")).json()["data"]
            assert {m["id"]: m["nvpair"]["state"] for m in listed} == {
                "alpha": "ready", "beta": "cold"}
            metrics = (await client.get("/metrics")).text
            assert 'nvpair_model_state{engine="r",model="alpha",state="ready"} 1' in metrics
            assert 'nvpair_model_state{engine="r",model="beta",state="cold"} 1' in metrics


async def test_never_a_request_that_evicts_a_model_with_one_in_flight(
        nursery, tmp_path) -> None:
    """An engine that evicts by count even a busy model (older llama-server builds, the
    simulator's ``router_evict_busy``): the chat for beta, sent through nvpair while a
    stream runs on alpha, waits in nvpair until the stream ends, which ends intact; nvpair
    then unloads alpha (idle) and beta is answered."""
    with trio.fail_after(30):
        sim, running = await start(nursery, tmp_path, models_max=1, model_load_s=0.1,
                                   router_evict_busy=True, token_rate=20.0)
        await wait_state(running.board, "r", "ready", where=lambda e: len(e.models) == 2)
        order: list[str] = []
        client = httpx2.AsyncClient(base_url=running.url, headers=JSON, timeout=20)
        async with client, client.stream("POST", "/v1/chat/completions",
                                         content=chat("alpha", stream=True, max_tokens=30)) as r:
            assert r.status_code == 200
            lines = r.aiter_lines()
            await lines.__anext__()  # (in flight in nvpair since before its head)

            async def other() -> None:
                answer = await client.post("/v1/chat/completions", content=chat("beta"))
                assert answer.status_code == 200, answer.text
                assert answer.json()["model"] == "beta"
                order.append("beta answered")

            async with trio.open_nursery() as inner:
                inner.start_soon(other)
                body = [line async for line in lines if line]
                order.append("alpha done")
        # (the role chunk, read above, then 30 tokens, the finish chunk and [DONE])
        assert body[-1] == "data: [DONE]" and len(body) == 30 + 2
        assert order == ["alpha done", "beta answered"]
        assert sim.stats().path("/models/unload").count == 1


async def test_a_managed_llamacpp_with_a_models_dir_starts_as_a_router(
        nursery, tmp_path) -> None:
    """[engines.args] models_dir and models_max: nvpair starts llama-server from the
    manifest's router_start (here the simulator in its place, given the same flags)."""
    doc = json.loads((builtin_dir() / "llamacpp.json").read_text())
    doc["router_start"]["argv"] = [sys.executable, "-m", "nvpair.sim", "llamacpp",
                                   "--host", "{host}", "--port", "{port}", "--no-control"]
    manifest = tmp_path / "llamacpp-sim.json"
    manifest.write_text(json.dumps(doc))
    path = tmp_path / "nvpair.toml"
    path.write_text(
        f"listen = '127.0.0.1:0'\nlog_dir = '{tmp_path / 'logs'}'\n[[engines]]\nname = 'r'\n"
        f"kind = '{manifest}'\nport = {free_port()}\nmanaged = true\n{FAST}"
        f"[engines.args]\nmodels_dir = '{models_dir(tmp_path, 'alpha', 'beta')}'\n"
        "models_max = 1\n")
    with trio.fail_after(60):
        running = await nursery.start(service.run, load_settings(str(path)))
        e = await wait_state(running.board, "r", "ready", within=30,
                             where=lambda e: len(e.models) == 2)
        assert e.identity is not None and e.identity.router and e.identity.models_max == 1
        assert states(running) == {"alpha": "cold", "beta": "cold"}
        async with httpx2.AsyncClient(base_url=running.url, headers=JSON, timeout=20) as client:
            answer = await client.post("/v1/chat/completions", content=chat("beta"))
            assert answer.status_code == 200 and answer.json()["model"] == "beta"


async def test_without_autoload_nvpair_loads_the_model_first(nursery, tmp_path) -> None:
    """``--no-models-autoload``: the router answers 400 "model is not loaded" to a chat for
    an unloaded model, and 503 while it loads; nvpair calls POST /models/load, waits for it
    to be loaded, then sends the chat."""
    with trio.fail_after(30):
        sim, running = await start(nursery, tmp_path, models_max=1, models_autoload=False,
                                   model_load_s=0.5)
        e = await wait_state(running.board, "r", "ready", where=lambda e: len(e.models) == 2)
        assert e.identity is not None and e.identity.autoload is False
        async with httpx2.AsyncClient(base_url=running.url, headers=JSON, timeout=20) as client:
            answer = await client.post("/v1/chat/completions", content=chat("alpha"))
            assert answer.status_code == 200, answer.text
            assert answer.json()["model"] == "alpha"
            # the other model: the idle one is unloaded by nvpair, the other loaded
            answer = await client.post("/v1/chat/completions", content=chat("beta"))
            assert answer.status_code == 200, answer.text
        assert sim.stats().path("/models/load").count == 2
        assert sim.stats().path("/models/unload").count == 1


async def test_the_routers_own_loads_show_after_the_next_routed_request(
        nursery, tmp_path) -> None:
    """Another client loads beta straight on the router: nvpair's model list comes every
    30 s, but the request it routes next reads the list again once answered, so beta
    shows loaded within a second of it, not at the next list."""
    with trio.fail_after(30):
        sim, running = await start(nursery, tmp_path, models_max=2, model_load_s=0.1,
                                   list_s=30)
        await wait_state(running.board, "r", "ready", where=lambda e: len(e.models) == 2)
        async with httpx2.AsyncClient(base_url=running.url, headers=JSON, timeout=20) as client:
            assert (await client.post("/v1/chat/completions", content=chat("alpha"))
                    ).status_code == 200
            await wait_state(running.board, "r", "ready",
                             where=lambda e: states(running)["alpha"] == "ready")
            async with httpx2.AsyncClient(base_url=sim.url) as direct:
                loaded = await direct.post("/models/load", json={"model": "beta"})
                assert loaded.status_code == 200, loaded.text
            assert states(running)["beta"] == "cold"  # (nvpair cannot know yet)
            answer = await client.post("/v1/chat/completions", content=chat("alpha"))
            assert answer.status_code == 200
            await wait_state(running.board, "r", "ready", within=3,
                             where=lambda e: states(running) == {"alpha": "ready",
                                                                 "beta": "ready"})
        assert running.board.current.engine("r").probe("models").requests == 1


async def test_requests_waiting_for_a_model_slot_have_the_queues_limits_and_show_queued(
        nursery, tmp_path) -> None:
    """While a stream holds the only slot, a request for the other model waits in nvpair:
    it is the engine's ``queued``; one more than ``queue_max`` is 429 at once; the one
    waiting gets 503 with why after ``queue_wait_s``; the stream ends whole."""
    with trio.fail_after(30):
        sim, running = await start(nursery, tmp_path, models_max=1, model_load_s=0.1,
                                   token_rate=10.0,
                                   extra="[activation]\nqueue_max = 1\nqueue_wait_s = 1\n")
        await wait_state(running.board, "r", "ready", where=lambda e: len(e.models) == 2)
        client = httpx2.AsyncClient(base_url=running.url, headers=JSON, timeout=20)
        async with client, client.stream("POST", "/v1/chat/completions",
                                         content=chat("alpha", stream=True, max_tokens=30)) as r:
            assert r.status_code == 200
            lines = r.aiter_lines()
            await lines.__anext__()
            answers: list[httpx2.Response] = []

            async def other() -> None:
                answers.append(await client.post("/v1/chat/completions", content=chat("beta")))

            async with trio.open_nursery() as inner:
                inner.start_soon(other)
                e = await wait_state(running.board, "r", "ready", where=lambda e: e.queued == 1)
                assert e.queued_since is not None
                doc = (await client.get("/v1/engines/r")).json()
                assert doc["queued"] == 1 and doc["queued_oldest_s"] is not None
                full = await client.post("/v1/chat/completions", content=chat("beta"))
                assert full.status_code == 429, full.text
                assert full.json()["error"]["code"] == "queue_full"
                assert "queue_max 1" in full.json()["error"]["message"]
            [late] = answers
            assert late.status_code == 503 and late.headers["retry-after"] == "5"
            message = late.json()["error"]["message"]
            assert "no free model slot for beta within queue_wait_s (1 s)" in message
            assert "(alpha)" in message
            e = running.board.current.engine("r")
            assert e is not None and (e.queued, e.queued_since) == (0, None)
            body = [line async for line in lines if line]
        assert body[-1] == "data: [DONE]"
        assert sim.stats().path("/models/unload").count == 0
