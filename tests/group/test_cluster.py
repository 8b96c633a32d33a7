"""Groups across real nvpair processes on loopback (one address per node), with simulated
SGLang ranks: ready only after the last rank, a rank killed -9, a rank that fails at start,
a rank's nvpair killed and started again, and nothing left after SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import trio
from tests.group.nodes import (
    Group,
    group_processes,
    rpc_manifest,
    sim_manifest,
    start_time,
    vllm_manifest,
)
from tests.peers.cluster import Cluster, open_cluster


def rank_states(doc: dict[str, Any]) -> list[str]:
    return [r["state"] for r in doc["ranks"]]


async def gone(present: Any, within: float) -> None:
    """Poll /proc (no event crosses processes) until ``present()`` is false."""
    with trio.fail_after(within):
        while True:
            if not present():
                return
            await trio.sleep(0.05)


def ready(doc: dict[str, Any]) -> bool:
    return bool(doc.get("state") == "ready")


@asynccontextmanager
async def group_cluster(tmp_path: Path, ranks: int = 3, *, manifest: Path | None = None,
                        group_extra: str = "") -> AsyncIterator[tuple[Cluster, Group]]:
    """A cluster on loopback and its group "g" of ``ranks`` nodes, not started yet;
    ``manifest``: the ranks' engines (default: simulated SGLang, ``sim_manifest``)."""
    if manifest is None:
        manifest = sim_manifest(tmp_path / "sim.json")
    async with open_cluster(tmp_path) as cluster:
        yield cluster, Group(cluster, tmp_path, ranks, manifest=manifest,
                             group_extra=group_extra)


@asynccontextmanager
async def ready_group(tmp_path: Path, ranks: int = 3, *, manifest: Path | None = None,
                      group_extra: str = "", within_s: float = 60.0,
                      what: str = "the group ready"
                      ) -> AsyncIterator[tuple[Cluster, Group, dict[str, Any]]]:
    """``group_cluster``'s nodes all started, and the group's document once it is ready
    (within 30 s); the block runs under a ``within_s`` ceiling, the start included."""
    async with group_cluster(tmp_path, ranks, manifest=manifest,
                             group_extra=group_extra) as (cluster, group):
            with trio.fail_after(within_s):
                await cluster.start(*group.nodes)
                yield cluster, group, await group.wait(ready, within=30, what=what)


