"""Queues with keys on a running node (real subprocesses, sockets and HTTP, simulators that
take a while to load): equal keys take turns, a low priority waits behind a high one and
goes within the ageing bound, GET /v1/queue and /metrics show who waits, and swap
batching holds an eviction until the loaded engine served its batch (or a waiter waited
max_swap_wait_s), saying why."""

from __future__ import annotations

import re
from pathlib import Path

import httpx2
import trio
from tests.managed import sim_command, wait_state
from tests.router.test_activation import GB, on_demand, on_demand_service, payload, queued

CHAT = "/v1/chat/completions"


def keys(tmp: Path, **priorities: int) -> str:
    """``[[keys]]`` tables of user keys of these priorities (and a reader, ``grafana``),
    each token ``token-NAME`` in its own 0600 file."""
    text = ""
    for name, role, priority in [*((n, "user", p) for n, p in priorities.items()),
                                 ("grafana", "reader", 0)]:
        (tmp / name).write_text(f"token-{name}\n")
        (tmp / name).chmod(0o600)
        text += (f"[[keys]]\nname = '{name}'\ntoken_file = '{name}'\nrole = '{role}'\n"
                 f"priority = {priority}\n")
    return text


def as_key(name: str) -> dict[str, str]:
    return {"authorization": f"Bearer token-{name}", "content-type": "application/json"}


async def test_equal_keys_with_100_and_10_waiting_take_turns(nursery, tmp_path) -> None:
    """One slot; 100 requests of ``big`` queue first, then 10 of ``small``, all while the
    engine loads: they go big, small, big, small... then the rest of big (first come first
    served would leave small's 10 to the end). GET /v1/queue shows the same order."""
    settings = on_demand(tmp_path, {"a": sim_command("vllm", "--load-s", "3")},
                         activation="queue_max = 128\n" + keys(tmp_path, big=0, small=0),
                         a="max_in_flight = 1")
    heads: list[str] = []
    statuses: list[int] = []
    with trio.fail_after(90):
        async with on_demand_service(nursery, settings) as (running, client, _):
            limits = httpx2.Limits(max_connections=200, max_keepalive_connections=200)
            async with httpx2.AsyncClient(base_url=str(client.base_url), timeout=60,
                                          limits=limits) as many:

                async def one(key: str) -> None:
                    async with many.stream("POST", CHAT, headers=as_key(key),
                                           content=payload("model-a", 2, stream=True)) as r:
                        heads.append(key)
                        statuses.append(r.status_code)
                        await r.aread()

                async with trio.open_nursery() as n:
                    for i in range(110):
                        n.start_soon(one, "big" if i < 100 else "small")
                        if i in (99, 109):
                            await queued(running.board, "a", i + 1)
                    doc = (await client.get("/v1/queue", headers=as_key("grafana"))).json()
                    denied = await client.get("/v1/queue", headers=as_key("big"))
                    metrics = (await client.get("/metrics", headers=as_key("grafana"))).text
                    a = running.board.current.engine("a")
                    assert a is not None and a.state == "starting", a
    assert statuses == [200] * 110
    assert heads[:20] == ["big", "small"] * 10 and heads[20:] == ["big"] * 90
    engine = doc["engines"]["a"]
    assert engine["depth"] == 110 and engine["model"] == "model-a"
    assert [w["key"] for w in engine["waiting"][:20]] == ["big", "small"] * 10
    assert [w["position"] for w in engine["waiting"]] == list(range(1, 111))
    assert engine["keys"]["big"]["depth"] == 100 and engine["keys"]["small"]["depth"] == 10
    assert doc["keys"]["small"]["engines"] == {"a": 10}
    assert all(w["age_s"] >= 0 and w["priority"] == 0 for w in engine["waiting"])
    assert "hi" not in str(doc)  # (no request bodies)
    assert denied.status_code == 403  # a user key may not read
    assert 'nvpair_queue_waiting{key="big"} 100\n' in metrics
    assert 'nvpair_queue_waiting{key="small"} 10\n' in metrics
    assert re.search(r'nvpair_queue_oldest_wait_seconds\{key="big"\} [0-9.]+\n', metrics)


async def test_a_low_priority_waits_behind_high_and_goes_within_the_ageing_bound(
        nursery, tmp_path) -> None:
    """``ops`` (priority 1) keeps three requests waiting all the time, each 0.2 s on the
    engine's one slot; one request of ``batch`` (priority -1) comes. priority_age_s = 1:
    it waits behind ops until it has waited (1 - (-1)) * 1 s = 2 s, then goes within
    K * (m + 1) = 2 turns (docs/on-demand.md, "Who goes next")."""
    settings = on_demand(tmp_path, {"a": sim_command("vllm", "--token-rate", "20")},
                         activation="priority_age_s = 1\n" + keys(tmp_path, ops=1, batch=-1),
                         a="max_in_flight = 1")
    served: list[tuple[str, float]] = []  # (key, when its answer began)
    with trio.fail_after(60):
        async with on_demand_service(nursery, settings) as (running, client, _):
            warm = await client.post(CHAT, headers=as_key("ops"), content=payload("model-a"))
            assert warm.status_code == 200, warm.text
            done = trio.Event()

            async def ops() -> None:
                while not done.is_set():
                    async with client.stream("POST", CHAT, headers=as_key("ops"),
                                             content=payload("model-a", 4, stream=True)) as r:
                        served.append(("ops", trio.current_time()))
                        assert r.status_code == 200
                        await r.aread()

            async with trio.open_nursery() as n:
                for _ in range(4):  # one on the engine, three waiting
                    n.start_soon(ops)
                await queued(running.board, "a", 3)
                sent = trio.current_time()
                low = await client.post(CHAT, headers=as_key("batch"),
                                        content=payload("model-a", 4))
                began = float(low.headers["x-nvpair-queue-ms"]) / 1000
                served.append(("batch", sent + began))
                done.set()
    assert low.status_code == 200, low.text
    before = [t for key, t in served if key == "ops" and sent < t < sent + began]
    assert len(before) >= 5  # it waited behind ops (0.2 s each, for 2 s)
    assert began >= 2.0  # its level was below ops' until it had waited 2 * priority_age_s
    # within the bound, counted in turns: once it had waited 2 s, at most K * (m + 1) - 1 =
    # 1 ops request was let go before it (one more may show here: an ops answer's head
    # reaches its client a moment after it was let go)
    after_bound = [t for t in before if t > sent + 2.0]
    assert len(after_bound) <= 2, (began, after_bound)
    assert began < 10, began


