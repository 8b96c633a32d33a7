"""POST /v1/peers/adverts over real sockets (nvpair in-process): token, size cap, schema,
and that none of it disturbs the listing. GET /v1/peers."""

from __future__ import annotations

from pathlib import Path

import httpx2
import msgspec
import pytest
import trio

from nvpair import service
from nvpair.config.cluster import PeerTarget
from nvpair.config.settings import load_settings
from nvpair.peers.advert import MAX_ADVERT_BYTES, Advert, AdvertEngine, Advertiser, AdvertModel
from nvpair.peers.push import Pusher
from nvpair.peers.table import Link
from nvpair.state.snapshot import Board, EngineState, Model

CLUSTER = "cluster-secret"
USER = "user-secret"


def advert_body(node: str = "peer", seq: int = 1, *, pad: int = 0, leaving: bool = False,
                boot: str = "b1") -> bytes:
    models = (AdvertModel(id="remote-model", engine="e", engines=("e",), kind="vllm",
                          owned_by="x" * pad),)
    return msgspec.json.encode(Advert(
        node=node, boot_id=boot, seq=seq, ttl_s=15, url="http://10.1.1.1:1", leaving=leaving,
        engines=(AdvertEngine(name="e", kind="vllm", state="ready", models=("remote-model",)),),
        models=() if leaving else models))


@pytest.fixture
async def node(nursery, tmp_path: Path) -> str:
    (tmp_path / "cluster").write_text(CLUSTER)
    (tmp_path / "user").write_text(USER)
    (tmp_path / "nvpair.toml").write_text(
        "listen = '127.0.0.1:0'\nnode = 'me'\ntoken_file = 'user'\n"
        "[cluster]\ntoken_file = 'cluster'\n")
    settings = load_settings(str(tmp_path / "nvpair.toml"))
    with trio.fail_after(10):
        running = await nursery.start(service.run, settings)
    return str(running.url)


