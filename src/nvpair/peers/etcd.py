"""The etcd backend: this node's advert under one leased key; every node's from a watch.

Two loops, each with its own httpx2 client and connection (a streaming watch never holds
the connection that keepalives need). A request cut short by a deadline or a restarted watch
takes its client with it, so nothing a cancelled request leaves in a pool can wedge a loop:

* ``_own``: grant a lease (TTL, default 10 s), put the advert under ``<prefix><node>``,
  renew at min(TTL/3, remaining/2), put again when the advert changes. A keepalive answer
  without a TTL, or a put that finds no lease, means the lease is lost: take a new one and
  put again (the owner keeps the desired state; etcd cannot restore it).
* ``_watch``: range the prefix into the table, then watch from the next revision. On any
  error, end of stream, cancellation by etcd (compaction), lost lease or every 60 s: range
  again and watch again. A deleted key is shown stale for a debounce before it is dropped;
  right after an etcd outage the debounce is a whole TTL, since a stall expires every lease
  at once and the owners need a moment to put their keys back.

When etcd cannot be reached the table keeps its entries: no contact for a TTL makes them
stale, for 3 x TTL gone. Nothing here ever blocks a read.

Each loop is a fault boundary (``nvpair.base.boundary.Part``): a failed call is ``unreachable``
(no answer), anything else at all (an answer that is not the gateway's, etcd's own error, a
bug here) is ``failed`` with the reason; both are retried with backoff and jitter (doubling
from 0.2 s to TTL/3) and never leave the backend.
"""

from __future__ import annotations

import functools
import logging
import random
import ssl
from typing import Any

import httpx2
import trio

from nvpair.base.ages import age
from nvpair.base.boundary import Part
from nvpair.base.tls import client_tls
from nvpair.config.cluster import EtcdSettings
from nvpair.errors import NvpairError
from nvpair.peers.advert import Advertiser, AdvertRejected, decode
from nvpair.peers.gateway import KV, EtcdError, Gateway, LeaseNotFound, WatchResult
from nvpair.peers.table import PeerTable

log = logging.getLogger("nvpair.peers")

#: a consistency check: the watch is restarted (after a fresh range) this often.
RERANGE_S = 60.0
#: the first retry after a failure comes after about this long; then it doubles to TTL/3.
FIRST_RETRY_S = 0.2
#: failures that mean etcd did not answer (``unreachable``); any other is ``failed``.
NO_ANSWER = (httpx2.TransportError, OSError, trio.TooSlowError)


class Unreachable(NvpairError):
    """etcd did not answer (refused, reset, timed out)."""