async def test_ready_after_the_last_rank_and_a_killed_rank_restarts_the_group(
        tmp_path: Path) -> None:
    async with ready_group(tmp_path) as (cluster, group, doc):
        assert doc["ranks_ready"] == 2 and rank_states(doc)[1:] == ["ready", "ready"]
        epoch = doc["epoch"]
        first = [e for e in doc["history"] if e["epoch"] == epoch]
        assert first and first[0]["ended_at"] is None
        procs = group_processes()
        assert set(procs.values()) == {epoch}, procs
        rank_pid = doc["ranks"][2]["pid"]
        assert rank_pid in procs
        # each process's memory (anonymous + swap, coarse; read every 5 s): a few MB
        doc = await group.wait(lambda d: all(
            isinstance(r["memory_bytes"], int) and 1 << 20 <= r["memory_bytes"] < 1 << 30
            for r in d["ranks"]), within=7, what="every process's memory")
        # kill -9 the process of rank 2: the head sees the group down within 1 s
        os.kill(rank_pid, signal.SIGKILL)
        killed_at = trio.current_time()
        doc = await group.wait(lambda d: d["state"] in ("down", "restarting", "forming")
                               and d["epoch"] > epoch, within=5, what="the group down")
        seen_down = trio.current_time() - killed_at
        assert seen_down < 1.0, seen_down
        old = next(e for e in doc["history"] if e["epoch"] == epoch)
        assert old["reason"] == "rank 2 (n2) was killed by SIGKILL", old
        # every process of the old epoch is gone within 6 s
        await gone(lambda: any(e == epoch for e in group_processes().values()), 6)
        gone_after = trio.current_time() - killed_at
        doc = await group.wait(ready, within=30, what="a new epoch ready")
        assert doc["epoch"] > epoch and doc["restarts"] == 1
        print(f"rank kill -9 -> down {seen_down * 1000:.0f} ms; old epoch gone "
              f"{gone_after:.2f} s")
        # only the head lists the group's models, with the group
        models = await cluster.json(group.head, "/v1/models")
        assert [m["nvpair"]["group"] for m in models["data"]] == [
            {"name": "g", "epoch": doc["epoch"], "ranks_ready": 2, "ranks": 2}]
        for node in group.nodes[1:]:
            assert (await cluster.json(node, "/v1/models"))["data"] == []
            assert (await cluster.json(node, "/v1/engines"))["engines"] == []
        # the router sends to the head while the group is ready
        r = await cluster.client.post(group.head.url + "/v1/chat/completions", json={
            "model": "big-model", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2})
        assert r.status_code == 200, r.text
        # the ranks' own view: the head's epoch and state
        rank_doc = await group.doc(group.nodes[1])
        assert rank_doc["role"] == "rank" and rank_doc["epoch"] == doc["epoch"]
        # nvpair groups, on a rank: the head's word and this rank's own process
        out = await trio.run_process(
            [sys.executable, "-m", "nvpair", "groups", "--url", group.nodes[2].url],
            capture_stdout=True, capture_stderr=True, env={**os.environ, "NO_COLOR": "1"})
        text = out.stdout.decode()
        assert f"group g: ready, epoch {doc['epoch']}, 2/2 ranks ready" in text, text
        assert "(this node: n2, rank 2)" in text and "n2" in text
        # nvpair status: the head's engine, and a groups table on every member
        for node, role, rank in ((group.head, "head", 0), (group.nodes[1], "rank", 1)):
            out = await trio.run_process(
                [sys.executable, "-m", "nvpair", "status", "--url", node.url],
                capture_stdout=True, capture_stderr=True,
                env={**os.environ, "NO_COLOR": "1"})
            lines = out.stdout.decode().splitlines()
            assert ("ENGINE" in lines[0]) == (role == "head"), lines
            assert "no engines answer yet" not in lines, lines
            row = next(line.split() for line in lines if line.startswith("g ")
                       and role in line.split())
            assert row[:7] == ["g", role, str(rank), "n0", "ready", str(doc["epoch"]),
                               "2/2"], lines
        # nvpair status --watch on a rank: its first drawing has the groups table too
        watch = await trio.lowlevel.open_process(
            [sys.executable, "-m", "nvpair", "status", "--watch", "--url",
             group.nodes[1].url], stdout=subprocess.PIPE,
            env={**os.environ, "NO_COLOR": "1"})
        try:
            assert watch.stdout is not None
            drawn = b""
            with trio.fail_after(10):
                while b"\n\n" not in drawn:
                    drawn += await watch.stdout.receive_some(4096) or b"\n\n"
            lines = drawn.decode().splitlines()
            assert "no engines answer yet" not in lines, lines
            assert any(line.split()[:5] == ["g", "rank", "1", "n0", "ready"]
                       for line in lines if line.strip()), lines
        finally:
            watch.kill()
            with trio.move_on_after(5, shield=True):
                await watch.wait()
        out = await trio.run_process(
            [sys.executable, "-m", "nvpair", "groups", "--url", group.nodes[1].url, "g",
             "restart"], capture_stdout=True, capture_stderr=True)
        assert out.stdout.decode().strip() == "g: restart accepted by n0"
        doc = await group.wait(lambda d: ready(d) and d["epoch"] > rank_doc["epoch"],
                               within=30, what="the restarted group ready")
        assert doc["history"][1]["reason"] == "restart requested"
        # SIGTERM on every node: no process of the group survives
        for node in group.nodes:
            cluster.send_signal(node, signal.SIGTERM)
        for node in group.nodes:
            assert node.proc is not None
            await node.proc.wait()
        assert group_processes() == {}


