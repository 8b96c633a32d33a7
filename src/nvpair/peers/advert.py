"""What a node says about itself to its peers, and the advertiser that keeps it current.

An advert is the whole state, never a delta: receivers keep the newest per node (by boot id
and sequence) and a lost advert costs nothing. It carries no wall-clock times; receivers age
it on their own monotonic clock.
"""

from __future__ import annotations

import logging
import secrets
from typing import Annotated

import msgspec
import trio

from nvpair import views
from nvpair.peers.settings import NODE_PATTERN, URL_PATTERN
from nvpair.snapshot import Board
from nvpair.state import effective_state

#: An advert larger than this is refused by receivers (413) and never sent: a node with
#: more models than fit advertises the first ones and how many it left out.
MAX_ADVERT_BYTES = 64 * 1024

log = logging.getLogger("nvpair.peers")

Text = Annotated[str, msgspec.Meta(max_length=512)]
Name = Annotated[str, msgspec.Meta(max_length=128)]
NodeName = Annotated[str, msgspec.Meta(pattern=NODE_PATTERN)]
#: where a node says it can be reached: requests for its models are sent there.
Url = Annotated[str, msgspec.Meta(pattern=URL_PATTERN, max_length=512)]


class AdvertModel(msgspec.Struct, frozen=True):
    """One listed model, as the sender's own ``/v1/models`` lists it."""

    id: Text
    engine: Name
    engines: tuple[Name, ...] = ()
    kind: Name = ""
    state: Name = "ready"
    stale: bool = False
    created: int = 0
    owned_by: Text = ""
    alias_of: Text | None = None


class AdvertEngine(msgspec.Struct, frozen=True):
    name: Name
    kind: Name
    state: Name
    models: tuple[Text, ...] = ()


class Advert(msgspec.Struct, frozen=True):
    """``POST /v1/peers/adverts`` and the value of a node's etcd key (unknown keys are
    ignored, so newer nodes may add fields)."""

    node: NodeName
    #: random per process start: a restart replaces the old entry even though seq restarts.
    boot_id: Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
    #: grows within a boot (the board version when the content last changed).
    seq: Annotated[int, msgspec.Meta(ge=0)]
    #: the sender's wish: stale after this long without an advert (receivers clamp it).
    ttl_s: Annotated[float, msgspec.Meta(gt=0)]
    url: Url | None = None
    engines: tuple[AdvertEngine, ...] = ()
    models: tuple[AdvertModel, ...] = ()
    #: a graceful leave: drop this node at once (and ignore this boot from now on).
    leaving: bool = False
    #: models this node serves but left out so the advert fits MAX_ADVERT_BYTES.
    left_out: Annotated[int, msgspec.Meta(ge=0)] = 0

    def content(self) -> tuple[object, ...]:
        """What a receiver stores; equal contents need no new listing."""
        return (self.url, self.engines, self.models)


decoder = msgspec.json.Decoder(Advert)
encoder = msgspec.json.Encoder()


def describe(board: Board, node: str, now: float) -> tuple[tuple[AdvertEngine, ...],
                                                           tuple[AdvertModel, ...]]:
    """The engines and models part of this node's advert, from the board's current snapshot.

    Only what peers list goes in: states, model ids and flags, never probe counters or ages,
    so the content changes only when the listing would.
    """
    snap = board.current
    engines = tuple(
        AdvertEngine(name=e.name, kind=e.kind, state=effective_state(e, now, e.overdue_after_s),
                     models=tuple(m.id for m in e.models))
        for e in snap.engines if views.visible(e))
    models = []
    for item in views.models_doc(snap, now, node)["data"]:
        nv = item["nvpair"]
        models.append(AdvertModel(
            id=item["id"], engine=nv["engine"], engines=tuple(nv["engines"]), kind=nv["kind"],
            state=nv["state"], stale=nv["stale"], created=item["created"],
            owned_by=item["owned_by"], alias_of=nv["alias_of"]))
    return engines, tuple(models)


