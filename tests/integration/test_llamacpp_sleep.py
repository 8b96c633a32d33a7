"""llama-server's sleep (``--sleep-idle-seconds``), against the real server (``[real]``,
marked ``integration``) and nvpair's simulator (``[sim]``): which requests wake it or
restart its idle timer. nvpair's probes rely on the answer (docs/sleep.md): ``/health``,
``/props`` and ``/v1/models`` must never wake it; ``GET /slots`` is a task, so it wakes it
(nvpair's wake call), as does a generation. And nvpair over it: adopted without
``sleep = true``, a sleeping server is listed ``sleeping``, and a chat wakes it; one asleep
before nvpair starts (a kept engine the next nvpair adopts) is never listed ``ready`` first.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx2
import trio
from tests.integration.llamacpp_process import DEFAULT_ALIAS, ServerFactory
from tests.managed import wait_state

from nvpair import service
from nvpair.config.settings import load_settings

IDLE_S = 1
#: the real server checks its idle time about once a second: asleep within a few
ASLEEP_WITHIN_S = 15.0
#: requests that must not wake it (``/metrics`` too: started with ``--metrics``)
QUIET = ("/health", "/v1/health", "/props", "/v1/models", "/models", "/metrics")


async def is_sleeping(client: httpx2.AsyncClient) -> bool:
    answer = await client.get("/props")
    assert answer.status_code == 200, answer.text
    value = answer.json()["is_sleeping"]
    assert isinstance(value, bool)
    return value


async def until_asleep(client: httpx2.AsyncClient) -> float:
    """Poll ``/props`` (which must not keep it awake) until it sleeps; the seconds it took."""
    started = trio.current_time()
    with trio.fail_after(ASLEEP_WITHIN_S):
        while not await is_sleeping(client):  # noqa: ASYNC110 (an outside process)
            await trio.sleep(0.1)
    return trio.current_time() - started


async def test_what_wakes_a_sleeping_llama_server(llama_server_factory: ServerFactory) -> None:
    extra = ["--sleep-idle-seconds", str(IDLE_S)]
    async with llama_server_factory(extra=extra) as server, server.client() as client:
        await until_asleep(client)
        for path in QUIET:
            answer = await client.get(path)
            assert answer.status_code == 200, (path, answer.text)
            assert await is_sleeping(client), f"GET {path} woke the server"
        slots = await client.get("/slots")
        assert slots.status_code == 200
        assert not await is_sleeping(client), "GET /slots did not wake the server"
        await until_asleep(client)
        chat = await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert chat.status_code == 200, chat.text
        assert chat.json()["choices"][0]["finish_reason"] == "length"
        assert not await is_sleeping(client)


async def test_only_a_task_restarts_the_idle_timer(llama_server_factory: ServerFactory) -> None:
    """Polled every 0.2 s by ``/health``, ``/props`` and ``/v1/models``, it still falls
    asleep; polled by ``/slots``, it stays awake."""
    extra = ["--sleep-idle-seconds", str(IDLE_S)]
    async with llama_server_factory(extra=extra) as server, server.client() as client:
        await until_asleep(client)
        assert (await client.get("/slots")).status_code == 200
        with trio.fail_after(ASLEEP_WITHIN_S):
            while not await is_sleeping(client):
                for path in ("/health", "/v1/models"):
                    assert (await client.get(path)).status_code == 200
                await trio.sleep(0.2)
        assert (await client.get("/slots")).status_code == 200
        started = trio.current_time()
        while trio.current_time() - started < 3 * IDLE_S + 1:
            assert (await client.get("/slots")).status_code == 200
            assert not await is_sleeping(client), "asleep though /slots came every 0.2 s"
            await trio.sleep(0.2)


async def test_nvpair_lists_an_adopted_sleeping_server_sleeping_without_sleep_true(
        llama_server_factory: ServerFactory, nursery: trio.Nursery, tmp_path: Path) -> None:
    """Started with ``--sleep-idle-seconds`` by someone else, adopted by nvpair with no
    ``sleep = true``: listed ``sleeping`` once it sleeps (its /props), kept asleep by
    nvpair's probes, woken by a chat routed through nvpair, then asleep again."""
    extra = ["--sleep-idle-seconds", str(IDLE_S)]
    async with llama_server_factory(extra=extra) as server, server.client() as direct:
        config = tmp_path / "nvpair.toml"
        config.write_text(
            f"listen = '127.0.0.1:0'\n[[engines]]\nname = 'g'\nkind = 'llamacpp'\n"
            f"port = {server.port}\nmodel = '{DEFAULT_ALIAS}'\n"
            "[engines.probes.health]\ninterval_s = 0.5\ntimeout_s = 0.5\n"
            "[engines.probes.identity]\ninterval_s = 1\ntimeout_s = 1\n"
            "[engines.probes.models]\ninterval_s = 1\ntimeout_s = 1\n")
        with trio.fail_after(120):
            running = await nursery.start(service.run, load_settings(str(config)))
            await wait_state(running.board, "g", "sleeping", within=ASLEEP_WITHIN_S + 30,
                             where=lambda e: bool(e.models))
            await trio.sleep(2.0)  # (probed every 0.5 s meanwhile)
            assert await is_sleeping(direct), "nvpair's probes woke it"
            async with httpx2.AsyncClient(base_url=running.url, timeout=60) as client:
                listed = (await client.get("/v1/models")).json()["data"]
                assert [m["nvpair"]["state"] for m in listed] == ["sleeping"]
                chat = await client.post("/v1/chat/completions", json={
                    "model": DEFAULT_ALIAS, "max_tokens": 2,
                    "messages": [{"role": "user", "content": "hi"}]})
                assert chat.status_code == 200, chat.text
                assert chat.headers["x-nvpair-engine"] == "g"
            e = running.board.current.engine("g")
            assert e is not None and (health := e.probe("health")) is not None
            assert health.path == "/props"  # (the sleeping probe, without sleep = true)


