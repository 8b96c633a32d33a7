"""The peer table as the event journal reads it (``nvpair.state.events.PeerSource``): each
peer's state and models, without ages or counters, and a wait that also wakes when a
peer's state changes with time alone (fresh to stale to gone)."""

from __future__ import annotations

from typing import Any

import trio

from nvpair.base.changes import Changes
from nvpair.peers.table import PeerTable

#: how often a waiter looks whether time alone moved a peer's state (the table's version
#: notices such a change when it is read)
TIME_CHECK_S = 0.5


class PeerFeed:
    """The table of the moment: ``switch`` takes another, or None while peers are off (a
    reload turns them on or off; the journal follows one feed for its life)."""

    def __init__(self, table: PeerTable | None) -> None:
        self.table = table
        self._switched = Changes()

    def switch(self, table: PeerTable | None) -> None:
        self.table = table
        self._switched.bump()

    @property
    def version(self) -> int:
        """The table's (versions of two tables never meet), 0 without one."""
        return 0 if self.table is None else self.table.version

    async def wait_changed(self, since: int) -> int:
        """Until the version differs from ``since``; cancelled like any wait."""
        while self.version == since:
            table = self.table
            if table is None:
                await self._switched.wait()
                continue
            with trio.move_on_after(TIME_CHECK_S):
                await table.wait_changed(since)
        return self.version

    def peers(self, now: float) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        table = self.table
        if table is None:
            return out
        for node, e in sorted(table.entries.items()):
            out[node] = {"node": node, "state": table.state(e, now),
                         "url": e.advert.url, "boot_id": e.advert.boot_id,
                         "models": sorted({m.id for m in e.advert.models}),
                         "engines": [{"name": g.name, "kind": g.kind, "state": g.state}
                                     for g in e.advert.engines]}
        return out
