"""The peer table as the event journal reads it (``nvpair.state.events.PeerSource``): each
peer's state and models, without ages or counters, and a wait that also wakes when a
peer's state changes with time alone (fresh to stale to gone)."""

from __future__ import annotations

from typing import Any

import trio

from nvpair.peers.table import PeerTable

#: how often a waiter looks whether time alone moved a peer's state (the table's version
#: notices such a change when it is read)
TIME_CHECK_S = 0.5


class PeerFeed:
    def __init__(self, table: PeerTable) -> None:
        self.table = table

    @property
    def version(self) -> int:
        return self.table.version

    async def wait_changed(self, since: int) -> int:
        """Until the table's version differs from ``since``; cancelled like any wait."""
        while self.table.version == since:
            with trio.move_on_after(TIME_CHECK_S):
                await self.table.wait_changed(since)
        return self.table.version

    def peers(self, now: float) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for node, e in sorted(self.table.entries.items()):
            out[node] = {"node": node, "state": self.table.state(e, now),
                         "url": e.advert.url, "boot_id": e.advert.boot_id,
                         "models": sorted({m.id for m in e.advert.models}),
                         "engines": [{"name": g.name, "kind": g.kind, "state": g.state}
                                     for g in e.advert.engines]}
        return out
