"""One pusher per configured peer: this node's advert, sent over one kept-alive connection.

When: at once when the advert changes (coalesced: a change during a push makes the next push
carry the newest advert, never a queue), else every ``interval`` x U(0.8, 1.2); the first
at a random offset in [0, interval) so that restarts do not synchronise. After three failed
pushes in a row the delay doubles, with jitter, up to 4 x interval (changes wait too).

Connection hygiene: one client per peer (replaced after a push that ran out of time, with
whatever that left in its pool), at most one connection and one request in flight, and a
total deadline per push. The client keeps an idle connection ``2 x interval`` and the
receiving nvpair ``3 x interval`` (see ``keep_alive_for``), so steady pushes reuse their
connection and the client, not the server, closes an idle one (no CLOSE-WAIT piles up here).
Failures are recorded in the ``Link`` and logged (the 1st, 2nd, 4th, 8th... in a row), never
raised. The loop is a fault boundary (``nvpair.base.boundary.Part``): anything else that goes
wrong in it (a bug of nvpair's) is a failed push of this link with the reason (``fault`` in
``/v1/peers``), retried after a backoff; it never reaches the other links or the node.
"""

from __future__ import annotations

import logging
import random
from contextlib import aclosing
from typing import Any

import httpx2
import msgspec
import trio

from nvpair.base.boundary import Part
from nvpair.base.decoding import is_digits
from nvpair.base.tls import client_tls
from nvpair.config.cluster import PeerTarget
from nvpair.peers.advert import Advertiser
from nvpair.peers.receiver import ADVERTS_PATH
from nvpair.peers.table import Link

log = logging.getLogger("nvpair.peers")

#: a graceful leave is sent to every peer in parallel, within this budget.
LEAVE_BUDGET_S = 1.0
#: the most of a peer's answer to a push that is read (a 204 has none; an error is a line)
ANSWER_MAX_BYTES = 64 * 1024


def keep_alive_for(interval: float) -> float:
    """How long a receiving nvpair should keep an idle peer connection open."""
    return 3 * interval


