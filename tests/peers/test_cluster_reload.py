"""A reload applies the whole ``[cluster]`` table live (docs/peers.md, "Reload"): two or
three real nvpair services in this process, over real HTTP on 127.0.0.1, node b with a
managed simulator whose model the others list through b's adverts.

A peer's state moves with the table's version (waited on); a count of adverts does not
move it (a refresh of the same content is no change), so those waits poll under a
``trio.fail_after`` ceiling, as the other peers tests do across processes.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx2
import pytest
import trio
from tests.group.nodes import vllm_manifest
from tests.managed import FAST_PROBES, fast_manifest, free_port, sim_command
from tests.peers.etcd_server import ETCD, SKIP_REASON, open_etcd

from nvpair import service
from nvpair.config.settings import load_settings
from nvpair.errors import ConfigError
from nvpair.peers.table import Entry
from nvpair.service import Running

POLL_S = 0.05
MODEL = "model-b"


class Nodes:
    """The config files of the nodes (a, b, c) and their ports; b has the engine."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.ports = {name: free_port() for name in "abc"}
        self.manifest = fast_manifest(tmp, "vllm")
        self.engine_port = free_port()
        for token in ("one", "two"):
            (tmp / token).write_text(f"reload-cluster-token-{token}")

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.ports[name]}"

    def write(self, name: str, peers: tuple[str, ...] = (), *, token: str | None = "one",
              interval: float = 0.5, etcd: str = "") -> Path:
        """``name``'s config: pushing to ``peers``, with the cluster token file ``token``
        (None: no [cluster] at all); ``etcd``: more of [cluster] (the etcd backend)."""
        text = (f"listen = '127.0.0.1:{self.ports[name]}'\nnode = '{name}'\n"
                f"state_dir = '{self.tmp / name}'\nlog_dir = '{self.tmp / name / 'logs'}'\n")
        if name == "b":
            command = sim_command("vllm", "--load-s", "0.1", "--warmup-s", "0")
            text += (f"[[engines]]\nname = 'eb'\nkind = '{self.manifest}'\n"
                     f"port = {self.engine_port}\nmodel = '{MODEL}'\nmanaged = true\n"
                     f"command = {json.dumps(command)}\n{FAST_PROBES}")
        text += "".join(f"[[peers]]\nurl = '{self.url(peer)}'\n" for peer in peers)
        if token is not None:
            text += f"[cluster]\ntoken_file = '{token}'\ninterval_s = {interval}\n{etcd}"
        path = self.tmp / f"{name}.toml"
        path.write_text(text)
        return path

    async def start(self, nursery: trio.Nursery, name: str, path: Path) -> Running:
        running: Running = await nursery.start(service.run, load_settings(str(path)))
        return running


async def get(url: str, **kw: Any) -> httpx2.Response:
    async with httpx2.AsyncClient(timeout=5) as client:
        return await client.request(kw.pop("method", "GET"), url, **kw)


async def cluster_models(nodes: Nodes, name: str) -> set[str]:
    r = await get(nodes.url(name) + "/v1/cluster/models")
    assert r.status_code == 200, r.text
    return {item["id"] for item in r.json()["data"]}


async def heard(running: Running, node: str, *states: str,
                where: Callable[[Entry], bool] = lambda e: True) -> Entry:
    """Until ``running``'s table holds ``node`` in one of ``states`` (waited on)."""
    while True:
        assert running.reloader is not None and running.reloader.peers is not None
        table = running.reloader.peers.table
        e = table.entries.get(node)
        if e is not None and table.state(e, trio.current_time()) in states and where(e):
            return e
        await table.wait_changed(table.version)


async def lists(nodes: Nodes, running: Running, name: str) -> None:
    """Until node ``name`` (``running``) lists b's model in its cluster's /v1/models."""
    await heard(running, "b", "fresh", where=lambda e: MODEL in e.states)

    async def listed() -> bool:  # (the engine's state on b: polled)
        return MODEL in await cluster_models(nodes, name)

    await until(listed)


async def until(check: Callable[[], bool | Awaitable[bool]]) -> None:
    while True:
        result = check()
        if not isinstance(result, bool):
            result = await result
        if result:
            return
        await trio.sleep(POLL_S)


