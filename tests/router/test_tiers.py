"""Eviction tiers end to end: on-demand simulators that sleep (vLLM, SGLang) beside one
that only stops (llama-server sleeps by itself only), a memory budget for one engine,
requests alternating between their models through nvpair's real HTTP front door.

Footprints are declared (``memory_bytes``) and the memory watch reads once, at start, so
every plan here is made on the same numbers whatever the machine (docs/on-demand.md).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import httpx2
import trio
from tests.managed import FAST_PROBES, fast_manifest, free_port, sim_command, wait_state
from tests.router.test_activation import on_demand_service, payload

from nvpair.config.settings import Settings, load_settings

MB = 10**6
TB = 10**12


def tiered(tmp: Path, engines: dict[str, tuple[str, list[str], str]], *,
           budget: int, queue_wait_s: float = 60) -> Settings:
    """On-demand engines ``name: (kind, command, extra lines)``, each serving the model
    named like it, sharing ``budget`` bytes; the memory watch reads once (at start)."""
    text = (f"listen = '127.0.0.1:0'\nlog_dir = '{tmp / 'logs'}'\nsweep_deadline_s = 2\n"
            f"[activation]\nmemory_budget_bytes = {budget}\nqueue_wait_s = {queue_wait_s}\n"
            "[memory]\ninterval_s = 3600\nwindow_h = 24\n")
    for name, (kind, command, extra) in engines.items():
        text += (f"[[engines]]\nname = '{name}'\nkind = '{fast_manifest(tmp, kind)}'\n"
                 f"port = {free_port()}\nmodel = 'model-{name}'\nmanaged = true\n"
                 f"activation = 'on_demand'\ncommand = {json.dumps(command)}\n{extra}\n"
                 + FAST_PROBES)
    path = tmp / "nvpair.toml"
    path.write_text(text)
    return load_settings(str(path))


def three(tmp: Path, *, a_extra: str = "") -> Settings:
    """a: vLLM that sleeps (loads in 1 s, wakes in 0.2 s, 20 tokens a second); b: SGLang
    that releases (its one sleep: level 2); c: llama-server, which nvpair can only stop.
    100 MB each, a budget of 150 MB: room for one."""
    return tiered(tmp, {
        "a": ("vllm", sim_command("vllm", "--enable-sleep-mode", "--load-s", "1",
                                  "--wake-s", "0.2", "--token-rate", "20"),
              f"sleep = true\nmemory_bytes = {100 * MB}\n{a_extra}"),
        "b": ("sglang", sim_command("sglang", "--enable-memory-saver", "--load-s", "1",
                                    "--wake-s", "0.2"),
              f"sleep = true\nmemory_bytes = {100 * MB}"),
        "c": ("llamacpp", sim_command("llamacpp", "--load-s", "1"),
              f"memory_bytes = {100 * MB}"),
    }, budget=150 * MB)


async def ask(client: httpx2.AsyncClient, model: str) -> httpx2.Response:
    return await client.post("/v1/chat/completions", content=payload(model))


async def test_alternating_requests_sleep_the_victims_that_can_sleep_and_stop_the_one_that_cannot(
        nursery, tmp_path, caplog) -> None:
    """a, b, c, a, b with room for one: a sleeps at level 1 for b (its stream in flight
    ends whole first), b sleeps at level 2 (SGLang's release) for c, c is stopped for a
    (llama-server cannot be put to sleep), a wakes, then a sleeps again for b, which
    wakes. No process is started twice but c's; no request fails."""
    with trio.fail_after(60), caplog.at_level(logging.INFO, logger="nvpair"):
        async with on_demand_service(nursery, three(tmp_path), read=True) as (
                running, client, reader):
            board = running.board
            first = await ask(client, "model-a")
            assert first.status_code == 200, first.text
            pid_a = board.current.engine("a").pid  # type: ignore[union-attr]

            chunks: list[bytes] = []
            streaming = trio.Event()
            answers: dict[str, int] = {}

            async def stream_a() -> None:  # 30 tokens at 20 a second: 1.5 s
                async with client.stream("POST", "/v1/chat/completions",
                                         content=payload("model-a", 30, stream=True)) as r:
                    answers["stream"] = r.status_code
                    async for chunk in r.aiter_bytes():
                        chunks.append(chunk)
                        streaming.set()

            async def for_b() -> None:
                answers["b"] = (await ask(client, "model-b")).status_code

            async with trio.open_nursery() as n:
                n.start_soon(stream_a)
                await streaming.wait()
                n.start_soon(for_b)
                draining = await wait_state(board, "a", "ready", where=lambda e: not e.admitting)
                assert draining.activity == ("draining to sleep (to make room for b): "
                                             "1 in flight, then sleep")
            assert answers == {"stream": 200, "b": 200}, answers
            body = b"".join(chunks)
            assert body.rstrip().endswith(b"data: [DONE]") and b"error" not in body
            assert body.count(b'"content"') >= 30
            a = board.current.engine("a")
            assert a is not None and a.state == "sleeping" and a.pid == pid_a
            assert a.activity is not None and a.activity.startswith(
                "evicted a (sleep at level 1) to make room for b: 1 request in flight, "
                "drained first, wakes in 1.0 s; frees 100 MB, moves 100 MB to host RAM ("), \
                a.activity

            assert (await ask(client, "model-c")).status_code == 200
            b = board.current.engine("b")
            assert b is not None and b.state == "sleeping"
            assert b.activity is not None and b.activity.startswith(
                "evicted b (sleep at level 2) to make room for c: idle "), b.activity
            assert b.activity.endswith("frees 100 MB (its only sleep)"), b.activity

            again = await ask(client, "model-a")  # a wakes; c cannot sleep: it stops
            assert again.status_code == 200, again.text
            c = board.current.engine("c")
            assert c is not None and c.state == "cold"
            assert c.activity is not None and c.activity.startswith(
                "evicted c (stop) to make room for a: idle "), c.activity
            assert c.activity.endswith("frees 100 MB (it cannot be put to sleep)"), c.activity
            a = board.current.engine("a")
            assert a is not None and a.state == "ready" and a.pid == pid_a
            assert a.activity is not None and a.activity.startswith("woken in "), a.activity
            woke = a.activity.removeprefix("woken in ")  # ("0.2 s": what it measured)

            assert (await ask(client, "model-b")).status_code == 200  # b wakes, a sleeps
            a, b = board.current.engine("a"), board.current.engine("b")
            assert a is not None and b is not None
            assert (a.state, b.state) == ("sleeping", "ready")
            assert a.activity is not None and a.activity.startswith(
                "evicted a (sleep at level 1) to make room for b: idle "), a.activity
            # a's come-back is its measured wake now, not the default (1.0 s)
            assert f", wakes in {woke}; " in a.activity, (woke, a.activity)
        assert reader.worst < 0.5, reader.worst
    starts = {name: r.starts for name, r in running.runners.items()}
    assert starts == {"a": 1, "b": 1, "c": 1}, starts  # slept and woken, never restarted
    lines = [r.getMessage() for r in caplog.records]
    assert any(line.startswith("evicting a (sleep at level 1) to make room for b: ")
               for line in lines), lines
    assert any(line.startswith("woke a for a request (queued 1) in ") for line in lines), lines


async def test_too_little_host_ram_for_level_1_sleeps_at_level_2(nursery, tmp_path) -> None:
    """Two vLLMs of 10 TB each (declared): level 1 would move 10 TB to host RAM, which no
    test machine has beyond its reserve, so a sleeps at level 2 (the engine is told so)."""
    vllm = sim_command("vllm", "--enable-sleep-mode", "--load-s", "0.3", "--wake-s", "0.1")
    settings = tiered(tmp_path, {
        "a": ("vllm", vllm, f"sleep = true\nmemory_bytes = {10 * TB}"),
        "b": ("vllm", vllm, f"sleep = true\nmemory_bytes = {10 * TB}"),
    }, budget=15 * TB)
    with trio.fail_after(40):
        async with on_demand_service(nursery, settings) as (running, client, _):
            assert (await ask(client, "model-a")).status_code == 200
            assert (await ask(client, "model-b")).status_code == 200
            a = running.board.current.engine("a")
            assert a is not None and a.state == "sleeping"
            assert a.activity is not None and a.activity.startswith(
                "evicted a (sleep at level 2) to make room for b: idle "), a.activity
            assert "(level 1 would move 10 TB to host RAM, " in a.activity, a.activity
            # woken with vLLM's level-2 wake (weights, reload_weights, kv_cache): a plain
            # /wake_up would leave the weights discarded (the simulator's 500)
            woken = await ask(client, "model-a")
            assert woken.status_code == 200, woken.text
            assert "\ufffd" not in woken.text  # (no garbage from discarded weights)
            b = running.board.current.engine("b")
            assert b is not None and b.state == "sleeping"
            assert b.activity is not None and b.activity.startswith(
                "evicted b (sleep at level 2) to make room for a: "), b.activity
    assert running.runners["a"].starts == 1 and running.runners["b"].starts == 1


async def test_a_pinned_engine_is_never_evicted(nursery, tmp_path) -> None:
    """a is pinned: a request for b, with room for one, is a 503 saying so, and a stays
    ready; the sleep it could take is never taken."""
    settings = three(tmp_path, a_extra="pin = true")
    with trio.fail_after(40):
        async with on_demand_service(nursery, settings) as (running, client, _):
            assert (await ask(client, "model-a")).status_code == 200
            refused = await ask(client, "model-b")
            assert refused.status_code == 503, refused.text
            assert refused.json()["error"]["message"] == (
                "no room for b: b needs 100 MB; 50 MB of the 150 MB budget can be made free "
                "(a pinned)")
            a = running.board.current.engine("a")
            assert a is not None and a.state == "ready" and a.admitting
            assert (await ask(client, "model-a")).status_code == 200



async def test_a_sleep_nobody_needs_any_more_is_called_off_and_a_sleeping_engine_wakes_once(
        nursery, tmp_path, caplog) -> None:
    """a streams for 5 s when a request for b (room for one) waits only 2.5 s: b's request
    gets 503, a's sleep for it is called off before any sleep call (a admits again, its
    stream ends whole). Then a sleeps for b, and four requests for a at once wake it once."""
    vllm = sim_command("vllm", "--enable-sleep-mode", "--load-s", "0.3", "--wake-s", "0.2",
                       "--token-rate", "20")
    settings = tiered(tmp_path, {
        "a": ("vllm", vllm, f"sleep = true\nmemory_bytes = {100 * MB}"),
        "b": ("vllm", vllm, f"sleep = true\nmemory_bytes = {100 * MB}"),
    }, budget=150 * MB, queue_wait_s=2.5)
    with trio.fail_after(40), caplog.at_level(logging.INFO, logger="nvpair"):
        async with on_demand_service(nursery, settings) as (running, client, _):
            board = running.board
            assert (await ask(client, "model-a")).status_code == 200
            chunks: list[bytes] = []
            streaming = trio.Event()
            answers: dict[str, int] = {}

            async def stream_a() -> None:  # 100 tokens at 20 a second: 5 s
                async with client.stream("POST", "/v1/chat/completions",
                                         content=payload("model-a", 100, stream=True)) as r:
                    async for chunk in r.aiter_bytes():
                        chunks.append(chunk)
                        streaming.set()

            async def for_b() -> None:
                answers["b"] = (await ask(client, "model-b")).status_code

            async with trio.open_nursery() as n:
                n.start_soon(stream_a)
                await streaming.wait()
                n.start_soon(for_b)
                await wait_state(board, "a", "ready", where=lambda e: not e.admitting)
                called_off = await wait_state(board, "a", "ready", where=lambda e: e.admitting)
                assert called_off.activity == ("sleep called off (no request waits for b any "
                                               "more)"), called_off.activity
            assert answers == {"b": 503}
            body = b"".join(chunks)
            assert body.rstrip().endswith(b"data: [DONE]") and body.count(b'"content"') >= 100
            assert board.current.engine("a").state == "ready"  # type: ignore[union-attr]

            assert (await ask(client, "model-b")).status_code == 200  # a sleeps for b
            assert board.current.engine("a").state == "sleeping"  # type: ignore[union-attr]
            caplog.clear()
            statuses: list[int] = []

            async def for_a() -> None:
                statuses.append((await ask(client, "model-a")).status_code)

            async with trio.open_nursery() as n:
                for _ in range(4):
                    n.start_soon(for_a)
            assert statuses == [200] * 4, statuses
    lines = [r.getMessage() for r in caplog.records]
    assert len([line for line in lines if line.startswith("woke a for a request")]) == 1, lines
    assert len([line for line in lines if line.startswith("a: woken in ")]) == 1, lines
    assert running.runners["a"].starts == 1


def test_a_sleeping_engine_counts_what_the_memory_watch_read_of_it_asleep() -> None:
    """a sleeps: until the memory watch has read it asleep it counts as nothing; once
    read asleep (600 MB) it counts that, even when a reading taken before it fell asleep
    is still on the board; its awake footprint (4 GB, measured while it was up) is what a
    wake is planned with. Each candidate says what it can do: a vLLM with sleep (levels 1
    and 2, its measured wake), b (no sleep) only a stop, c pinned."""
    from types import SimpleNamespace

    import msgspec
    from tests.fakes import engine_spec

    from nvpair.config.settings import ActivationConfig
    from nvpair.router.activation import Activator
    from nvpair.state.snapshot import Board
    from nvpair.state.traffic import Traffic
    from nvpair.state.transitions import initial_state
    from nvpair.supervision.sleeper import Sleepers

    def spec(name: str, **kw: object):  # type: ignore[no-untyped-def]
        return engine_spec("vllm", name=name, managed=True, model=name, command=["srv"],
                           activation="on_demand", **kw)

    specs = [spec("a", sleep=True, sleep_level=1), spec("b"), spec("c", pin=True)]
    board = Board(tuple(initial_state(s, now=0.0) for s in specs))
    traffic = Traffic()
    sleepers = Sleepers(specs, board, traffic)
    activator = Activator(board, specs, {}, traffic,
                          ActivationConfig(memory_budget_bytes=10 * 10**9), sleepers=sleepers)
    GB = 10**9

    def state(name: str, state: str, anon: int | None, at: float, since: float) -> None:
        board.update(name, lambda e: msgspec.structs.replace(
            e, state=state, since=since, memory=None if anon is None else SimpleNamespace(
                rss_anon_bytes=anon, swap_bytes=0, at=at)))

    state("a", "ready", 4 * GB, at=1.0, since=0.5)
    state("b", "ready", 2 * GB, at=1.0, since=0.5)
    state("c", "ready", 1 * GB, at=1.0, since=0.5)
    sleepers.woke_in["a"] = 0.25
    activator.remember()
    state("a", "sleeping", 4 * GB, at=1.0, since=2.0)  # (the reading is from before)
    by_name = {c.name: c for c in activator._running("new")}
    assert by_name["a"].asleep and by_name["a"].footprint == 0  # not read asleep yet
    state("a", "sleeping", 600 * 10**6, at=3.0, since=2.0)
    by_name = {c.name: c for c in activator._running("new")}
    a, b, c = by_name["a"], by_name["b"], by_name["c"]
    assert (a.asleep, a.footprint, a.residual, a.levels, a.wake_s) == (
        True, 600 * 10**6, 600 * 10**6, (1, 2), 0.25)
    assert (b.levels, b.asleep, b.pin) == ((), False, False) and c.pin
    assert activator.footprint("a") == 4 * GB  # what its wake is planned with
    assert [c.name for c in activator._running("a")] == ["b", "c"]



async def test_a_request_for_an_engine_going_to_sleep_waits_and_wakes_it(
        nursery, tmp_path) -> None:
    """a streams for 2 s; a request for b makes a go to sleep (drained first); a request for
    a meanwhile waits in a's queue: once a sleeps and b has answered, b goes to sleep and a
    wakes for it. Every request is answered whole; no engine is started twice."""
    vllm = sim_command("vllm", "--enable-sleep-mode", "--load-s", "0.3", "--wake-s", "0.2",
                       "--token-rate", "20")
    settings = tiered(tmp_path, {
        "a": ("vllm", vllm, f"sleep = true\nmemory_bytes = {100 * MB}"),
        "b": ("vllm", vllm, f"sleep = true\nmemory_bytes = {100 * MB}"),
    }, budget=150 * MB)
    with trio.fail_after(40):
        async with on_demand_service(nursery, settings, read=True) as (
                running, client, reader):
            board = running.board
            assert (await ask(client, "model-a")).status_code == 200
            chunks: list[bytes] = []
            streaming = trio.Event()
            answers: dict[str, int] = {}

            async def stream_a() -> None:  # 40 tokens at 20 a second: 2 s
                async with client.stream("POST", "/v1/chat/completions",
                                         content=payload("model-a", 40, stream=True)) as r:
                    answers["stream"] = r.status_code
                    async for chunk in r.aiter_bytes():
                        chunks.append(chunk)
                        streaming.set()

            async def asks(model: str) -> None:
                answers[model] = (await ask(client, model)).status_code

            async with trio.open_nursery() as n:
                n.start_soon(stream_a)
                await streaming.wait()
                n.start_soon(asks, "model-b")
                await wait_state(board, "a", "ready", where=lambda e: not e.admitting)
                n.start_soon(asks, "model-a")  # while a goes to sleep
                await wait_state(board, "a", "ready", where=lambda e: e.queued == 1)
            assert answers == {"stream": 200, "model-b": 200, "model-a": 200}, answers
            body = b"".join(chunks)
            assert body.rstrip().endswith(b"data: [DONE]") and body.count(b'"content"') >= 40
            a, b = board.current.engine("a"), board.current.engine("b")
            assert a is not None and b is not None
            assert (a.state, b.state) == ("ready", "sleeping")
        assert reader.worst < 0.5, reader.worst
    assert running.runners["a"].starts == 1 and running.runners["b"].starts == 1


async def test_a_sleep_that_fails_falls_back_to_a_stop(nursery, tmp_path, caplog) -> None:
    """a says it can sleep but its vLLM was started without --enable-sleep-mode (/sleep
    answers 404): the eviction's sleep fails, a is stopped instead (drained), b serves."""
    settings = tiered(tmp_path, {
        "a": ("vllm", sim_command("vllm", "--load-s", "0.3"),
              f"sleep = true\nmemory_bytes = {100 * MB}"),
        "b": ("vllm", sim_command("vllm", "--load-s", "0.3"), f"memory_bytes = {100 * MB}"),
    }, budget=150 * MB)
    with trio.fail_after(40), caplog.at_level(logging.INFO, logger="nvpair"):
        async with on_demand_service(nursery, settings) as (running, client, _):
            assert (await ask(client, "model-a")).status_code == 200
            served = await ask(client, "model-b")
            assert served.status_code == 200, served.text
            a = running.board.current.engine("a")
            assert a is not None and a.state == "cold"
            assert a.activity is not None and a.activity.startswith(
                "evicted a (stop) to make room for b: sleep failed: POST "
                "/sleep?level=1&mode=wait answered 404"), a.activity
            assert a.activity.endswith(", so stopped instead"), a.activity
            assert (await ask(client, "model-a")).status_code == 200  # started again
    assert running.runners["a"].starts == 2
