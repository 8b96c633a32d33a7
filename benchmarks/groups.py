"""Multi-node groups: the failure timings of docs/groups.md, measured (issue 17).

``python -m benchmarks.groups [--quick]``

Three real nvpair processes on one machine, each on its own loopback address
(127.0.0.1-3), one group ``g`` over them with simulated SGLang processes (the tests'
manifest, tests/group/nodes.py: ranks that ignore SIGTERM, a head that hangs when a rank
is lost, as SGLang's do); peers push every 1 s (ttl 3 s), ``rank_lost_grace_s = 2``,
``fence_after_s = 4``, a rank's stop grace 2 s. Each run, in turn, waiting for the group
``ready`` again after each:

* **rank kill -9**: a rank's process SIGKILLed; until the head's ``/v1/groups/g`` shows a
  later epoch (down), until no process of the old epoch is left (``/proc``: every process
  with that ``NVPAIR_GROUP_EPOCH``), until ready again;
* **rank frozen**: SIGSTOP of a rank node's nvpair and its process; until down (expected:
  ttl + grace);
* **rank nvpair restart**: a rank's nvpair SIGKILLed and started again; until its stale
  process is gone, until the group is ready in a new epoch;
* **head frozen**: SIGSTOP of the head's nvpair; until its ranks have fenced themselves
  (their processes gone; expected: ``fence_after_s`` + the stop grace);
* **partition** (root, iproute2 and nftables only, else left out): a two-node group with
  the rank in its own network namespace, nftables there dropping all it sends to the
  head; until the rank's process is gone (fenced).

Every time is from the fault to the first poll (every 50 ms) that sees its effect, so it
is late by up to one poll. Writes ``benchmarks/results/groups.json``
(``groups-quick.json`` with ``--quick``: one run; full: three).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio
from tests.group.nodes import Group, group_processes, sim_manifest
from tests.peers.cluster import open_cluster

from benchmarks.procs import machine

RESULTS = Path(__file__).resolve().parent / "results"
FENCE_S = 4.0
TTL_S, GRACE_S, STOP_GRACE_S = 3.0, 2.0, 2.0
EXTRA = f"fence_after_s = {FENCE_S:g}"


def ready(doc: dict[str, Any]) -> bool:
    return bool(doc.get("state") == "ready")


async def until(present: Callable[[], bool], within: float) -> None:
    """Poll ``/proc`` (no event crosses processes) until ``present()`` is false."""
    with trio.fail_after(within):
        while True:
            if not present():
                return
            await trio.sleep(0.05)


async def each_gone(pids: set[int], t0: float, within: float) -> dict[int, float]:
    """When each of ``pids`` left ``/proc``'s group processes, in seconds since ``t0``."""
    out: dict[int, float] = {}
    with trio.fail_after(within):
        while len(out) < len(pids):
            live = group_processes()
            for p in pids - set(out) - set(live):
                out[p] = round(trio.current_time() - t0, 3)
            await trio.sleep(0.05)
    return out


async def since(t0: float) -> float:
    return round(trio.current_time() - t0, 3)


async def ready_again(group: Group, epoch: int, within: float = 40) -> dict[str, Any]:
    doc: dict[str, Any] = await group.wait(lambda d: ready(d) and d["epoch"] > epoch,
                                           within=within, what="a new epoch ready")
    return doc


async def one_run(tmp: Path) -> dict[str, float]:
    out: dict[str, float] = {}
    manifest = sim_manifest(tmp / "sim.json")
    async with open_cluster(tmp) as cluster:
        group = Group(cluster, tmp, 3, manifest=manifest, group_extra=EXTRA)
        t0 = trio.current_time()
        await cluster.start(*group.nodes)
        doc = await group.wait(ready, within=60, what="the group ready")
        out["start_to_ready_s"] = await since(t0)

        # a rank's process killed -9
        epoch, pid = doc["epoch"], doc["ranks"][2]["pid"]
        os.kill(pid, signal.SIGKILL)
        t0 = trio.current_time()
        await group.wait(lambda d: d["epoch"] > epoch, within=10, what="the group down")
        out["rank_kill_to_down_s"] = await since(t0)
        roles = {r["pid"]: r["rank"] for r in doc["ranks"]}
        gone_at = await each_gone(set(roles) - {pid}, t0, 15)
        await until(lambda: epoch in group_processes().values(), 15)
        out["rank_kill_to_old_epoch_gone_s"] = await since(t0)
        for p, at in gone_at.items():  # which process took longest: rank 0 (the head) or 1
            out[f"rank_kill_to_rank{roles[p]}_gone_s"] = at
        doc = await ready_again(group, epoch)
        out["rank_kill_to_ready_again_s"] = await since(t0)

        # a rank's node frozen: its nvpair and its process
        epoch, pid, frozen = doc["epoch"], doc["ranks"][2]["pid"], group.nodes[2]
        os.kill(frozen.pid, signal.SIGSTOP)
        os.killpg(pid, signal.SIGSTOP)
        t0 = trio.current_time()
        try:
            await group.wait(lambda d: d["epoch"] > epoch, within=20, what="the group down")
            out["rank_frozen_to_down_s"] = await since(t0)
        finally:
            os.killpg(pid, signal.SIGCONT)
            os.kill(frozen.pid, signal.SIGCONT)
        doc = await ready_again(group, epoch)

        # a rank's nvpair SIGKILLed and started again
        epoch, stale, node = doc["epoch"], doc["ranks"][1]["pid"], group.nodes[1]
        await cluster.stop(node, signal.SIGKILL)
        if node._log_file is not None:
            node._log_file.close()
        t0 = trio.current_time()
        await cluster.start(node)
        out["rank_nvpair_restart_to_answering_s"] = await since(t0)
        await until(lambda: stale in group_processes(), 15)
        out["rank_nvpair_restart_to_stale_gone_s"] = await since(t0)
        doc = await ready_again(group, epoch)
        out["rank_nvpair_restart_to_ready_again_s"] = await since(t0)

        # the head's nvpair frozen: its ranks fence themselves
        epoch, ranks = doc["epoch"], [r["pid"] for r in doc["ranks"][1:]]
        os.kill(group.head.pid, signal.SIGSTOP)
        t0 = trio.current_time()
        try:
            await until(lambda: any(p in group_processes() for p in ranks), 20)
            out["head_frozen_to_ranks_fenced_s"] = await since(t0)
        finally:
            os.kill(group.head.pid, signal.SIGCONT)
        await ready_again(group, epoch)
    return out


