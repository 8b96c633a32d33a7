"""Requests for a model that only a peer serves go to that peer (two nvpair services, real
sockets): the same base URL works for the whole cluster's models."""

from __future__ import annotations

import os
from pathlib import Path

import httpx2
import msgspec
import pytest
import trio
import trio.testing
from tests.managed import free_port, wait_state
from tests.peers.cluster import Sock, sockets
from tests.router.script_engine import JSON, ScriptEngine, json_script, sse_script

from nvpair import service
from nvpair.config.settings import RouterConfig, load_settings
from nvpair.peers.advert import Advert, AdvertEngine, AdvertModel
from nvpair.peers.table import PeerTable
from nvpair.router import Router, Traffic
from nvpair.router.peering import PeerRoute, PeerRoutes
from nvpair.sim import SimOptions, serve_sim
from nvpair.state.snapshot import Board

CHAT = "/v1/chat/completions"
def cluster_token(node: str) -> str:
    """Each node its own cluster token: a peer is sent the one its [[peers]] entry names."""
    return f"cluster-token-of-{node}"


def chat(model: str, stream: bool = False) -> bytes:
    return msgspec.json.encode({"model": model, "stream": stream,
                                "messages": [{"role": "user", "content": "hi"}]})


def node_config(tmp: Path, name: str, port: int, engine: ScriptEngine, peer: tuple[str, int],
                top: str = "") -> Path:
    (tmp / f"user-{name}").write_text(f"user-token-of-{name}")
    (tmp / f"cluster-{name}").write_text(cluster_token(name))
    (tmp / f"cluster-{peer[0]}").write_text(cluster_token(peer[0]))
    path = tmp / f"{name}.toml"
    path.write_text(
        f"listen = '127.0.0.1:{port}'\nnode = '{name}'\ntoken_file = '{tmp / f'user-{name}'}'\n"
        f"{top}\n"
        f"[[engines]]\nname = 'e-{name}'\nkind = 'openai'\nport = {engine.port}\n"
        "[engines.probes.ready]\ninterval_s = 0.1\ntimeout_s = 0.1\n"
        "[engines.probes.health]\ninterval_s = 0.5\ntimeout_s = 0.5\n"
        f"[[peers]]\nurl = 'http://127.0.0.1:{peer[1]}'\nname = '{peer[0]}'\n"
        f"token_file = '{tmp / f'cluster-{peer[0]}'}'\n"
        f"[cluster]\ninterval_s = 0.5\ntoken_file = '{tmp / f'cluster-{name}'}'\n")
    return path


async def wait_routable(table: PeerTable, model: str, within: float = 20.0) -> None:
    """Wait (on the table's changes) until a fresh peer offers ``model``."""
    version = -1
    with trio.fail_after(within):
        while not table.routes(model, trio.current_time()).ready:
            version = await table.wait_changed(version)


async def two_nodes(nursery: trio.Nursery, tmp_path: Path, top: str = ""
                    ) -> tuple[service.Running, service.Running, ScriptEngine, ScriptEngine]:
    """Nodes a and b, peers of each other, serving m-a and m-b; a can route m-b. ``top``:
    more of both nodes' config (tables before their engines)."""
    engine_a, engine_b = ScriptEngine("m-a"), ScriptEngine("m-b")
    await nursery.start(engine_a.serve)
    await nursery.start(engine_b.serve)
    port_a, port_b = free_port(), free_port()
    a = await nursery.start(service.run, load_settings(
        str(node_config(tmp_path, "a", port_a, engine_a, ("b", port_b), top))))
    b = await nursery.start(service.run, load_settings(
        str(node_config(tmp_path, "b", port_b, engine_b, ("a", port_a), top))))
    await wait_state(a.board, "e-a", "ready", where=lambda e: bool(e.models))
    await wait_state(b.board, "e-b", "ready", where=lambda e: bool(e.models))
    assert a.peers is not None and b.peers is not None
    await wait_routable(a.peers.table, "m-b")
    return a, b, engine_a, engine_b


