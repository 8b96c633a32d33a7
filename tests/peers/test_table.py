"""The peer table's state machine on the receiver's clock (trio's autojump clock), and the
advertiser's sequence rules."""

from __future__ import annotations

import msgspec
import trio

from nvpair.peers.advert import (
    MAX_ADVERT_BYTES,
    Advert,
    AdvertEngine,
    Advertiser,
    AdvertModel,
)
from nvpair.peers.table import FORGET_AFTER_S, Link, PeerTable
from nvpair.router.peering import PeerRoutes
from nvpair.state.snapshot import Board, EngineState, Model, ProbeStats


def advert(node: str = "a", *, boot: str = "b1", seq: int = 1, ttl: float = 3.0,
           models: tuple[str, ...] = ("m",), leaving: bool = False,
           url: str | None = None) -> Advert:
    return Advert(node=node, boot_id=boot, seq=seq, ttl_s=ttl, url=url, leaving=leaving,
                  engines=(AdvertEngine(name="e", kind="vllm", state="ready", models=models),),
                  models=tuple(AdvertModel(id=m, engine="e", engines=("e",), kind="vllm")
                               for m in models))


def now() -> float:
    return trio.current_time()


def listed(table: PeerTable) -> dict[str, dict[str, object]]:
    return {item["id"]: item["nvpair"] for item in table.models(now())}


async def test_silent_peer_goes_stale_then_gone_then_is_forgotten(autojump_clock) -> None:
    table = PeerTable("me")
    assert table.receive(advert(), 200, now()) == "new"
    v = table.version
    await trio.sleep(2.9)
    assert table.states(now()) == {"a": "fresh"}
    assert listed(table)["m"]["stale"] is False and listed(table)["m"]["routable"] is True
    await trio.sleep(0.2)  # 3.1 s > ttl
    assert table.states(now()) == {"a": "stale"}
    item = listed(table)["m"]
    assert item["stale"] is True and item["state"] == "stale" and item["age_s"] == 3.1
    await trio.sleep(2.95)  # 6.05 s > 2 x ttl
    assert table.states(now()) == {"a": "gone"}
    assert listed(table) == {}
    assert table.version > v  # states changed with time: cached listings must go
    assert [p["state"] for p in table.doc(now())["peers"]] == ["gone"]
    await trio.sleep(FORGET_AFTER_S)
    assert table.doc(now())["peers"] == []


async def test_a_fresh_advert_revives_a_stale_peer_and_bumps_the_version(autojump_clock) -> None:
    table = PeerTable("me")
    table.receive(advert(), 200, now())
    await trio.sleep(4)
    v = table.version
    assert table.receive(advert(), 200, now()) == "refreshed"
    assert table.states(now()) == {"a": "fresh"} and table.version > v


async def test_ttl_is_clamped_so_one_advert_cannot_flap_or_pin(autojump_clock) -> None:
    table = PeerTable("me")
    table.receive(advert("short", ttl=0.01), 10, now())
    table.receive(advert("long", ttl=1e9), 10, now())
    await trio.sleep(0.5)
    assert table.states(now()) == {"short": "fresh", "long": "fresh"}
    await trio.sleep(600)
    assert table.states(now()) == {"short": "gone", "long": "gone"}  # 300 s x 2


async def test_newest_advert_wins_by_boot_and_sequence(autojump_clock) -> None:
    table = PeerTable("me")
    table.receive(advert(seq=5, models=("m1",)), 10, now())
    assert table.receive(advert(seq=4, models=("old",)), 10, now()) == "old"
    assert set(listed(table)) == {"m1"}
    v = table.version
    assert table.receive(advert(seq=5, models=("m1",)), 10, now()) == "refreshed"
    assert table.version == v  # same content: the cached listing stays valid
    assert table.receive(advert(seq=6, models=("m2",)), 10, now()) == "updated"
    assert set(listed(table)) == {"m2"} and table.version > v
    # a restart: a new boot replaces the entry although its sequence starts again
    assert table.receive(advert(boot="b2", seq=1, models=("m3",)), 10, now()) == "restarted"
    assert set(listed(table)) == {"m3"}
    # a late advert of the old boot does not come back
    assert table.receive(advert(boot="b1", seq=99, models=("m2",)), 10, now()) == "old-boot"
    assert set(listed(table)) == {"m3"}


async def test_graceful_leave_is_immediate_and_a_replay_cannot_resurrect(autojump_clock) -> None:
    table = PeerTable("me")
    table.receive(advert(seq=3), 10, now())
    v = table.version
    assert table.receive(advert(seq=4, leaving=True, models=()), 10, now()) == "left"
    assert table.states(now()) == {"a": "left"} and listed(table) == {}
    assert table.version > v
    assert table.receive(advert(seq=5), 10, now()) == "left"  # replayed or late: ignored
    assert table.states(now()) == {"a": "left"}
    assert table.receive(advert(boot="b2", seq=1), 10, now()) == "restarted"  # a new start
    assert table.states(now()) == {"a": "fresh"}
    assert table.receive(advert("z", leaving=True), 10, now()) == "ignored"
    assert "z" not in table.entries


