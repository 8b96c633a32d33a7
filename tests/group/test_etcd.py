"""A group over the etcd backend: the adverts, and the reports in them, go through etcd."""

from __future__ import annotations

import base64
import json
import os
import signal
from pathlib import Path

import httpx2
import pytest
import trio
from tests.group.nodes import Group, group_processes, sim_manifest
from tests.peers.cluster import open_cluster
from tests.peers.etcd_server import ETCD, SKIP_REASON, open_etcd

pytestmark = [
    pytest.mark.skipif(ETCD is None, reason=SKIP_REASON),
    pytest.mark.filterwarnings("ignore:Async generator 'httpx2:ResourceWarning"),
]


async def test_a_group_over_etcd_forms_and_restarts(tmp_path: Path) -> None:
    manifest = sim_manifest(tmp_path / "sim.json")
    with trio.fail_after(90):
        async with open_etcd(tmp_path) as etcd, open_cluster(tmp_path) as cluster:
            group = Group(cluster, tmp_path, 3, manifest=manifest, etcd_url=etcd.url)
            await cluster.start(*group.nodes)
            doc = await group.wait(lambda d: d.get("state") == "ready", within=30,
                                   what="the group ready over etcd")
            epoch, rank_pid = doc["epoch"], doc["ranks"][2]["pid"]
            os.kill(rank_pid, signal.SIGKILL)
            killed_at = trio.current_time()
            doc = await group.wait(lambda d: d["epoch"] > epoch, within=10,
                                   what="the epoch over")
            print(f"over etcd: rank kill -9 -> down {trio.current_time() - killed_at:.2f} s")
            doc = await group.wait(lambda d: d.get("state") == "ready" and d["epoch"] > epoch,
                                   within=30, what="a new epoch ready over etcd")
            assert set(group_processes().values()) == {doc["epoch"]}


async def test_the_head_claims_each_epoch_and_waits_while_another_lease_holds_it(
        tmp_path: Path) -> None:
    manifest = sim_manifest(tmp_path / "sim.json")
    key = base64.b64encode(b"nvpair/test/groups/g").decode()
    with trio.fail_after(90):
        async with open_etcd(tmp_path) as etcd, open_cluster(tmp_path) as cluster, \
                httpx2.AsyncClient(base_url=etcd.url, trust_env=False) as client:
            lease = (await client.post("/v3/lease/grant", json={"TTL": 60})).json()["ID"]
            other = base64.b64encode(b'{"epoch": 99, "node": "impostor"}').decode()
            r = await client.post("/v3/kv/put", json={"key": key, "value": other,
                                                      "lease": lease})
            assert r.status_code == 200, r.text
            group = Group(cluster, tmp_path, 2, manifest=manifest, etcd_url=etcd.url)
            await cluster.start(*group.nodes)
            doc = await group.wait(lambda d: "held by impostor (epoch 99" in (d["error"] or ""),
                                   within=20, what="the claim refused")
            assert doc["state"] == "forming" and group_processes() == {}
            await client.post("/v3/lease/revoke", json={"ID": lease})
            doc = await group.wait(lambda d: d.get("state") == "ready", within=30,
                                   what="the group ready once the key is free")
            r = await client.post("/v3/kv/range", json={"key": key})
            held = json.loads(base64.b64decode(r.json()["kvs"][0]["value"]))
            assert held == {"epoch": doc["epoch"], "node": "n0"}