async def test_a_rank_that_fails_at_start_backs_off_then_fails_with_history(
        tmp_path: Path) -> None:
    manifest = sim_manifest(tmp_path / "sim.json", rank_extra=("--fail-on-load", "3"))
    budget = "max_restarts = {count = 2, per_s = 3600}"
    async with group_cluster(tmp_path, 2, manifest=manifest, group_extra=budget) as (
            cluster, group):
        with trio.fail_after(60):
            await cluster.start(*group.nodes)
            doc = await group.wait(lambda d: d.get("state") == "failed", within=30,
                                   what="the group failed")
            assert doc["restarts"] == 2
            reasons = [e["reason"] for e in doc["history"]]
            assert len(reasons) == 3, doc["history"]
            assert all(r and "rank 1 (n1) exited with code 3" in r for r in reasons), reasons
            assert "2 restarts in the last 3600 s" in doc["error"]
            ends = sorted(e["ended_at"] for e in doc["history"])
            starts = sorted(e["started_at"] for e in doc["history"])
            # the backoff: 0.5 s, then 1 s between an epoch's end and the next one's start
            assert starts[1] - ends[0] >= 0.45 and starts[2] - ends[1] >= 0.95, doc["history"]
            # failed is stopped: no process of the group runs, on any node
            await gone(lambda: group_processes() != {}, 10)
            # a start from a rank is passed on to the head: a new epoch forms
            r = await cluster.client.post(group.nodes[1].url + "/v1/groups/g/start")
            assert r.status_code == 202, r.text
            assert r.json()["node"] == "n0"
            doc = await group.wait(lambda d: d.get("state") != "failed", within=5,
                                   what="the group started again")
            assert doc["epoch"] > doc["history"][1]["epoch"]


async def test_a_ranks_nvpair_killed_and_started_again_stops_its_stale_rank_and_rejoins(
        tmp_path: Path) -> None:
    async with ready_group(tmp_path, within_s=90) as (cluster, group, doc):
        epoch, stale = doc["epoch"], doc["ranks"][2]["pid"]
        await cluster.stop(group.nodes[2], signal.SIGKILL)
        assert stale in group_processes()  # its process outlives its nvpair
        log = group.nodes[2]._log_file
        assert log is not None
        log.close()
        await cluster.start(group.nodes[2])
        await gone(lambda: stale in group_processes(), 10)
        restarted_at = trio.current_time()
        doc = await group.wait(lambda d: ready(d) and d["epoch"] > epoch, within=30,
                               what="a new epoch ready with the restarted node")
        print(f"a rank's nvpair restarted -> the group ready again in "
              f"{trio.current_time() - restarted_at:.2f} s")
        assert doc["ranks"][2]["pid"] != stale
        assert set(group_processes().values()) == {doc["epoch"]}


async def test_a_frozen_rank_node_is_down_within_the_ttl_and_grace(tmp_path: Path) -> None:
    async with ready_group(tmp_path, within_s=90) as (_cluster, group, doc):
        epoch, rank_pid = doc["epoch"], doc["ranks"][2]["pid"]
        frozen = group.nodes[2]
        os.kill(frozen.pid, signal.SIGSTOP)  # the node: its nvpair and its rank
        os.killpg(rank_pid, signal.SIGSTOP)
        stopped_at = trio.current_time()
        try:
            doc = await group.wait(lambda d: d["state"] == "degraded", within=10,
                                   what="the group degraded")
            assert doc["ranks"][2]["state"] == "unknown"
            doc = await group.wait(lambda d: d["epoch"] > epoch, within=10,
                                   what="the group down")
            took = trio.current_time() - stopped_at
            ttl, grace = 3.0, 2.0  # interval_s = 1: ttl 3 x interval; rank_lost_grace_s
            assert took < ttl + grace + 1.0, took
            assert "rank 2 (n2) silent for more than 2 s" in doc["history"][-1]["reason"] \
                or any("silent" in (e["reason"] or "") for e in doc["history"])
            print(f"node frozen -> down {took:.2f} s")
        finally:
            os.killpg(rank_pid, signal.SIGCONT)
            os.kill(frozen.pid, signal.SIGCONT)
        # thawed, it hears the new epoch, stops its old rank and rejoins
        await gone(lambda: rank_pid in group_processes(), 10)
        doc = await group.wait(lambda d: ready(d) and d["epoch"] > epoch, within=30,
                               what="a new epoch ready with the thawed node")