async def test_one_way_when_our_pushes_fail_longer_than_ttl(autojump_clock) -> None:
    table = PeerTable("me")
    link = table.add_link(Link("http://a:1", name="a"))
    link.ok(now(), 100)
    table.receive(advert(), 10, now())
    await trio.sleep(1)
    link.failed(now(), "ConnectTimeout")  # one failure is not enough
    table.receive(advert(), 10, now())
    assert table.states(now()) == {"a": "fresh"}
    for _ in range(3):
        await trio.sleep(1)
        link.failed(now(), "ConnectTimeout")
        table.receive(advert(), 10, now())
    assert table.states(now()) == {"a": "one-way"}
    item = listed(table)["m"]
    assert item["peer"] == "one-way" and item["routable"] is False and item["stale"] is False
    doc = table.doc(now())["peers"][0]
    assert doc["outbound"]["last_error"] == "ConnectTimeout"
    assert doc["outbound"]["consecutive_failures"] == 4
    link.ok(now(), 100)
    assert table.states(now()) == {"a": "fresh"}


async def test_a_peer_that_refused_our_first_push_is_not_one_way_at_once(
        autojump_clock) -> None:
    """On a cold start the first push often finds the peer not listening yet."""
    table = PeerTable("me")
    link = table.add_link(Link("http://a:1", name="a"))
    link.failed(now(), "ConnectError")
    table.receive(advert(), 10, now())
    assert table.states(now()) == {"a": "fresh"}  # it pushes to us: it is up now
    await trio.sleep(3.5)  # still never through, past the ttl
    link.failed(now(), "ConnectError")
    table.receive(advert(), 10, now())
    assert table.states(now()) == {"a": "one-way"}


async def test_a_link_is_joined_by_learned_node_or_by_advertised_url(autojump_clock) -> None:
    table = PeerTable("me")
    by_url = table.add_link(Link("http://10.0.0.9:1"))
    unheard = table.add_link(Link("http://10.0.0.8:1", name="ghost"))
    table.receive(advert("a", url="http://10.0.0.9:1"), 10, now())
    assert table.link_for(table.entries["a"]) is by_url
    by_url.learn("b")  # it answered as b: the URL now reaches another node
    assert table.link_for(table.entries["a"]) is None
    doc = table.doc(now())
    assert [u["name"] for u in doc["unheard"]] == [None, "ghost"]
    assert unheard.doc(now())["pushes"] == 0


async def test_etcd_delete_is_debounced_and_a_re_put_cancels_it(autojump_clock) -> None:
    table = PeerTable("me", gone_factor=3.0)
    table.receive(advert(ttl=10), 10, now())
    await trio.sleep(8)
    table.touch(now())  # contact with etcd confirms every existing key
    await trio.sleep(8)
    assert table.states(now()) == {"a": "fresh"}
    table.delete("a", now(), debounce=5)
    assert table.states(now()) == {"a": "stale"}
    await trio.sleep(4)
    table.touch(now())  # does not revive a deleted key
    assert table.receive(advert(ttl=10), 10, now()) == "refreshed"  # the owner put it back
    assert table.states(now()) == {"a": "fresh"}
    table.delete("a", now(), debounce=5)
    await trio.sleep(5.1)
    assert table.states(now()) == {"a": "gone"} and listed(table) == {}
    # no contact with etcd: stale after ttl, gone after 3 x ttl
    table.receive(advert("b", ttl=10), 10, now())
    await trio.sleep(10.5)
    assert table.states(now())["b"] == "stale"
    await trio.sleep(20)
    assert table.states(now())["b"] == "gone"


async def test_etcd_holds_no_peer_to_a_ttl_shorter_than_its_own_contacts(autojump_clock) -> None:
    """A peer with a 3 s lease seen by a node with a 30 s lease (a rolling config change):
    news comes with the node's own contacts, every 10 s, so the peer must not go stale
    between them."""
    table = PeerTable("me", gone_factor=3.0, min_ttl=30.0)
    table.receive(advert(ttl=3), 10, now())
    seen = set()
    for _ in range(60):
        await trio.sleep(1)
        if int(now()) % 10 == 0:
            table.touch(now())
        seen |= set(table.states(now()).values())
    assert seen == {"fresh"}


