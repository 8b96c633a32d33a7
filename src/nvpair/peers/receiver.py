"""``POST /v1/peers/adverts``: where peers' adverts arrive (push backend).

O(1) per request (a changed advert costs O(peers)) and never calls out: the cluster token
is compared in constant time, the body is capped (413 above 64 KiB, before any of it is
parsed), the schema is checked (400), and the table keeps the newest advert per node. The
answer is 204 with this node's name in ``x-nvpair-node`` (so a sender learns whom its URL
reaches)."""

from __future__ import annotations

import hmac
import logging

import trio

from nvpair.http.asgi import (
    BodyTooLarge,
    Receive,
    Scope,
    Send,
    bearer,
    header,
    read_body,
    send_error,
    send_wrong_method,
)
from nvpair.peers.advert import MAX_ADVERT_BYTES, AdvertRejected, decode
from nvpair.peers.table import PeerTable

log = logging.getLogger("nvpair.peers")

ADVERTS_PATH = "/v1/peers/adverts"
#: a sender that starts a body and stalls gets 408 after this long.
READ_BUDGET_S = 5.0


class Receiver:
    """The ASGI handler of ``ADVERTS_PATH`` (mounted with ``own_auth``)."""

    def __init__(self, table: PeerTable, token: str) -> None:
        self.table = table
        self.expected = token.encode()
        self.node_header = [(b"x-nvpair-node", table.node.encode())]
        self.accepted = 0
        self.rejected: dict[str, int] = {}

    def _reject(self, why: str) -> None:
        self.rejected[why] = self.rejected.get(why, 0) + 1

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["method"] != "POST":
            await send_wrong_method(send, "POST", ADVERTS_PATH)
            return
        given = bearer(scope) or b""
        if not hmac.compare_digest(given, self.expected):
            self._reject("token")
            await send_error(send, 401, "missing or wrong cluster token", "invalid_cluster_token",
                             [(b"www-authenticate", b"Bearer")])
            return
        length = header(scope, b"content-length")
        if length is not None and (not length.isdigit() or int(length) > MAX_ADVERT_BYTES):
            self._reject("size")
            await send_error(send, 413, f"an advert is at most {MAX_ADVERT_BYTES} bytes")
            return
        body = b""
        with trio.move_on_after(READ_BUDGET_S) as scope_:
            try:
                body = await read_body(receive, MAX_ADVERT_BYTES)
            except BodyTooLarge:
                self._reject("size")
                await send_error(send, 413, f"an advert is at most {MAX_ADVERT_BYTES} bytes")
                return
        if scope_.cancelled_caught:
            self._reject("slow")
            await send_error(send, 408, f"the advert did not arrive within {READ_BUDGET_S:g} s")
            return
        try:
            advert = decode(body)
        except AdvertRejected as exc:  # any decode failure, RecursionError and bad URLs too
            self._reject("schema")
            await send_error(send, 400, str(exc), "invalid_advert")
            return
        if advert.node == self.table.node:
            self._reject("self")
            await send_error(send, 409, f"{advert.node!r} is this node's own name; node names "
                             "must be unique", "duplicate_node")
            return
        outcome = self.table.receive(advert, len(body), trio.current_time())
        if outcome == "old-boot":  # another process took this name over (or a replay)
            self._reject("old-boot")
            await send_error(send, 409, f"node {advert.node!r}: boot {advert.boot_id} was "
                             "replaced by a newer one; if two processes run with this name, "
                             "give each its own node name", "duplicate_node")
            return
        self.accepted += 1
        if outcome in ("new", "restarted", "left"):
            log.info("peer %s: %s (boot %s)", advert.node, outcome, advert.boot_id)
        await send({"type": "http.response.start", "status": 204,
                    "headers": [*self.node_header, (b"x-nvpair-outcome", outcome.encode())]})
        await send({"type": "http.response.body", "body": b""})