def sharing(tmp: Path, activation: str) -> object:
    """Two engines, a memory budget for one; a answers at 20 tokens a second."""
    return on_demand(
        tmp, {"a": sim_command("vllm", "--token-rate", "20", "--load-s", "0.3"),
              "b": sim_command("vllm", "--load-s", "0.3")},
        activation=f"memory_budget_bytes = {10 * GB}\n{activation}",
        extra=f"memory_bytes = {6 * GB}")


async def a_busy_then_b(nursery: trio.Nursery, settings: object) -> tuple[int, float, str]:
    """Two clients keep a busy (4 tokens, 0.2 s a request); then one request for b. How
    many a served before its eviction, how long b's request waited, a's activity."""
    with trio.fail_after(60):
        async with on_demand_service(nursery, settings) as (running, client, _):  # type: ignore[arg-type]
            first = await client.post(CHAT, content=payload("model-a"))
            assert first.status_code == 200, first.text
            done = trio.Event()
            answered: list[float] = []
            one_answered = trio.Event()

            async def keep_a_busy() -> None:
                while not done.is_set():
                    r = await client.post(CHAT, content=payload("model-a", 4))
                    assert r.status_code == 200, r.text
                    answered.append(trio.current_time())
                    one_answered.set()

            evicted: list[str] = []

            async def watch() -> None:  # (a's activity once evicted, before it starts again)
                e = await wait_state(running.board, "a", "cold", within=40,
                                     where=lambda e: "swap:" in (e.activity or ""))
                evicted.append(e.activity)

            async with trio.open_nursery() as n:
                n.start_soon(watch)
                n.start_soon(keep_a_busy)
                n.start_soon(keep_a_busy)
                await one_answered.wait()  # (both clients have one in flight or on the way)
                sent = trio.current_time()
                b = await client.post(CHAT, content=payload("model-b"))
                done.set()
            assert b.status_code == 200, b.text
            return (1 + sum(t < sent + float(b.headers["x-nvpair-queue-ms"]) / 1000
                            for t in answered),
                    float(b.headers["x-nvpair-queue-ms"]) / 1000, evicted[0])


async def test_swap_batching_lets_the_loaded_engine_serve_its_batch_first(
        nursery, tmp_path, caplog) -> None:
    settings = sharing(tmp_path, "swap_batch = 6\nmax_swap_wait_s = 30")
    caplog.set_level("INFO", logger="nvpair.activation")
    served, waited, activity = await a_busy_then_b(nursery, settings)
    assert served >= 6  # (its first request, and five more of the two clients at least)
    assert re.search(r"; swap: served [6-9] of swap_batch 6$", activity), activity
    assert re.search(r"swap: a evicted for b: served [6-9] of swap_batch 6", caplog.text)
    assert "swap for b held: a keeps serving (served " in caplog.text
    assert waited < 30


async def test_a_waiter_that_waited_max_swap_wait_s_ends_the_hold(
        nursery, tmp_path, caplog) -> None:
    settings = sharing(tmp_path, "swap_batch = 10000\nmax_swap_wait_s = 1")
    caplog.set_level("INFO", logger="nvpair.activation")
    served, waited, activity = await a_busy_then_b(nursery, settings)
    assert waited >= 1.0
    assert re.search(r"; swap: b waited 1\.\d s >= max_swap_wait_s 1 s \(served \d+\)$",
                     activity), activity
    assert served < 10000


async def test_queue_max_is_each_keys_share(nursery, tmp_path) -> None:
    """queue_max = 2: a third request of ``big`` waiting for the engine is 429, while
    ``small`` still gets a place (one busy key cannot fill the queue)."""
    settings = on_demand(tmp_path, {"a": sim_command("vllm", "--load-s", "3")},
                         activation="queue_max = 2\n" + keys(tmp_path, big=0, small=0))
    statuses: dict[str, list[int]] = {"big": [], "small": []}
    with trio.fail_after(40):
        async with on_demand_service(nursery, settings) as (running, client, _):

            async def one(key: str) -> None:
                r = await client.post(CHAT, headers=as_key(key), content=payload("model-a"))
                statuses[key].append(r.status_code)

            async with trio.open_nursery() as n:
                for i in range(2):
                    n.start_soon(one, "big")
                    await queued(running.board, "a", i + 1)
                full = await client.post(CHAT, headers=as_key("big"),
                                         content=payload("model-a"))
                n.start_soon(one, "small")
                await queued(running.board, "a", 3)
    assert full.status_code == 429, full.text
    assert full.json()["error"]["message"] == (
        "2 requests of key 'big' are waiting for engine a to start (queue_max 2)")
    assert statuses == {"big": [200, 200], "small": [200]}
