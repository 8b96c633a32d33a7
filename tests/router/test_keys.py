"""Keys on a running node (real sockets, a scripted engine): their limits answer 429 at the
limit and not before, their model patterns 404 a routed request, their roles keep a
reader or a user from stopping an engine, and /metrics counts each key."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx2
import msgspec
import trio
import trio.testing
from tests.managed import sim_command
from tests.router.script_engine import JSON, SSE_HEAD, ScriptEngine, json_script
from tests.router.test_activation import on_demand, payload
from tests.router.test_relay import CHAT, body, start

from nvpair import service

KEYS = """
token_file = 'admin'
[[keys]]
name = 'batch'
token_file = 'batch'
role = 'user'
max_in_flight = 2
models = ['m*']
[[keys]]
name = 'slow'
token_file = 'slow'
role = 'user'
requests_per_minute = 3
[[keys]]
name = 'grafana'
token_file = 'grafana'
role = 'reader'
"""


def as_key(token: str) -> dict[str, str]:
    return {**JSON, "authorization": f"Bearer {token}"}


def engine() -> ScriptEngine:
    """An engine of ``m1`` that holds a request asking to be held (its answer's head, then
    nothing for a minute) and answers any other at once."""
    eng = ScriptEngine("m1")
    eng.script = lambda path, raw: ([(0.0, SSE_HEAD), (60.0, b"data: [DONE]\n\n")]
                                    if b'"hold"' in raw else json_script({"ok": 1}))
    return eng


async def node(nursery: trio.Nursery, tmp: Path, eng: ScriptEngine) -> Any:
    for name in ("admin", "batch", "slow", "grafana"):
        (tmp / name).write_text(f"token-{name}\n")
        (tmp / name).chmod(0o600)
    return await start(nursery, tmp, {"e": eng}, top=KEYS)


async def key_doc(client: httpx2.AsyncClient, name: str, token: str = "token-grafana"
                  ) -> dict[str, Any]:
    r = await client.get("/v1/router", headers=as_key(token))
    doc: dict[str, Any] = r.json()["keys"][name]
    return doc


async def test_max_in_flight_is_429_at_the_limit_and_not_before(nursery, tmp_path) -> None:
    eng = engine()
    with trio.fail_after(30):
        running = await node(nursery, tmp_path, eng)
        async with httpx2.AsyncClient(base_url=running.url) as client, \
                client.stream("POST", CHAT, content=body("m1", hold=True),
                              headers=as_key("token-batch")) as first, \
                client.stream("POST", CHAT, content=body("m1", hold=True),
                              headers=as_key("token-batch")) as second:
            assert (first.status_code, second.status_code) == (200, 200)
            over = await client.post(CHAT, content=body("m1"), headers=as_key("token-batch"))
            assert over.status_code == 429, over.text
            assert over.json()["error"]["code"] == "rate_limit_exceeded"
            assert over.json()["error"]["type"] == "rate_limit_error"
            assert over.headers["retry-after"] == "1"
            other = await client.post(CHAT, content=body("m1"), headers=as_key("token-ops"))
            assert other.status_code == 401  # (no such token)
            admin = await client.post(CHAT, content=body("m1"), headers=as_key("token-admin"))
            assert admin.status_code == 200  # another key's limit is not this one's
            eng.closed = trio.Event()  # (set by the next connection the engine sees close)
            await first.aclose()  # one ends: a slot is free again
            await eng.closed.wait()  # (the engine saw it go; then nvpair settles)
            await trio.testing.wait_all_tasks_blocked(0.05)
            assert (await key_doc(client, "batch"))["in_flight"] == 1
            again = await client.post(CHAT, content=body("m1"), headers=as_key("token-batch"))
            assert again.status_code == 200, again.text
            metrics = (await client.get("/metrics", headers=as_key("token-grafana"))).text
    assert 'nvpair_key_requests_total{key="batch"} 3\n' in metrics
    assert 'nvpair_key_rejections_total{key="batch",reason="in_flight"} 1\n' in metrics
    assert 'nvpair_key_requests_total{key="token_file"} 1\n' in metrics
    assert 'nvpair_key_queue_wait_seconds_count{key="batch"} 0\n' in metrics
    assert "token-batch" not in metrics


async def test_requests_per_minute_is_429_at_the_limit_and_not_before(nursery,
                                                                      tmp_path) -> None:
    with trio.fail_after(30):
        running = await node(nursery, tmp_path, engine())
        async with httpx2.AsyncClient(base_url=running.url, headers=as_key("token-slow")
                                      ) as client:
            codes = [(await client.post(CHAT, content=body("m1"))).status_code
                     for _ in range(3)]
            over = await client.post(CHAT, content=body("m1"))
            doc = await key_doc(client, "slow")
    assert codes == [200, 200, 200]
    assert over.status_code == 429 and over.json()["error"]["code"] == "rate_limit_exceeded"
    assert 10 <= int(over.headers["retry-after"]) <= 20  # a token every 20 s
    assert doc["requests"] == 3 and doc["rejected"] == {"rate": 1}


async def test_a_model_outside_the_keys_patterns_is_404_for_that_key(nursery,
                                                                     tmp_path) -> None:
    eng = ScriptEngine("other")
    with trio.fail_after(30):
        running = await node(nursery, tmp_path, eng)
        async with httpx2.AsyncClient(base_url=running.url) as client:
            hidden = await client.post(CHAT, content=body("other"),
                                       headers=as_key("token-batch"))
            listed = await client.get("/v1/models", headers=as_key("token-batch"))
            admin = await client.post(CHAT, content=body("other"),
                                      headers=as_key("token-admin"))
    assert hidden.status_code == 404 and hidden.json()["error"]["code"] == "model_not_found"
    assert listed.json()["data"] == []
    assert admin.status_code == 200
    assert eng.posts == 1  # the refused one never reached the engine


async def test_only_an_admin_key_stops_an_engine(nursery, tmp_path) -> None:
    with trio.fail_after(30):
        running = await node(nursery, tmp_path, engine())
        async with httpx2.AsyncClient(base_url=running.url) as client:
            reader = await client.post("/v1/engines/e/stop", headers=as_key("token-grafana"))
            user = await client.post("/v1/engines/e/stop", headers=as_key("token-batch"))
            chat = await client.post(CHAT, content=body("m1"), headers=as_key("token-grafana"))
            assert running.board.current.engine("e").state == "ready"
            admin = await client.post("/v1/engines/e/stop", headers=as_key("token-admin"))
    assert (reader.status_code, user.status_code, chat.status_code) == (403, 403, 403)
    assert reader.json()["error"]["code"] == "forbidden_role"
    assert admin.status_code == 202, admin.text
    assert msgspec.json.decode(admin.content)["operation"] == "stopping"


async def test_an_on_demand_start_names_the_key_and_its_queue_wait_is_counted(
        nursery, tmp_path) -> None:
    (tmp_path / "batch").write_text("token-batch\n")
    (tmp_path / "batch").chmod(0o600)
    settings = on_demand(tmp_path, {"a": sim_command("vllm", "--load-s", "0.5")},
                         activation="[[keys]]\nname = 'batch'\ntoken_file = 'batch'\n"
                                    "role = 'admin'\n")
    with trio.fail_after(40):
        running = await nursery.start(service.run, settings)
        async with httpx2.AsyncClient(base_url=running.url, headers=as_key("token-batch"),
                                      timeout=30) as client:
            r = await client.post(CHAT, content=payload("model-a"))
            doc = await key_doc(client, "batch", "token-batch")
            metrics = (await client.get("/metrics")).text
    assert r.status_code == 200, r.text
    engine = running.board.current.engine("a")
    assert engine is not None and engine.activity == (
        "started a for a request of key 'batch' (queued 1)")
    assert doc["queued"] == 1 and doc["queue_wait_s"] >= 0.5  # (it loads for 0.5 s)
    assert 'nvpair_key_queue_wait_seconds_count{key="batch"} 1\n' in metrics
