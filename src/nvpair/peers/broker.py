"""The peers broker of one node: builds the advertiser, table, receiver and senders (or the
etcd backend) from the settings, gives the API its mounts and cluster view, and runs; a
reload changes any of its settings in place (``reconfigure``)."""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import trio

from nvpair.base.boundary import Part
from nvpair.config.cluster import ClusterSettings, PeerTarget
from nvpair.http.asgi import Mount, Receive, Scope, Send, send_error
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
        self.pushers = [self._pusher(t, cluster) for t in cluster.peers]
        self.etcd = None if etcd is None else EtcdBackend(etcd, self.advertiser, self.table)
        #: the broker's own fault boundary: it runs in the API's nursery, so nothing in it
        #: may end that nursery (a failure is ``broker.state: failed`` in /v1/peers).
        self.part = Part("peers: broker", initial_s=1.0, max_s=30.0)
        #: where the API listens (set by ``run``): the advertised URL unless one is set
        self.bound_url: str | None = None
        #: the senders' nursery while the broker runs (None otherwise)
        self._nursery: trio.Nursery | None = None
        #: the running etcd backend's own scope (a reload that replaces it cancels it)
        self._etcd_scope: trio.CancelScope | None = None
        #: ``stop()`` was asked (peers turned off): the run leaves and returns
        self._stopping = False
        self._waiting: trio.CancelScope | None = None

    def _pusher(self, target: PeerTarget, cluster: ClusterSettings) -> Pusher:
        return Pusher(target, self.advertiser,
                      self.table.add_link(Link(target.url, target.name, target.token)),
                      interval=cluster.interval_s, timeout=cluster.push_timeout_s)

    def refusal(self, cluster: ClusterSettings, *, groups: bool) -> str | None:
        """Why a reload cannot take ``cluster`` (None: it can). ``groups``: a multi-node
        group runs on this node. Its runners read this broker's table and advertiser,
        which a reload keeps, so every change is live but one: with a group running, the
        backend and the etcd settings stay (the group's epoch key lives in the etcd
        backend, and its ranks know the others only through the backend)."""
        if groups and (cluster.backend, cluster.etcd) != (self.cluster.backend,
                                                          self.cluster.etcd):
            return ("the [cluster] backend or etcd settings changed while a multi-node group "
                    "runs on this node (its ranks hear each other through them): restart "
                    "nvpair")
        return None

    def reconfigure(self, cluster: ClusterSettings) -> None:
        """A reload (``refusal`` None): take ``cluster``, whatever changed in it. Sync: a
        reader sees the old settings or the new, never a mix, and never waits.

        The advertiser (this node's boot id and seq) and the table stay, so peers see no
        restart and readers no gap; when the source of adverts moves (the backend, or the
        etcd URL or prefix) the table forgets what the old source said. The receiver
        checks the new token from now on; what peers pushed with the old one stays as
        heard and ages as usual (stale after its TTL unless they push with the new one).
        A sender whose peer, token or timings changed is replaced: a peer no longer
        configured is sent a leave advert, one still configured is just taken over by
        its new sender (no leave, or the peer would ignore this boot from then on). A
        changed etcd backend is replaced: the old one is cancelled and its lease left to
        expire (within its TTL): at the same URL and prefix the new lease takes the key
        over with its first put, so watchers see no gap."""
        if cluster == self.cluster:
            return
        old, self.cluster = self.cluster, cluster
        etcd = cluster.etcd
        ttl = float(etcd.lease_ttl_s) if etcd is not None else cluster.ttl_s
        if cluster.backend != old.backend or (
                etcd is not None and old.etcd is not None
                and (etcd.url, etcd.prefix) != (old.etcd.url, old.etcd.prefix)):
            self.table.clear()
        self.table.gone_factor = 3.0 if etcd is not None else 2.0
        self.table.min_ttl = ttl if etcd is not None else 0.0
        self.advertiser.set_ttl(ttl)
        url = cluster.advertise_url or (None if self.bound_url is None
                                        else default_url(self.bound_url))
        if url is not None and url != self.advertiser.url:
            self.advertiser.set_url(url)
        if cluster.backend != "push" or cluster.token is None:
            self.receiver = None
        elif self.receiver is None:
            self.receiver = Receiver(self.table, cluster.token)
        else:
            self.receiver.expected = cluster.token.encode()
        self._reconfigure_pushers(old, cluster)
        if etcd != old.etcd:
            if self._etcd_scope is not None:
                self._etcd_scope.cancel(reason="a reload replaced the etcd settings")
            self.etcd = None if etcd is None else EtcdBackend(etcd, self.advertiser,
                                                               self.table)
            if self.etcd is not None and self._nursery is not None:
                self._nursery.start_soon(self._run_etcd, self.etcd)

    def _reconfigure_pushers(self, old: ClusterSettings, cluster: ClusterSettings) -> None:
        same_timings = ((old.interval_s, old.push_timeout_s)
                        == (cluster.interval_s, cluster.push_timeout_s))
        kept = {p.target: p for p in self.pushers
                if p.target in cluster.peers and same_timings}
        urls = {t.url for t in cluster.peers}
        for pusher in self.pushers:
            if pusher.target in kept:
                continue
            if pusher.target.url in urls:
                pusher.stop()  # (its successor pushes the same boot on)
            else:
                pusher.leave()  # (its run sends the leave advert and returns)
            self.table.remove_link(pusher.link)
        pushers = []
        for target in cluster.peers:
            known = kept.get(target)
            if known is None:
                known = self._pusher(target, cluster)
                if self._nursery is not None:
                    self._nursery.start_soon(known.run)
            pushers.append(known)
        self.pushers = pushers

    def stop(self) -> None:
        """Peers turned off by a reload: the run leaves the cluster (leave adverts, the
        etcd lease revoked) and returns, as at a shutdown. Sync."""
        self._stopping = True
        if self._waiting is not None:
            self._waiting.cancel(reason="peers turned off")

    @property
    def mounts(self) -> list[Mount]:
        return [Mount(handler=Status(self.doc), paths=frozenset({PEERS_PATH})),
                Mount(handler=self._adverts, paths=frozenset({ADVERTS_PATH}), own_auth=True)]

    async def _adverts(self, scope: Scope, receive: Receive, send: Send) -> None:
        """``ADVERTS_PATH``: the receiver of the moment (a reload may replace it)."""
        receiver = self.receiver
        if receiver is None:
            await send_error(send, 404, "this node takes no pushed adverts (its cluster "
                             f"backend is {self.cluster.backend!r})", "not_found")
            return
        await receiver(scope, receive, send)

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

        self.bound_url = bound_url
        while not shutdown.is_set() and not self._stopping:
            try:
                await self._run(bound_url, shutdown, started)
                return
            except Exception as exc:  # the broker's failure, never the API's
                self.part.failed(exc)
            started()
            await self._until(shutdown, self.part.backoff.next())
        started()

    async def _until(self, shutdown: trio.Event, within: float = float("inf")) -> None:
        """Until nvpair shuts down, ``stop()`` is asked, or ``within`` seconds pass."""
        with trio.move_on_after(within), trio.CancelScope() as self._waiting:
            if not self._stopping:
                await shutdown.wait()
        self._waiting = None

    async def _run(self, bound_url: str, shutdown: trio.Event,
                   started: Callable[[], None]) -> None:
        if self.cluster.advertise_url is None:
            self.advertiser.set_url(default_url(bound_url))
        async with trio.open_nursery() as nursery:
            await nursery.start(self.advertiser.run)
            pushers, etcd = self.pushers, self.etcd
            self._nursery = nursery  # (where a reload's new senders run from now on)
            for pusher in pushers:
                await nursery.start(pusher.run)
            if etcd is not None:
                await nursery.start(self._run_etcd, etcd)
            started()
            self.part.ok()
            try:
                await self._until(shutdown)
            finally:
                self._nursery = None
            await self.leave()
            nursery.cancel_scope.cancel(reason="nvpair is shutting down"
                                        if shutdown.is_set() else "peers turned off")

    async def _run_etcd(self, etcd: EtcdBackend, *,
                        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                        ) -> None:
        """Run ``etcd`` under a scope of its own, until a reload replaces it.

        Started value: None, once ``etcd`` runs (at once when a reload replaced it
        before it began: it never runs). Cancellation: as ``EtcdBackend.run`` (its lease
        left to expire). Raises: nothing but Cancelled."""
        if etcd is not self.etcd:  # replaced before it began
            task_status.started()
            return
        with trio.CancelScope() as self._etcd_scope:
            await etcd.run(task_status=task_status)

    async def leave(self) -> None:
        """Tell every peer that this node leaves (best effort, bounded)."""
        with trio.move_on_after(LEAVE_BUDGET_S + 0.5):
            for pusher in self.pushers:
                pusher.leave()
            if self.etcd is not None:
                await self.etcd.leave()
            for pusher in self.pushers:
                await pusher.done.wait()