async def test_ranks_fence_themselves_when_the_head_is_gone(tmp_path: Path) -> None:
    async with ready_group(tmp_path, group_extra="fence_after_s = 4",
                           within_s=90) as (_cluster, group, doc):
        ranks = [r["pid"] for r in doc["ranks"][1:]]
        head_pid = doc["ranks"][0]["pid"]
        os.kill(group.head.pid, signal.SIGSTOP)  # the head's nvpair, not its engine
        stopped_at = trio.current_time()
        try:
            await gone(lambda: any(p in group_processes() for p in ranks), 15)
            took = trio.current_time() - stopped_at
            assert 4.0 <= took < 4.0 + 3.0, took
            print(f"head's nvpair frozen -> ranks fenced {took:.2f} s")
            doc = await group.doc(group.nodes[1])
            assert doc["ranks"][1]["state"] == "fenced", doc
            assert "fenced itself" in doc["error"]
            assert head_pid in group_processes()  # the head's engine: its nvpair's to stop
        finally:
            os.kill(group.head.pid, signal.SIGCONT)
        doc = await group.wait(lambda d: ready(d) and d["epoch"] > doc["epoch"],
                               within=30, what="a new epoch ready after the head thawed")


async def test_llamacpp_rpc_ranks_first_never_probed_and_the_head_restarts_alone(
        tmp_path: Path) -> None:
    counts = tmp_path / "counts"
    counts.mkdir()
    manifest = rpc_manifest(tmp_path / "rpc.json", counts)
    async with ready_group(tmp_path, manifest=manifest, group_extra='restart = "head"',
                           what="the RPC group ready") as (_cluster, group, doc):
        # the head started after both rpc-servers listened (else it exits 1: a restart)
        assert doc["restarts"] == 0 and len(doc["history"]) == 1, doc
        # each rpc-server was connected to once: by the head, never by a probe
        assert [(counts / f"rank{r}.count").read_text() for r in (1, 2)] == ["1\n"] * 2
        epoch = doc["epoch"]
        rank_pids = [r["pid"] for r in doc["ranks"][1:]]
        # the head dies (llama.cpp aborts): it restarts alone, its ranks stay up
        os.kill(doc["ranks"][0]["pid"], signal.SIGKILL)
        doc = await group.wait(lambda d: d["state"] == "restarting", within=5,
                               what="the head restarting")
        assert doc["epoch"] == epoch
        doc = await group.wait(ready, within=30, what="the RPC group ready again")
        assert doc["epoch"] == epoch and doc["restarts"] == 1
        assert [r["pid"] for r in doc["ranks"][1:]] == rank_pids
        assert [(counts / f"rank{r}.count").read_text() for r in (1, 2)] == ["2\n"] * 2


async def test_forming_waits_for_the_last_rank_and_reads_stay_fast(tmp_path: Path) -> None:
    async with group_cluster(tmp_path) as (cluster, group):
        late = group.nodes[2]
        with trio.fail_after(60):
            await cluster.start(*group.nodes[:2])
            doc = await group.wait(lambda d: d["ranks"][1]["state"] == "ready", within=30,
                                   what="rank 1 ready")
            assert doc["state"] == "forming" and doc["ranks_ready"] == 1
            assert doc["ranks"][2]["state"] == "unknown"
            engines = await cluster.json(group.head, "/v1/engines/g")
            assert engines["admitting"] is False  # the router sends the head nothing yet
            assert engines["group"] == {"name": "g", "role": "head", "rank": 0,
                                        "epoch": doc["epoch"], "ranks_ready": 1, "ranks": 2}
            # a forming group's head is not listed as serving, here or on its peers
            assert (await cluster.json(group.head, "/v1/models"))["data"] == []
            assert (await cluster.json(group.nodes[1], "/v1/models?scope=cluster"))[
                "data"] == []
            slowest = 0.0
            await cluster.start(late)
            with trio.fail_after(30):
                while True:  # every node's reads, while the last rank joins
                    for node in group.nodes:
                        t0 = trio.current_time()
                        doc = await cluster.json(node, "/v1/groups/g")
                        await cluster.json(node, "/healthz")
                        slowest = max(slowest, trio.current_time() - t0)
                    if ready(await group.doc()):
                        break
                    await trio.sleep(0.05)
            assert slowest < 0.2, slowest
            engines = await cluster.json(group.head, "/v1/engines/g")
            assert engines["admitting"] is True
            models = await cluster.json(group.head, "/v1/models")
            assert [m["id"] for m in models["data"]] == ["big-model"]
            print(f"slowest read while forming: {slowest * 1000:.0f} ms")


