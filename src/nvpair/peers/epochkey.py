"""With the etcd backend: a group's epoch under one key, moved by its head with a
compare-and-swap tied to the head's lease.

The head puts ``{"epoch": N, "node": NAME}`` under ``<root>groups/<group>`` (``<root>``: the
node prefix without its last part, ``nvpair/default/`` for ``nvpair/default/nodes/``) only
if the key is absent or already held by its own lease; a key held by another lease is
another head's, and this one starts nothing until that lease is gone. The key goes with
the lease, so a head that dies releases it within the lease TTL.

Ranks watch the key (``EpochWatch``): a rank runs a process only for the epoch its head
holds there (``machine.apply_key``), so two heads can never both run an epoch, and a rank
fences itself as soon as the key is gone with its head's lease (not ``fence_after_s``
later, as it would from the head's advert alone).
"""

from __future__ import annotations

import base64
import logging
import ssl
from collections.abc import Callable
from typing import Any

import httpx2
import msgspec
import trio

from nvpair.base.boundary import Part
from nvpair.base.tls import client_tls
from nvpair.peers.etcd import EtcdBackend
from nvpair.peers.gateway import KV, Gateway, WatchResult
from nvpair.state.group import KeyView

log = logging.getLogger("nvpair.group")

#: one claim (two transactions at most) gets this long
CLAIM_TIMEOUT_S = 3.0
#: a rank's watch of the key ranges it again this often (a consistency check)
REREAD_S = 60.0


def _b64(data: str | bytes) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode()


def key_for(prefix: str, group: str) -> str:
    """``nvpair/default/nodes/`` -> ``nvpair/default/groups/<group>``."""
    root = prefix.rstrip("/").rpartition("/")[0]
    return f"{root}/groups/{group}" if root else f"groups/{group}"


class _Held(msgspec.Struct):
    epoch: int = 0
    node: str = "?"


class _KV(msgspec.Struct):
    value: str = ""
    lease: str = "0"


class _RangeAnswer(msgspec.Struct):
    kvs: list[_KV] = []


class _Op(msgspec.Struct):
    response_range: _RangeAnswer | None = None


class _Txn(msgspec.Struct):
    succeeded: bool = False
    responses: list[_Op] = []


class _Auth(msgspec.Struct):
    token: str


class EpochKey:
    """``claim(epoch)`` for one group's head (``GroupRunner.claim``)."""

    def __init__(self, backend: EtcdBackend, group: str, node: str, *,
                 transport: httpx2.AsyncBaseTransport | None = None) -> None:
        self.backend = backend
        self.key = key_for(backend.settings.prefix, group)
        self.node = node
        self._transport = transport
        self._token: str | None = None

    async def _post(self, client: httpx2.AsyncClient, path: str, doc: dict[str, Any]
                    ) -> bytes:
        s = self.backend.settings
        if s.username is not None and self._token is None:
            r = await client.post("/v3/auth/authenticate",
                                  json={"name": s.username, "password": s.password})
            r.raise_for_status()
            self._token = msgspec.json.decode(r.content, type=_Auth).token
        headers = {"authorization": self._token} if self._token else {}
        r = await client.post(path, content=msgspec.json.encode(doc), headers=headers)
        if r.status_code == 401:
            self._token = None
        r.raise_for_status()
        return r.content[:1 << 20]

    async def claim(self, epoch: int) -> str | None:
        """Put ``epoch`` under the key if it is absent or held by this node's lease; None
        once done, else why not, in words (the key another head holds, no lease yet)."""
        lease = self.backend.lease
        if lease is None:
            return "this node has no etcd lease yet"
        s = self.backend.settings
        value = msgspec.json.encode({"epoch": epoch, "node": self.node})
        put = {"request_put": {"key": _b64(self.key), "value": _b64(value), "lease": str(lease)}}
        read = {"request_range": {"key": _b64(self.key)}}
        absent = {"key": _b64(self.key), "target": "CREATE", "result": "EQUAL",
                  "create_revision": "0"}
        ours = {"key": _b64(self.key), "target": "LEASE", "result": "EQUAL", "lease": str(lease)}
        verify = client_tls()
        if s.ca_file or s.cert_file:  # (as the etcd backend's own client)
            verify = ssl.create_default_context(cafile=s.ca_file)
            if s.cert_file and s.key_file:
                verify.load_cert_chain(s.cert_file, s.key_file)
        async with httpx2.AsyncClient(base_url=s.url, timeout=CLAIM_TIMEOUT_S, verify=verify,
                                      trust_env=False, transport=self._transport) as client:
            held: _KV | None = None
            for compare in (absent, ours):
                raw = await self._post(client, "/v3/kv/txn", {
                    "compare": [compare], "success": [put], "failure": [read]})
                answer = msgspec.json.decode(raw, type=_Txn)
                if answer.succeeded:
                    return None
                for op in answer.responses:
                    if op.response_range is not None and op.response_range.kvs:
                        held = op.response_range.kvs[0]
        if held is None:
            return "the key changed while it was claimed; trying again"
        try:
            who = msgspec.json.decode(base64.b64decode(held.value), type=_Held)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError):
            who = _Held()
        return (f"{self.key} is held by {who.node} (epoch {who.epoch}, lease {held.lease}): "
                "another head; this one starts nothing until that lease is gone")


def view_of(kv: KV | None) -> KeyView:
    """The key's value as a rank reads it; a value that is not a head's claim is held by
    nobody this rank follows (node "?")."""
    if kv is None:
        return KeyView(None)
    try:
        held = msgspec.json.decode(kv.value_bytes, type=_Held)
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError):
        return KeyView(-1, "?")
    return KeyView(held.epoch, held.node)


class EpochWatch:
    """A rank's watch of its group's epoch key: ``view`` is the key as last read (None:
    not read yet), and ``on_change`` is called when it changes. A failing watch keeps the
    last view and tries again with backoff (the head's advert still fences this rank)."""

    def __init__(self, backend: EtcdBackend, group: str, *,
                 transport: httpx2.AsyncBaseTransport | None = None) -> None:
        self.backend = backend
        self.key = key_for(backend.settings.prefix, group)
        self.view: KeyView | None = None
        self.on_change: Callable[[], None] = lambda: None
        self.part = Part(f"group {group}: epoch key watch", initial_s=0.5, max_s=5.0,
                         logger=log)
        self._transport = transport

    async def run(self) -> None:
        """Watch until cancelled (each failure retried with backoff)."""
        await self.part.supervise(self._loop)

    def _set(self, view: KeyView) -> None:
        if view != self.view:
            self.view = view
            self.on_change()

    async def _loop(self) -> None:
        s = self.backend.settings
        timeout = httpx2.Timeout(CLAIM_TIMEOUT_S, read=None)
        async with httpx2.AsyncClient(base_url=s.url, timeout=timeout, trust_env=False,
                                      verify=self.backend._tls,
                                      transport=self._transport) as client:
            gw = Gateway(client, username=s.username, password=s.password)
            while True:
                with trio.fail_after(CLAIM_TIMEOUT_S):
                    revision, kvs = await gw.range(self.key)
                self._set(view_of(next((kv for kv in kvs if kv.key_text == self.key), None)))
                self.part.ok()
                with trio.move_on_after(REREAD_S):
                    await gw.watch(self.key, revision + 1, self._on_result)
                    raise ConnectionError("the watch stream ended (etcd going away?)")

    def _on_result(self, result: WatchResult) -> None:
        for event in result.events:
            if event.kv.key_text == self.key:  # (the watch is of a prefix: "g" and "g2")
                self._set(KeyView(None) if event.type == "DELETE" else view_of(event.kv))