def _stable(models: tuple[AdvertModel, ...]) -> tuple[AdvertModel, ...]:
    """Models without ``created``: some engines (vLLM) answer the time of the request."""
    return tuple(msgspec.structs.replace(m, created=0) for m in models)


class Advertiser:
    """This node's current advert, encoded once per change and shared by every sender.

    ``refresh`` is sync (called by senders before they send, and by ``run`` on every board
    change); ``wait_changed`` wakes senders when the content changed.
    """

    def __init__(self, board: Board, node: str, ttl_s: float, url: str | None = None) -> None:
        self.board = board
        self.node = node
        self.ttl_s = ttl_s
        self.url = url
        self.boot_id = secrets.token_hex(8)
        self._changed = trio.Event()
        self._advert = Advert(node=node, boot_id=self.boot_id, seq=0, ttl_s=ttl_s, url=url)
        self._content: tuple[object, ...] | None = None  # the last content built from
        self.body = encoder.encode(self._advert)
        self.changed_at = trio.current_time()
        self.refresh(trio.current_time())

    @property
    def advert(self) -> Advert:
        return self._advert

    @property
    def seq(self) -> int:
        return self._advert.seq

    def set_url(self, url: str) -> None:
        self.url = url
        self.refresh(trio.current_time())

    def refresh(self, now: float) -> bool:
        """Rebuild the advert if its content changed; True if it did (seq grew)."""
        engines, models = describe(self.board, self.node, now)
        content = (self.url, engines, _stable(models))
        if self._advert.seq and content == self._content:
            return False
        self._content = content
        seq = max(self.board.current.version, self._advert.seq + 1)
        advert = Advert(node=self.node, boot_id=self.boot_id, seq=seq, ttl_s=self.ttl_s,
                        url=self.url, engines=engines, models=models)
        body = encoder.encode(advert)
        if len(body) > MAX_ADVERT_BYTES:
            advert, body = _fitted(advert)
            if len(body) > MAX_ADVERT_BYTES:  # the engines alone: keep the last that fit
                log.error("advert: %d engines do not fit %d bytes; peers keep the last advert",
                          len(engines), MAX_ADVERT_BYTES)
                return False
            log.warning("advert: %d of %d models left out: the advert must fit %d bytes",
                        advert.left_out, len(models), MAX_ADVERT_BYTES)
        self._advert, self.body, self.changed_at = advert, body, now
        self._changed.set()
        self._changed = trio.Event()
        return True

    def leave_body(self) -> bytes:
        """The graceful-leave advert (no engines, so a late copy can list nothing)."""
        leave = Advert(node=self.node, boot_id=self.boot_id, seq=self.seq + 1,
                       ttl_s=self.ttl_s, url=self.url, leaving=True)
        return encoder.encode(leave)

    async def wait_changed(self, seq: int) -> None:
        """Return once the advert's seq differs from ``seq``."""
        while self._advert.seq == seq:
            await self._changed.wait()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Refresh on every board change, until cancelled."""
        version = self.board.current.version
        task_status.started()
        while True:
            snap = await self.board.wait_changed(version)
            version = snap.version
            self.refresh(trio.current_time())


def _fitted(advert: Advert) -> tuple[Advert, bytes]:
    """The advert with as many of its models as fit MAX_ADVERT_BYTES (the first ones, and
    the engines naming only those), and how many were left out."""

    def cut(n: int) -> tuple[Advert, bytes]:
        kept = advert.models[:n]
        ids = {m.id for m in kept}
        engines = tuple(msgspec.structs.replace(e, models=tuple(m for m in e.models if m in ids))
                        for e in advert.engines)
        smaller = msgspec.structs.replace(advert, models=kept, engines=engines,
                                          left_out=len(advert.models) - n)
        return smaller, encoder.encode(smaller)

    low, high = 0, len(advert.models)  # cut(low) fits (none fit: the engines alone)
    while low < high:
        mid = (low + high + 1) // 2
        if len(cut(mid)[1]) <= MAX_ADVERT_BYTES:
            low = mid
        else:
            high = mid - 1
    return cut(low)