async def test_vllm_headless_ranks_start_after_the_head(tmp_path: Path) -> None:
    manifest = vllm_manifest(tmp_path / "vllm.json")
    async with ready_group(tmp_path, manifest=manifest,
                           what="the vLLM group ready") as (_cluster, group, doc):
        head, *ranks = [r["pid"] for r in doc["ranks"]]
        assert all(start_time(head) <= start_time(pid) for pid in ranks)
        os.kill(ranks[0], signal.SIGKILL)
        doc = await group.wait(lambda d: ready(d) and d["restarts"] == 1, within=30,
                               what="a new epoch ready")
        assert doc["history"][1]["reason"] == "rank 1 (n1) was killed by SIGKILL"


async def test_the_heads_nvpair_restarted_moves_the_epoch_on_and_its_leave_stops_ranks(
        tmp_path: Path) -> None:
    async with ready_group(tmp_path, within_s=90) as (cluster, group, doc):
        epoch, old = doc["epoch"], set(group_processes())
        await cluster.stop(group.head, signal.SIGKILL)
        log = group.head._log_file
        assert log is not None
        log.close()
        await cluster.start(group.head)
        doc = await group.wait(lambda d: ready(d) and d["epoch"] > epoch, within=30,
                               what="a new epoch ready after the head's nvpair restart")
        assert doc["epoch"] == epoch + 1  # kept in the state dir, one past it
        assert not old & set(group_processes())  # every process of the old boot gone
        # the head's nvpair stops (SIGTERM): it leaves, and its ranks stop at once
        ranks = [r["pid"] for r in doc["ranks"][1:]]
        left_at = trio.current_time()
        await cluster.stop(group.head)
        await gone(lambda: any(p in group_processes() for p in ranks), 5)
        print(f"the head left -> ranks stopped {trio.current_time() - left_at:.2f} s")
        # (its process reaped, the rank's node publishes it stopped a moment later)
        rank_doc = await group.wait(lambda d: d["ranks"][1]["state"] != "stopping",
                                    within=2, what="rank 1 stopped", node=group.nodes[1])
        assert rank_doc["ranks"][1]["state"] == "stopped" and rank_doc["error"] is None


async def test_a_rank_whose_nvpair_stops_ends_the_epoch_at_once(tmp_path: Path) -> None:
    async with ready_group(tmp_path) as (cluster, group, doc):
        epoch = doc["epoch"]
        stopped_at = trio.current_time()
        rank = group.nodes[2]
        assert rank.proc is not None
        cluster.send_signal(rank, signal.SIGTERM)  # it leaves the cluster at once
        doc = await group.wait(lambda d: d["epoch"] > epoch, within=5,
                               what="the epoch over")
        took = trio.current_time() - stopped_at
        await rank.proc.wait()  # (its exit, after its engines stop, is not timed here)
        assert took < 2.0, took  # not the grace after a ttl
        old = next(e for e in doc["history"] if e["epoch"] == epoch)
        assert old["reason"] == f"rank 2 (n2) left (its nvpair stopped) (epoch {epoch})"
        print(f"a rank's nvpair stopped -> the epoch over {took:.2f} s")
