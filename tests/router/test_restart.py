"""After an engine restart, even after SIGKILL, no request fails on a stale connection."""

from __future__ import annotations

import os
import signal

import httpx2
import msgspec
import trio
from tests.managed import free_port, managed_config, sim_command, wait_state
from tests.router.script_engine import JSON

from nvpair import service


async def test_requests_succeed_again_as_soon_as_the_restarted_engine_is_ready(
        nursery, tmp_path) -> None:
    settings = managed_config(tmp_path, "e", free_port(),
                              sim_command("vllm", "--load-s", "0.3", "--token-rate", "2000"))
    payload = msgspec.json.encode({"model": "sim-model", "max_tokens": 4,
                                   "messages": [{"role": "user", "content": "hi"}]})
    with trio.fail_after(40):
        running = await nursery.start(service.run, settings)
        first = await wait_state(running.board, "e", "ready", where=lambda e: bool(e.models))
        # (status, whether the restarted engine was already ready when the request was sent)
        statuses: list[tuple[int, bool]] = []
        wanted, reached = 10, trio.Event()
        async with httpx2.AsyncClient(headers=JSON, base_url=running.url) as client:

            async def steady() -> None:
                nonlocal reached
                while True:
                    e = running.board.current.engine("e")
                    restarted = e is not None and e.state == "ready" and e.pid != first.pid
                    r = await client.post("/v1/chat/completions", content=payload)
                    statuses.append((r.status_code, restarted))
                    if len(statuses) >= wanted:
                        reached.set()
                    await trio.sleep(0.01)  # a steady client, one request every 10 ms or so

            async def until(count: int) -> None:
                nonlocal wanted, reached
                wanted, reached = count, trio.Event()
                await reached.wait()

            async with trio.open_nursery() as n:
                n.start_soon(steady)
                await until(10)
                os.kill(first.pid, signal.SIGKILL)  # type: ignore[arg-type]
                await wait_state(running.board, "e", "ready", where=lambda e: e.pid != first.pid)
                mark = len(statuses)
                await until(mark + 30)
                n.cancel_scope.cancel()
    before = [s for s, _ in statuses[:10]]
    after_ready = [s for s, restarted in statuses if restarted]
    assert before == [200] * 10
    assert len(after_ready) >= 20 and after_ready == [200] * len(after_ready), after_ready
    down = [s for s, restarted in statuses[10:] if not restarted]
    assert set(down) <= {200, 503}, down  # while it restarts: 503 from the snapshot, never 5xx else
