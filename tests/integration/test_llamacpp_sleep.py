"""llama-server's sleep (``--sleep-idle-seconds``), against the real server (``[real]``,
marked ``integration``) and nvpair's simulator (``[sim]``): which requests wake it or
restart its idle timer. nvpair's probes rely on the answer (docs/sleep.md): ``/health``,
``/props`` and ``/v1/models`` must never wake it; ``GET /slots`` is a task, so it wakes it
(nvpair's wake call), as does a generation.
"""

from __future__ import annotations

import httpx2
import trio
from tests.integration.llamacpp_process import ServerFactory

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
