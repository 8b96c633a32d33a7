"""A reload changes multi-node groups (docs/groups.md, "Reload"): a group whose rank's
command changed restarts once into a new epoch, whichever node is reloaded first; a
change of its timings alone is taken in place; a group added on both nodes starts, one
removed on both stops and leaves nothing; a reload that touches nothing of the group
leaves it alone.

Two real nvpair nodes on loopback (tests/group/nodes.py), simulated SGLang roles whose
``--load-s`` comes from ``[engines.args]`` (so an arg changes both roles' command lines).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import trio
from tests.group.nodes import Group, group_processes, sim_manifest
from tests.peers.cluster import Cluster, Node, open_cluster


def ready(doc: dict[str, Any]) -> bool:
    return bool(doc.get("state") == "ready")


def args_manifest(path: Path) -> Path:
    """``sim_manifest``'s, with ``--load-s {load_s}`` (default 0.3) in both roles, and a
    head that streams 20 tokens a second."""
    base = json.loads(sim_manifest(path, head_extra=("--token-rate", "20")).read_text())
    for role in base["group"]["roles"].values():
        argv = role["start"]["argv"]
        argv[argv.index("--load-s") + 1] = "{load_s}"
        role["start"]["defaults"] = {"load_s": "0.3"}
    path.write_text(json.dumps(base))
    return path


#: the group's fencing and restart budget, changed (taken in place)
TIMINGS = "fence_after_s = 45\nmax_restarts = {count = 20, per_s = 600}"


def cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")


async def reload(cluster: Cluster, node: Node) -> dict[str, Any]:
    r = await cluster.client.post(node.url + "/v1/admin/reload")
    assert r.status_code == 200, (node.name, r.text)
    doc: dict[str, Any] = r.json()
    return doc


@asynccontextmanager
async def two_nodes(tmp_path: Path, *, group: bool = True
                    ) -> AsyncIterator[tuple[Cluster, Group]]:
    async with open_cluster(tmp_path) as cluster:
        g = Group(cluster, tmp_path, 2, manifest=args_manifest(tmp_path / "sim.json"))
        if not group:
            g.write(group=False)
        with trio.fail_after(150):
            await cluster.start(*g.nodes)
            yield cluster, g


async def until(done: Callable[[], bool], within: float) -> None:
    """Poll (no event crosses processes) until ``done()``."""
    with trio.fail_after(within):
        while True:
            if done():
                return
            await trio.sleep(0.05)


def pids(doc: dict[str, Any]) -> list[int]:
    return [r["pid"] for r in doc["ranks"]]


async def test_a_changed_arg_restarts_the_group_once_whichever_node_is_reloaded_first(
        tmp_path: Path) -> None:
    async with two_nodes(tmp_path) as (cluster, group):
        head, rank = group.nodes
        doc = await group.wait(ready, within=30, what="the group ready")
        for first, second, load in ((head, rank, "0.2"), (rank, head, "0.25")):
            epoch, before = doc["epoch"], pids(doc)
            group.write(args=f"load_s = {load}")
            said = await reload(cluster, first)
            assert said["restart"] == {"g": ["args"]}, said
            if first is rank:  # the head has the old definition: its epoch runs on
                own = await group.wait(lambda d: "differs from its head's" in (
                    d["error"] or ""), within=10, what="the rank waiting", node=rank)
                assert own["ranks"][1]["pid"] == before[1], own
                assert (await group.doc())["epoch"] == epoch
            else:  # a new epoch; the rank, not reloaded yet, starts nothing for it
                waiting = await group.wait(
                    lambda d, epoch=epoch: d["epoch"] > epoch
                    and d["ranks"][1]["exit"] is not None
                    and "differs" in d["ranks"][1]["exit"], within=15,
                    what="the rank waiting for its config")
                assert "rank 1 (n1)" in waiting["error"], waiting
            assert (await reload(cluster, second))["restart"] == {"g": ["args"]}
            reloaded_at = trio.current_time()
            doc = await group.wait(lambda d, epoch=epoch: ready(d) and d["epoch"] > epoch,
                                   within=30,
                                   what="the new epoch ready")
            # once: one new epoch, every process new and running the new command
            assert doc["epoch"] == epoch + 1, doc
            assert doc["history"][1]["reason"] == "its config changed (reload)", doc
            now = pids(doc)
            assert not set(now) & set(before), (before, now)
            assert all(cmdline(p)[cmdline(p).index("--load-s") + 1] == load for p in now)
            assert set(group_processes().values()) == {doc["epoch"]}
            assert doc["error"] is None, doc
            print(f"{first.name} reloaded first: the second reload -> the new epoch ready "
                  f"in {trio.current_time() - reloaded_at:.2f} s")


async def test_a_timing_is_taken_in_place_and_another_engine_leaves_the_group_alone(
        tmp_path: Path) -> None:
    async with two_nodes(tmp_path) as (cluster, group):
        doc = await group.wait(ready, within=30, what="the group ready")
        epoch, before = doc["epoch"], pids(doc)
        group.write(group_extra=TIMINGS)
        for node in group.nodes:
            assert (await reload(cluster, node))["update"] == {"g": ["group"]}
        # another engine (adopted, on the head only) added: the group is not touched
        other = ("[[engines]]\nname = 'other'\nkind = 'vllm'\nhost = '127.0.0.1'\n"
                 "port = 9\n")
        group.write(group_extra=TIMINGS, engines=other, nodes=[group.head])
        said = await reload(cluster, group.head)
        assert said["added"] == {"other": []} and said["unchanged"] == 1, said
        said = await reload(cluster, group.nodes[1])  # (nothing changed there)
        assert said["unchanged"] == 1 and not said["restart"], said
        # held for a while: no epoch moved, no process replaced
        for _ in range(10):
            doc = await group.doc()
            assert ready(doc) and doc["epoch"] == epoch and pids(doc) == before, doc
            await trio.sleep(0.2)
        assert doc["restarts"] == 0 and len(doc["history"]) == 1, doc
        engines = await cluster.json(group.head, "/v1/engines")
        assert {e["name"] for e in engines["engines"]} == {"g", "other"}


async def test_a_group_added_on_both_nodes_starts_and_removed_leaves_nothing(
        tmp_path: Path) -> None:
    async with two_nodes(tmp_path, group=False) as (cluster, group):
        head, rank = group.nodes
        assert (await cluster.json(head, "/v1/engines"))["engines"] == []
        group.write()
        for node in (rank, head):
            said = await reload(cluster, node)
            assert said["added"] == {"g": []}, said
        doc = await group.wait(ready, within=30, what="the added group ready")
        before = pids(doc)
        assert set(group_processes()) == set(before)
        models = await cluster.json(head, "/v1/models")
        assert [m["id"] for m in models["data"]] == ["big-model"]
        own = await group.wait(ready, within=10, what="the rank's view", node=rank)
        assert own["role"] == "rank"
        # the dashboard learns of the groups' route the reload mounted
        for node in group.nodes:
            history = await cluster.json(node, "/v1/history?points=1")
            assert history["routes"]["groups"] is True, history["routes"]
        # removed on both: no process left, gone from /v1/groups and the head's engines
        group.write(group=False)
        for node in (head, rank):
            said = await reload(cluster, node)
            assert said["removed"] == {"g": []}, said
        await until(lambda: not group_processes(), 20)
        for node in group.nodes:
            await cluster.wait(node, "/v1/groups", lambda d: d["groups"] == [], within=10,
                               what="no group")
        await cluster.wait(head, "/v1/engines", lambda d: d["engines"] == [], within=10,
                           what="no engine")
        said = head.log.read_text()
        assert "group g: removed (reload)" in said, said[-3000:]


async def test_the_heads_stream_in_flight_ends_before_a_reload_restarts_or_removes_it(
        tmp_path: Path) -> None:
    """Nothing generating is cut: the head admits no new request and its epoch runs on
    until the routed stream in flight has ended (40 tokens at 20 a second)."""
    async with two_nodes(tmp_path) as (cluster, group):
        head, rank = group.nodes
        doc = await group.wait(ready, within=30, what="the group ready")
        for step in ("restart", "remove"):
            epoch, head_pid = doc["epoch"], doc["ranks"][0]["pid"]
            chunks: list[bytes] = []
            streaming = trio.Event()

            async def stream(chunks: list[bytes] = chunks,
                             streaming: trio.Event = streaming) -> None:
                body = {"model": "big-model", "max_tokens": 40, "stream": True,
                        "messages": [{"role": "user", "content": "hi"}]}
                async with cluster.client.stream("POST", head.url + "/v1/chat/completions",
                                                 json=body, timeout=30) as r:
                    assert r.status_code == 200
                    async for chunk in r.aiter_bytes():
                        chunks.append(chunk)
                        streaming.set()

            async with trio.open_nursery() as n:
                n.start_soon(stream)
                await streaming.wait()
                if step == "restart":
                    group.write(args="load_s = 0.2")
                    assert (await reload(cluster, head))["restart"] == {"g": ["args"]}
                else:
                    group.write(group=False)
                    assert (await reload(cluster, head))["removed"] == {"g": []}
                engines = await cluster.json(head, "/v1/engines")
                assert [e["admitting"] for e in engines["engines"]] == [False], engines
                mid = await group.doc()  # the stream runs: its epoch and process too
                assert (mid["epoch"], mid["ranks"][0]["pid"]) == (epoch, head_pid), mid
            body = b"".join(chunks)
            assert body.rstrip().endswith(b"data: [DONE]"), body[-200:]
            assert body.count(b'"content"') >= 40, body  # every token: not cut
            if step == "restart":
                assert (await reload(cluster, rank))["restart"] == {"g": ["args"]}
                doc = await group.wait(lambda d, epoch=epoch: ready(d) and d["epoch"] > epoch,
                                       within=30, what="the new epoch ready")
                assert doc["ranks"][0]["pid"] != head_pid
        await until(lambda: head_pid not in group_processes(), 15)
        await cluster.wait(head, "/v1/engines", lambda d: d["engines"] == [], within=10,
                           what="the head's engine gone")
