"""The etcd epoch key's claim against etcd's JSON gateway (httpx2.MockTransport stands
for etcd here; tests/group/test_etcd.py runs a real one)."""

from __future__ import annotations

import base64
import json
from typing import Any

import httpx2

from nvpair.config.cluster import EtcdSettings
from nvpair.peers.epochkey import EpochKey, key_for


class Backend:
    def __init__(self, lease: int | None) -> None:
        self.lease = lease
        self.settings = EtcdSettings(url="http://etcd:2379", prefix="nvpair/x/nodes/",
                                     lease_ttl_s=10, debounce_s=5)


def test_the_key_sits_beside_the_nodes() -> None:
    assert key_for("nvpair/default/nodes/", "big") == "nvpair/default/groups/big"
    assert key_for("nodes/", "g") == "groups/g"
    assert key_for("", "g") == "groups/g"


def etcd(answers: list[dict[str, Any]], seen: list[dict[str, Any]]) -> httpx2.MockTransport:
    def handle(request: httpx2.Request) -> httpx2.Response:
        seen.append(json.loads(request.content))
        return httpx2.Response(200, json=answers.pop(0))
    return httpx2.MockTransport(handle)


async def test_an_absent_key_is_claimed_with_the_lease() -> None:
    seen: list[dict[str, Any]] = []
    key = EpochKey(Backend(7), "g", "n0", transport=etcd([{"succeeded": True}], seen))  # type: ignore[arg-type]
    assert await key.claim(12) is None
    put = seen[0]["success"][0]["request_put"]
    assert base64.b64decode(put["key"]) == b"nvpair/x/groups/g" and put["lease"] == "7"
    assert json.loads(base64.b64decode(put["value"])) == {"epoch": 12, "node": "n0"}
    assert seen[0]["compare"][0]["target"] == "CREATE"


async def test_a_key_of_another_lease_is_refused_in_words() -> None:
    held = {"value": base64.b64encode(b'{"epoch": 5, "node": "n9"}').decode(), "lease": "3"}
    refused = {"succeeded": False, "responses": [{"response_range": {"kvs": [held]}}]}
    seen: list[dict[str, Any]] = []
    key = EpochKey(Backend(7), "g", "n0", transport=etcd([refused, refused], seen))  # type: ignore[arg-type]
    why = await key.claim(6)
    assert why == ("nvpair/x/groups/g is held by n9 (epoch 5, lease 3): another head; this "
                   "one starts nothing until that lease is gone")
    assert [s["compare"][0]["target"] for s in seen] == ["CREATE", "LEASE"]


async def test_no_lease_yet_no_claim() -> None:
    key = EpochKey(Backend(None), "g", "n0")  # type: ignore[arg-type]
    assert await key.claim(1) == "this node has no etcd lease yet"
