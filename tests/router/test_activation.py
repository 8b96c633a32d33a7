"""Engines on demand, end to end: nvpair with managed simulators that take a while to load.

Each test runs the real service (real subprocesses, real sockets, real HTTP); the reads
(/v1/models, /v1/engines) are polled throughout and must never wait on any of it.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, NamedTuple

import httpx2
import msgspec
import pytest
import trio
from tests.fakes import FakeEngine, engine_spec, vllm_routes
from tests.managed import FAST_PROBES, fast_manifest, free_port, reading, sim_command, wait_state
from tests.router.script_engine import JSON
from tests.supervision.test_process import FakeSpawn

from nvpair import service
from nvpair.config.settings import ActivationConfig, Settings, load_settings
from nvpair.router.activation import Activator
from nvpair.state.snapshot import Board
from nvpair.state.traffic import Traffic
from nvpair.state.transitions import initial_state
from nvpair.supervision.lifecycle import EngineRunner

GB = 10**9


def on_demand(tmp: Path, engines: dict[str, list[str]], *, extra: str = "",
              activation: str = "", kind: str = "vllm", **per_engine: str) -> Settings:
    """A config of on-demand engines, each serving the model named like it."""
    manifest = fast_manifest(tmp, kind)
    text = f"listen = '127.0.0.1:0'\nlog_dir = '{tmp / 'logs'}'\nsweep_deadline_s = 2\n"
    text += f"[activation]\n{activation}\n"
    for name, command in engines.items():
        text += (f"[[engines]]\nname = '{name}'\nkind = '{manifest}'\nport = {free_port()}\n"
                 f"model = 'model-{name}'\nmanaged = true\nactivation = 'on_demand'\n"
                 f"command = {json.dumps(command)}\n{per_engine.get(name, '')}\n{extra}\n"
                 + FAST_PROBES)
    path = tmp / "nvpair.toml"
    path.write_text(text)
    return load_settings(str(path))


def payload(model: str, tokens: int = 4, stream: bool = False) -> bytes:
    return msgspec.json.encode({"model": model, "max_tokens": tokens, "stream": stream,
                                "messages": [{"role": "user", "content": "hi"}]})


async def queued(board: Any, name: str, count: int) -> None:
    await wait_state(board, name, "cold", "starting", "ready", "stopped", "down",
                     where=lambda e: e.queued == count)


class OnDemand(NamedTuple):
    board: Board
    fake: FakeEngine
    runner: EngineRunner
    activator: Activator


@contextlib.asynccontextmanager
async def on_demand_service(
        nursery: trio.Nursery, settings: Settings, *,
        read: bool = False) -> AsyncIterator[tuple[Any, httpx2.AsyncClient, Any]]:
    """A running nvpair of ``settings`` (in ``nursery``), a client of its API, and with
    ``read`` a reader that times its reads all along (``tests.managed.reading``)."""
    running = await nursery.start(service.run, settings)
    async with contextlib.AsyncExitStack() as stack:
        reader = await stack.enter_async_context(reading(running.url)) if read else None
        client = await stack.enter_async_context(
            httpx2.AsyncClient(headers=JSON, base_url=running.url, timeout=30))
        yield running, client, reader


async def one_on_demand(nursery: trio.Nursery, *, loading: bool = False,
                        config: ActivationConfig | None = None, **spec_kw: Any) -> OnDemand:
    """One managed on-demand vLLM engine "e" (a fake process through the spawn seam, a
    mock engine over httpx2.MockTransport, /health 503 while ``loading``), its real
    runner and the activator, both started."""
    spec = engine_spec("vllm", managed=True, port=free_port(), model="m",
                       command=["srv", "--port", "{port}"], activation="on_demand", **spec_kw)
    board = Board((initial_state(spec),))
    fake = FakeEngine(vllm_routes())
    if loading:
        fake.routes["/health"] = (503, "loading")
    traffic = Traffic()
    runner = EngineRunner(spec, board, None, None, traffic, transport=fake.transport(),
                          spawn=FakeSpawn())
    activator = Activator(board, [spec], {"e": runner}, traffic, config or ActivationConfig())
    await nursery.start(runner.run)
    await nursery.start(activator.run)
    return OnDemand(board, fake, runner, activator)


async def test_eight_requests_for_a_cold_model_start_it_once_and_go_in_order(
        nursery, tmp_path) -> None:
    """One slot (max_in_flight = 1): the waiting requests go one after the other, in the
    order they came (with more slots they go together: the capacity tests below)."""
    settings = on_demand(tmp_path, {"a": sim_command("vllm", "--load-s", "1.5")},
                         a="max_in_flight = 1")
    with trio.fail_after(40):
        async with on_demand_service(nursery, settings, read=True) as (
                running, client, reader):
            listed = (await client.get("/v1/models")).json()["data"]
            assert [(m["id"], m["nvpair"]["state"]) for m in listed] == [("model-a", "cold")]
            heads: list[int] = []
            statuses: dict[int, int] = {}

            async def one(i: int) -> None:
                async with client.stream("POST", "/v1/chat/completions",
                                         content=payload("model-a", stream=True)) as r:
                    heads.append(i)
                    statuses[i] = r.status_code
                    await r.aread()

            async with trio.open_nursery() as n:
                for i in range(8):  # in a known order: each is queued before the next
                    n.start_soon(one, i)
                    await queued(running.board, "a", i + 1)
                doc = (await client.get("/v1/engines/a")).json()
                assert doc["queued"] == 8 and doc["state"] in ("starting", "cold"), doc
                assert heads == []  # nothing on the wire while they wait (no invented head)
            assert running.runners["a"].starts == 1
            assert statuses == dict.fromkeys(range(8), 200)
            assert heads == list(range(8))
            engine = running.board.current.engine("a")
            assert engine is not None and engine.queued == 0
            assert engine.activity == "started a for a request (queued 1)"
        assert reader.worst < 0.5, reader.worst


async def burst(client: httpx2.AsyncClient, model: str, count: int,
                tokens: int) -> list[tuple[float, int]]:
    """``count`` requests at once (non-streaming): each one's end (seconds from the send)
    and status, in the order they ended."""
    sent = trio.current_time()
    ended: list[tuple[float, int]] = []

    async def one() -> None:
        r = await client.post("/v1/chat/completions", content=payload(model, tokens))
        ended.append((trio.current_time() - sent, r.status_code))

    async with trio.open_nursery() as n:
        for _ in range(count):
            n.start_soon(one)
    return ended


async def test_a_cold_engine_with_eight_slots_serves_eight_waiting_requests_at_once(
        nursery, tmp_path) -> None:
    """llama-server with 8 slots (-np 8; its /props says total_slots 8), loading for 1 s:
    8 requests of 2 s each, sent together while it is cold, all end within 2 + 0.5 s of
    its being ready (1 + 2 + 0.5 s of the send, plus the simulator's own start, 0.3-0.8 s
    on this 2-core machine). Before, each waited for the whole answer of the one before it
    (16 s and more, and 503s once queue_wait_s had passed)."""
    settings = on_demand(tmp_path, {"a": sim_command(
        "llamacpp", "-np", "8", "--load-s", "1", "--token-rate", "5")}, kind="llamacpp",
        activation="queue_wait_s = 30")
    with trio.fail_after(40):
        running = await nursery.start(service.run, settings)
        ready_at: list[float] = []

        async def ready() -> None:
            await wait_state(running.board, "a", "ready")
            ready_at.append(trio.current_time())

        async with reading(running.url) as reader, httpx2.AsyncClient(
                headers=JSON, base_url=running.url, timeout=30) as client:
            nursery.start_soon(ready)
            sent = trio.current_time()
            ended = await burst(client, "model-a", 8, tokens=10)  # 10 tokens at 5 a second
        assert reader.worst < 0.5, reader.worst
    assert [status for _, status in ended] == [200] * 8, ended
    assert max(t for t, _ in ended) - (ready_at[0] - sent) < 2 + 0.5, (ended, ready_at, sent)
    e = running.board.current.engine("a")
    assert e is not None and e.identity is not None and e.identity.slots == 8
    assert running.runners["a"].starts == 1


async def test_two_slots_serve_eight_waiting_requests_in_four_waves_without_a_503(
        nursery, tmp_path) -> None:
    """The same with 2 slots and 1 s answers: two at a time, each pair as the one before
    ends (four waves), none 503 though the last waits about 3 s for a slot
    (queue_wait_s 5 bounds that wait, not the answers). Before: one at a time, each
    after the whole answer before it; those still waiting at 5 s got 503."""
    settings = on_demand(tmp_path, {"a": sim_command(
        "llamacpp", "-np", "2", "--load-s", "1", "--token-rate", "10")}, kind="llamacpp",
        activation="queue_wait_s = 5")
    with trio.fail_after(40):
        async with on_demand_service(nursery, settings) as (_, client, _):
            ended = await burst(client, "model-a", 8, tokens=10)  # 1 s each
            traffic = (await client.get("/v1/engines/a")).json()
    assert [status for _, status in ended] == [200] * 8, ended
    times = sorted(t for t, _ in ended)
    waves = [times[i:i + 2] for i in range(0, 8, 2)]
    for k, wave in enumerate(waves):  # wave k ends 1 s (answers) after wave k - 1
        assert wave[1] - wave[0] < 0.5, waves
        if k:
            assert 0.8 < wave[0] - waves[k - 1][0] < 1.6, waves
    assert times[-1] < 1 + 4 + 1.5, waves
    assert traffic["state"] == "ready" and traffic["queued"] == 0


async def test_a_client_that_leaves_while_queued_leaves_the_queue(nursery, tmp_path) -> None:
    settings = on_demand(tmp_path, {"a": sim_command("vllm", "--load-s", "1.5")})
    with trio.fail_after(40):
        async with on_demand_service(nursery, settings) as (running, client, _):
            with trio.CancelScope() as gone:
                async with trio.open_nursery() as n:
                    n.start_soon(lambda: client.post("/v1/chat/completions",
                                                     content=payload("model-a")))
                    await queued(running.board, "a", 1)
                    gone.cancel()  # the client goes away while it waits
            left = await wait_state(running.board, "a", "cold", "starting",
                                    where=lambda e: e.queued == 0)
            assert left.state in ("cold", "starting")  # (the start goes on: one start)
            r = await client.post("/v1/chat/completions", content=payload("model-a"))
            assert r.status_code == 200, r.text
            assert running.runners["a"].starts == 1


async def test_a_full_queue_is_429_and_a_long_wait_is_503(nursery, tmp_path) -> None:
    settings = on_demand(tmp_path, {"a": sim_command("vllm", "--load-s", "30")},
                         activation="queue_max = 2\nqueue_wait_s = 1.0")
    with trio.fail_after(30):
        async with on_demand_service(nursery, settings, read=True) as (
                running, client, reader):
            waited: list[httpx2.Response] = []

            async def one() -> None:
                waited.append(await client.post("/v1/chat/completions",
                                                content=payload("model-a")))

            async with trio.open_nursery() as n:
                n.start_soon(one)
                n.start_soon(one)
                await queued(running.board, "a", 2)
                full = await client.post("/v1/chat/completions", content=payload("model-a"))
        assert full.status_code == 429, full.text
        assert "queue_max 2" in full.json()["error"]["message"]
        assert [r.status_code for r in waited] == [503, 503]
        assert all(r.headers["retry-after"] == "5" for r in waited)
        assert "not ready within queue_wait_s (1 s)" in waited[0].json()["error"]["message"]
        assert reader.worst < 0.5, reader.worst


async def test_a_start_that_fails_is_503_for_every_waiter_with_the_reason(
        nursery, tmp_path) -> None:
    settings = on_demand(tmp_path, {"a": sim_command("vllm", "--load-s", "0.5",
                                                     "--fail-on-load", "3")})
    with trio.fail_after(30):
        async with on_demand_service(nursery, settings) as (running, client, _):
            answers: list[httpx2.Response] = []

            async def one() -> None:
                answers.append(await client.post("/v1/chat/completions",
                                                 content=payload("model-a")))

            async with trio.open_nursery() as n:
                for i in range(3):
                    n.start_soon(one)
                    await queued(running.board, "a", i + 1)
            back = await wait_state(running.board, "a", "cold")
    assert [r.status_code for r in answers] == [503, 503, 503]
    messages = {r.json()["error"]["message"] for r in answers}
    assert len(messages) == 1, messages
    message = messages.pop()
    assert message.startswith("engine a failed to start: engine process exited with code 3")
    assert "its last line:" in message, message
    assert back.state == "cold" and running.runners["a"].starts == 1


async def test_a_budget_for_one_drains_the_first_engine_then_starts_the_second(
        nursery, tmp_path) -> None:
    settings = on_demand(
        tmp_path, {"a": sim_command("vllm", "--token-rate", "20"),
                   "b": sim_command("vllm", "--load-s", "0.5")},
        activation=f"memory_budget_bytes = {10 * GB}", extra=f"memory_bytes = {6 * GB}")
    with trio.fail_after(40):
        async with on_demand_service(nursery, settings, read=True) as (
                running, client, reader):
            first = await client.post("/v1/chat/completions", content=payload("model-a"))
            assert first.status_code == 200, first.text
            chunks: list[bytes] = []
            streaming = trio.Event()
            second: list[httpx2.Response] = []

            async def stream() -> None:  # 30 tokens at 20 a second: 1.5 s
                async with client.stream("POST", "/v1/chat/completions",
                                         content=payload("model-a", 30, stream=True)) as r:
                    async for chunk in r.aiter_bytes():
                        chunks.append(chunk)
                        streaming.set()

            async def for_b() -> None:
                second.append(await client.post("/v1/chat/completions",
                                                content=payload("model-b")))

            async with trio.open_nursery() as n:
                n.start_soon(stream)
                await streaming.wait()
                n.start_soon(for_b)
                drained = await wait_state(running.board, "a", "ready",
                                           where=lambda e: not e.admitting)
                assert drained.activity == "draining (to make room for b): 1 in flight, then stop"
                # b is not started while a still generates
                assert running.board.current.engine("b").state == "cold"  # type: ignore[union-attr]
        assert reader.worst < 0.5, reader.worst
    body = b"".join(chunks)
    assert body.rstrip().endswith(b"data: [DONE]") and body.count(b'"content"') >= 30
    assert second[0].status_code == 200, second[0].text
    a = running.board.current.engine("a")
    assert a is not None and a.state == "cold"
    assert a.activity is not None and a.activity.startswith(
        "evicted a (stop) to make room for b: 1 request in flight, drained first, loads "
        "again in "), a.activity  # (its measured load)
    assert a.activity.endswith("; frees 6.0 GB (it cannot be put to sleep)"), a.activity


def evicting(tmp: Path, queue_wait_s: float) -> Settings:
    """Memory for one of a and b; a answers slowly (20 tokens a second) and its stop grace
    (0.5 s) is shorter than its answers."""
    return on_demand(
        tmp, {"a": sim_command("vllm", "--token-rate", "20", "--load-s", "0.3"),
              "b": sim_command("vllm", "--load-s", "0.3")},
        activation=f"memory_budget_bytes = {10 * GB}\nqueue_wait_s = {queue_wait_s}",
        extra=f"memory_bytes = {6 * GB}", a="stop_grace_s = 0.5")


async def stream_and_ask_b(client: httpx2.AsyncClient,
                           tokens: int) -> tuple[bytes, httpx2.Response, float]:
    """A stream of ``tokens`` on a, and once it streams, a request for b: the stream's
    body, b's answer, and how long after the stream's end b's answer came (negative:
    before it ended)."""
    chunks: list[bytes] = []
    streaming = trio.Event()
    times: dict[str, float] = {}
    second: list[httpx2.Response] = []

    async def stream() -> None:
        async with client.stream("POST", "/v1/chat/completions",
                                 content=payload("model-a", tokens, stream=True)) as r:
            async for chunk in r.aiter_bytes():
                chunks.append(chunk)
                streaming.set()
        times["stream"] = trio.current_time()

    async def for_b() -> None:
        second.append(await client.post("/v1/chat/completions", content=payload("model-b")))
        times["b"] = trio.current_time()

    async with trio.open_nursery() as n:
        n.start_soon(stream)
        await streaming.wait()
        n.start_soon(for_b)
    return b"".join(chunks), second[0], times["b"] - times["stream"]


async def test_an_eviction_waits_for_a_stream_longer_than_the_stop_grace(
        nursery, tmp_path, caplog) -> None:
    """a streams for 2 s (its stop grace is 0.5 s); a request for b needs a's room: a
    lets its stream end intact (every token, [DONE]), then a stops and b
    starts and answers. Before, a was stopped 0.5 s into the drain and its stream cut."""
    with trio.fail_after(40), caplog.at_level(logging.INFO, logger="nvpair"):
        async with on_demand_service(nursery, evicting(tmp_path, 30), read=True) as (
                running, client, reader):
            assert (await client.post("/v1/chat/completions",
                                      content=payload("model-a"))).status_code == 200
            body, b, after = await stream_and_ask_b(client, 40)
        assert reader.worst < 0.5, reader.worst
    assert body.rstrip().endswith(b"data: [DONE]") and body.count(b'"content"') >= 40, body
    assert b"error" not in body
    assert b.status_code == 200, b.text
    assert after > 0.3  # b started after the stream (b loads for 0.3 s)
    a = running.board.current.engine("a")
    assert a is not None and a.state == "cold"
    assert a.activity is not None and a.activity.startswith(
        "evicted a (stop) to make room for b: 1 request in flight, drained first, loads "
        "again in "), a.activity
    assert a.activity.endswith("; frees 6.0 GB (it cannot be put to sleep)"), a.activity
    lines = [r.getMessage() for r in caplog.records]
    assert ("a: drained (to make room for b): 1 request in flight finished, then stopped"
            in lines), lines
    assert not any("cut" in line for line in lines), lines


async def test_a_request_that_cannot_wait_for_the_stream_gets_503_and_the_stream_goes_on(
        nursery, tmp_path) -> None:
    """The same with queue_wait_s (1 s) shorter than a's stream: b's request gets 503
    saying what it waited for; a's stream still ends intact, and once nobody waits for b
    a's drain is called off (a admits again, b never started)."""
    with trio.fail_after(40):
        async with on_demand_service(nursery, evicting(tmp_path, 1)) as (running, client, _):
            assert (await client.post("/v1/chat/completions",
                                      content=payload("model-a"))).status_code == 200
            body, b, after = await stream_and_ask_b(client, 40)
            again = await client.post("/v1/chat/completions", content=payload("model-a"))
    assert body.rstrip().endswith(b"data: [DONE]") and body.count(b'"content"') >= 40, body
    assert b"error" not in body
    assert b.status_code == 503 and after < 0, (b.text, after)
    assert b.json()["error"]["message"] == (
        "engine b was not ready within queue_wait_s (1 s): waiting for a's 1 request in "
        "flight to finish to make room")
    assert again.status_code == 200 and again.headers["x-nvpair-engine"] == "a", again.text
    a = running.board.current.engine("a")
    assert a is not None and a.state == "ready" and a.admitting
    assert a.activity == "drain called off (no request waits for b any more)"
    assert running.runners["a"].starts == 1 and running.runners["b"].starts == 0