async def test_a_server_asleep_before_nvpair_starts_is_never_listed_ready(
        llama_server_factory: ServerFactory, nursery: trio.Nursery, tmp_path: Path) -> None:
    """Asleep when nvpair comes (as a kept engine is when the next nvpair adopts it, docs/
    lifecycle.md): listed ``sleeping`` from the first, not ``ready`` until the next health
    probe (2 s here, 5 s by the manifest): the identity answer (``/props``) that confirms
    who answers says it sleeps too. It stays asleep."""
    extra = ["--sleep-idle-seconds", str(IDLE_S)]
    async with llama_server_factory(extra=extra) as server, server.client() as direct:
        await until_asleep(direct)
        config = tmp_path / "nvpair.toml"
        config.write_text(
            f"listen = '127.0.0.1:0'\n[[engines]]\nname = 'g'\nkind = 'llamacpp'\n"
            f"port = {server.port}\nmodel = '{DEFAULT_ALIAS}'\n"
            "[engines.probes.health]\ninterval_s = 2\ntimeout_s = 1\n")
        with trio.fail_after(60):
            running = await nursery.start(service.run, load_settings(str(config)))
            await wait_state(running.board, "g", "sleeping", where=lambda e: bool(e.models))
            async with httpx2.AsyncClient(base_url=running.url) as client:
                listed = (await client.get("/v1/engines")).json()  # (the journal caught up)
        # every state it was shown in: the event journal's (GET /v1/events)
        shown = [json.loads(e.data)["state"] for e in running.events.ring
                 if e.type == "engine" and e.engine == "g"]
        assert [e["state"] for e in listed["engines"]] == ["sleeping"], listed
        assert "ready" not in shown and shown[-1] == "sleeping", shown
        assert await is_sleeping(direct), "nvpair woke it"