def advert_push(token: str) -> dict[str, Any]:
    """A push that would pass the token check and stop at the body (400: not an advert)."""
    return {"method": "POST", "content": b"{}",
            "headers": {"authorization": f"Bearer {token}",
                        "content-type": "application/json"}}


async def test_a_cluster_token_changed_on_both_nodes_keeps_the_peers(
        nursery: trio.Nursery, tmp_path: Path) -> None:
    """The cluster token moves from one to two by a reload on a, then on b: a checks the
    new token from its reload on (a push with the old one is 401), b's pushes get in
    again once b has reloaded, and a lists b's model after both. Before, a's reload was
    refused (the token was fixed at a start)."""
    nodes = Nodes(tmp_path)
    with trio.fail_after(60):
        b = await nodes.start(nursery, "b", nodes.write("b", ("a",)))
        a = await nodes.start(nursery, "a", nodes.write("a", ("b",)))
        await lists(nodes, a, "a")
        old, new = (tmp_path / "one").read_text(), (tmp_path / "two").read_text()
        assert (await get(nodes.url("a") + "/v1/peers/adverts",
                          **advert_push(old))).status_code == 400
        nodes.write("a", ("b",), token="two")
        nodes.write("b", ("a",), token="two")
        assert a.reloader is not None and b.reloader is not None
        change_a = await a.reloader.reload("test")
        between = await cluster_models(nodes, "a")  # the table stays: no blink
        refused_old = await get(nodes.url("a") + "/v1/peers/adverts", **advert_push(old))
        taken_new = await get(nodes.url("a") + "/v1/peers/adverts", **advert_push(new))
        change_b = await b.reloader.reload("test")
        assert a.reloader.peers is not None and a.reloader.peers.receiver is not None
        receiver = a.reloader.peers.receiver
        accepted = receiver.accepted
        await until(lambda: receiver.accepted >= accepted + 2)  # b's pushes, new token
        listed = await cluster_models(nodes, "a")
        peers = (await get(nodes.url("a") + "/v1/peers")).json()
    assert change_a.sections == change_b.sections == ("peers",)
    assert refused_old.status_code == 401, refused_old.text
    assert taken_new.status_code == 400, taken_new.text  # past the token: the body is bad
    assert MODEL in between and MODEL in listed
    [peer] = peers["peers"]
    assert (peer["node"], peer["state"]) == ("b", "fresh")
    assert peer["outbound"]["consecutive_failures"] == 0  # a's pushes, new token, get in


async def test_peers_turned_on_off_and_on_again(nursery: trio.Nursery, tmp_path: Path) -> None:
    """Node a starts without [cluster] (b pushes to it in vain); a reload turns peers on:
    a lists b's model and b hears a. Off: b's model leaves a's cluster listing at once,
    /v1/peers is gone (and the dashboard knows it) and b sees a leave. On again: b's
    model comes back and b hears a under a new boot. Before, each reload was refused
    (peers turned on or off)."""
    nodes = Nodes(tmp_path)
    with trio.fail_after(60):
        b = await nodes.start(nursery, "b", nodes.write("b", ("a",)))
        a = await nodes.start(nursery, "a", nodes.write("a", token=None))
        assert a.reloader is not None and a.reloader.peers is None
        before = await get(nodes.url("a") + "/v1/peers")
        nodes.write("a", ("b",))
        turned_on = await a.reloader.reload("test")
        await lists(nodes, a, "a")
        on_history = (await get(nodes.url("a") + "/v1/history")).json()
        first = await heard(b, "a", "fresh")
        boot = first.advert.boot_id
        nodes.write("a", token=None)
        turned_off = await a.reloader.reload("test")
        off_listed = await cluster_models(nodes, "a")
        off_peers = await get(nodes.url("a") + "/v1/peers")


        async def no_peers_route() -> bool:  # (its answer is kept for up to a second)
            doc = (await get(nodes.url("a") + "/v1/history")).json()
            return not doc["routes"]["peers"]

        await until(no_peers_route)
        off_adverts = await get(nodes.url("a") + "/v1/peers/adverts", **advert_push(
            (tmp_path / "one").read_text()))
        await heard(b, "a", "left")
        nodes.write("a", ("b",))
        await a.reloader.reload("test")
        await lists(nodes, a, "a")
        again = await heard(b, "a", "fresh", where=lambda e: e.advert.boot_id != boot)
    assert before.status_code == 404
    assert turned_on.sections == turned_off.sections == ("peers",)
    assert MODEL not in off_listed
    assert off_peers.status_code == 404 and off_adverts.status_code == 404
    assert on_history["routes"]["peers"]  # the dashboard asks for /v1/peers (then not)
    assert again.advert.boot_id != boot


