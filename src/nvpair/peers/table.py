"""The peer table: the newest advert of every peer, aged on this node's own clock.

States, computed when read (never stored, so no timer can be missed)::

    fresh    adverts arrive (age <= ttl) and, if we push to it, our pushes get through
    one-way  adverts arrive but our pushes to it have failed for longer than ttl: it can reach
             us, we cannot reach it (listed, flagged, not routable)
    stale    no advert for longer than ttl (listed with stale: true and its age); with etcd
             also a deleted key during its debounce
    gone     no advert for longer than gone_factor x ttl (unlisted; kept in /v1/peers a while)
    left     it said goodbye (unlisted at once; adverts of that boot are ignored from then)

Everything here is sync: receivers, senders and readers call it between checkpoints.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any, Literal

import trio

from nvpair.base.ages import age
from nvpair.base.changes import Changes
from nvpair.config.cluster import MAX_TTL_S
from nvpair.peers.advert import Advert
from nvpair.router.peering import PeerRoute, PeerRoutes
from nvpair.state.snapshot import LISTED_STATES

PeerState = Literal["fresh", "one-way", "stale", "gone", "left"]
LISTED: frozenset[str] = frozenset({"fresh", "one-way", "stale"})
#: receivers clamp the sender's ttl_s to this range, so one bad advert cannot pin or flap.
TTL_RANGE = (1.0, float(MAX_TTL_S))
#: the most reasons a 503 for a peer's model names
REASONS_SHOWN = 5
#: gone and left peers stay in /v1/peers this long, then they are forgotten.
FORGET_AFTER_S = 600.0
RETIRED_BOOTS = 8
#: where each table's version starts: apart by 2**32, so that no two tables of one process
#: ever show the same version (peers turned off and on by reloads make a new table, and a
#: reader's answer cached under the old table's version must not pass for the new one's)
_FIRST_VERSIONS = itertools.count(1, 1 << 32)


class Link:
    """What this node's sender to one peer has seen (written by that sender only)."""

    def __init__(self, url: str, name: str | None = None, token: str | None = None) -> None:
        self.url = url
        self.name = name
        #: the token this peer expects (its cluster token): also sent on requests routed to it
        self.token = token
        #: the node that answered (its x-nvpair-node header), else the configured name.
        self.node = name
        self.pushes = 0
        self.failures = 0
        self.consecutive_failures = 0
        self.bytes_sent = 0
        self.connects = 0
        self.last_ok_at: float | None = None
        self.first_failed_at: float | None = None  # the first failure, before any success
        self.last_error: str | None = None
        self.last_error_at: float | None = None
        #: the sender's own failure (a bug of nvpair's caught at its boundary), else None.
        self.fault: str | None = None
        #: called when the link starts or stops failing (the table's version changes).
        self.on_change: Callable[[], None] = lambda: None

    def learn(self, node: str) -> None:
        """The peer at this URL answered as ``node``."""
        if node != self.node:
            self.node = node
            self.on_change()

    def ok(self, now: float, nbytes: int) -> None:
        self.pushes += 1
        self.bytes_sent += nbytes
        if self.consecutive_failures:
            self.on_change()
        self.consecutive_failures = 0
        self.last_ok_at = now

    def failed(self, now: float, error: str) -> None:
        self.failures += 1
        self.consecutive_failures += 1
        self.last_error, self.last_error_at = error, now
        if self.first_failed_at is None and self.last_ok_at is None:
            self.first_failed_at = now
        if self.consecutive_failures == 1:
            self.on_change()

    def failing_since(self) -> float | None:
        """Since when our pushes have not got through (None while they do)."""
        if self.consecutive_failures == 0:
            return None
        return self.last_ok_at if self.last_ok_at is not None else self.first_failed_at

    def failing(self, now: float, ttl: float) -> bool:
        """Our pushes have not got through for longer than ``ttl`` (a peer that is still
        starting refuses the first ones: that alone is not one-way)."""
        since = self.failing_since()
        return since is not None and now - since > ttl

    def doc(self, now: float) -> dict[str, Any]:
        return {"url": self.url, "name": self.name, "node": self.node, "pushes": self.pushes,
                "failures": self.failures, "consecutive_failures": self.consecutive_failures,
                "bytes_sent": self.bytes_sent, "connects": self.connects,
                "last_ok_age_s": age(now, self.last_ok_at), "last_error": self.last_error,
                "last_error_age_s": age(now, self.last_error_at),
                "state": "degraded" if self.fault or self.consecutive_failures else "ok",
                "fault": self.fault}