async def test_nothing_can_make_room_is_503_in_words(nursery, tmp_path) -> None:
    settings = on_demand(tmp_path, {"a": sim_command("vllm")},
                         activation=f"memory_budget_bytes = {4 * GB}",
                         extra=f"memory_bytes = {6 * GB}")
    with trio.fail_after(20):
        async with on_demand_service(nursery, settings) as (running, client, _):
            r = await client.post("/v1/chat/completions", content=payload("model-a"))
    assert r.status_code == 503
    assert r.json()["error"]["message"] == (
        "no room for a: a needs 6.0 GB, more than the memory budget of 4.0 GB for engines "
        "on demand")
    assert running.runners["a"].starts == 0


async def test_an_idle_engine_unloads_after_idle_unload_s_and_probes_do_not_count(
        nursery, tmp_path) -> None:
    settings = on_demand(tmp_path, {"a": sim_command("vllm")},
                         extra="idle_unload_s = 1.5")
    with trio.fail_after(30):
        async with on_demand_service(nursery, settings) as (running, client, _):
            r = await client.post("/v1/chat/completions", content=payload("model-a"))
            assert r.status_code == 200, r.text
            used = trio.current_time()
            ready = running.board.current.engine("a")
            assert ready is not None and ready.state == "ready"
            health_before = ready.probe("health")
            cold = await wait_state(running.board, "a", "cold")
            waited = trio.current_time() - used
            assert (await client.get("/v1/models")).json()["data"][0]["nvpair"]["state"] == "cold"
    # health probes ran every 0.3 s meanwhile and never reset the idle timer
    assert 1.5 <= waited < 4.0, waited
    probed = cold.probe("health")
    assert probed is not None and probed.requests > (health_before.requests
                                                     if health_before else 0) + 2
    assert cold.activity is not None and cold.activity.startswith("drained (idle for 1.")
    assert cold.activity.endswith(" s), then stopped")