async def test_a_peers_model_is_routed_to_the_peer_with_its_cluster_token(
        nursery: trio.Nursery, tmp_path: Path) -> None:
    a, b, engine_a, engine_b = await two_nodes(nursery, tmp_path)
    engine_b.script = lambda path, body: json_script({"answer": "from b"})
    user_a = {"authorization": "Bearer user-token-of-a"}
    with trio.fail_after(20):
        async with httpx2.AsyncClient(base_url=a.url, headers={**JSON, **user_a}) as client:
            r = await client.post(CHAT, content=chat("m-b"))
            assert r.status_code == 200, r.text
            assert r.json() == {"answer": "from b"}
            assert r.headers["x-nvpair-node"] == "b"
            assert r.headers["x-nvpair-engine"] == "e-b"  # passed through from b
            # b's engine got the request, without any token (it has no key configured)
            path, body, headers = engine_b.requests[-1]
            assert (path, body) == (CHAT, chat("m-b"))
            assert "authorization" not in headers
            assert engine_a.posts == 0

            # streams pass through both nodes byte for byte
            script = sse_script(20, model="m-b")
            engine_b.script = lambda path, body: script
            async with client.stream("POST", CHAT, content=chat("m-b", True)) as s:
                got = b"".join([chunk async for chunk in s.aiter_raw()])
            assert got == b"".join(data for _, data in script[1:])

            # a's own model stays local; a model nobody serves is 404
            engine_a.script = lambda path, body: json_script({"answer": "from a"})
            r = await client.post(CHAT, content=chat("m-a"))
            assert r.json() == {"answer": "from a"} and "x-nvpair-node" not in r.headers
            r = await client.post(CHAT, content=chat("m-nowhere"))
            assert r.status_code == 404
            assert r.json()["error"]["code"] == "model_not_found"

        posts_a = engine_a.posts
        async with httpx2.AsyncClient(headers=JSON, base_url=b.url) as client:
            cluster = {"authorization": f"Bearer {cluster_token('b')}"}
            # the cluster token alone is not a user token
            r = await client.post(CHAT, content=chat("m-b"), headers=cluster)
            assert r.status_code == 401
            # a request a node passed on is never passed on again (no loops): b knows m-a
            # from a's adverts, but serves forwarded requests from its own engines only
            assert b.peers is not None
            await wait_routable(b.peers.table, "m-a")
            r = await client.post(CHAT, content=chat("m-a"),
                                  headers={**cluster, "x-nvpair-forwarded-by": "a"})
            assert r.status_code == 404
            assert engine_a.posts == posts_a
            # another node's cluster token is not b's: refused even with the header (so a
            # routed request that works above carried b's token, from a's [[peers]] entry)
            r = await client.post(CHAT, content=chat("m-b"), headers={
                "authorization": f"Bearer {cluster_token('a')}", "x-nvpair-forwarded-by": "a"})
            assert r.status_code == 401


async def test_a_peers_model_whose_engine_is_down_is_503_naming_the_node(
        nursery: trio.Nursery, tmp_path: Path) -> None:
    a, b, _, engine_b = await two_nodes(nursery, tmp_path)
    await engine_b.close_listener()
    await wait_state(b.board, "e-b", "down", "starting", "unhealthy")
    table = a.peers.table
    version = -1
    with trio.fail_after(20):  # b pushes the change at once
        while table.routes("m-b", trio.current_time()).ready:
            version = await table.wait_changed(version)
        async with httpx2.AsyncClient(base_url=a.url, headers={**JSON,
                "authorization": "Bearer user-token-of-a"}) as client:
            r = await client.post(CHAT, content=chat("m-b"))
    assert r.status_code == 503
    assert r.headers["retry-after"] == "2"
    assert "node b" in r.json()["error"]["message"]


async def test_a_peer_that_moves_leaves_no_connection_behind(nursery, tmp_path) -> None:
    """A peer advertises a new URL: requests follow it, and the pool to the old one is
    closed (its idle keep-alive connection would sit in CLOSE-WAIT until nvpair stops)."""
    old = await nursery.start(serve_sim, SimOptions(kind="vllm", model="m-b"))
    new = await nursery.start(serve_sim, SimOptions(kind="vllm", model="m-b"))
    (tmp_path / "cluster").write_text("cluster-secret")
    (tmp_path / "nvpair.toml").write_text(
        "listen = '127.0.0.1:0'\nnode = 'a'\n[cluster]\ntoken_file = 'cluster'\n")
    with trio.fail_after(30):
        running = await nursery.start(service.run, load_settings(str(tmp_path / "nvpair.toml")))
        async with httpx2.AsyncClient(headers=JSON, base_url=running.url,
                                      trust_env=False) as client:
            for seq, sim in ((1, old), (2, new)):
                advert = Advert(
                    node="b", boot_id="b1", seq=seq, ttl_s=15, url=f"http://127.0.0.1:{sim.port}",
                    engines=(AdvertEngine(name="e", kind="vllm", state="ready", models=("m-b",)),),
                    models=(AdvertModel(id="m-b", engine="e", engines=("e",), kind="vllm"),))
                r = await client.post("/v1/peers/adverts", content=msgspec.json.encode(advert),
                                      headers={"authorization": "Bearer cluster-secret"})
                assert r.status_code == 204, r.text
                r = await client.post(CHAT, content=chat("m-b"))
                assert r.status_code == 200 and r.headers["x-nvpair-node"] == "b", r.text
                assert sim.stats().path(CHAT).count == 1
                if seq == 1:
                    assert mine(await sockets(), old.port)  # kept alive for the next request
            await trio.testing.wait_all_tasks_blocked(0.05)  # the old pool's close has run
            assert mine(await sockets(), old.port) == []
            assert mine(await sockets(), new.port)


def mine(socks: list[Sock], port: int) -> list[Sock]:
    """This process's open connections to ``port``."""
    return [s for s in socks if s.pid == os.getpid() and s.peer_port == port
            and s.state in ("ESTAB", "CLOSE-WAIT")]