class Entry:
    """One peer as heard from (written by the table only)."""

    def __init__(self, advert: Advert, size: int, now: float, ttl: float) -> None:
        self.node = advert.node
        self.first_seen = now
        self.adverts = 0
        self.bytes_received = 0
        self.retired: list[str] = []
        self.left_at: float | None = None
        self.deleted_at: float | None = None
        self.debounce = 0.0
        self.store(advert, size, now, ttl)

    def store(self, advert: Advert, size: int, now: float, ttl: float) -> None:
        self.advert = advert
        self.ttl = ttl
        self.received_at = now
        self.adverts += 1
        self.bytes_received += size
        self.deleted_at = None
        self.changed_at = now
        #: the advert's models are stored as they came (``ModelItem``); by id, the states
        #: of the engines that list each (what ``routes`` asks, per request)
        self.states: dict[str, list[str]] = {}
        for m in advert.models:
            self.states.setdefault(m.id, []).append(m.state)
        #: the models a ready engine lists cold: a multi-model engine (llama-server in
        #: router mode) that loads them on request; an on-demand engine is cold itself
        up = {g.name for g in advert.engines if g.state in LISTED_STATES}
        self.loadable = {m.id for m in advert.models if m.state == "cold" and m.engine in up}


class PeerTable:
    """Implements the API's ``ClusterView``: ``version`` and ``models(now)``.

    ``gone_factor``: a peer is gone after ``gone_factor x ttl`` without news (2 for push;
    3 for etcd, where news is any successful contact with etcd, see ``touch``).
    """

    def __init__(self, node: str, *, gone_factor: float = 2.0, min_ttl: float = 0.0) -> None:
        self.node = node
        self.gone_factor = gone_factor
        self.min_ttl = min_ttl
        self.entries: dict[str, Entry] = {}
        self.links: list[Link] = []
        self._by_node: dict[str, Link] = {}
        self._by_url: dict[str, Link] = {}
        self._changes = Changes(next(_FIRST_VERSIONS))
        self._next_transition = float("inf")
        #: model id -> nodes that ever listed it (so a model gone for now is 503, not 404)
        self.seen: dict[str, set[str]] = {}

    @property
    def version(self) -> int:
        """Changes with every stored change and whenever a peer's state changes with time,
        so an answer cached per version is never behind the states."""
        now = trio.current_time()
        if now >= self._next_transition:
            self._changed()
        return self._changes.version

    def add_link(self, link: Link) -> Link:
        self.links.append(link)
        link.on_change = self._links_changed
        self._links_changed()
        return link

    def remove_link(self, link: Link) -> None:
        """A peer taken out of the config (a reload): no longer pushed to. What it said of
        itself stays until it leaves or is gone, as for any peer."""
        if link in self.links:
            self.links.remove(link)
            self._links_changed()

    def clear(self) -> None:
        """Forget every peer heard from (a reload moved the source of adverts: another
        backend, or another etcd URL or prefix). The links stay. Sync."""
        if self.entries or self.seen:
            self.entries, self.seen = {}, {}
            self._changed()

    def _links_changed(self) -> None:
        self._by_node = {link.node: link for link in self.links if link.node is not None}
        self._by_url = {link.url: link for link in self.links if link.node is None}
        self._changed()

    def _changed(self) -> None:
        self._next_transition = self._transition_after(trio.current_time())
        self._changes.bump()

    async def wait_changed(self, since_version: int) -> int:
        """Wait until a stored change moves the version past ``since_version``."""
        while self.version == since_version:
            await self._changes.wait_changed(since_version)
        return self._changes.version

    def _transition_after(self, now: float) -> float:
        """The next moment a state changes with time alone."""
        times = []
        for e in self.entries.values():
            if e.left_at is not None:
                continue
            if e.deleted_at is not None:
                times.append(e.deleted_at + e.debounce)
                continue
            times += [e.received_at + e.ttl, e.received_at + e.ttl * self.gone_factor]
            link = self.link_for(e)
            if link is not None and (since := link.failing_since()) is not None:
                times.append(since + e.ttl)
        # states change just after a boundary (age > ttl)
        return min((t + 1e-6 for t in times if t + 1e-6 > now), default=float("inf"))

    # -- writes -------------------------------------------------------------------------

    def receive(self, advert: Advert, size: int, now: float) -> str:
        """Store ``advert`` if it is the newest of its node; say what happened."""
        ttl = min(max(advert.ttl_s, TTL_RANGE[0], self.min_ttl), TTL_RANGE[1])
        e = self.entries.get(advert.node)
        if e is None:
            if advert.leaving:
                return "ignored"
            self.entries[advert.node] = Entry(advert, size, now, ttl)
            self._learn(self.entries[advert.node])
            self._changed()
            self.prune(now)
            return "new"
        if advert.boot_id in e.retired:
            return "old-boot"
        if advert.boot_id != e.advert.boot_id and advert.leaving:
            return "ignored"  # the leave of a boot never heard: it cannot retire the current
        if advert.boot_id != e.advert.boot_id:
            e.retired = [*e.retired[-(RETIRED_BOOTS - 1):], e.advert.boot_id]
            e.left_at = None
            if advert.leaving:
                e.left_at = now
            e.store(advert, size, now, ttl)
            self._learn(e)
            self._changed()
            return "restarted"
        if e.left_at is not None:
            return "left"
        if advert.seq < e.advert.seq:
            return "old"
        if advert.leaving:
            e.left_at = now
            self._changed()
            return "left"
        before = self.state(e, now)
        same = advert.content() == e.advert.content()
        if same:
            e.advert, e.received_at, e.ttl = advert, now, ttl
            e.adverts += 1
            e.bytes_received += size
            e.deleted_at = None
        else:
            e.store(advert, size, now, ttl)
            self._learn(e)
        if not same or before != "fresh":
            self._changed()
        return "refreshed" if same else "updated"

    def _learn(self, e: Entry) -> None:
        for model_id in e.states:
            nodes = self.seen.get(model_id)
            if nodes is None and len(self.seen) < 10_000:
                nodes = self.seen[model_id] = set()
            if nodes is not None:
                nodes.add(e.node)

    def touch(self, now: float) -> None:
        """etcd: a successful contact confirms every entry whose key still exists."""
        for e in self.entries.values():
            if e.left_at is None and e.deleted_at is None:
                e.received_at = now

    def delete(self, node: str, now: float, debounce: float) -> None:
        """etcd: the node's key is gone; show it stale for ``debounce``, then drop it."""
        e = self.entries.get(node)
        if e is not None and e.left_at is None and e.deleted_at is None:
            e.deleted_at, e.debounce = now, debounce
            self._changed()

    def prune(self, now: float) -> None:
        """Forget peers that have been gone or left for ``FORGET_AFTER_S``."""
        forget = [n for n, e in self.entries.items()
                  if (end := self.ended_at(e, now)) is not None and now - end > FORGET_AFTER_S]
        for node in forget:
            del self.entries[node]
        if forget:  # a forgotten node's models are no longer "known" through it
            gone = set(forget)
            for model, nodes in list(self.seen.items()):
                nodes -= gone
                if not nodes:
                    del self.seen[model]
            self._changed()

    # -- reads --------------------------------------------------------------------------

    def link_for(self, e: Entry) -> Link | None:
        """Our sender to this peer: by the node it answered as (or its configured name),
        else by the URL the peer advertises."""
        link = self._by_node.get(e.node)
        if link is None and e.advert.url is not None:
            link = self._by_url.get(e.advert.url)
        return link

    def ended_at(self, e: Entry, now: float) -> float | None:
        """When the entry stopped being listed (None while it is listed)."""
        if e.left_at is not None:
            return e.left_at
        if e.deleted_at is not None:
            end = e.deleted_at + e.debounce
        else:
            end = e.received_at + e.ttl * self.gone_factor
        return end if end < now else None

    def state(self, e: Entry, now: float) -> PeerState:
        if e.left_at is not None:
            return "left"
        if e.deleted_at is not None:
            return "gone" if now - e.deleted_at > e.debounce else "stale"
        age = now - e.received_at
        if age > e.ttl * self.gone_factor:
            return "gone"
        if age > e.ttl:
            return "stale"
        link = self.link_for(e)
        if link is not None and link.failing(now, e.ttl):
            return "one-way"
        return "fresh"

    def since(self, e: Entry, state: PeerState) -> float | None:
        """When ``e`` entered ``state`` (its current state); None for fresh."""
        if state == "left":
            return e.left_at
        if e.deleted_at is not None:
            return e.deleted_at if state == "stale" else e.deleted_at + e.debounce
        if state == "stale":
            return e.received_at + e.ttl
        if state == "gone":
            return e.received_at + e.ttl * self.gone_factor
        link = self.link_for(e)
        if state == "one-way" and link is not None:
            since = link.failing_since()
            return None if since is None else since + e.ttl
        return None

    def states(self, now: float) -> dict[str, PeerState]:
        return {node: self.state(e, now) for node, e in self.entries.items()}

    def models(self, now: float) -> list[dict[str, Any]]:
        """The model items of every listed peer (``ClusterView.models``)."""
        out: list[dict[str, Any]] = []
        for e in self.entries.values():
            state = self.state(e, now)
            if state not in LISTED:
                continue
            heard = age(now, e.received_at)
            stale = state == "stale"
            url = e.advert.url
            for m in e.advert.models:
                out.append({
                    "id": m.id, "object": "model", "created": m.created,
                    "owned_by": m.owned_by or m.kind,
                    "nvpair": {"engine": m.engine, "engines": list(m.engines), "kind": m.kind,
                               "node": e.node, "node_url": url,
                               "state": "stale" if stale else m.state,
                               "stale": m.stale or stale, "alias_of": m.alias_of,
                               "peer": state, "routable": state == "fresh", "age_s": heard}})
        return out

    def routes(self, model: str, now: float) -> PeerRoutes:
        """Where a request for ``model`` (an id or alias a peer lists) may go: fresh peers
        whose engine for it is ready, fresh peers whose ready multi-model engine lists it
        cold (``loadable``), and, for an error message, why the others may not."""
        ready: list[PeerRoute] = []
        loadable: list[PeerRoute] = []
        others: list[str] = []
        for e in self.entries.values():
            states = e.states.get(model, ())
            if not states:
                continue
            peer = self.state(e, now)
            if peer not in LISTED:
                continue
            if peer != "fresh":
                others.append(f"node {e.node} is {peer}")
            elif not e.advert.url:
                others.append(f"node {e.node} advertises no URL")
            elif model in e.loadable and not any(s in LISTED_STATES for s in states):
                link = self.link_for(e)  # (it loads the model for the request)
                loadable.append(PeerRoute(e.node, e.advert.url, link.token if link else None))
            elif not any(s in LISTED_STATES for s in states):
                others.append(f"node {e.node}'s engine is {states[0]}")
            else:
                link = self.link_for(e)
                ready.append(PeerRoute(e.node, e.advert.url, link.token if link else None))
        if not ready and not others and not loadable:
            others = [f"node {n} no longer lists it" for n in sorted(self.seen.get(model, ()))]
        if len(others) > REASONS_SHOWN:  # a message, not a census
            others = [*others[:REASONS_SHOWN], f"and {len(others) - REASONS_SHOWN} more"]
        return PeerRoutes(tuple(ready), tuple(others), tuple(loadable))

    def doc(self, now: float) -> dict[str, Any]:
        """The peers part of ``GET /v1/peers``."""
        self.prune(now)
        peers = []
        linked: set[int] = set()
        for e in sorted(self.entries.values(), key=lambda e: e.node):
            link = self.link_for(e)
            if link is not None:
                linked.add(id(link))
            a = e.advert
            state = self.state(e, now)
            peers.append({
                "node": e.node, "state": state, "state_age_s": age(now, self.since(e, state)),
                "age_s": age(now, e.received_at),
                "url": a.url, "boot_id": a.boot_id, "seq": a.seq, "ttl_s": e.ttl,
                "changed_age_s": age(now, e.changed_at),
                "first_seen_age_s": age(now, e.first_seen), "adverts": e.adverts,
                "bytes_received": e.bytes_received, "left_age_s": age(now, e.left_at),
                "deleted_age_s": age(now, e.deleted_at), "models": len(e.advert.models),
                "models_left_out": a.left_out,
                "engines": [{"name": g.name, "kind": g.kind, "state": g.state,
                             "models": list(g.models)} for g in a.engines],
                "outbound": None if link is None else link.doc(now)})
        unheard = [link.doc(now) for link in self.links if id(link) not in linked]
        return {"peers": peers, "unheard": unheard}