def test_the_config_is_strict_and_its_errors_are_one_line(tmp_path) -> None:
    from nvpair.errors import ConfigError

    base = "[[engines]]\nname = 'a'\nkind = 'vllm'\nmodel = 'm'\n"
    cases = {
        base + "activation = 'on_demand'\n":
            "engines[0].activation: on_demand needs managed = true",
        base + "activation = 'sometimes'\n": "engines[0].activation",
        base + "memory_bytes = -1\n": "engines[0].memory_bytes",
        base + "idle_unload_s = -5\n": "engines[0].idle_unload_s",
        "[activation]\nqueue_max = 0\n": "activation.queue_max",
        "[activation]\nmemory_budget_bytes = 'lots'\n": "activation.memory_budget_bytes",
        "[activation]\nqueue_wait = 3\n": "queue_wait",
    }
    for text, expected in cases.items():
        path = tmp_path / "nvpair.toml"
        path.write_text(text)
        with pytest.raises(ConfigError) as caught:
            load_settings(str(path))
        message = str(caught.value)
        assert expected in message and "\n" not in message, (text, message)
    path = tmp_path / "nvpair.toml"
    path.write_text(base + "managed = true\ncommand = ['x']\nactivation = 'on_demand'\n"
                    "idle_unload_s = 60\npriority = 3\nmemory_bytes = 1000\n"
                    "[activation]\nmemory_budget_bytes = 5000\nqueue_max = 2\n")
    spec = load_settings(str(path)).engines[0]
    assert (spec.activation, spec.idle_unload_s, spec.priority, spec.memory_bytes) == (
        "on_demand", 60, 3, 1000)


