"""What a node says about itself to its peers, and the advertiser that keeps it current.

An advert is the whole state, never a delta: receivers keep the newest per node (by boot id
and sequence) and a lost advert costs nothing. It carries no wall-clock times; receivers age
it on their own monotonic clock.
"""

from __future__ import annotations

import logging
import secrets
from typing import Annotated, Any, NamedTuple

import msgspec
import trio

from nvpair.base.boundary import Part
from nvpair.base.changes import Changes
from nvpair.base.decoding import decode_json
from nvpair.base.urls import url_problem
from nvpair.config.cluster import NODE_PATTERN
from nvpair.errors import NvpairError
from nvpair.state.group import Report as GroupReport
from nvpair.state.listing import NAME_MAX, TEXT_MAX, ModelItem, Name, Text, catalog, visible
from nvpair.state.snapshot import Board
from nvpair.supervision.group import Reports

#: An advert larger than this is refused by receivers (413) and never sent: a node with
#: more models than fit advertises the first ones and how many it left out.
MAX_ADVERT_BYTES = 64 * 1024

log = logging.getLogger("nvpair.peers")

#: the longest model id, owner or alias receivers take (and names: engines, kinds, states)
#: are ``nvpair.state.listing``'s TEXT_MAX and NAME_MAX.
NodeName = Annotated[str, msgspec.Meta(pattern=NODE_PATTERN)]
#: where a node says it can be reached: requests for its models are sent there (checked
#: further by ``Advert.__post_init__``: scheme, host, port, IPv6 literal).
Url = Annotated[str, msgspec.Meta(max_length=512)]


#: One listed model, as the sender's own ``/v1/models`` lists it: the listing's own item,
#: advertised and stored as it is (its limits are the receivers').
AdvertModel = ModelItem


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
    #: this node's word on the multi-node groups it is in (docs/groups.md)
    groups: Annotated[tuple[GroupReport, ...], msgspec.Meta(max_length=64)] = ()

    def __post_init__(self) -> None:
        # checked at decode (msgspec turns this into a ValidationError): a URL nothing
        # could use (port 99999, "http://[::1") never reaches the table or the router.
        if self.url is not None and (problem := url_problem(self.url)) is not None:
            raise ValueError(f"url: {problem}, got {self.url[:100]!r}")

    def content(self) -> tuple[object, ...]:
        """What a receiver stores; equal contents need no new listing."""
        return (self.url, self.engines, self.models, self.groups)


decoder = msgspec.json.Decoder(Advert)
encoder = msgspec.json.Encoder()
_model_decoder = msgspec.json.Decoder(AdvertModel)
_engine_decoder = msgspec.json.Decoder(AdvertEngine)


class AdvertRejected(NvpairError):
    """A body that is not an advert (bad JSON, nested too deeply, a schema or URL this node
    refuses): the message says what, in one line."""


def decode(body: bytes) -> Advert:
    """An advert from a peer's body or an etcd value; any failure at all (``RecursionError``
    included) is ``AdvertRejected`` with one line: ``the advert does not fit: url: ...``."""
    advert: Advert = decode_json(body, "the advert", decoder=decoder,
                                 error=AdvertRejected)
    return advert


#: the models' refusals seen last (an unchanged listing is not checked again), by model and
#: the types that == cannot tell apart (created 1, 1.0 and True are equal and hash alike)
_refusals: dict[object, str | None] = {}
_REFUSALS_MAX = 50_000


def refusal(item: msgspec.Struct, check: msgspec.json.Decoder[Any]) -> str | None:
    """Why a receiver's decoder would refuse ``item`` (None: it takes it): the sender's
    check, made with the receivers' own types and limits."""
    if not isinstance(item, AdvertModel):
        return _refusal(item, check)
    key = (item, type(item.created), type(item.stale))
    try:
        return _refusals[key]
    except (KeyError, TypeError):  # not seen yet, or not hashable (then a refusal anyway)
        pass
    problem = _refusal(item, check)
    try:
        if len(_refusals) >= _REFUSALS_MAX:
            _refusals.clear()
        _refusals[key] = problem
    except TypeError:
        pass
    return problem


def _refusal(item: msgspec.Struct, check: msgspec.json.Decoder[Any]) -> str | None:
    try:
        check.decode(encoder.encode(item))
    except Exception as exc:  # a refusal, or a value that cannot even be encoded
        return " ".join(str(exc).split())[:200] or type(exc).__name__
    return None