async def test_peers_turned_on_for_a_node_that_started_without_them(
        nursery: trio.Nursery, tmp_path: Path) -> None:
    """Node c starts without [cluster]; a reload gives it b as a peer: b hears c with its
    URL, and c's /v1/peers shows b heard and its own pushes getting through."""
    nodes = Nodes(tmp_path)
    with trio.fail_after(60):
        b = await nodes.start(nursery, "b", nodes.write("b", ("c",)))
        c = await nodes.start(nursery, "c", nodes.write("c", token=None))
        nodes.write("c", ("b",))
        assert c.reloader is not None
        await c.reloader.reload("test")
        seen = await heard(b, "c", "fresh")
        await lists(nodes, c, "c")
        doc = (await get(nodes.url("c") + "/v1/peers")).json()
    assert seen.advert.url == nodes.url("c")
    assert doc["broker"]["state"] == "ok" and doc["url"] == nodes.url("c")
    assert [p["node"] for p in doc["peers"]] == ["b"]


async def test_a_new_push_interval_takes_effect(nursery: trio.Nursery,
                                                tmp_path: Path) -> None:
    """interval_s from 4 s to 0.1 s: node b receives ten adverts of a within 3 s (at 4 s
    they take about 40 s), and a's /v1/peers says the new interval. Before, the reload
    was refused (the timings were fixed at a start)."""
    nodes = Nodes(tmp_path)
    with trio.fail_after(60):
        b = await nodes.start(nursery, "b", nodes.write("b"))
        a = await nodes.start(nursery, "a", nodes.write("a", ("b",), interval=4.0))
        e = await heard(b, "a", "fresh")
        nodes.write("a", ("b",), interval=0.1)
        assert a.reloader is not None
        change = await a.reloader.reload("test")
        count = e.adverts
        started = trio.current_time()
        with trio.fail_after(3):
            await until(lambda: e.adverts >= count + 10)
        took = trio.current_time() - started
        doc = (await get(nodes.url("a") + "/v1/peers")).json()
    assert change.sections == ("peers",)
    assert doc["interval_s"] == 0.1, doc
    assert took < 3, took


def on_etcd(url: str, prefix: str) -> str:
    return (f"backend = 'etcd'\netcd_url = '{url}'\netcd_prefix = '{prefix}'\n"
            "etcd_lease_ttl_s = 3\n")


async def etcd_keys(url: str, prefix: str) -> list[str]:
    """The keys under ``prefix`` (etcd's JSON gateway: keys are base64)."""
    start = prefix.encode()
    end = start[:-1] + bytes([start[-1] + 1])
    r = await get(url + "/v3/kv/range", method="POST", json={
        "key": base64.b64encode(start).decode(), "range_end": base64.b64encode(end).decode(),
        "keys_only": True})
    return [base64.b64decode(kv["key"]).decode() for kv in r.json().get("kvs", [])]