def engine(models: tuple[str, ...], requests: int = 0, state: str = "ready") -> EngineState:
    stats = ProbeStats(path="/health", ok=True, requests=requests)
    return EngineState(name="e", kind="vllm", url="http://127.0.0.1:1", managed=False,
                       state=state,  # type: ignore[arg-type]
                       models=tuple(Model(id=m, created=requests) for m in models),
                       checked_at=trio.current_time(), probes=(("health", stats),))


async def test_advertiser_seq_grows_only_when_the_listing_would_change(autojump_clock) -> None:
    board = Board((engine(("m",)),))
    adv = Advertiser(board, "me", ttl_s=15, url="http://me:1")
    first = adv.seq
    assert msgspec.json.decode(adv.body, type=Advert).models[0].id == "m"
    for i in range(1, 5):  # probe counters and vLLM's per-request "created" change nothing
        board.publish((engine(("m",), requests=i),))
        assert not adv.refresh(trio.current_time())
    assert adv.seq == first
    board.publish((engine(("m", "m2")),))
    assert adv.refresh(trio.current_time())
    assert adv.seq == board.current.version > first
    board.publish((engine(("m", "m2"), state="unhealthy"),))
    assert adv.refresh(trio.current_time())
    assert adv.advert.models == () and adv.advert.engines[0].state == "unhealthy"
    leave = msgspec.json.decode(adv.leave_body(), type=Advert)
    assert leave.leaving and leave.seq == adv.seq + 1 and leave.boot_id == adv.boot_id


async def test_the_version_changes_when_a_state_changes_with_time(autojump_clock) -> None:
    table = PeerTable("me")
    link = table.add_link(Link("http://a:1", name="a"))
    link.ok(trio.current_time(), 1)
    table.receive(advert(), 10, now())
    seen = [table.version]
    for _ in range(70):  # 7 s in steps of 0.1 s
        await trio.sleep(0.1)
        if table.version != seen[-1]:
            seen.append(table.version)
    assert len(seen) == 3  # fresh -> stale at 3 s, stale -> gone at 6 s
    v = table.version
    link.failed(now(), "refused")
    assert table.version > v  # a link starting to fail may make a peer one-way


async def test_routes_name_fresh_peers_serving_a_model_and_say_why_others_cannot(
        autojump_clock) -> None:
    table = PeerTable("me")
    table.receive(advert("a", url="http://a:1"), 200, now())
    table.receive(advert("b"), 200, now())  # advertises no URL: nobody can reach it
    table.receive(advert("c", models=("x",), url="http://c:1"), 200, now())
    routes = table.routes("m", now())
    assert routes.ready == (("a", "http://a:1", None),)  # no link to a: the cluster token
    assert routes.others == ("node b advertises no URL",)
    assert table.routes("unknown", now()) == PeerRoutes()
    await trio.sleep(3.5)  # past the ttl: a, b and c are stale
    assert table.routes("m", now()) == PeerRoutes(
        others=("node a is stale", "node b is stale"))
    table.receive(advert("c", seq=2, models=(), url="http://c:1"), 200, now())
    assert table.routes("x", now()) == PeerRoutes(others=("node c no longer lists it",))


async def test_why_not_is_short_and_forgotten_nodes_are_forgotten(autojump_clock) -> None:
    table = PeerTable("me")
    for i in range(8):
        table.receive(advert(f"n{i}", url=f"http://n{i}:1"), 200, now())
    await trio.sleep(3.5)  # all stale
    assert table.routes("m", now()).others == (
        *(f"node n{i} is stale" for i in range(5)), "and 3 more")
    await trio.sleep(6 + FORGET_AFTER_S)  # gone, then forgotten
    table.prune(now())
    assert table.entries == {} and table.seen == {}
    assert table.routes("m", now()) == PeerRoutes()  # no longer known: 404, not 503


async def test_an_advert_too_large_keeps_the_models_that_fit_and_says_how_many_not(
        autojump_clock) -> None:
    many = tuple(f"org/model-{i:04d}-" + "x" * 150 for i in range(600))
    board = Board((engine(many[:20]),))
    adv = Advertiser(board, "me", ttl_s=15, url="http://me:1")
    board.publish((engine(many),))
    assert adv.refresh(trio.current_time())  # it changed: peers must hear of it
    sent = msgspec.json.decode(adv.body, type=Advert)
    assert len(adv.body) <= MAX_ADVERT_BYTES
    assert 20 < len(sent.models) < 600 and len(sent.models) + sent.left_out == 600
    assert set(sent.engines[0].models) == {m.id for m in sent.models}
    assert not adv.refresh(trio.current_time())  # the same content: nothing rebuilt
    table = PeerTable("you")
    table.receive(sent, len(adv.body), now())
    assert table.doc(now())["peers"][0]["models_left_out"] == sent.left_out