class Described(NamedTuple):
    engines: tuple[AdvertEngine, ...]
    models: tuple[AdvertModel, ...]
    #: models peers would refuse (too long an id or owner, a created that is not an
    #: integer...), left out so that they cannot make peers refuse the whole advert
    unfit: int = 0
    #: why the first of them does not fit, in words
    why: str = ""
    #: models not looked at: those before them already fill an advert
    beyond: int = 0


def advertised(board: Board, node: str, now: float,
             budget: int = MAX_ADVERT_BYTES) -> Described:
    """The engines and models part of this node's advert, from the board's listing.

    Only what peers list goes in: states, model ids and flags, never probe counters or ages,
    so the content changes only when the listing does. Models are taken in the listing's
    order until their encoding alone fills ``budget`` (the rest are ``beyond``: an advert
    could not carry them); each is checked against the receivers' own limits, and a model
    that does not fit is left out (and counted), its id left out of its engine's list.
    """
    del node  # (the advert names the node once, not per model)
    cat = catalog(board, now)
    models = []
    refused: set[object] = set()
    unfit = 0
    why = ""
    size = 0
    seen = 0
    total = sum(len(cat.owned[pos]) for pos in cat.order)
    for pos in cat.order:
        for model in cat.owned[pos]:
            if size > budget:
                break
            seen += 1
            model_id = model.id
            if (problem := refusal(model, _model_decoder)) is None:
                models.append(model)
                size += len(encoder.encode(model)) + len(model_id) + 4  # (+ its engine's list)
            else:
                refused.add(model_id)
                unfit += 1
                why = why or f"engine {model.engine!r}: model {model_id[:60]!r}: {problem}"
    kept = None if seen == total else {m.id for m in models}
    engines = []
    snap = board.current
    for pos, e in enumerate(snap.engines):
        if not visible(e):
            continue
        ids = tuple(m.id for m in e.models if (m.id in kept if kept is not None else (
            m.id not in refused and isinstance(m.id, str) and len(m.id) <= TEXT_MAX)))
        engine = AdvertEngine(name=e.name, kind=e.kind, models=ids, state=cat.shown[pos])
        if (problem := refusal(engine, _engine_decoder)) is None:
            engines.append(engine)
        else:  # cannot happen with a valid config; never let it cost the whole advert
            why = why or f"engine {e.name[:NAME_MAX]!r}: {problem}"
    return Described(tuple(engines), tuple(models), unfit, why, total - seen)


def _stable(models: tuple[AdvertModel, ...]) -> tuple[AdvertModel, ...]:
    """Models without ``created``: some engines (vLLM) answer the time of the request."""
    return tuple(msgspec.structs.replace(m, created=0) for m in models)


