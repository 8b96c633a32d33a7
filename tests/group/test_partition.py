"""A partition between the head and a rank at the network layer: the rank in its own
network namespace, an nftables rule there dropping everything it sends to the head's
address (so no TCP exchange gets through either way). The rank fences itself; the head
sees it silent and ends the epoch; once healed, the group forms again.

Needs root, iproute2 and nftables; skipped otherwise.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import trio
from tests.group.nodes import Group, group_processes, sim_manifest
from tests.peers.cluster import USER_TOKEN, open_cluster
from tests.peers.test_partition import namespace, sh, unblock

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("nft") is None,
    reason="needs root, iproute2 and nftables for a network namespace")


async def read_inside(ns: str, url: str) -> Any:
    """GET ``url`` from inside ``ns`` (the test's own client is cut off from it too)."""
    code = ("import json, sys, urllib.request; r = urllib.request.Request(sys.argv[1], "
            f"headers={{'authorization': 'Bearer {USER_TOKEN}'}}); "
            "print(urllib.request.urlopen(r, timeout=5).read().decode())")
    out = await trio.run_process(["ip", "netns", "exec", ns, sys.executable, "-c", code, url],
                                 capture_stdout=True)
    return json.loads(out.stdout)


async def cut_off(ns: str, ip: str) -> None:
    """Drop every packet that ``ns`` sends to ``ip``."""
    nft = ["ip", "netns", "exec", ns, "nft"]
    await sh(*nft, "add", "table", "inet", "nvpair_partition")
    await sh(*nft, "add", "chain", "inet", "nvpair_partition", "out",
             "{ type filter hook output priority 0; }")
    await sh(*nft, "add", "rule", "inet", "nvpair_partition", "out", "ip", "daddr", ip, "drop")


async def test_a_rank_cut_off_from_its_head_fences_itself(tmp_path: Path) -> None:
    manifest = sim_manifest(tmp_path / "sim.json")
    with trio.fail_after(90):
        async with namespace() as (ns, root_ip, ns_ip), open_cluster(tmp_path) as cluster:
            group = Group(cluster, tmp_path, 2, manifest=manifest,
                          group_extra="fence_after_s = 4", hosts=[(root_ip, None), (ns_ip, ns)])
            await cluster.start(*group.nodes)
            doc = await group.wait(lambda d: d.get("state") == "ready", within=30,
                                   what="the group ready")
            epoch, rank_pid = doc["epoch"], doc["ranks"][1]["pid"]
            await cut_off(ns, root_ip)
            cut_at = trio.current_time()
            try:
                with trio.fail_after(15):
                    while True:
                        if rank_pid not in group_processes():
                            break
                        await trio.sleep(0.05)
                fenced_after = trio.current_time() - cut_at
                rank_doc = await read_inside(ns, group.nodes[1].url + "/v1/groups/g")
                assert rank_doc["ranks"][1]["state"] == "fenced", rank_doc
                doc = await group.wait(lambda d: d["epoch"] > epoch, within=10,
                                       what="the head ends the epoch")
                assert "rank 1 (n1) silent" in doc["history"][0]["reason"] or any(
                    "rank 1 (n1) silent" in (e["reason"] or "") for e in doc["history"])
                print(f"partition -> rank fenced {fenced_after:.2f} s")
                assert 4.0 <= fenced_after < 4.0 + 2.0 + 1.5, fenced_after
            finally:
                with trio.move_on_after(10, shield=True):
                    await unblock(ns)
            doc = await group.wait(lambda d: d.get("state") == "ready" and d["epoch"] > epoch,
                                   within=40, what="the group ready again, healed")