async def test_a_model_hot_on_a_peer_goes_there_before_anything_starts_here(
        nursery, tmp_path) -> None:
    """Node a has a cold on-demand engine for m-b, node b serves m-b (ready): a request at
    a goes to b, and a starts nothing; once b no longer serves it, a starts its own."""
    from tests.router.script_engine import ScriptEngine, json_script
    from tests.router.test_peer_routing import cluster_token, node_config, wait_routable

    engine_b = ScriptEngine("m-b")
    await nursery.start(engine_b.serve)
    engine_b.script = lambda path, body: json_script({"answer": "from b"})
    port_a, port_b = free_port(), free_port()
    (tmp_path / "user-a").write_text("user-token-of-a")
    for node in ("a", "b"):
        (tmp_path / f"cluster-{node}").write_text(cluster_token(node))
    manifest = fast_manifest(tmp_path)
    command = json.dumps(sim_command("vllm"))
    config_a = tmp_path / "a.toml"
    config_a.write_text(
        f"listen = '127.0.0.1:{port_a}'\nnode = 'a'\ntoken_file = '{tmp_path / 'user-a'}'\n"
        f"log_dir = '{tmp_path / 'logs'}'\n"
        f"[[engines]]\nname = 'cold-b'\nkind = '{manifest}'\nport = {free_port()}\n"
        f"model = 'm-b'\nmanaged = true\nactivation = 'on_demand'\ncommand = {command}\n"
        + FAST_PROBES +
        f"[[peers]]\nurl = 'http://127.0.0.1:{port_b}'\nname = 'b'\n"
        f"token_file = '{tmp_path / 'cluster-b'}'\n"
        f"[cluster]\ninterval_s = 0.5\ntoken_file = '{tmp_path / 'cluster-a'}'\n")
    with trio.fail_after(40):
        a = await nursery.start(service.run, load_settings(str(config_a)))
        scope = trio.CancelScope()

        async def run_b() -> None:
            with scope:
                await service.run(load_settings(str(node_config(
                    tmp_path, "b", port_b, engine_b, ("a", port_a)))))

        nursery.start_soon(run_b)
        assert a.peers is not None
        await wait_routable(a.peers.table, "m-b")
        user_a = {"authorization": "Bearer user-token-of-a"}
        async with httpx2.AsyncClient(base_url=a.url, headers={**JSON, **user_a},
                                      timeout=30) as client:
            r = await client.post("/v1/chat/completions", content=payload("m-b"))
            assert r.status_code == 200, r.text
            assert r.headers["x-nvpair-node"] == "b" and r.json() == {"answer": "from b"}
            assert a.runners["cold-b"].starts == 0
            assert a.board.current.engine("cold-b").state == "cold"  # type: ignore[union-attr]
            scope.cancel()  # b leaves: now a starts its own engine for m-b
            version = -1
            while a.peers.table.routes("m-b", trio.current_time()).ready:
                version = await a.peers.table.wait_changed(version)
            r = await client.post("/v1/chat/completions", content=payload("m-b"))
            assert r.status_code == 200, r.text
            assert r.headers["x-nvpair-engine"] == "cold-b" and "x-nvpair-node" not in r.headers
            assert a.runners["cold-b"].starts == 1


async def test_idle_unload_in_virtual_time_and_probes_never_reset_the_timer(
        nursery, autojump_clock) -> None:
    """A real runner (a fake process through the spawn seam, a mock engine over
    httpx2.MockTransport) under the autojump clock: used once, the engine is drained to
    cold idle_unload_s later, though its health probe answered all along."""
    board, fake, runner, activator = await one_on_demand(nursery, idle_unload_s=600)
    assert board.current.engine("e").state == "cold"  # type: ignore[union-attr]
    ticket = await activator.admit("e")
    ticket.leave()
    activator.used("e")  # one routed request, now
    used = trio.current_time()
    cold = await wait_state(board, "e", "cold", within=2000)
    idle = trio.current_time() - used
    assert 600 <= idle <= 600 + 5 + 1, idle  # (idle engines are looked for every 5 s)
    during = [t for t in fake.times["/health"] if used < t < used + 600]
    assert len(during) >= 600 / 5 - 2  # every 5 s, and none counted as use
    assert cold.activity is not None and cold.activity.startswith("drained (idle for 10 min)")
    assert runner.starts == 1


