"""Peer events: the journal over a real peer table (nvpair.peers.feed), on trio's autojump
clock: a new peer, a changed advert, a refresh that changes nothing, a peer gone quiet."""

from __future__ import annotations

import msgspec
import trio
from tests.peers.test_table import advert

from nvpair.peers.feed import PeerFeed
from nvpair.peers.table import PeerTable
from nvpair.state.events import Journal
from nvpair.state.snapshot import Board


def peer_events(journal: Journal) -> list[dict[str, object]]:
    stream = next(iter(journal.streams))
    return [msgspec.json.decode(e.data) for e in stream.take() if e.type == "peer"]


async def test_peer_events_come_from_the_table(autojump_clock) -> None:
    table = PeerTable("me")
    journal = Journal(Board(()), node="me", peers=PeerFeed(table))
    stream, first = journal.subscribe(types=frozenset({"peer"}))
    assert first is None
    async with trio.open_nursery() as nursery:
        await nursery.start(journal.run)
        table.receive(advert("a", models=("m1",)), 200, trio.current_time())
        await stream.wait()
        [new] = peer_events(journal)
        assert (new["node"], new["state"], new["models"]) == ("a", "fresh", ["m1"])
        seq = journal.seq
        await trio.sleep(1.0)
        table.receive(advert("a", seq=2, models=("m1",)), 200, trio.current_time())
        await trio.sleep(0.1)
        assert journal.seq == seq  # a refresh of the same content: no event
        table.receive(advert("a", seq=3, models=("m1", "m2")), 200, trio.current_time())
        await stream.wait()
        [changed] = peer_events(journal)
        assert changed["models"] == ["m1", "m2"]
        with trio.fail_after(10):  # silent past its ttl (3 s): stale with time alone
            await stream.wait()
        [stale] = peer_events(journal)
        assert stale["state"] == "stale"
        nursery.cancel_scope.cancel()


async def test_the_journal_follows_peers_turned_on_and_off(autojump_clock) -> None:
    """A reload turns peers on (the feed switches to a table) and off (to none): the
    journal, made while there were none, tells each peer, then that it is forgotten."""
    feed = PeerFeed(None)
    journal = Journal(Board(()), node="me", peers=feed)
    stream, _ = journal.subscribe(types=frozenset({"peer"}))
    async with trio.open_nursery() as nursery:
        await nursery.start(journal.run)
        table = PeerTable("me")
        table.receive(advert("a", models=("m1",)), 200, trio.current_time())
        feed.switch(table)
        with trio.fail_after(1):
            await stream.wait()
        [on] = peer_events(journal)
        feed.switch(None)
        with trio.fail_after(1):
            await stream.wait()
        [off] = peer_events(journal)
        nursery.cancel_scope.cancel()
    assert (on["node"], on["state"], on["models"]) == ("a", "fresh", ["m1"])
    assert (off["node"], off["state"]) == ("a", "forgotten")
