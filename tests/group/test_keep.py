"""A group's rank with ``on_exit = "keep"``: its process outlives its nvpair (SIGTERM,
SIGKILL) and the next nvpair adopts it while the head still has its epoch, with no group
restart; a head that moved on meanwhile gets a new rank process; ``nvpair stop-engines``
leaves no rank process, its nvpair running or not.

Two real nvpair nodes on loopback (tests/group/nodes.py), simulated SGLang roles. The
rank's grace (``rank_lost_grace_s``) is 30 s, well above an nvpair restart here (2-4 s):
the head waits that long for a silent rank before it ends the epoch.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import trio
from tests.group.nodes import Group, group_processes, rpc_manifest, sim_manifest
from tests.managed import alive
from tests.peers.cluster import Cluster, Node, open_cluster

GRACE_S = 30


def ready(doc: dict[str, Any]) -> bool:
    return bool(doc.get("state") == "ready")


def rank_pids() -> list[int]:
    """The group's rank processes running now, by /proc: a simulated SGLang's with
    ``--node-rank 1``, or an rpc-server's counting into ``rank1.count``."""
    out = []
    for pid in group_processes():
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if (b"--node-rank" in argv and argv[argv.index(b"--node-rank") + 1] == b"1") or any(
                a.endswith(b"/rank1.count") for a in argv):
            out.append(pid)
    return out


async def gone(pid: int, within: float) -> None:
    """Poll /proc (no event crosses processes) until ``pid`` has ended."""
    with trio.fail_after(within):
        while True:
            if not alive(pid):
                return
            await trio.sleep(0.05)


@asynccontextmanager
async def kept_group(tmp_path: Path, manifest: Path | None = None
                     ) -> AsyncIterator[tuple[Cluster, Group, dict[str, Any]]]:
    """A ready group of a head and one rank whose config keeps its engines (the top-level
    on_exit, which a group's engine now takes); ``manifest``: simulated SGLang's."""
    async with open_cluster(tmp_path) as cluster:
        group = Group(cluster, tmp_path, 2,
                      manifest=manifest or sim_manifest(tmp_path / "sim.json"),
                      grace_s=GRACE_S, top={1: "on_exit = 'keep'"})
        with trio.fail_after(120):
            await cluster.start(*group.nodes)
            yield cluster, group, await group.wait(ready, within=30, what="the group ready")


async def restart_node(cluster: Cluster, node: Node) -> None:
    assert node._log_file is not None
    node._log_file.close()
    await cluster.start(node)


def stop_engines(node: Node, *url: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "nvpair", "stop-engines", "--config",
                           str(node.config), *url], capture_output=True, text=True,
                          timeout=60, check=False)


async def test_a_kept_rank_is_adopted_after_sigterm_and_sigkill_without_a_group_restart(
        tmp_path: Path) -> None:
    async with kept_group(tmp_path) as (cluster, group, doc):
        epoch, head_pid, rank_pid = doc["epoch"], doc["ranks"][0]["pid"], doc["ranks"][1]["pid"]
        rank = group.nodes[1]
        for how in (signal.SIGTERM, signal.SIGKILL):
            code = await cluster.stop(rank, how)
            if how == signal.SIGTERM:
                assert code == 0
                said = rank.log.read_text()
                assert "leaving 1 engine(s) running (on_exit = keep)" in said, said[-3000:]
                assert f"g (pid {rank_pid})" in said
            # its nvpair is down: the rank's process runs on; the head waits its grace
            assert rank_pid in group_processes()
            down = await group.wait(lambda d: d["ranks"][1]["state"] == "unknown",
                                    within=10, what="the rank unknown to the head")
            assert down["epoch"] == epoch and down["state"] in ("ready", "degraded"), down
            restarted_at = trio.current_time()
            await restart_node(cluster, rank)
            doc = await group.wait(lambda d: ready(d) and d["ranks"][1]["state"] == "ready"
                                   and d["ranks"][1]["pid"] is not None, within=20,
                                   what="the group ready with the adopted rank")
            took = trio.current_time() - restarted_at
            # the same processes, the same epoch: no group restart
            assert (doc["epoch"], doc["ranks"][0]["pid"], doc["ranks"][1]["pid"]) == (
                epoch, head_pid, rank_pid), doc
            assert doc["restarts"] == 0 and len(doc["history"]) == 1, doc
            own = await group.wait(lambda d: d["epoch"] is not None, within=10,
                                   what="the rank's view", node=rank)
            assert own["epoch"] == epoch and own["ranks"][1]["pid"] == rank_pid, own
            print(f"{signal.Signals(how).name}: the rank's nvpair spawned again -> the "
                  f"group ready again with the kept rank in {took:.2f} s")
        log = (rank.dir / "logs" / f"g.e{epoch}.log").read_text()
        assert log.count(": starting: ") == 1, log  # one start in three nvpairs
        assert log.count(f"adopted process {rank_pid}") == 2, log
        # stop-engines with the rank's nvpair running: through its API, held on this node
        done = await trio.to_thread.run_sync(stop_engines, rank, "--url", rank.url)
        assert done.returncode == 0, done
        assert "stopped 1 engine(s): g" in done.stdout, done
        assert not alive(rank_pid) and rank_pids() == []
        own = await group.doc(rank)
        assert own["ranks"][1]["pid"] is None, own
        # and it stays stopped while its nvpair runs (the head's next epoch gets no rank)
        await group.wait(lambda d: d["epoch"] > epoch, within=10, what="the epoch ended")
        assert rank_pids() == []


