"""Drain (EngineRunner.drain, POST /v1/engines/{name}/drain, nvpair drain): stop admitting,
let the routed requests in flight finish, then stop, with a managed simulator."""

from __future__ import annotations

import sys

import httpx2
import msgspec
import trio
from tests.managed import (
    free_port,
    managed_config,
    reading,
    sim_command,
    states_during,
    wait_state,
)
from tests.router.script_engine import JSON

from nvpair import service
from nvpair.supervision.lifecycle import Accepted, Busy


def stream_payload(tokens: int) -> bytes:
    return msgspec.json.encode({"model": "sim-model", "max_tokens": tokens, "stream": True,
                                "messages": [{"role": "user", "content": "hi"}]})


async def test_nvpair_drain_finishes_a_running_stream_and_leaves_the_engine_stopped(
        nursery, tmp_path) -> None:
    settings = managed_config(tmp_path, "e", free_port(),
                              sim_command("vllm", "--token-rate", "20"))
    with trio.fail_after(40):
        running = await nursery.start(service.run, settings)
        await wait_state(running.board, "e", "ready", where=lambda e: bool(e.models))
        chunks: list[bytes] = []
        during: list[httpx2.Response] = []
        streaming = trio.Event()
        async with reading(running.url) as reader, httpx2.AsyncClient(
                headers=JSON, base_url=running.url, timeout=20) as client:

            async def stream() -> None:  # 30 tokens at 20 a second: 1.5 s
                async with client.stream("POST", "/v1/chat/completions",
                                         content=stream_payload(30)) as r:
                    assert r.status_code == 200
                    async for chunk in r.aiter_bytes():
                        chunks.append(chunk)
                        streaming.set()

            async with trio.open_nursery() as n:
                n.start_soon(stream)
                await streaming.wait()
                r = await trio.run_process(
                    [sys.executable, "-m", "nvpair", "drain", "e", "--url", running.url],
                    capture_stdout=True, capture_stderr=True, check=False)
                assert r.returncode == 0, r.stderr
                assert b"drain accepted" in r.stdout
                e = running.board.current.engine("e")
                assert e is not None and not e.admitting and e.state == "ready"
                # a new request for its model while it drains: 503, come back later
                during.append(await client.post("/v1/chat/completions",
                                                content=stream_payload(2)))
            stopped = await wait_state(running.board, "e", "stopped")
        assert reader.worst < 0.5, reader.worst  # reads never waited on the drain
    body = b"".join(chunks)
    assert body.rstrip().endswith(b"data: [DONE]"), body[-200:]
    assert body.count(b'"content"') >= 30, body  # every token, nothing cut
    assert during[0].status_code == 503, during[0].text
    assert during[0].headers.get("retry-after") and "draining" in during[0].text
    assert stopped.admitting and stopped.activity is not None
    assert stopped.activity == ("drained (asked by the operator): 1 request in flight finished, "
                                "then stopped")


async def test_drain_results(nursery, tmp_path) -> None:
    """A repeat is accepted, a drain to the other end is busy, a stopped engine has nothing
    to drain to a stop and cannot drain to a restart."""
    settings = managed_config(tmp_path, "e", free_port(), sim_command("vllm"))
    with trio.fail_after(30):
        running = await nursery.start(service.run, settings)
        await wait_state(running.board, "e", "ready")
        runner = running.runners["e"]
        # a request in flight keeps the drain waiting (the router's count)
        running.traffic.started("e")
        assert runner.drain(then="restart", reason="test") == Accepted("draining")
        assert runner.drain(then="restart", reason="test") == Accepted("draining")
        assert isinstance(runner.drain(then="stop", reason="test"), Busy)
        # while the request is in flight, the engine stays up (not admitting)
        assert set(await states_during(running.board, 0.5)) <= {"ready"}
        running.traffic.finished("e", "ok")
        first_pid = running.board.current.engine("e").pid  # type: ignore[union-attr]
        restarted = await wait_state(running.board, "e", "ready",
                                     where=lambda e: e.pid != first_pid and e.admitting)
        assert restarted.activity == "drained (test): 1 request in flight finished, then restarted"
        async with httpx2.AsyncClient(base_url=running.url) as client:
            r = await client.post("/v1/engines/e/drain")
            assert r.status_code == 202 and r.json()["operation"] == "draining", r.text
            assert r.json()["admitting"] is False
            again = await client.post("/v1/engines/e/drain")
            assert again.status_code == 202 and again.json()["operation"] == "draining"
            await wait_state(running.board, "e", "stopped")
            assert runner.request("start") == Accepted("starting")
            await wait_state(running.board, "e", "ready")
            assert runner.request("stop") == Accepted("stopping")
            busy = await client.post("/v1/engines/e/drain")  # a stop in progress
            assert busy.status_code == 409 and busy.json()["error"]["code"] == "engine_busy"
            await wait_state(running.board, "e", "stopped")
            stopped = await client.post("/v1/engines/e/drain")  # nothing to drain
            assert stopped.status_code == 202 and stopped.json()["operation"] == "stop"
        assert isinstance(runner.drain(then="restart", reason="test"), Busy)


async def test_a_drain_that_runs_out_of_stop_grace_says_what_it_cut(nursery, tmp_path) -> None:
    """The operator's drain is bounded by the stop grace (0.5 s here): a 3 s stream is cut
    by the stop, and the drain's line says so. Before, it said "drained (...), then
    stopped": the count was read after the stop, when the cut request had ended."""
    settings = managed_config(tmp_path, "e", free_port(),
                              sim_command("vllm", "--token-rate", "20", "--load-s", "0.3"),
                              extra="stop_grace_s = 0.5")
    with trio.fail_after(30):
        running = await nursery.start(service.run, settings)
        await wait_state(running.board, "e", "ready", where=lambda e: bool(e.models))
        chunks: list[bytes] = []
        streaming = trio.Event()
        async with httpx2.AsyncClient(headers=JSON, base_url=running.url, timeout=20) as client:

            async def stream() -> None:  # 60 tokens at 20 a second: 3 s
                async with client.stream("POST", "/v1/chat/completions",
                                         content=stream_payload(60)) as r:
                    async for chunk in r.aiter_bytes():
                        chunks.append(chunk)
                        streaming.set()

            async with trio.open_nursery() as n:
                n.start_soon(stream)
                await streaming.wait()
                assert running.runners["e"].drain(reason="asked by the operator") == Accepted(
                    "draining")
            stopped = await wait_state(running.board, "e", "stopped")
    assert not b"".join(chunks).rstrip().endswith(b"data: [DONE]")  # it was cut
    assert stopped.activity == ("drained (asked by the operator), then stopped; 1 request "
                                "still in flight after the stop grace (0.5 s) cut")