class EtcdBackend:
    """The etcd backend of one node (see the module): the lease owner keeps this node's
    advert under ``<prefix><node>``, the watcher feeds every node's into the peer table.
    ``state`` (connecting, ok, unreachable, failed) and ``doc`` are what ``/v1/peers``
    shows; ``leave`` revokes the lease on a graceful exit."""

    def __init__(self, settings: EtcdSettings, advertiser: Advertiser, table: PeerTable, *,
                 transport: httpx2.AsyncBaseTransport | None = None) -> None:
        self.settings = settings
        self.advertiser = advertiser
        self.table = table
        self.transport = transport
        self.node = advertiser.node
        self.key = settings.prefix + self.node
        self.ttl = settings.lease_ttl_s
        self.timeout = max(1.0, min(2.0, self.ttl / 3))
        self.rng = random.Random()
        self.state = "connecting"
        self.state_at = trio.current_time()
        self.recovered_at: float | None = None
        self.lease: int | None = None
        self.last_ok_at: float | None = None
        self.last_error: str | None = None
        self.last_error_at: float | None = None
        self.counts = dict.fromkeys(("grants", "puts", "keepalives", "lost_leases", "ranges",
                                     "watches", "events", "failures"), 0)
        #: values under the prefix that are not adverts this node can use, by reason.
        self.rejected: dict[str, int] = {}
        self._rejected_logged: dict[str, str] = {}  # key -> the reason last logged
        backoff = {"initial_s": FIRST_RETRY_S, "max_s": max(FIRST_RETRY_S, self.ttl / 3)}
        self.own_part = Part("etcd: lease owner", **backoff)  # type: ignore[arg-type]
        self.watch_part = Part("etcd: watch", **backoff)  # type: ignore[arg-type]
        self._own_scope = trio.CancelScope()
        self._leaving = False
        self._wake: trio.CancelScope | None = None
        self._own_missing = False  # our key was deleted while our lease lives: put it again
        self._watch_scope: trio.CancelScope | None = None
        self._conflict_warned = False
        #: the lease owner's calls (grant, put, keepalive, revoke).
        self._owner = self._gateway(streaming=False)
        #: the watcher's calls (range, then the watch stream).
        self._watcher = self._gateway(streaming=True)

    # -- clients ------------------------------------------------------------------------

    @functools.cached_property
    def _tls(self) -> ssl.SSLContext:
        """Built once: a client built without a context loads the CA bundle every time."""
        s = self.settings
        if not (s.ca_file or s.cert_file):
            return client_tls()
        context = ssl.create_default_context(cafile=s.ca_file)
        if s.cert_file and s.key_file:
            context.load_cert_chain(s.cert_file, s.key_file)
        return context

    def _client(self, *, streaming: bool) -> httpx2.AsyncClient:
        s = self.settings
        # One loop, one request at a time: a pool wait can only be a leaked slot.
        timeout = httpx2.Timeout(self.timeout, read=None if streaming else self.timeout,
                                 pool=0.5)
        limits = httpx2.Limits(max_connections=1, keepalive_expiry=max(5.0, self.ttl))
        return httpx2.AsyncClient(base_url=s.url, timeout=timeout, limits=limits,
                                  verify=self._tls, trust_env=False, transport=self.transport)

    def _gateway(self, *, streaming: bool) -> Gateway:
        return Gateway(self._client(streaming=streaming), username=self.settings.username,
                       password=self.settings.password)

    async def _renew(self, gw: Gateway, *, streaming: bool) -> None:
        """Replace ``gw``'s client after a cancelled request (its auth token stays)."""
        old, gw.client = gw.client, self._client(streaming=streaming)
        with trio.move_on_after(1):
            await old.aclose()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Keep this node's key and watch everyone's until cancelled.

        Started value: None, at once (both loops start; etcd need not answer yet: the
        state is ``connecting`` until it does). Cancellation ends both loops and closes
        the owner's client (shielded, at most 1 s); the key's lease is left to expire
        (``leave`` revokes it first on a graceful exit). Raises: nothing but Cancelled:
        each loop is its own boundary (``own_part``, ``watch_part``), a failure is the
        backend's state (``unreachable`` or ``failed``) and is retried with backoff."""
        # a run again (the broker retries its own run) needs clients: the last run's end
        # closed them (the gateways keep their auth tokens)
        for gw, streaming in ((self._owner, False), (self._watcher, True)):
            if gw.client.is_closed:
                gw.client = self._client(streaming=streaming)
        try:
            async with trio.open_nursery() as nursery:
                # the loops catch their own failures; supervise is the net for the rest
                nursery.start_soon(self.own_part.supervise, self._own)
                nursery.start_soon(self.watch_part.supervise, self._watch)
                task_status.started()
        finally:
            with trio.move_on_after(1, shield=True):
                await self._owner.client.aclose()
                await self._watcher.client.aclose()

    async def leave(self) -> None:
        """Stop renewing; mark the key as leaving (watchers drop it without a debounce) and
        revoke the lease (etcd deletes the key). Best effort; the caller bounds the time."""
        self._leaving = True
        self._own_scope.cancel(reason="nvpair is leaving the cluster")
        if self.lease is None:
            return
        await self._renew(self._owner, streaming=False)  # the owner may have been mid-call
        try:
            await self._owner.put(self.key, self.advertiser.leave_body(), ignore_lease=True)
            await self._owner.revoke(self.lease)
        except Exception as exc:  # best effort: the lease expires by itself
            log.warning("etcd: leaving: %s: %s", type(exc).__name__, exc)

    # -- bookkeeping --------------------------------------------------------------------

    def _ok(self, part: Part) -> None:
        """``part`` got an answer it could use: etcd is ok once both loops are."""
        now = trio.current_time()
        self.last_ok_at = now
        part.ok()
        if self.watch_part.failure is None:  # news of the keys only while the watch works
            self.table.touch(now)
        if self.own_part.failure is not None or self.watch_part.failure is not None:
            return
        if self.state != "ok":
            if self.state in ("unreachable", "failed"):
                log.info("etcd: works again (was %s)", self.state)
                self.recovered_at = now
                if part is self.own_part:  # the watch may have hung meanwhile: range again
                    self._rewatch()
            self.state, self.state_at = "ok", now

    def _failed(self, part: Part, what: str, exc: Exception) -> float:
        """A failure of one loop: recorded, published, logged once per change; the delay
        before its retry (backoff with jitter)."""
        now = trio.current_time()
        state = "unreachable" if isinstance(exc, (*NO_ANSWER, Unreachable)) else "failed"
        if isinstance(exc, Unreachable):
            exc = Unreachable(f"{what}: {exc}")
        elif isinstance(exc, NO_ANSWER):
            words = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            exc = Unreachable(f"{what}: {words}")
        elif isinstance(exc, NvpairError):  # etcd's error or an answer that is not etcd's
            exc = EtcdError(f"{what}: {exc}")
        self.counts["failures"] += 1
        self.last_error, self.last_error_at = part.failed(exc), now
        if self.state != state:
            self.state, self.state_at = state, now
        return part.backoff.next()

    def _rewatch(self) -> None:
        if self._watch_scope is not None:
            self._watch_scope.cancel(reason="range again")

    def debounce(self, now: float) -> float:
        """How long a deleted key stays listed as stale."""
        recent = self.recovered_at is not None and now - self.recovered_at < self.ttl
        if self.state != "ok" or recent:
            return max(self.settings.debounce_s, float(self.ttl))
        return self.settings.debounce_s

    # -- this node's key ----------------------------------------------------------------

    async def _own(self) -> None:
        if self._leaving:
            return
        with trio.CancelScope() as self._own_scope:  # a new one each (supervised) run
            await self._own_loop()

    async def _own_loop(self) -> None:
        gw = self._owner
        put_seq = -1
        due = 0.0
        failures = 0
        while True:
            try:
                if self.lease is None:
                    with trio.fail_after(self.timeout):
                        self.lease, granted = await gw.grant(self.ttl)
                    self.counts["grants"] += 1
                    due = trio.current_time() + granted / 3
                    put_seq = -1
                    self._ok(self.own_part)
                self.advertiser.refresh(trio.current_time())
                if self._own_missing:  # deleted behind our back (the lease may live on)
                    self._own_missing, put_seq = False, -1
                if put_seq != self.advertiser.seq:
                    seq, body = self.advertiser.seq, self.advertiser.body
                    with trio.fail_after(self.timeout):
                        await gw.put(self.key, body, lease=self.lease)
                    self.counts["puts"] += 1
                    put_seq = seq
                    failures = 0
                    self._ok(self.own_part)
                with trio.move_on_at(due) as self._wake:
                    await self.advertiser.wait_changed(put_seq)
                if not self._wake.cancelled_caught or self._own_missing:
                    continue  # the advert changed, or our key is gone: put it now
                with trio.fail_after(self.timeout):
                    remaining = await gw.keepalive(self.lease)
                self.counts["keepalives"] += 1
                if remaining <= 0:
                    self._lost("the keepalive answer has no TTL")
                    continue
                due = trio.current_time() + min(self.ttl / 3, remaining / 2)
                failures = 0
                self._ok(self.own_part)
            except LeaseNotFound:
                self._lost("etcd has no such lease")
                failures += 1
                if failures > 1:  # lost again at once: do not spin
                    await trio.sleep(self.own_part.backoff.next())
            except Exception as exc:  # any failure is this loop's, retried with backoff
                failures += 1
                delay = self._failed(self.own_part, "renewing the lease", exc)
                if isinstance(exc, trio.TooSlowError | httpx2.PoolTimeout):
                    await self._renew(gw, streaming=False)
                await trio.sleep(delay)

    def _lost(self, why: str) -> None:
        log.warning("etcd: lease %s lost (%s); taking a new one", self.lease, why)
        self.counts["lost_leases"] += 1
        self.lease = None
        self._rewatch()

    def _wake_owner(self) -> None:
        """Our key was deleted (lease revoked or expired, or a plain delete): put it again
        now, not at the next tick (a lost lease shows as such when the put is refused)."""
        self._own_missing = True
        if self._wake is not None:
            self._wake.cancel(reason="own key deleted")

    # -- everyone's keys ----------------------------------------------------------------

    async def _watch(self) -> None:
        gw = self._watcher
        prefix = self.settings.prefix
        while True:
            try:
                with trio.fail_after(self.timeout):
                    revision, kvs = await gw.range(prefix)
                self.counts["ranges"] += 1
                self._apply_range(kvs)
                self.last_ok_at = trio.current_time()
                self.counts["watches"] += 1  # (the watch works once its first answer came)
                with trio.CancelScope() as self._watch_scope, trio.move_on_after(RERANGE_S):
                    await gw.watch(prefix, revision + 1, self._on_result)
                    raise Unreachable("the watch stream ended (etcd going away?)")
                # cancelled: a lost lease, etcd back after an outage, or the periodic check
                await self._renew(gw, streaming=True)
            except Exception as exc:  # any failure is this loop's, retried with backoff
                delay = self._failed(self.watch_part, "watching", exc)
                await self._renew(gw, streaming=True)
                await trio.sleep(delay)

    def _node_of(self, kv: KV) -> str:
        return kv.key_text[len(self.settings.prefix):]

    def _apply_range(self, kvs: list[KV]) -> None:
        now = trio.current_time()
        present = set()
        for kv in kvs:
            node = self._node_of(kv)
            present.add(node)
            self._put(node, kv, now)
        for node, e in list(self.table.entries.items()):
            if node not in present and e.left_at is None:
                self.table.delete(node, now, self.debounce(now))
        if self.node not in present and self.lease is not None:
            self._wake_owner()

    def _on_result(self, result: WatchResult) -> None:
        now = trio.current_time()
        self._ok(self.watch_part)
        for event in result.events:
            self.counts["events"] += 1
            node = self._node_of(event.kv)
            if event.type == "DELETE":
                if node == self.node:
                    self._wake_owner()
                else:
                    self.table.delete(node, now, self.debounce(now))
            else:
                self._put(node, event.kv, now)

    def _put(self, node: str, kv: KV, now: float) -> None:
        value = kv.value_bytes
        try:
            advert = decode(value)
        except AdvertRejected as exc:  # one node's value: skip it, never the watch
            self._reject(kv.key_text, "schema", str(exc))
            return
        if node == self.node:
            if advert.boot_id != self.advertiser.boot_id and not advert.leaving \
                    and not self._conflict_warned:
                self._conflict_warned = True
                log.error("etcd: another nvpair uses node name %r (boot %s); node names must "
                          "be unique", node, advert.boot_id)
            return
        if advert.node != node:
            self._reject(kv.key_text, "node", f"it names node {advert.node!r}")
            return
        self._rejected_logged.pop(kv.key_text, None)
        self.table.receive(advert, len(value), now)

    def _reject(self, key: str, why: str, message: str) -> None:
        """Count a value that is not a usable advert; log it once per key and reason."""
        self.rejected[why] = self.rejected.get(why, 0) + 1
        if self._rejected_logged.get(key) != message:
            if len(self._rejected_logged) >= 1000:
                self._rejected_logged.clear()
            self._rejected_logged[key] = message
            log.warning("etcd: ignoring %s: %s", key[:200], message)

    def doc(self, now: float) -> dict[str, Any]:
        """The etcd part of ``GET /v1/peers``."""
        gws = (self._owner, self._watcher)
        return {"url": self.settings.url, "key": self.key, "state": self.state,
                "state_age_s": age(now, self.state_at), "lease": self.lease,
                "lease_ttl_s": self.ttl, "last_ok_age_s": age(now, self.last_ok_at),
                "last_error": self.last_error, "last_error_age_s": age(now, self.last_error_at),
                "bytes_sent": sum(g.bytes_sent for g in gws),
                "bytes_received": sum(g.bytes_received for g in gws), **self.counts,
                "rejected": dict(self.rejected)}