async def partition_run(tmp: Path) -> dict[str, float]:
    from tests.group.test_partition import cut_off
    from tests.peers.test_partition import namespace, unblock

    await trio.Path(tmp).mkdir(exist_ok=True)
    manifest = sim_manifest(tmp / "sim.json")
    async with namespace() as (ns, root_ip, ns_ip), open_cluster(tmp) as cluster:
        group = Group(cluster, tmp, 2, manifest=manifest, group_extra=EXTRA,
                      hosts=[(root_ip, None), (ns_ip, ns)])
        await cluster.start(*group.nodes)
        doc = await group.wait(ready, within=60, what="the group ready")
        epoch, pid = doc["epoch"], doc["ranks"][1]["pid"]
        await cut_off(ns, root_ip)
        t0 = trio.current_time()
        out: dict[str, float] = {}
        try:
            await until(lambda: pid in group_processes(), 20)
            out["partition_to_rank_fenced_s"] = await since(t0)
            await group.wait(lambda d: d["epoch"] > epoch, within=15, what="the epoch over")
            out["partition_to_down_at_head_s"] = await since(t0)
        finally:
            with trio.move_on_after(10, shield=True):
                await unblock(ns)
        return out


def can_partition() -> bool:
    return os.geteuid() == 0 and shutil.which("ip") is not None \
        and shutil.which("nft") is not None


async def run(quick: bool) -> dict[str, Any]:
    runs = 1 if quick else 3
    samples: dict[str, list[float]] = {}
    for i in range(runs):
        with tempfile.TemporaryDirectory(prefix=f"nvpair-bench-groups-{i}-") as tmp:
            with trio.fail_after(240):
                got = await one_run(Path(tmp))
            if can_partition():
                with trio.fail_after(120):
                    got |= await partition_run(Path(tmp) / "partition")
        for key, value in got.items():
            samples.setdefault(key, []).append(value)
        print(f"run {i + 1}/{runs}: {json.dumps(got)}", flush=True)
    timings: dict[str, dict[str, Any]] = {key: {"median": round(statistics.median(values), 3),
                     "min": min(values), "max": max(values), "runs": values}
               for key, values in samples.items()}

    def med(key: str) -> float:
        return float(timings[key]["median"]) if key in timings else float("nan")

    targets = {
        "rank kill -9 -> down within 1 s": med("rank_kill_to_down_s") < 1.0,
        "old-epoch processes gone within 6 s": med("rank_kill_to_old_epoch_gone_s") < 6.0,
        "rank frozen -> down within ttl + grace + 1 s":
            med("rank_frozen_to_down_s") < TTL_S + GRACE_S + 1.0,
        "head frozen -> ranks fenced within fence_after_s + stop grace + 1 s":
            med("head_frozen_to_ranks_fenced_s") < FENCE_S + STOP_GRACE_S + 1.0,
    }
    if "partition_to_rank_fenced_s" in timings:
        targets["partition -> rank fenced within fence_after_s + stop grace + 1.5 s"] = \
            med("partition_to_rank_fenced_s") < FENCE_S + STOP_GRACE_S + 1.5
    return {"machine": machine(), "quick": quick, "runs": runs,
            "setup": {"nodes": 3, "push_interval_s": 1, "ttl_s": TTL_S,
                      "rank_lost_grace_s": GRACE_S, "fence_after_s": FENCE_S,
                      "rank_stop_grace_s": STOP_GRACE_S,
                      "partition": "measured" if can_partition() else
                      "left out (needs root, iproute2 and nftables)"},
            "timings": timings, "targets": targets}


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one run instead of three")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="nvpair-bench-groups-state-") as state:
        # the nodes and their processes inherit it: the group's processes are told from
        # others' by it (tests/group/nodes.py's group_processes), and no state is shared
        os.environ["XDG_STATE_HOME"] = state
        result = trio.run(run, args.quick)
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / ("groups-quick.json" if args.quick else "groups.json")
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{'timing':<42} {'median':>8} {'min':>8} {'max':>8}")
    for key, t in result["timings"].items():
        print(f"{key:<42} {t['median']:>8.3f} {t['min']:>8.3f} {t['max']:>8.3f}")
    for target, met in result["targets"].items():
        print(f"{target}: {'met' if met else 'NOT met'}")
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