def test_the_footprint_is_the_larger_of_the_watchs_reading_and_the_configured_one() -> None:
    """A configured ``memory_bytes`` is a floor: the memory watch reads host memory, so a
    GPU engine declared at 40 GB that holds 3 GB of host RAM is still planned at 40 GB (the
    reading replaced it before, and two such engines were planned side by side)."""
    from types import SimpleNamespace

    from tests.fakes import engine_spec

    from nvpair.router.activation import footprint
    from nvpair.state.transitions import initial_state

    spec = engine_spec("vllm", managed=True, model="m", command=["srv"],
                       activation="on_demand", memory_bytes=5 * GB)
    measured = engine_spec("vllm", managed=True, model="m", command=["srv"],
                           activation="on_demand")
    e = initial_state(spec, now=0.0)
    assert footprint(e, spec) == 5 * GB  # no reading: configured
    assert footprint(None, spec) == 5 * GB
    assert footprint(e, measured) is None  # "measured", nothing seen: unknown
    read = msgspec.structs.replace(e, state="ready", memory=SimpleNamespace(
        rss_anon_bytes=3 * GB, swap_bytes=GB))
    assert footprint(read, measured) == 4 * GB  # up: anonymous memory and swap
    assert footprint(read, measured, remembered=7 * GB) == 4 * GB  # (the reading now)
    assert footprint(read, spec) == 5 * GB  # a reading under the configured size: the size
    more = msgspec.structs.replace(read, memory=SimpleNamespace(rss_anon_bytes=6 * GB,
                                                                swap_bytes=GB))
    assert footprint(more, spec) == 7 * GB  # a reading over it: the reading
    # starting (loading): its reading is part of it, never less than what is known
    loading = msgspec.structs.replace(read, state="starting", memory=SimpleNamespace(
        rss_anon_bytes=GB // 10, swap_bytes=0))
    assert footprint(loading, spec) == 5 * GB
    assert footprint(loading, measured) is None
    assert footprint(loading, measured, remembered=4 * GB) == 4 * GB
    assert footprint(loading, spec, remembered=6 * GB) == 6 * GB
    big = msgspec.structs.replace(loading, memory=SimpleNamespace(rss_anon_bytes=6 * GB,
                                                                  swap_bytes=0))
    assert footprint(big, spec) == 6 * GB
    assert footprint(e, measured, remembered=4 * GB) == 4 * GB  # cold: what it measured up
    assert footprint(e, spec, remembered=4 * GB) == 5 * GB
    unread = msgspec.structs.replace(e, memory=SimpleNamespace(rss_anon_bytes=None,
                                                               swap_bytes=None))
    assert footprint(unread, spec) == 5 * GB
    measured = engine_spec("vllm", managed=True, model="m", command=["srv"],
                           activation="on_demand")
    assert footprint(initial_state(measured, now=0.0), measured) is None  # not known
    assert footprint(msgspec.structs.replace(loading, memory=SimpleNamespace(
        rss_anon_bytes=GB // 10, swap_bytes=0)), measured) is None  # (a partial reading)


async def test_an_engine_a_request_was_just_let_through_to_is_no_victim() -> None:
    """A request let out of an engine's queue is on its way, not yet in flight (the router
    has not counted it): until it is, the engine is no victim of an eviction and is not
    unloaded as idle. Before, that moment counted as "nothing in flight": the engine was
    drained and stopped under the request, which got a 502 (seen 2 runs in 18 of the
    eviction test above)."""
    from tests.fakes import engine_spec

    from nvpair.config.settings import ActivationConfig
    from nvpair.router.activation import Activator, Ticket
    from nvpair.state.snapshot import Board
    from nvpair.state.traffic import Traffic
    from nvpair.state.transitions import initial_state

    specs = [engine_spec("vllm", name=n, managed=True, model=n, command=["srv"],
                         activation="on_demand", idle_unload_s=1) for n in ("a", "b")]
    board = Board(tuple(initial_state(s, now=0.0) for s in specs))
    activator = Activator(board, specs, {}, Traffic(),
                          ActivationConfig(memory_budget_bytes=10 * GB))
    board.update("b", lambda e: msgspec.structs.replace(e, state="ready"))
    queue = activator.queue("b")
    ticket = Ticket(queue)
    queue.waiting.add(ticket)
    queue.release(None)  # let through: not waiting any more, not in flight yet
    assert ticket.ready.is_set() and not queue.waiting
    assert [c.evictable for c in activator._running("a")] == [False]
    activator.last_used["b"] = -100.0
    assert activator.unload_idle(trio.current_time()) == []
    ticket.started()  # the router counts it in flight from here
    assert [c.evictable for c in activator._running("a")] == [True]


def test_a_cold_engine_is_planned_with_what_it_measured_when_it_was_up() -> None:
    """An on-demand engine with memory_bytes = "measured" ran (the watch read 4 GB), then
    went cold (no process: no reading): its next start is planned with 4 GB, not as the
    whole budget; while it loads again, its partial reading does not free the room.
    Before, a cold engine's footprint was unknown again (so one that ran beside another
    evicted it to start), and a loading engine counted only what it had loaded."""
    from types import SimpleNamespace

    from tests.fakes import engine_spec

    from nvpair.config.settings import ActivationConfig
    from nvpair.router.activation import Activator
    from nvpair.state.snapshot import Board
    from nvpair.state.traffic import Traffic
    from nvpair.state.transitions import initial_state

    specs = [engine_spec("vllm", name=n, managed=True, model=n, command=["srv"],
                         activation="on_demand") for n in ("a", "b")]
    board = Board(tuple(initial_state(s, now=0.0) for s in specs))
    config = ActivationConfig(memory_budget_bytes=10 * GB)
    activator = Activator(board, specs, {}, Traffic(), config)

    def up(name: str, state: str, anon: int | None) -> None:
        board.update(name, lambda e: msgspec.structs.replace(e, state=state, memory=None
                     if anon is None else SimpleNamespace(rss_anon_bytes=anon, swap_bytes=0)))

    up("a", "ready", 4 * GB)
    activator.remember()
    up("a", "cold", None)
    assert activator.footprint("a") == 4 * GB
    up("b", "ready", 5 * GB)
    assert [c.footprint for c in activator._running("a")] == [5 * GB]
    up("a", "starting", GB // 10)  # loading again
    assert [c.footprint for c in activator._running("b")] == [4 * GB]


def test_the_auto_budget_keeps_the_memory_watchs_reserve() -> None:
    """One reserve for both features: the [memory] table's reserve_bytes ("auto":
    nvpair.supervision.memtrend.reserve_bytes), on /proc/meminfo read now, else on the memory
    watch's
    node reading; a cgroup limit the watch read caps it."""
    from nvpair.router.activation import auto_budget
    from nvpair.state.memory import NodeMemory
    from nvpair.supervision.memproc import Meminfo
    from nvpair.supervision.memtrend import reserve_bytes

    info = Meminfo(mem_total=64 * GB, mem_available=40 * GB, anon_pages=10 * GB)
    assert auto_budget(6 * GB, "auto", info, None) == 46 * GB - reserve_bytes(40 * GB, 10 * GB)
    assert auto_budget(6 * GB, 3 * GB, info, None) == 43 * GB  # the configured reserve
    node = NodeMemory(mem_available=20 * GB, anon_pages=0)
    assert auto_budget(0, 3 * GB, None, node) == 17 * GB  # the watch's reading, no meminfo
    assert auto_budget(0, 3 * GB, info, node) == 37 * GB  # meminfo read now comes first
    capped = NodeMemory(mem_available=20 * GB, cgroup_max=16 * GB, cgroup_current=10 * GB)
    assert auto_budget(2 * GB, 3 * GB, info, capped) == 8 * GB
    assert auto_budget(0, "auto", None, None) == 0  # nothing known: no room
    assert auto_budget(GB, 100 * GB, info, None) == 0  # never below zero


# (as in tests/test_sse.py: httpx2's nested stream generators, left to the collector)
@pytest.mark.filterwarnings("ignore:Async generator 'httpx2:ResourceWarning")
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
async def test_the_queue_and_each_activation_are_events(nursery, tmp_path) -> None:
    """GET /v1/events: the engine's events carry its queue (queued) and its activity."""
    from tests.http.test_sse import stream

    settings = on_demand(tmp_path, {"a": sim_command("vllm", "--load-s", "1")})
    with trio.fail_after(40):
        async with on_demand_service(nursery, settings) as (_, client, _):
            seen: list[dict[str, Any]] = []
            async with stream(client, "/v1/events?types=engine") as events:
                snapshot = await events.start()
                assert snapshot.event == "snapshot"
                async with trio.open_nursery() as n:
                    n.start_soon(lambda: client.post("/v1/chat/completions",
                                                     content=payload("model-a")))
                    while not any(e["state"] == "ready" and e["queued"] == 0 for e in seen):
                        event = await events.next()
                        if event.event == "engine":
                            seen.append(json.loads(event.data or "{}"))
    assert any(e["queued"] == 1 and e["queued_keys"] == {"(no key)": 1} for e in seen), seen
    assert any(e["activity"] == "started a for a request (queued 1)" for e in seen), seen
    assert seen[-1]["queued_keys"] == {}


async def test_a_request_for_the_engine_being_evicted_waits_and_is_served(
        nursery, tmp_path) -> None:
    """Memory for one: a streams, b evicts a (a drains), a request for a meanwhile waits in
    a's queue; once b has served its request, b makes room for a in turn. Nothing fails."""
    settings = on_demand(
        tmp_path, {"a": sim_command("vllm", "--token-rate", "20"),
                   "b": sim_command("vllm", "--load-s", "0.5")},
        activation=f"memory_budget_bytes = {10 * GB}", extra=f"memory_bytes = {6 * GB}")
    with trio.fail_after(40):
        async with on_demand_service(nursery, settings, read=True) as (
                running, client, reader):
            assert (await client.post("/v1/chat/completions",
                                      content=payload("model-a"))).status_code == 200
            streaming = trio.Event()
            answers: dict[str, int] = {}
            streamed: list[bytes] = []

            async def stream() -> None:
                async with client.stream("POST", "/v1/chat/completions",
                                         content=payload("model-a", 20, stream=True)) as r:
                    async for chunk in r.aiter_bytes():
                        streamed.append(chunk)
                        streaming.set()
                    answers["stream"] = r.status_code

            async def ask(key: str, model: str) -> None:
                r = await client.post("/v1/chat/completions", content=payload(model))
                answers[key] = r.status_code

            async with trio.open_nursery() as n:
                n.start_soon(stream)
                await streaming.wait()
                n.start_soon(ask, "b", "model-b")
                await wait_state(running.board, "a", "ready", where=lambda e: not e.admitting)
                n.start_soon(ask, "a again", "model-a")
                await queued(running.board, "a", 1)
        assert reader.worst < 0.5, reader.worst
    assert answers == {"stream": 200, "b": 200, "a again": 200}, answers
    assert b"".join(streamed).rstrip().endswith(b"data: [DONE]")
    a, b = running.board.current.engine("a"), running.board.current.engine("b")
    assert a is not None and b is not None and a.state == "ready" and b.state == "cold"
    assert b.activity is not None and b.activity.startswith(
        "evicted b (stop) to make room for a: "), b.activity
    assert running.runners["a"].starts == 2 and running.runners["b"].starts == 1


async def test_two_cold_engines_asked_at_once_with_memory_for_one_take_turns(
        nursery, tmp_path) -> None:
    """Both cold, both asked at the same moment, room for one: one starts and serves, then
    makes way for the other (never both at once, never a deadlock); both answers 200."""
    settings = on_demand(
        tmp_path, {"a": sim_command("vllm", "--load-s", "0.5"),
                   "b": sim_command("vllm", "--load-s", "0.5")},
        activation=f"memory_budget_bytes = {10 * GB}", extra=f"memory_bytes = {6 * GB}")
    with trio.fail_after(40):
        running = await nursery.start(service.run, settings)
        both_up: list[bool] = []

        async def watch() -> None:  # at no moment are both engines up
            version = -1
            while True:
                snap = await running.board.wait_changed(version)
                version = snap.version
                up = [e.state not in ("cold", "stopped") for e in snap.engines]
                both_up.append(all(up))

        async with httpx2.AsyncClient(headers=JSON, base_url=running.url, timeout=30) as client:
            answers: dict[str, int] = {}

            async def ask(model: str) -> None:
                r = await client.post("/v1/chat/completions", content=payload(model))
                answers[model] = r.status_code

            async with trio.open_nursery() as n:
                n.start_soon(watch)
                async with trio.open_nursery() as asking:
                    asking.start_soon(ask, "model-a")
                    asking.start_soon(ask, "model-b")
                n.cancel_scope.cancel()
    assert answers == {"model-a": 200, "model-b": 200}, answers
    assert not any(both_up)
    states = sorted(e.state for e in running.board.current.engines)
    assert states == ["cold", "ready"], states


async def test_a_cold_start_with_requests_waiting_is_seen_ready_within_a_quarter_second(
        nursery, autojump_clock) -> None:
    """With vLLM's own manifest (ready probed every 2 s), requests waiting for the engine
    make its ready probe tick every 0.25 s at most: the engine is seen ready at most
    0.25 s (and its jitter) after it is, not up to 2 s. Once nobody waits, it is probed at
    the manifest's rate again."""
    from tests.fakes import FakeEngine, engine_spec, vllm_routes
    from tests.supervision.test_process import FakeSpawn

    from nvpair.config.settings import ActivationConfig
    from nvpair.probing.prober import AWAITED_READY_INTERVAL_S
    from nvpair.router.activation import Activator
    from nvpair.state.snapshot import Board
    from nvpair.state.traffic import Traffic
    from nvpair.state.transitions import initial_state
    from nvpair.supervision.lifecycle import EngineRunner

    spec = engine_spec("vllm", managed=True, port=free_port(), model="m",
                       command=["srv", "--port", "{port}"], activation="on_demand")
    assert spec.probes.ready is not None and spec.probes.ready.interval_s == 2
    board = Board((initial_state(spec),))
    fake = FakeEngine(vllm_routes())
    fake.routes["/health"] = (503, "loading")
    traffic = Traffic()
    probed = trio.Event()

    async def handle(request: httpx2.Request) -> httpx2.Response:
        probed.set()
        return await fake.handle(request)

    runner = EngineRunner(spec, board, None, None, traffic,
                          transport=httpx2.MockTransport(handle), spawn=FakeSpawn())
    activator = Activator(board, [spec], {"e": runner}, traffic, ActivationConfig())
    await nursery.start(runner.run)
    await nursery.start(activator.run)
    loaded_at: list[float] = []

    async def load() -> None:  # the engine is ready 0.3 s past a probe (old: 1.7 s more)
        await probed.wait()
        await trio.sleep(10.3)
        fake.routes["/health"] = (200, "")
        loaded_at.append(trio.current_time())

    nursery.start_soon(load)
    ticket = await activator.admit("e")
    seen = trio.current_time() - loaded_at[0]
    assert seen <= AWAITED_READY_INTERVAL_S * 1.05 + 0.01, seen
    probes = len(fake.times["/health"])
    assert probes <= 10.6 / AWAITED_READY_INTERVAL_S + 2, probes  # bounded meanwhile
    ticket.started()
    ticket.leave()

    # nobody waits: a start (the operator's) is probed at the manifest's 2 s again
    runner.request("stop")
    await wait_state(board, "e", "cold", "stopped", within=100)
    fake.routes["/health"] = (503, "loading")
    before = len(fake.times["/health"])
    started = trio.current_time()
    runner.request("start")
    await trio.sleep(20)
    slow = len(fake.times["/health"]) - before
    assert slow <= (trio.current_time() - started) / 2 + 2, slow


async def test_the_status_shows_how_many_wait_and_the_oldest_wait(
        nursery, autojump_clock) -> None:
    """GET /v1/engines/{name} carries ``queued`` and ``queued_oldest_s`` (the longest wait
    now, computed when read); the event stream carries ``queued`` only (no ages)."""
    from nvpair.http.views import engine_status
    from nvpair.state.events import engine_content

    board, fake, _, activator = await one_on_demand(nursery, loading=True)

    def status() -> dict[str, Any]:
        snap = board.current
        return engine_status(snap.engine("e"), snap, trio.current_time(), "n")  # type: ignore[arg-type]

    assert (status()["queued"], status()["queued_oldest_s"]) == (0, None)
    first = trio.CancelScope()

    async def wait(scope: trio.CancelScope) -> None:
        with scope:
            await activator.admit("e")

    nursery.start_soon(wait, first)
    await trio.sleep(10)
    nursery.start_soon(wait, trio.CancelScope())
    await trio.sleep(5)
    doc = status()
    assert doc["queued"] == 2 and doc["queued_oldest_s"] == pytest.approx(15, abs=0.01)
    content = engine_content(board.current.engine("e"), trio.current_time())  # type: ignore[arg-type]
    assert content["queued"] == 2 and "queued_oldest_s" not in content
    first.cancel()  # the oldest leaves: the next is the oldest now
    await trio.sleep(1)
    doc = status()
    assert doc["queued"] == 1 and doc["queued_oldest_s"] == pytest.approx(6, abs=0.01)
    fake.routes["/health"] = (200, "")
    await wait_state(board, "e", "ready", where=lambda e: e.queued == 0, within=30)
    assert status()["queued_oldest_s"] is None


async def test_a_drain_during_a_cold_start_starts_it_again_for_the_waiting_requests(
        nursery, autojump_clock) -> None:
    """The operator drains an on-demand engine while it starts for a request: it stops
    (nothing in flight) and rests cold, and the request that waits starts it again and is
    served; before, it got 503 'failed to start: cold'."""
    board, fake, runner, activator = await one_on_demand(nursery, loading=True)

    async def operator() -> None:
        await wait_state(board, "e", "starting", within=30)
        await trio.sleep(5)
        runner.drain(then="stop", reason="drain requested")
        await wait_state(board, "e", "cold", within=30)
        await wait_state(board, "e", "starting", within=30)  # started again for the request
        await trio.sleep(5)
        fake.routes["/health"] = (200, "")

    nursery.start_soon(operator)
    with trio.fail_after(200):
        ticket = await activator.admit("e")
    ticket.started()
    ticket.leave()
    assert runner.starts == 2
    assert board.current.engine("e").state == "ready"  # type: ignore[union-attr]


async def test_a_request_during_a_memory_restart_waits_and_is_served(
        nursery, autojump_clock) -> None:
    """A ready on-demand engine drains to a restart (restart_when_quiet's drain): a request
    for it waits in its queue and is served by the restarted engine; the restart is no
    failed start (the engine is not unloaded, the request gets no 503)."""
    board, fake, runner, activator = await one_on_demand(nursery)
    with trio.fail_after(100):
        ticket = await activator.admit("e")
    ticket.started()
    ticket.leave()
    first = board.current.engine("e")
    assert first is not None and first.state == "ready"
    fake.routes["/health"] = (503, "loading")  # the new process loads for a while
    runner.drain(then="restart", reason="memory")
    assert activator.candidate(["e"]) == "e"  # not admitting: requests wait for it

    async def loaded() -> None:
        await wait_state(board, "e", "starting", within=30)
        await trio.sleep(5)
        fake.routes["/health"] = (200, "")

    nursery.start_soon(loaded)
    with trio.fail_after(200):
        ticket = await activator.admit("e")
    ticket.started()
    ticket.leave()
    after = board.current.engine("e")
    assert after is not None and after.state == "ready" and after.admitting
    assert runner.starts == 2 and after.restarts == first.restarts + 1


async def test_a_request_for_an_on_demand_engine_starting_otherwise_waits_for_it(
        nursery, autojump_clock) -> None:
    """An on-demand engine starting for another reason than a request (nvpair start, the
    restart of a memory restart's drain) is waited for, as docs/on-demand.md says ("if it
    is starting already, waited for"); before, a request then got 503."""
    board, fake, runner, activator = await one_on_demand(nursery, loading=True)
    runner.request("start")  # the operator's
    await wait_state(board, "e", "starting", within=30)
    assert activator.candidate(["e"]) == "e"

    async def loaded() -> None:
        await trio.sleep(5)
        fake.routes["/health"] = (200, "")

    nursery.start_soon(loaded)
    with trio.fail_after(100):
        ticket = await activator.admit("e")
    ticket.started()
    ticket.leave()
    assert runner.starts == 1 and board.current.engine("e").state == "ready"  # type: ignore[union-attr]


async def test_requests_that_come_for_an_engine_starting_otherwise_speed_its_probe_at_once(
        nursery, autojump_clock) -> None:
    """An on-demand engine started by the operator is probed at its manifest's 2 s; a
    request that comes while its prober sleeps wakes the ready probe at once, so the
    request waits at most 0.25 s past the engine's readiness, not the rest of the 2 s."""
    board, fake, runner, activator = await one_on_demand(nursery, loading=True)
    runner.request("start")  # the operator's: nobody waits, so the manifest's 2 s
    await wait_state(board, "e", "starting", within=30)
    await trio.sleep(10.1)  # a few ticks at 2 s; the prober sleeps now
    probes = fake.times["/health"]
    assert len(probes) <= 10.1 / 2 + 2, probes
    fake.routes["/health"] = (200, "")  # ready now; nvpair does not know yet
    asked = trio.current_time()
    with trio.fail_after(100):
        ticket = await activator.admit("e")
    ticket.started()
    ticket.leave()
    assert trio.current_time() - asked <= 0.05, trio.current_time() - asked


async def test_waiting_requests_go_as_slots_free_and_newcomers_wait_their_turn(
        nursery, autojump_clock) -> None:
    """max_in_flight = 2: of four requests waiting for a cold engine, two go once it is
    ready; each request that ends lets the next go, in arrival order; one that comes
    meanwhile waits behind those before it (no overtaking); one let go whose client leaves
    before it reaches the engine gives its slot to the next; while every slot is taken a
    newcomer waits in the queue too."""
    from trio.testing import wait_all_tasks_blocked

    board, fake, _, activator = await one_on_demand(nursery, loading=True, max_in_flight=2)
    traffic = activator.traffic
    tickets: dict[int, Any] = {}

    async def ask(i: int) -> None:
        tickets[i] = await activator.admit("e")

    def start(i: int) -> None:  # the router counts it in flight
        traffic.started("e")
        tickets[i].started()

    def end(i: int) -> None:  # its answer is over
        traffic.finished("e", "ok")
        activator.ended("e")
        tickets[i].leave()

    for i in range(4):
        nursery.start_soon(ask, i)
        await queued(board, "e", i + 1)
    fake.routes["/health"] = (200, "")
    await wait_state(board, "e", "ready", where=lambda e: e.queued == 2, within=30)
    await wait_all_tasks_blocked()
    assert sorted(tickets) == [0, 1]
    start(0)
    start(1)
    assert activator.holds("e")  # two wait: a newcomer queues behind them
    nursery.start_soon(ask, 4)
    await queued(board, "e", 3)
    end(0)
    await wait_all_tasks_blocked()
    assert sorted(tickets) == [0, 1, 2]
    tickets[2].leave()  # its client left before it reached the engine: 3 takes the slot
    await wait_all_tasks_blocked()
    assert sorted(tickets) == [0, 1, 2, 3]
    start(3)
    assert activator.holds("e")
    end(1)
    await wait_all_tasks_blocked()
    assert sorted(tickets) == [0, 1, 2, 3, 4]
    assert board.current.engine("e").queued == 0  # type: ignore[union-attr]
    # nobody waits, but both slots are taken (3 in flight, 4 on its way): a newcomer waits
    # its turn in the queue (its order: priority, key), not in the engine's
    assert activator.holds("e")
    start(4)
    end(3)
    assert not activator.holds("e")  # a slot is free: a newcomer goes straight there


def test_the_capacity_is_max_in_flight_else_what_the_engine_says_else_none() -> None:
    """A queue sends as many requests at once as: the engine's max_in_flight; else the
    slots the engine said it has (llama-server's total_slots, read by the identity probe);
    else Ollama's OLLAMA_NUM_PARALLEL in its configured environment; else all (None)."""
    from nvpair.state.snapshot import Identity

    def activator_of(kind: str, **kw: Any) -> Activator:
        spec = engine_spec(kind, managed=True, model="m", command=["srv"],
                           activation="on_demand", **kw)
        return Activator(Board((initial_state(spec, now=0.0),)), [spec], {}, Traffic(),
                         ActivationConfig())

    def said(activator: Activator, slots: int) -> None:
        activator.board.update("e", lambda e: msgspec.structs.replace(
            e, identity=Identity(model="m", slots=slots)))

    llama = activator_of("llamacpp")
    assert llama.capacity("e") is None  # not said yet
    said(llama, 8)
    assert llama.capacity("e") == 8
    capped = activator_of("llamacpp", max_in_flight=3)
    said(capped, 8)
    assert capped.capacity("e") == 3
    assert activator_of("vllm").capacity("e") is None
    assert activator_of("ollama", env={"OLLAMA_NUM_PARALLEL": "4"}).capacity("e") == 4
    assert activator_of("ollama", env={"OLLAMA_NUM_PARALLEL": "0"}).capacity("e") is None
    assert activator_of("ollama").capacity("e") is None


async def test_a_request_that_waits_too_long_for_a_slot_is_503_saying_so(
        nursery, autojump_clock) -> None:
    """queue_wait_s bounds the wait for a slot: with the engine's one slot busy, a second
    request waits 60 s, then 503 saying the slot was busy (not "not ready"); the request
    on the engine is not touched."""
    from nvpair.router.activation import Unavailable

    _, _, _, activator = await one_on_demand(
        nursery, max_in_flight=1, config=ActivationConfig(queue_wait_s=60))
    first = await activator.admit("e")
    activator.traffic.started("e")
    first.started()
    asked = trio.current_time()
    with pytest.raises(Unavailable) as waited:
        await activator.admit("e")
    assert trio.current_time() - asked == pytest.approx(60)
    assert str(waited.value) == ("engine e had no free slot within queue_wait_s (60 s): its 1 "
                                 "slot was busy")
    assert activator.traffic.engines["e"].in_flight == 1 and not activator.queue("e").waiting


# (as in tests/test_sse.py: httpx2's nested stream generators, left to the collector)
@pytest.mark.filterwarnings("ignore:Async generator 'httpx2:ResourceWarning")
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
async def test_the_events_of_a_routed_request_name_its_request_id(nursery, tmp_path) -> None:
    """GET /v1/events: an engine's event for a queue change, a start, an eviction or a
    failed start carries the id of the routed request it was for."""
    from tests.http.test_sse import stream

    settings = on_demand(
        tmp_path, {"a": sim_command("vllm", "--load-s", "0.3"),
                   "b": sim_command("vllm", "--load-s", "0.3"),
                   "c": sim_command("vllm", "--load-s", "0.3", "--fail-on-load", "3")},
        activation=f"memory_budget_bytes = {10 * GB}", extra=f"memory_bytes = {6 * GB}")
    seen: list[dict[str, Any]] = []

    def ids(name: str, where: Any) -> set[str | None]:
        return {e["request_id"] for e in seen if e["name"] == name and where(e)}

    def evicted(e: dict[str, Any]) -> bool:
        return (e["activity"] or "").startswith("evicted a")

    def failed(e: dict[str, Any]) -> bool:
        return e["state"] == "cold" and bool(e["error"])

    with trio.fail_after(60):
        async with on_demand_service(nursery, settings) as (_, client, _), stream(
                client, "/v1/events?types=engine") as events:
            await events.start()
            async with trio.open_nursery() as n:
                async def ask() -> None:
                    for model, rid in (("model-a", "for-a"), ("model-b", "for-b"),
                                       ("model-c", "for-c")):
                        await client.post("/v1/chat/completions", content=payload(model),
                                          headers={"x-request-id": rid})

                n.start_soon(ask)
                # (the last state of a and of c: every change before them was sent first)
                while not (ids("a", evicted) and ids("c", failed)):
                    event = await events.next()
                    if event.event == "engine":
                        seen.append(json.loads(event.data or "{}"))
    assert ids("a", lambda e: e["queued"] == 1) == {"for-a"}
    assert ids("a", lambda e: (e["activity"] or "").startswith("started a")) == {"for-a"}
    assert ids("a", evicted) == {"for-b"}
    assert ids("b", lambda e: (e["activity"] or "").startswith("started b")) == {"for-b"}
    assert ids("c", lambda e: e["queued"] == 1) == {"for-c"}
    assert ids("c", failed) == {"for-c"}


def test_a_reload_gives_the_activator_the_new_queue_and_swap_settings() -> None:
    """``Activator.reconfigure`` (a reload): the swap rule and the ageing of queues that
    already exist follow the new ``[activation]``; an engine no longer on demand is off."""
    from tests.fakes import engine_spec

    from nvpair.config.settings import ActivationConfig, MemoryConfig
    from nvpair.router.activation import Activator
    from nvpair.router.swaps import SwapPolicy
    from nvpair.state.snapshot import Board
    from nvpair.state.traffic import Traffic
    from nvpair.state.transitions import initial_state

    specs = [engine_spec("vllm", name=n, managed=True, model=n, command=["srv"],
                         activation="on_demand") for n in ("a", "b")]
    board = Board(tuple(initial_state(s, now=0.0) for s in specs))
    activator = Activator(board, specs, {}, Traffic(), ActivationConfig())
    queue = activator.queue("a")
    assert not activator.swaps.holds
    new = ActivationConfig(swap_batch=8, min_residency_s=5.0, max_swap_wait_s=30.0,
                           priority_age_s=3.0)
    activator.reconfigure([specs[0], msgspec.structs.replace(specs[1], activation="always")],
                          new, MemoryConfig())
    assert activator.swaps == SwapPolicy(8, 5.0, 30.0) and activator.swaps.holds
    assert queue.waiting.age_s == 3.0 and activator.config is new
    assert set(activator.specs) == {"a"}