class Advertiser:
    """This node's current advert, encoded once per change and shared by every sender.

    ``refresh`` is sync (called by senders before they send, and by ``run`` on every
    listing change: probe counters and ages wake nothing here); ``wait_changed`` wakes
    senders when the content changed.
    """

    def __init__(self, board: Board, node: str, ttl_s: float, url: str | None = None,
                 groups: Reports | None = None) -> None:
        self.board = board
        #: this node's group reports (refreshed on each of their changes: see Reports)
        self.groups = groups
        self.node = node
        self.ttl_s = ttl_s
        self.url = url
        self.boot_id = secrets.token_hex(8)
        self._changes = Changes()
        #: the listing version and URL the last content was built from
        self._built: tuple[int, str | None, tuple[GroupReport, ...]] | None = None
        self._advert = Advert(node=node, boot_id=self.boot_id, seq=0, ttl_s=ttl_s, url=url)
        self._content: tuple[object, ...] | None = None  # the last content built from
        self._unfit = 0  # models left out because peers would refuse them (logged on change)
        self.body = encoder.encode(self._advert)
        self.changed_at = trio.current_time()
        #: the advertiser's fault boundary (its failure: ``fault``, shown in /v1/peers).
        self.part = Part("peers: advertiser", self._publish, max_s=30.0)
        self.fault: str | None = None
        self._refused = False  # the last content built would be refused: a fault until it moves
        with self.part.guard():
            self.refresh(trio.current_time())

    def _publish(self, reason: str | None) -> None:
        self.fault = reason

    @property
    def advert(self) -> Advert:
        return self._advert

    @property
    def seq(self) -> int:
        return self._advert.seq

    def set_url(self, url: str) -> None:
        self.url = url
        self.refresh(trio.current_time())

    def set_ttl(self, ttl_s: float) -> None:
        """A reload changed the TTL peers hold this node to: a new advert says so."""
        if ttl_s != self.ttl_s:
            self.ttl_s = ttl_s
            self._built = self._content = None  # (the TTL is no part of the content)
            self.refresh(trio.current_time())

    def refresh(self, now: float) -> bool:
        """Rebuild the advert if its content changed; True if it did (seq grew). With the
        listing and URL as last time this returns at once, whatever the number of models."""
        groups = () if self.groups is None else self.groups.all()
        built = (self.board.listed(now), self.url, groups)
        if self._advert.seq and built == self._built:
            return False
        engines, models, unfit, why, beyond = advertised(self.board, self.node, now)
        content = (self.url, engines, _stable(models), beyond, unfit, groups)  # unfit: left_out
        self._built = built
        if self._advert.seq and content == self._content:
            return False
        self._content = content
        if unfit != self._unfit and unfit:
            log.warning("advert: %d models left out: peers would refuse them (%s)", unfit, why)
        self._unfit = unfit
        seq = max(self.board.current.version, self._advert.seq + 1)
        advert = Advert(node=self.node, boot_id=self.boot_id, seq=seq, ttl_s=self.ttl_s,
                        url=self.url, engines=engines, models=models,
                        left_out=unfit + beyond, groups=groups)
        body = encoder.encode(advert)
        if len(body) > MAX_ADVERT_BYTES:
            advert, body = _fitted(advert)
            if len(body) > MAX_ADVERT_BYTES:  # the engines alone: keep the last that fit
                log.error("advert: %d engines do not fit %d bytes; peers keep the last advert",
                          len(engines), MAX_ADVERT_BYTES)
                return False
            log.warning("advert: %d of %d models left out: the advert must fit %d bytes",
                        advert.left_out - unfit, len(models) + beyond, MAX_ADVERT_BYTES)
        try:  # the receivers' own decoder, on the whole advert, before anyone gets it
            decode(body)
        except AdvertRejected as exc:  # a bug of nvpair's: peers keep the last advert
            self._refused = True
            self.part.failed(RuntimeError(f"this node's advert would be refused: {exc}"))
            return False
        self._refused = False
        self._advert, self.body, self.changed_at = advert, body, now
        self._changes.bump()
        return True

    def leave_body(self) -> bytes:
        """The graceful-leave advert (no engines, so a late copy can list nothing)."""
        leave = Advert(node=self.node, boot_id=self.boot_id, seq=self.seq + 1,
                       ttl_s=self.ttl_s, url=self.url, leaving=True)
        return encoder.encode(leave)

    async def wait_changed(self, seq: int) -> None:
        """Return once the advert's seq differs from ``seq``."""
        while self._advert.seq == seq:
            await self._changes.wait_changed(self._changes.version)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Refresh on every listing change, until cancelled. Started value: None, at once.
        Cancellation: a plain wait is cancelled (the last advert stays, nothing to close).
        Raises: nothing but Cancelled (a failure is the advertiser's ``fault``, retried
        with backoff)."""
        task_status.started()
        await self.part.supervise(self._loop)

    async def _loop(self) -> None:
        version = self.board.listed(trio.current_time())
        while True:
            self.refresh(trio.current_time())  # (first: again after a failure)
            if not self._refused:
                self.part.ok()
            version = await self.board.wait_listed(version)


def _fitted(advert: Advert) -> tuple[Advert, bytes]:
    """The advert with as many of its models as fit MAX_ADVERT_BYTES (the first ones, and
    the engines naming only those), and how many were left out."""

    def cut(n: int) -> tuple[Advert, bytes]:
        kept = advert.models[:n]
        ids = {m.id for m in kept}
        engines = tuple(msgspec.structs.replace(e, models=tuple(m for m in e.models if m in ids))
                        for e in advert.engines)
        smaller = msgspec.structs.replace(advert, models=kept, engines=engines,
                                          left_out=advert.left_out + len(advert.models) - n)
        return smaller, encoder.encode(smaller)

    low, high = 0, len(advert.models)  # cut(low) fits (none fit: the engines alone)
    while low < high:
        mid = (low + high + 1) // 2
        if len(cut(mid)[1]) <= MAX_ADVERT_BYTES:
            low = mid
        else:
            high = mid - 1
    return cut(low)

