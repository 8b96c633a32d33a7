"""What the router needs to know of peers, and nothing more: the routes to a model.

The peer table (``nvpair.peers.table``) implements ``PeerRouter``; the router reads it and
never imports ``nvpair.peers``, so peers sit above the router, not beside it.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import msgspec


class PeerRoute(NamedTuple):
    node: str
    url: str
    token: str | None  # the token configured for this peer (None: this node's cluster token)


class PeerRoutes(msgspec.Struct, frozen=True):
    """``ready``: peers that can take a request now; ``others``: why the peers that list
    the model cannot (empty: no peer lists it); ``loadable``: peers whose ready
    multi-model engine lists the model ``cold`` and loads it on request (tried after this
    node's own on-demand engines: docs/multi-model.md)."""

    ready: tuple[PeerRoute, ...] = ()
    others: tuple[str, ...] = ()
    loadable: tuple[PeerRoute, ...] = ()


class PeerRouter(Protocol):
    """The peers' models as the broker keeps them (``PeerTable``): read, never fetched."""

    def routes(self, model: str, now: float) -> PeerRoutes: ...