async def test_a_kept_rank_of_an_epoch_the_head_ended_is_replaced(tmp_path: Path) -> None:
    """llama.cpp RPC stand-ins: an rpc-server outlives its head's process (a simulated
    SGLang rank exits once its head's process goes, as SGLang's does, so it would not
    be there to adopt after the group restarted)."""
    counts = tmp_path / "counts"
    counts.mkdir()
    manifest = rpc_manifest(tmp_path / "rpc.json", counts, listen_after_s=0.3)
    async with kept_group(tmp_path, manifest) as (cluster, group, doc):
        epoch, rank_pid = doc["epoch"], doc["ranks"][1]["pid"]
        rank = group.nodes[1]
        await cluster.stop(rank, signal.SIGKILL)
        assert rank_pid in group_processes()
        r = await cluster.client.post(group.head.url + "/v1/groups/g/restart")
        assert r.status_code == 202, r.text
        await group.wait(lambda d: d["epoch"] > epoch, within=10, what="a new epoch")
        assert alive(rank_pid)  # (its nvpair is down: no one stops it yet)
        await restart_node(cluster, rank)
        # the adopted process of the old epoch is stopped, a new one runs the new epoch
        await gone(rank_pid, 15)
        doc = await group.wait(lambda d: ready(d) and d["epoch"] > epoch, within=45,
                               what="the new epoch ready with a new rank process")
        new_pid = doc["ranks"][1]["pid"]
        assert new_pid != rank_pid and rank_pids() == [new_pid], (doc, rank_pids())
        assert group_processes()[new_pid] == doc["epoch"]
        log = (rank.dir / "logs" / f"g.e{epoch}.log").read_text()
        assert f"adopted process {rank_pid}" in log, log
        # stop-engines with the rank's nvpair gone: from the record, as an orphan
        await cluster.stop(rank, signal.SIGTERM)
        assert alive(new_pid)
        done = await trio.to_thread.run_sync(stop_engines, rank)
        assert done.returncode == 0, done
        assert "stopped 1 engine(s): g" in done.stdout, done
        assert not alive(new_pid) and rank_pids() == []
        assert not list((rank.dir / "state" / "engines").glob("*.json"))


async def test_the_head_keeps_no_process_and_says_so(tmp_path: Path) -> None:
    """on_exit = keep on the head (its config's): one line at start, and its process still
    stops with nvpair."""
    async with open_cluster(tmp_path) as cluster:
        group = Group(cluster, tmp_path, 2, manifest=sim_manifest(tmp_path / "sim.json"),
                      top={0: "on_exit = 'keep'"})
        with trio.fail_after(90):
            await cluster.start(*group.nodes)
            doc = await group.wait(ready, within=30, what="the group ready")
            head_pid = doc["ranks"][0]["pid"]
            await cluster.stop(group.head, signal.SIGTERM)
            said = group.head.log.read_text()
            assert ("group g: on_exit = keep keeps the ranks' processes; the head's stops "
                    "with nvpair") in said, said[-3000:]
            assert "leaving" not in said
            assert not alive(head_pid)


async def test_stop_engines_on_the_head_node_stops_the_group(tmp_path: Path) -> None:
    """On the head's node, with its nvpair running, ``nvpair stop-engines`` stops the
    group through the head (its process is the group's): the head's and the rank's
    processes end, and the head's record is gone, well within the command's wait."""
    async with open_cluster(tmp_path) as cluster:
        group = Group(cluster, tmp_path, 2, manifest=sim_manifest(tmp_path / "sim.json"))
        with trio.fail_after(90):
            await cluster.start(*group.nodes)
            doc = await group.wait(ready, within=30, what="the group ready")
            head_pid, rank_pid = doc["ranks"][0]["pid"], doc["ranks"][1]["pid"]
            done = await trio.to_thread.run_sync(stop_engines, group.head, "--url",
                                                 group.head.url)
            assert done.returncode == 0, done
            assert "stopped 1 engine(s): g" in done.stdout, done
            assert not alive(head_pid)
            await gone(rank_pid, 15)
            doc = await group.doc(group.head)
            assert doc["state"] == "stopped", doc