class Routes:
    """Peer routes as the peer table would give them (the table's decode is not tested here:
    a URL it let through must still never become a 500)."""

    def __init__(self, *ready: PeerRoute) -> None:
        self.ready = ready

    def routes(self, model: str, now: float) -> PeerRoutes:
        return PeerRoutes(ready=self.ready)


@pytest.mark.parametrize("url", ["http://127.0.0.1:99999", "http://[::1", "http://127.0.0.1:8o",
                                 "http://127.0.0.1:-1", "ftp://127.0.0.1:80", "http://"])
async def test_a_peer_advertising_an_unusable_url_is_skipped(nursery, url) -> None:
    good = await nursery.start(serve_sim, SimOptions(kind="vllm", model="m-b"))
    bad = PeerRoute("bad", url, "t")
    both = Routes(bad, PeerRoute("good", f"http://127.0.0.1:{good.port}", "t"))
    with trio.fail_after(20):
        for peers in (both, Routes(bad)):
            router = Router(Board(()), (), RouterConfig(), Traffic(), node="a", peers=peers)
            await nursery.start(router.run)
            transport = httpx2.ASGITransport(app=router)  # type: ignore[arg-type]
            async with httpx2.AsyncClient(transport=transport, base_url="http://127.0.0.1",
                                          headers=JSON) as client:
                answers = [await client.post(CHAT, content=chat("m-b")) for _ in range(4)]
            if peers is both:
                assert [r.status_code for r in answers] == [200] * 4, answers[0].text
                assert {r.headers["x-nvpair-node"] for r in answers} == {"good"}
            else:
                for r in answers:
                    assert r.status_code == 503, r.text
                    assert "node bad advertises a URL that cannot be used" in r.text


async def test_a_cold_model_of_a_peers_multi_model_engine_is_routed_there_and_loaded(
        nursery: trio.Nursery, tmp_path: Path) -> None:
    """Node b adopts llama-server in router mode (the simulator), its models listed cold;
    a request on node a for one of them goes to b, whose router loads it. An on-demand
    engine's cold model on a peer stays unrouted (its engine is cold, not a router)."""
    models = tmp_path / "models"
    models.mkdir()
    (tmp_path / "one.gguf").write_bytes(b"GGUF")
    for name in ("alpha", "beta"):
        (models / f"{name}.gguf").symlink_to(tmp_path / "one.gguf")
    sim = await nursery.start(serve_sim, SimOptions(kind="llamacpp", models_dir=str(models),
                                                    models_max=1, model_load_s=0.1))
    await sim.wait_phase("ready")
    engine_a = ScriptEngine("m-a")
    await nursery.start(engine_a.serve)
    port_a, port_b = free_port(), free_port()
    a = await nursery.start(service.run, load_settings(
        str(node_config(tmp_path, "a", port_a, engine_a, ("b", port_b)))))
    path_b = node_config(tmp_path, "b", port_b, engine_a, ("a", port_a))
    text = path_b.read_text().replace(f"name = 'e-b'\nkind = 'openai'\nport = {engine_a.port}",
                                      f"name = 'r'\nkind = 'llamacpp'\nport = {sim.port}")
    path_b.write_text(text)
    b = await nursery.start(service.run, load_settings(str(path_b)))
    with trio.fail_after(20):
        await wait_state(b.board, "r", "ready", where=lambda e: len(e.models) == 2)
        assert a.peers is not None
        table, version = a.peers.table, -1
        while not table.routes("alpha", trio.current_time()).loadable:
            version = await table.wait_changed(version)
        routes = table.routes("alpha", trio.current_time())
        assert routes.ready == () and [r.node for r in routes.loadable] == ["b"]
        async with httpx2.AsyncClient(base_url=a.url, timeout=10, headers={
                **JSON, "authorization": "Bearer user-token-of-a"}) as client:
            r = await client.post(CHAT, content=chat("alpha"))
            assert r.status_code == 200, r.text
            assert r.headers["x-nvpair-node"] == "b" and r.json()["model"] == "alpha"
        assert sim.stats().path("/v1/chat/completions").count == 1


async def test_a_peers_cold_model_is_loadable_only_on_a_ready_engine(autojump_clock) -> None:
    table = PeerTable("me")
    models = (AdvertModel(id="alpha", engine="r", engines=("r",), kind="llamacpp",
                          state="cold"),
              AdvertModel(id="big", engine="od", engines=("od",), kind="vllm", state="cold"))
    table.receive(Advert(node="b", boot_id="x", seq=1, ttl_s=3.0, url="http://b:1",
                         engines=(AdvertEngine(name="r", kind="llamacpp", state="ready",
                                               models=("alpha",)),
                                  AdvertEngine(name="od", kind="vllm", state="cold",
                                               models=("big",))),
                         models=models), 200, trio.current_time())
    now = trio.current_time()
    assert table.routes("alpha", now) == PeerRoutes(
        loadable=(PeerRoute("b", "http://b:1", None),))
    assert table.routes("big", now) == PeerRoutes(others=("node b's engine is cold",))