class Pusher:
    """Sends this node's advert to one peer (see the module): on change and on a jittered
    interval, one request at a time over one connection. The outcomes go to its ``Link``
    in the peer table; ``leave()`` ends the pushes with one leave advert."""

    def __init__(self, target: PeerTarget, advertiser: Advertiser, link: Link, *,
                 interval: float, timeout: float,
                 transport: httpx2.AsyncBaseTransport | None = None,
                 rng: random.Random | None = None) -> None:
        self.target = target
        self.advertiser = advertiser
        self.link = link
        self.interval = interval
        self.timeout = timeout
        self.transport = transport
        self.rng = rng or random.Random()
        self.done = trio.Event()
        self._loop_scope = trio.CancelScope()
        self._leaving = False
        self._stopped = False
        self._http: httpx2.AsyncClient | None = None
        self._in_flight = False
        self.part = Part(f"peer {target.url}", self._publish, initial_s=interval,
                         max_s=4 * interval, rng=self.rng)

    def _publish(self, reason: str | None) -> None:
        if reason is not None:
            self.link.failed(trio.current_time(), reason)
        self.link.fault = reason

    def client(self) -> httpx2.AsyncClient:
        limits = httpx2.Limits(max_connections=1, max_keepalive_connections=1,
                               keepalive_expiry=2 * self.interval)
        headers = {"authorization": f"Bearer {self.target.token}",
                   "content-type": "application/json", "user-agent": "nvpair-peers"}
        # A pool wait means a leaked slot (never more than one request is in flight here):
        # fail it fast and start over with a new client.
        timeout = httpx2.Timeout(self.timeout, pool=min(0.5, self.timeout))
        return httpx2.AsyncClient(base_url=self.target.url, headers=headers, limits=limits,
                                  timeout=timeout, trust_env=False, transport=self.transport,
                                  verify=client_tls())

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Push until cancelled or until ``leave()``; then send the leave advert.

        Started value: None, once the client exists. After ``leave()``, one leave advert
        is sent (at most ``LEAVE_BUDGET_S``) and it returns; after ``stop()`` it returns.
        Cancellation: closes the connection (shielded, at most 1 s) without a leave
        advert. ``done`` is set when it ends either way. Raises: nothing but Cancelled: a
        failed push is the link's state, any other failure its ``fault``, retried with
        backoff.
        """
        self._http = self.client()
        # new for each run (the broker runs its senders again after a failure; a scope is
        # entered once); a leave() asked for before still counts
        self._loop_scope = trio.CancelScope()
        if self._leaving or self._stopped:
            self._loop_scope.cancel(reason="nvpair is leaving the cluster")
        if self.done.is_set():
            self.done = trio.Event()
        try:
            task_status.started()
            with self._loop_scope:
                await self.part.supervise(self._loop)
            if self._leaving:
                with trio.move_on_after(LEAVE_BUDGET_S), self.part.guard():
                    if self._in_flight:  # the leave cut a push short
                        await self._renew()
                    await self.push(self.advertiser.leave_body())
        finally:
            with trio.move_on_after(1, shield=True), self.part.guard():
                await self._http.aclose()
            self.done.set()

    def leave(self) -> None:
        """Stop the regular pushes and send one leave advert (sync; see ``done``)."""
        self._leaving = True
        self._loop_scope.cancel(reason="nvpair is leaving the cluster")

    def stop(self) -> None:
        """Stop the pushes without a leave advert: a reload replaced this sender with one
        for the same peer, which goes on with this node's advert (sync; see ``done``)."""
        self._stopped = True
        self._loop_scope.cancel(reason="a reload replaced this sender")

    async def _loop(self) -> None:
        deadline = trio.current_time() + self.rng.uniform(0, self.interval)
        sent = self.advertiser.seq
        while True:
            if self.link.consecutive_failures:
                await trio.sleep_until(deadline)
            else:
                with trio.move_on_at(deadline):
                    await self.advertiser.wait_changed(sent)
            self.advertiser.refresh(trio.current_time())
            sent = self.advertiser.seq
            ok = await self.push(self.advertiser.body)
            deadline = trio.current_time() + self.next_delay(ok)

    def next_delay(self, ok: bool) -> float:
        failures = 0 if ok else self.link.consecutive_failures
        if failures < 3:
            return self.interval * self.rng.uniform(0.8, 1.2)
        cap = min(4 * self.interval, self.interval * 2.0 ** (failures - 2))
        return cap * self.rng.uniform(0.5, 1.0)

    async def push(self, body: bytes) -> bool:
        """One POST of ``body``; True if the peer stored it (204). Never raises."""
        assert self._http is not None
        error = "?"
        renew = False
        with trio.move_on_after(self.timeout) as scope:
            try:
                self._in_flight = True
                async with self._http.stream("POST", ADVERTS_PATH, content=body,
                                             extensions={"trace": self._trace}) as r:
                    answer = await _read_at_most(r, ANSWER_MAX_BYTES)
                self._in_flight = False
            except Exception as exc:  # httpx2 errors and OSError: a state, never a crash
                error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
                renew = isinstance(exc, httpx2.PoolTimeout)
            else:
                if r.status_code == 204:
                    self._ok(r.headers.get("x-nvpair-node"), len(body))
                    return True
                error = f"HTTP {r.status_code}: {_message(answer)}"
        if scope.cancelled_caught:
            error = f"no answer within {self.timeout:g} s"
            renew = True
        if renew:
            await self._renew()
        failures = self.link.consecutive_failures + 1
        if failures & (failures - 1) == 0:  # the 1st, 2nd, 4th, 8th... failure in a row
            log.warning("peer %s: push failed (%d in a row): %s", self.target.url, failures,
                        error)
        self.link.failed(trio.current_time(), error)
        return False

    async def _renew(self) -> None:
        """A new client: whatever a cancelled request left in the pool goes with the old."""
        assert self._http is not None
        old, self._http = self._http, self.client()
        self._in_flight = False
        with trio.move_on_after(1):
            await old.aclose()

    def _ok(self, node: str | None, nbytes: int) -> None:
        if self.link.consecutive_failures:
            log.info("peer %s: pushes get through again", self.target.url)
        if node:
            self.link.learn(node)
        self.link.ok(trio.current_time(), nbytes)
        self.part.ok()

    async def _trace(self, name: str, info: dict[str, Any]) -> None:
        if name == "connection.connect_tcp.complete":
            self.link.connects += 1


async def _read_at_most(r: httpx2.Response, limit: int) -> bytes:
    """The answer's body, or its first ``limit`` bytes; the rest is never read (leaving
    the stream closes the connection). A declared length over ``limit``: nothing is read."""
    length = r.headers.get("content-length", "")
    if is_digits(length) and int(length) > limit:
        return b"(an answer of %d bytes, not read)" % int(length)
    chunks, size = [], 0
    async with aclosing(r.aiter_bytes()) as body:  # closed here, not when collected
        async for chunk in body:
            chunks.append(chunk)
            size += len(chunk)
            if size >= limit:
                break
    return b"".join(chunks)[:limit]


def _message(answer: bytes) -> str:
    try:
        doc = msgspec.json.decode(answer)
        return " ".join(str(doc["error"]["message"]).split())[:200]
    except Exception:
        return " ".join(answer[:200].decode("utf-8", "replace").split())
