"""A group over the etcd backend: the adverts, and the reports in them, go through etcd;
the head claims each epoch under one key, and its ranks watch that key."""

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
from tests.group.test_cluster import gone
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


async def held(client: httpx2.AsyncClient, key: str) -> tuple[dict[str, object], str] | None:
    """The epoch key's value and lease (None: absent)."""
    kvs = (await client.post("/v3/kv/range", json={"key": key})).json().get("kvs") or []
    if not kvs:
        return None
    return json.loads(base64.b64decode(kvs[0]["value"])), kvs[0]["lease"]


async def test_ranks_watch_the_epoch_key_fenced_when_its_lease_goes_stopped_by_another(
        tmp_path: Path) -> None:
    manifest = sim_manifest(tmp_path / "sim.json")
    key = base64.b64encode(b"nvpair/test/groups/g").decode()
    with trio.fail_after(120):
        async with open_etcd(tmp_path) as etcd, open_cluster(tmp_path) as cluster, \
                httpx2.AsyncClient(base_url=etcd.url, trust_env=False) as client:
            # fence_after_s 30 (the default): a rank fenced sooner heard it from the key
            group = Group(cluster, tmp_path, 3, manifest=manifest, etcd_url=etcd.url)
            await cluster.start(*group.nodes)
            doc = await group.wait(lambda d: d.get("state") == "ready", within=30,
                                   what="the group ready over etcd")
            claim = await held(client, key)
            assert claim is not None and claim[0] == {"epoch": doc["epoch"], "node": "n0"}
            # the head's lease revoked (as when it expires): the key and its advert go
            ranks = [r["pid"] for r in doc["ranks"][1:]]
            await client.post("/v3/lease/revoke", json={"ID": claim[1]})
            revoked_at = trio.current_time()
            # the rank's stop grace is 2 s; not fence_after_s (30 s) after the advert went
            await gone(lambda: any(p in group_processes() for p in ranks), 6)
            took = trio.current_time() - revoked_at
            print(f"the head's lease revoked -> its ranks fenced {took:.2f} s")
            # the head ended that epoch for its ranks (they stopped: the key was gone)
            doc = await group.wait(lambda d: any(
                e["epoch"] == claim[0]["epoch"] and e["ended_at"] for e in d["history"]),
                within=10, what="the old epoch over")
            old = next(e for e in doc["history"] if e["epoch"] == claim[0]["epoch"])
            assert old["reason"].startswith("rank "), old
            doc = await group.wait(lambda d: d.get("state") == "ready" and d["epoch"] >
                                   claim[0]["epoch"], within=40,
                                   what="a new epoch ready under a new lease")
            # another holder writes the key (as a second head would): the ranks stop
            lease = (await client.post("/v3/lease/grant", json={"TTL": 60})).json()["ID"]
            other = base64.b64encode(b'{"epoch": 99, "node": "impostor"}').decode()
            ranks = [r["pid"] for r in doc["ranks"][1:]]
            await client.post("/v3/kv/put", json={"key": key, "value": other, "lease": lease})
            await gone(lambda: any(p in group_processes() for p in ranks), 6)
            doc = await group.wait(lambda d: "held by impostor" in (d["error"] or ""),
                                   within=15, what="the head refused the next epoch")
            assert doc["state"] != "ready"
            await client.post("/v3/lease/revoke", json={"ID": lease})
            doc = await group.wait(lambda d: d.get("state") == "ready", within=40,
                                   what="ready again once the key is free")
            assert set(group_processes().values()) == {doc["epoch"]}