@pytest.mark.skipif(ETCD is None, reason=SKIP_REASON)
async def test_an_etcd_prefix_changed_moves_the_node(nursery: trio.Nursery,
                                                     tmp_path: Path) -> None:
    """Nodes a and b in one etcd under prefix one/. A reload moves a to two/: a forgets b
    at once (b is not under two/), a's key is under two/, and its old key under one/ goes
    with its lease (left to expire: within the 3 s TTL). b moved to two/ too: a lists b's
    model again. Before, each reload was refused (etcd was fixed at a start)."""
    nodes = Nodes(tmp_path)
    async with open_etcd(tmp_path) as etcd:
        with trio.fail_after(60):
            b = await nodes.start(nursery, "b", nodes.write("b", etcd=on_etcd(etcd.url, "one/")))
            a = await nodes.start(nursery, "a", nodes.write("a", etcd=on_etcd(etcd.url, "one/")))
            await lists(nodes, a, "a")
            nodes.write("a", etcd=on_etcd(etcd.url, "two/"))
            assert a.reloader is not None and b.reloader is not None
            change = await a.reloader.reload("test")
            moved_listing = await cluster_models(nodes, "a")

            async def moved() -> bool:
                return (await etcd_keys(etcd.url, "two/") == ["two/a"]
                        and await etcd_keys(etcd.url, "one/") == ["one/b"])

            with trio.fail_after(3 + 3):  # the old lease's TTL, and slack
                await until(moved)
            nodes.write("b", etcd=on_etcd(etcd.url, "two/"))
            await b.reloader.reload("test")
            await lists(nodes, a, "a")
            doc = (await get(nodes.url("a") + "/v1/peers")).json()
    assert change.sections == ("peers",)
    assert MODEL not in moved_listing
    assert doc["etcd"]["state"] == "ok" and [p["node"] for p in doc["peers"]] == ["b"]


async def test_a_group_keeps_hearing_its_rank_through_a_token_and_interval_change(
        nursery: trio.Nursery, tmp_path: Path) -> None:
    """A two-node group (vLLM-like: head h, headless rank r) runs; a reload on both nodes
    moves the cluster token and the interval: the group stays ready in the same epoch and
    the head hears its rank's reports under the new token. A change of the backend while
    the group runs is refused with its reason (the group's ranks hear each other through
    it). Before, the first reload was refused (the token was fixed at a start)."""
    manifest = vllm_manifest(tmp_path / "group.json")
    ports = {"h": free_port(), "r": free_port()}
    engine_port, dist_port = free_port(), free_port()
    (tmp_path / "one").write_text("group-cluster-token-one")
    (tmp_path / "two").write_text("group-cluster-token-two")

    def write(name: str, token: str, interval: float, cluster: str = "") -> Path:
        other = "r" if name == "h" else "h"
        path = tmp_path / f"{name}.toml"
        path.write_text(
            f"listen = '127.0.0.1:{ports[name]}'\nnode = '{name}'\n"
            f"log_dir = '{tmp_path / name / 'logs'}'\nstate_dir = '{tmp_path / name}'\n"
            f"[[engines]]\nname = 'g'\nkind = '{manifest}'\nmanaged = true\n"
            f"model = 'big-model'\nhost = '127.0.0.1'\nport = {engine_port}\n"
            "stop_grace_s = 3\n[engines.probes.ready]\ninterval_s = 0.25\ntimeout_s = 0.25\n"
            "[engines.group]\nranks = ['h', 'r']\n"
            f"dist_port = {dist_port}\nrank_lost_grace_s = 2\n"
            + ("" if cluster else
               f"[[peers]]\nurl = 'http://127.0.0.1:{ports[other]}'\nname = '{other}'\n")
            + f"[cluster]\ntoken_file = '{token}'\ninterval_s = {interval}\n{cluster}")
        return path

    def report(running: Running) -> Any:
        assert running.groups is not None
        return running.groups.runners["g"].status(trio.current_time()).report

    with trio.fail_after(60):
        r = await nursery.start(service.run, load_settings(str(write("r", "one", 0.5))))
        h = await nursery.start(service.run, load_settings(str(write("h", "one", 0.5))))
        await until(lambda: getattr(report(h), "state", None) == "ready")
        epoch = report(h).epoch
        write("h", "two", 0.3)
        write("r", "two", 0.3)
        changes = [await h.reloader.reload("test"), await r.reloader.reload("test")]
        reloaded = trio.current_time()
        rank = await heard(h, "r", "fresh", where=lambda e: e.received_at > reloaded
                           and any(g.name == "g" for g in e.advert.groups))
        after = report(h)
        write("h", "two", 0.3, "backend = 'etcd'\netcd_url = 'http://127.0.0.1:1'\n")
        with pytest.raises(ConfigError) as refused:
            await h.reloader.reload("test")
    assert [c.sections for c in changes] == [("peers",), ("peers",)]
    assert (after.state, after.epoch, after.ranks_ready) == ("ready", epoch, 1), after
    assert rank.advert.ttl_s == 0.3 * 3
    assert "multi-node group runs on this node" in str(refused.value)