def auth(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


async def test_adverts_need_the_cluster_token_and_a_valid_body(node: str) -> None:
    with trio.fail_after(10):
        async with httpx2.AsyncClient(base_url=node, trust_env=False) as client:
            async def post(body: bytes, token: str | None = CLUSTER,
                           **kw: object) -> httpx2.Response:
                headers = auth(token) if token else {}
                return await client.post("/v1/peers/adverts", content=body, headers=headers,
                                         **kw)  # type: ignore[arg-type]

            async def cluster_ids() -> set[str]:
                r = await client.get("/v1/models?scope=cluster", headers=auth(USER))
                assert r.status_code == 200
                return {m["id"] for m in r.json()["data"]}

            assert (await post(advert_body(), token=None)).status_code == 401
            assert (await post(advert_body(), token="wrong")).status_code == 401
            assert (await post(advert_body(), token=USER)).status_code == 401  # not the user's
            r = await post(advert_body(pad=MAX_ADVERT_BYTES))
            assert r.status_code == 413
            chunks = [b'{"node":"peer","pad":"', b"x" * MAX_ADVERT_BYTES, b'"}']

            async def stream() -> object:
                for c in chunks:
                    yield c
            r = await client.post("/v1/peers/adverts", content=stream(),  # no content-length
                                  headers=auth(CLUSTER))
            assert r.status_code == 413
            assert (await post(b"{not json")).status_code == 400
            r = await post(b'{"node": "peer", "seq": -1}')
            assert r.status_code == 400 and "advert" in r.json()["error"]["message"]
            assert (await post(advert_body(node="bad name!"))).status_code == 400
            # the URL requests for its models would go to: http(s)://HOST:PORT only
            r = await post(advert_body().replace(b"http://10.1.1.1:1", b"file:///etc/x"))
            assert r.status_code == 400 and "url" in r.json()["error"]["message"]
            assert (await post(advert_body(node="me"))).status_code == 409
            assert (await client.get("/v1/peers/adverts", headers=auth(CLUSTER))).status_code \
                == 405
            assert await cluster_ids() == set()  # nothing refused was stored

            r = await post(advert_body())
            assert r.status_code == 204 and r.headers["x-nvpair-node"] == "me"
            assert r.headers["x-nvpair-outcome"] == "new"
            assert await cluster_ids() == {"remote-model"}
            assert (await post(advert_body(seq=0))).headers["x-nvpair-outcome"] == "old"

            assert (await client.get("/v1/peers")).status_code == 401  # the user token applies
            doc = (await client.get("/v1/peers", headers=auth(USER))).json()
            assert doc["node"] == "me" and doc["backend"] == "push"
            assert doc["received"] == {"accepted": 2, "rejected": {
                "token": 3, "size": 2, "schema": 4, "self": 1}}
            (peer,) = doc["peers"]
            assert peer["node"] == "peer" and peer["state"] == "fresh" and peer["adverts"] == 1
            assert peer["url"] == "http://10.1.1.1:1" and peer["outbound"] is None

            r = await post(advert_body(seq=2, leaving=True))
            assert r.status_code == 204 and r.headers["x-nvpair-outcome"] == "left"
            assert await cluster_ids() == set()
            assert (await post(advert_body(seq=3))).headers["x-nvpair-outcome"] == "left"
            assert await cluster_ids() == set()


async def test_two_processes_with_one_name_are_told_not_hidden(node: str) -> None:
    """The newest boot of a name wins; the other process's adverts are refused with 409,
    so its sender shows the error (and a leave from a boot never heard retires nothing)."""
    with trio.fail_after(10):
        async with httpx2.AsyncClient(base_url=node, trust_env=False) as client:
            async def post(body: bytes) -> httpx2.Response:
                return await client.post("/v1/peers/adverts", content=body,
                                         headers=auth(CLUSTER))

            assert (await post(advert_body(boot="a1"))).status_code == 204
            r = await post(advert_body(boot="z9", seq=2, leaving=True))  # never heard: ignored
            assert r.status_code == 204 and r.headers["x-nvpair-outcome"] == "ignored"
            assert (await post(advert_body(boot="b2"))).headers["x-nvpair-outcome"] == \
                "restarted"
            r = await post(advert_body(boot="a1", seq=7))
            assert r.status_code == 409 and r.json()["error"]["code"] == "duplicate_node"
            assert "give each its own node name" in r.json()["error"]["message"]
            doc = (await client.get("/v1/peers", headers=auth(USER))).json()
    assert doc["peers"][0]["boot_id"] == "b2" and doc["peers"][0]["state"] == "fresh"



async def test_a_node_with_odd_models_is_heard_with_its_good_ones(node: str) -> None:
    """An engine listing a 600-character id, ``created: true`` and a 600-character owner
    next to good models: the peer (a real node, over HTTP) takes the advert, lists the good
    models and shows how many were left out. Before, it refused the whole advert (400)."""
    odd = (Model(id="x" * 600), Model(id="bool-created", created=True),  # type: ignore[arg-type]
           Model(id="long-owner", owned_by="o" * 600))
    board = Board((EngineState(name="e", kind="vllm", url="http://127.0.0.1:1", managed=False,
                               state="ready", checked_at=trio.current_time(),
                               models=(Model(id="good-1"), *odd, Model(id="good-2"))),))
    advertiser = Advertiser(board, "sender", ttl_s=15, url="http://127.0.0.1:9")
    link = Link(node)
    pusher = Pusher(PeerTarget(url=node, token=CLUSTER), advertiser, link, interval=60,
                    timeout=5)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            await nursery.start(pusher.run)
            assert await pusher.push(advertiser.body), link.last_error
            nursery.cancel_scope.cancel()
        async with httpx2.AsyncClient(base_url=node, trust_env=False) as client:
            r = await client.get("/v1/models?scope=cluster", headers=auth(USER))
            doc = (await client.get("/v1/peers", headers=auth(USER))).json()
    assert {m["id"] for m in r.json()["data"]} == {"good-1", "good-2"}
    (peer,) = doc["peers"]
    assert peer["node"] == "sender" and peer["models_left_out"] == 3
    assert doc["received"]["rejected"] == {}


async def test_the_bearer_schemes_name_is_matched_in_any_case_the_token_exactly(
        node: str) -> None:
    with trio.fail_after(10):
        async with httpx2.AsyncClient(base_url=node, trust_env=False) as client:
            r = await client.post("/v1/peers/adverts", content=advert_body(),
                                  headers={"authorization": f"bearer {CLUSTER}"})
            assert r.status_code == 204, r.text
            r = await client.post("/v1/peers/adverts", content=advert_body(seq=2),
                                  headers={"authorization": f"BEARER {CLUSTER.upper()}"})
            assert r.status_code == 401
            r = await client.post("/v1/peers/adverts", content=advert_body(seq=3),
                                  headers={"authorization": f"Basic {CLUSTER}"})
            assert r.status_code == 401
