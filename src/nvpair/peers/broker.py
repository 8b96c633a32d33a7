"""The peers broker of one node: builds the advertiser, table, receiver and senders (or the
etcd backend) from the settings, gives the API its mounts and cluster view, and runs."""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import msgspec
import trio

from nvpair.base.boundary import Part
from nvpair.config.cluster import ClusterSettings
from nvpair.http.asgi import Mount
from nvpair.peers.advert import Advertiser
from nvpair.peers.etcd import EtcdBackend
from nvpair.peers.push import LEAVE_BUDGET_S, Pusher
from nvpair.peers.receiver import ADVERTS_PATH, Receiver
from nvpair.peers.status import PEERS_PATH, Status
from nvpair.peers.table import Link, PeerTable
from nvpair.state.snapshot import Board


def default_url(bound: str) -> str:
    """The URL peers should use when none is configured: the bound address, or this host's
    name when nvpair listens on every address."""
    parts = urlsplit(bound)
    if parts.hostname in ("0.0.0.0", "::"):
        netloc = f"{socket.gethostname()}:{parts.port}"
        return urlunsplit((parts.scheme, netloc, "", "", ""))
    return bound.rstrip("/")


class Broker:
    """The peers of one node, built from the ``[cluster]`` settings: the advertiser, the
    peer table (the API's ``ClusterView`` and the router's ``PeerRouter``), the receiver
    and one pusher per peer (push backend) or the etcd backend. ``mounts`` are its API
    routes; ``run`` runs it beside the API, inside its own fault boundary (``part``)."""

    def __init__(self, cluster: ClusterSettings, board: Board, node: str) -> None:
        self.cluster = cluster
        self.node = node
        etcd = cluster.etcd
        ttl = float(etcd.lease_ttl_s) if etcd is not None else cluster.ttl_s
        self.advertiser = Advertiser(board, node, ttl, cluster.advertise_url)
        #: the API's ClusterView.
        # With etcd, news of a peer comes with this node's own contacts (every own TTL / 3),
        # so no peer can be held to a shorter TTL than this node's.
        self.table = PeerTable(node, gone_factor=3.0 if etcd is not None else 2.0,
                               min_ttl=ttl if etcd is not None else 0.0)
        self.receiver = None
        if cluster.backend == "push" and cluster.token is not None:
            self.receiver = Receiver(self.table, cluster.token)
        self.pushers = [
            Pusher(t, self.advertiser, self.table.add_link(Link(t.url, t.name, t.token)),
                   interval=cluster.interval_s, timeout=cluster.push_timeout_s)
            for t in cluster.peers]
        self.etcd = None if etcd is None else EtcdBackend(etcd, self.advertiser, self.table)
        #: the broker's own fault boundary: it runs in the API's nursery, so nothing in it
        #: may end that nursery (a failure is ``broker.state: failed`` in /v1/peers).
        self.part = Part("peers: broker", initial_s=1.0, max_s=30.0)
        #: the senders' nursery while the broker runs (None otherwise)
        self._nursery: trio.Nursery | None = None

    def refusal(self, cluster: ClusterSettings) -> str | None:
        """Why a reload cannot take ``cluster`` (None: it can). Only ``[[peers]]`` of the
        push backend change live; the token, the backend, etcd, the advertised URL and
        the timings are fixed at a start."""
        if msgspec.structs.replace(cluster, peers=self.cluster.peers) != self.cluster:
            return ("the [cluster] table changed (its token, backend, etcd, advertise_url "
                    "or timings): restart nvpair; only [[peers]] change in a reload")
        return None

    def reconfigure(self, cluster: ClusterSettings) -> None:
        """A reload (``refusal`` None): a peer added is pushed to from now on; a peer
        removed is sent a leave advert, then no longer pushed to. Sync."""
        kept = {p.target: p for p in self.pushers if p.target in cluster.peers}
        for pusher in self.pushers:
            if pusher.target not in kept:
                pusher.leave()  # (its run sends the leave advert and returns)
                self.table.remove_link(pusher.link)
        pushers = []
        for target in cluster.peers:
            known = kept.get(target)
            if known is None:
                known = Pusher(target, self.advertiser,
                               self.table.add_link(Link(target.url, target.name,
                                                        target.token)),
                               interval=cluster.interval_s, timeout=cluster.push_timeout_s)
                if self._nursery is not None:
                    self._nursery.start_soon(known.run)
            pushers.append(known)
        self.pushers = pushers
        self.cluster = cluster

    @property
    def mounts(self) -> list[Mount]:
        mounts = [Mount(handler=Status(self.doc), paths=frozenset({PEERS_PATH}))]
        if self.receiver is not None:
            mounts.append(Mount(handler=self.receiver, paths=frozenset({ADVERTS_PATH}),
                                own_auth=True))
        return mounts

    def doc(self, now: float) -> dict[str, Any]:
        """``GET /v1/peers``."""
        a = self.advertiser.advert
        doc: dict[str, Any] = {
            "node": self.node, "backend": self.cluster.backend, "url": a.url,
            "boot_id": a.boot_id, "seq": a.seq, "ttl_s": a.ttl_s,
            "changed_age_s": round(now - self.advertiser.changed_at, 3),
            "interval_s": self.cluster.interval_s,
            "received": None if self.receiver is None else {
                "accepted": self.receiver.accepted, "rejected": dict(self.receiver.rejected)},
            "etcd": None if self.etcd is None else self.etcd.doc(now),
            "broker": self.health()}
        doc.update(self.table.doc(now))
        return doc

    def health(self) -> dict[str, Any]:
        """``ok``, or ``failed`` with the reason (the broker's or the advertiser's)."""
        reason = self.part.failure or self.advertiser.fault
        return {"state": "ok" if reason is None else "failed", "reason": reason,
                "failures": self.part.failures + self.advertiser.part.failures}

    async def run(self, bound_url: str, shutdown: trio.Event, *,
                  task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Advertise and listen until ``shutdown`` is set, then leave (within about 1 s).

        ``bound_url``: where the API listens (the advertised URL unless one is configured).
        Started value: None, once every sender has its client (or once the broker failed:
        the API starts without peers then). Cancellation ends the advertiser, the senders
        and the etcd loops without a leave (set ``shutdown`` for that). Raises: nothing but
        Cancelled: any failure is the broker's (``broker.state: failed`` in /v1/peers),
        published and retried with backoff.
        """
        reported = False

        def started() -> None:  # at most once: a retried run starts again
            nonlocal reported
            if not reported:
                reported = True
                task_status.started()

        while not shutdown.is_set():
            try:
                await self._run(bound_url, shutdown, started)
                return
            except Exception as exc:  # the broker's failure, never the API's
                self.part.failed(exc)
            started()
            with trio.move_on_after(self.part.backoff.next()):
                await shutdown.wait()

    async def _run(self, bound_url: str, shutdown: trio.Event,
                   started: Callable[[], None]) -> None:
        if self.cluster.advertise_url is None:
            self.advertiser.set_url(default_url(bound_url))
        async with trio.open_nursery() as nursery:
            await nursery.start(self.advertiser.run)
            for pusher in self.pushers:
                await nursery.start(pusher.run)
            self._nursery = nursery  # (where a reload's new pushers run)
            if self.etcd is not None:
                await nursery.start(self.etcd.run)
            started()
            self.part.ok()
            try:
                await shutdown.wait()
            finally:
                self._nursery = None
            await self.leave()
            nursery.cancel_scope.cancel(reason="nvpair is shutting down")

    async def leave(self) -> None:
        """Tell every peer that this node leaves (best effort, bounded)."""
        with trio.move_on_after(LEAVE_BUDGET_S + 0.5):
            for pusher in self.pushers:
                pusher.leave()
            if self.etcd is not None:
                await self.etcd.leave()
            for pusher in self.pushers:
                await pusher.done.wait()

