"""The listing: what ``/v1/models``, adverts and peers see of this node's engines.

Built from the board's snapshots engine by engine, once per listing version
(``Board.listing``, which probe counters and ages do not move): an engine whose listed
fields changed gets its model items (``ModelItem``) rebuilt, and so do the engines whose
items name it (a model several engines serve lists them all); nothing else is touched.
``ModelsBody`` keeps each engine's part of the ``/v1/models`` body encoded, and joins
the parts with each engine's ``checked_age_s`` at read time, so a change to one engine
re-encodes one engine and an age re-encodes nothing. Each listing version is a
``Catalog`` of its own, never changed: a reader that takes one keeps reading that version
across its checkpoints, as it keeps the ``board.current`` it took.

The order is the one ``models_doc`` of tests/listing_oracle.py defines (the tests hold
this to it, byte for byte): engines listed ready first, then stale, each in the board's
order; a model id is one item, owned by the first engine that lists it, its ``engines``
every engine that does.
"""

from __future__ import annotations

import bisect
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Annotated, NamedTuple

import msgspec
import trio

from nvpair.base.ages import age, ages
from nvpair.state.group import GroupTag
from nvpair.state.snapshot import SHOWN_STATES, Board, EngineState

#: the longest model id, owner or alias peers take (and names: engines, kinds, states);
#: items are not cut to these here, the advertiser leaves out the ones that do not fit.
TEXT_MAX = 512
#: an engine's part joined again at least this large ends a step (``parts_stepwise``)
STEP_BYTES = 256 * 1024
#: a stepwise walk ends a step after this many engines' parts, joined or not
STEP_ENGINES = 256
#: an engine's part in at most this many pieces (items + 1) is joined at every read, not
#: cached: the check would cost what the join does
SMALL_PIECES = 9
NAME_MAX = 128
Text = Annotated[str, msgspec.Meta(max_length=TEXT_MAX)]
Name = Annotated[str, msgspec.Meta(max_length=NAME_MAX)]


class ModelItem(msgspec.Struct, frozen=True, gc=False):
    """One listed model: built once per listing, served in ``/v1/models`` (with the node
    and the owner's age), advertised to peers and stored by them as it is."""

    id: Text
    engine: Name
    engines: tuple[Name, ...] = ()
    kind: Name = ""
    state: Name = "ready"
    stale: bool = False
    created: int = 0
    owned_by: Text = ""  # as listed: the engine's owned_by, else the kind
    alias_of: Text | None = None
    #: the head of a multi-node group: the group's name, epoch and ranks (docs/groups.md)
    group: GroupTag | None = None


def visible(e: EngineState) -> bool:
    """Optional engines (the embedded default's guesses) are hidden while nothing answers."""
    return not (e.optional and e.state in ("down", "starting") and e.checked_at is None)


NameRow = tuple[str, int, str, "str | None", "str | None"]


def _names(e: EngineState) -> list[NameRow]:
    """(id, created, owned_by, alias_of, own state) of what ``e`` lists: its models, then
    its aliases (an alias in its model's state)."""
    names: list[NameRow] = [(m.id, m.created, m.owned_by, None, m.state) for m in e.models]
    if e.models:
        first = e.models[0]
        names += [(a, first.created, first.owned_by, first.id, first.state)
                  for a in e.aliases]
    return names


def model_state(engine_shown: str, own: str | None) -> str:
    """What a model's item shows: its own state (router mode) while its engine is ready,
    else the engine's (a stale or cold engine's models are as their engine is)."""
    return own if own is not None and engine_shown == "ready" else engine_shown


class Catalog:
    """The model items of one board at one listing version (``catalog(board, now)``).

    Never changed once made: when the listing moves, the next call makes a new one (the
    engines that did not change share their items with the last). A reader takes one, as
    it takes ``board.current``, and whatever it awaits, what it reads of it is of that one
    version."""

    __slots__ = ("_items", "changed_at", "layout", "order", "owned", "positions", "shown",
                 "version")

    def __init__(self, version: int, layout: int, order: tuple[int, ...],
                 owned: tuple[tuple[ModelItem, ...], ...], changed_at: tuple[int, ...],
                 shown: tuple[str, ...], positions: Mapping[str, int]) -> None:
        self.version = version  # the listing version this is
        self.layout = layout  # the board's layout it was built for
        #: positions of the listed engines, in listing order
        self.order = order
        #: by engine position: the items it owns (in its order), the version they last
        #: changed at (equal versions in one layout: the same items), its shown state
        self.owned = owned
        self.changed_at = changed_at
        self.shown = shown
        #: engine name -> position (the same mapping for every catalog of a layout)
        self.positions = positions
        self._items: dict[str, ModelItem] | None = None

    @property
    def items(self) -> Mapping[str, ModelItem]:
        """Every listed item by model id (made at the first look: the lists do not need
        it, and 100,000 items would cost milliseconds at every listing change)."""
        if self._items is None:
            self._items = {m.id: m for pos in self.order for m in self.owned[pos]}
        return self._items

    def in_order(self) -> list[ModelItem]:
        """Every item, as ``/v1/models`` lists them."""
        return [m for pos in self.order for m in self.owned[pos]]


_EMPTY = Catalog(0, 0, (), (), (), (), {})


class _Index:
    """What a board's next catalog is built from, kept current engine by engine: by
    whom each model id is listed, and the items each engine owns. Only ``catalog`` changes
    it, in one sync call per listing version, and each call ends in a new ``Catalog``."""

    def __init__(self) -> None:
        self.catalog = _EMPTY  # the last one made
        self.version = 0  # the listing version this reflects
        self.layout = 0  # the board's layout it was built for
        #: by engine position: what it lists (empty when not listed), its shown state, the
        #: items it owns (in its order), the version its owned items last changed
        self.names: list[list[NameRow]] = []
        #: what the names and rank were built from: (models, aliases, listed, not ready)
        self.basis: list[tuple[object, object, bool, bool] | None] = []
        self.shown: list[str] = []
        self.owned: list[tuple[ModelItem, ...]] = []
        self.changed_at: list[int] = []
        #: model id -> positions of the engines that list it, in listing order (repeats)
        self.listers: dict[str, list[int]] = {}
        self.items: dict[str, ModelItem] = {}
        #: positions of the listed engines, in listing order
        self.order: list[int] = []
        #: engine names and positions (they change only with the board's layout)
        self.engine_names: list[str] = []
        self.positions: dict[str, int] = {}

    def _rank(self, pos: int) -> tuple[bool, int]:
        return self.shown[pos] != "ready", pos

    def sync(self, board: Board, now: float) -> Catalog:
        version = board.listed(now)
        if version == self.version:
            return self.catalog
        engines = board.current.engines
        if board.layout > self.layout or len(engines) != len(self.names):
            n = len(engines)
            self.names, self.owned = [[] for _ in range(n)], [() for _ in range(n)]
            self.shown, self.changed_at = [""] * n, [version] * n
            self.basis = [None] * n
            self.listers, self.items, self.order = {}, {}, []
            self.layout = board.layout
            self.engine_names = [e.name for e in engines]
            # (a new dict per layout: the catalogs of the last one keep theirs)
            self.positions = {name: i for i, name in enumerate(self.engine_names)}
            changed = list(range(n))
        else:
            changed = [i for i, s in enumerate(board.serials) if s > self.version]
        self.version = version
        try:
            self._update(engines, board.keys, changed)
        except BaseException:  # an engine nothing can list (a bug): all again next time
            self.__init__()  # type: ignore[misc]
            raise
        self.catalog = Catalog(version, self.layout, tuple(self.order), tuple(self.owned),
                               tuple(self.changed_at), tuple(self.shown), self.positions)
        return self.catalog

    def _update(self, engines: tuple[EngineState, ...], keys: list[tuple[object, ...]],
                changed: list[int]) -> None:
        affected: set[str] = set()
        dirty = set(changed)
        listers = self.listers
        moved = []  # engines whose listed names or rank changed (not only their fields)
        for pos in changed:
            e = engines[pos]
            # a group's head lists its models only while the group is ready (admitting)
            listed = e.state in SHOWN_STATES and (e.group is None or e.admitting)
            shown = keys[pos][1]
            basis = (e.models, e.aliases, listed, shown != "ready")
            old = self.basis[pos]
            if (old is not None and old[0] is basis[0] and old[1] is basis[1]
                    and old[2:] == basis[2:]):
                self.shown[pos] = str(shown)  # the same items, other fields: its own
                continue
            self.basis[pos] = basis
            moved.append(pos)
            for name in self.names[pos]:
                model_id = name[0]
                ids = listers[model_id]
                if ids == [pos]:
                    del listers[model_id]
                else:
                    ids[:] = [p for p in ids if p != pos]
                affected.add(model_id)
            self.shown[pos] = str(shown)
            self.names[pos] = _names(e) if listed else []
        for pos in moved:
            for name in self.names[pos]:
                model_id = name[0]
                found = listers.get(model_id)
                if found is None:
                    listers[model_id] = [pos]
                else:
                    bisect.insort(found, pos, key=self._rank)
                affected.add(model_id)
        for model_id in affected:
            item = self.items.get(model_id)
            if item is not None:
                dirty.add(self.positions[item.engine])
            owners = listers.get(model_id)
            if owners:
                dirty.add(owners[0])
            elif item is not None:
                del self.items[model_id]
        for pos in dirty:
            self._own(engines[pos], pos, rebuild=pos in changed, affected=affected)
        if moved:  # (the others' names and rank are as they were: so is the order; a new
            # layout starts with none, and every engine in it has moved)
            self.order = sorted((p for p, names in enumerate(self.names) if names),
                                key=self._rank)

    def _own(self, e: EngineState, pos: int, *, rebuild: bool, affected: set[str]) -> None:
        """Recompute the items ``pos`` owns (all when it changed itself, else the ids
        another engine's change touched)."""
        owned: list[ModelItem] = []
        seen: set[str] = set()
        shown = self.shown[pos]
        stale = shown == "stale" or e.models_stale
        name, kind, names_of = e.name, e.kind, self.engine_names
        items, listers, alone = self.items, self.listers, (e.name,)
        for model_id, created, owned_by, alias_of, own in self.names[pos]:
            ids = listers[model_id]
            if ids[0] != pos or model_id in seen:
                continue  # (another engine's item, or this one's again: listed once)
            seen.add(model_id)
            item = items.get(model_id)
            if item is None or rebuild or model_id in affected:
                item = items[model_id] = ModelItem(  # (positional: 10,000 in milliseconds)
                    model_id, name, alone if len(ids) == 1 else tuple(names_of[p] for p in ids),
                    kind, model_state(shown, own), stale, created, owned_by or kind,
                    alias_of, e.group)
            owned.append(item)
        self.owned[pos] = tuple(owned)
        self.changed_at[pos] = self.version

_indexes: weakref.WeakKeyDictionary[Board, _Index] = weakref.WeakKeyDictionary()


def catalog(board: Board, now: float) -> Catalog:
    """The board's catalog at its listing version at ``now`` (sync; the work is the
    engines that changed since the last call, by anyone; the same object until the
    listing moves)."""
    index = _indexes.get(board)
    if index is None:
        index = _indexes[board] = _Index()
    return index.sync(board, now)


class _Nvpair(msgspec.Struct):
    engine: str
    engines: tuple[str, ...]
    kind: str
    node: str
    state: str
    stale: bool
    checked_age_s: float | None
    alias_of: str | None


class _GroupNvpair(_Nvpair):
    """``nvpair`` of a group's model: ``group`` too (other items are encoded without it)."""

    group: GroupTag


class _Item(msgspec.Struct):
    """An item of ``/v1/models`` on the wire (docs/api.md)."""

    id: str
    object: str
    created: int
    owned_by: str
    nvpair: _Nvpair


_encoder = msgspec.json.Encoder()
_AGE = b'"checked_age_s":'
_PLACEHOLDER = _AGE + b"null"


def wire(item: ModelItem, node: str, checked_age_s: float | None) -> _Item:
    if item.group is not None:
        return _Item(item.id, "model", item.created, item.owned_by, _GroupNvpair(
            item.engine, item.engines, item.kind, node, item.state, item.stale,
            checked_age_s, item.alias_of, item.group))
    return _Item(item.id, "model", item.created, item.owned_by, _Nvpair(
        item.engine, item.engines, item.kind, node, item.state, item.stale, checked_age_s,
        item.alias_of))


#: an engine's part: the catalog version its items changed at, and its items encoded,
#: split where each item's checked_age_s goes
Part = tuple[int, list[bytes]]
#: a large part joined with its age: (the part, the age, the joined bytes)
Joined = tuple[Part, bytes, bytes]


class _Encoded(NamedTuple):
    """The parts of one catalog, by engine position, as a walk of it left them (a new one
    per walk; never changed)."""

    catalog: Catalog
    parts: tuple[Part | None, ...]
    joined: tuple[Joined | None, ...]


class ModelsBody:
    """This node's ``/v1/models`` data, encoded per engine and joined at read time."""

    def __init__(self, node: str) -> None:
        self.node = node
        #: the newest catalog walked to its end, with its parts (what the next walk
        #: reuses: an engine's part whose items did not change, a large part's join at
        #: the same age)
        self._encoded: _Encoded | None = None

    def data(self, board: Board, now: float) -> bytes:
        """The items of ``/v1/models``, encoded and comma-separated (no brackets)."""
        return b",".join(self.parts(board, now))

    def parts(self, board: Board, now: float, ages_at: float | None = None) -> list[bytes]:
        """Each engine's items, encoded (to be joined with commas), with ages as at
        ``ages_at`` (default ``now``). An engine's part with the same items and the same
        age is the one joined last time (with ages at a fixed moment, only engines whose
        items changed or that were probed since are joined again; small parts are joined
        at every call)."""
        return [part for part, _ in self._walk(board, now, ages_at)]

    async def parts_stepwise(self, board: Board, now: float, ages_at: float | None = None
                             ) -> list[bytes]:
        """``parts``, with a checkpoint after each engine whose part was joined again and
        is large, and after every ``STEP_ENGINES`` engines: when the ages move, ten
        engines of 10,000 models are 20 MB to join, in steps of one engine's instead of
        one step of the loop, and 1,024 engines of one model each are four steps of 1-2
        ms, not one of 5. What it returns is of the one catalog and snapshot it took at
        its start, whatever changed while it waited at a checkpoint. Cancellation: at a
        checkpoint, nothing half made."""
        out, since = [], 0
        for part, joined in self._walk(board, now, ages_at):
            out.append(part)
            since += 1
            if (joined and len(part) >= STEP_BYTES) or since >= STEP_ENGINES:
                since = 0
                await trio.lowlevel.checkpoint()
        return out

    async def parts_where(self, board: Board, now: float, keep: Callable[[str], bool],
                          ages_at: float | None = None) -> list[bytes]:
        """The parts of ``parts``, of only the items whose id ``keep`` takes (the list a
        key with model patterns sees: nvpair.http.keys), encoded at each call (nothing of
        them is kept), a checkpoint every ``STEP_ENGINES`` engines. Of the one catalog
        and snapshot it took at its start."""
        cat, engines = catalog(board, now), board.current.engines
        at = now if ages_at is None else ages_at
        out = []
        for n, pos in enumerate(cat.order, 1):
            if items := [m for m in cat.owned[pos] if keep(m.id)]:
                checked = age(at, engines[pos].checked_at)
                out.append(_encoder.encode([wire(m, self.node, checked) for m in items])[1:-1])
            if n % STEP_ENGINES == 0:
                await trio.lowlevel.checkpoint()
        return out

    def _walk(self, board: Board, now: float, ages_at: float | None
              ) -> Iterator[tuple[bytes, bool]]:
        """Each listed engine's part, in order, and whether it is a large part joined
        now (``parts_stepwise`` ends a step after those). The catalog and the snapshot
        are taken once, before the first part; the ages of all engines are encoded in
        one call (each engine's age moves with every probe); a small part is joined
        again at each walk (cheaper than checking a cache), a large one only when its
        items or its age changed. A walk that ends leaves its parts for the next, unless
        a walk of a newer catalog already has."""
        cat, engines = catalog(board, now), board.current.engines
        last = self._encoded
        parts: list[Part | None]
        joined_last: list[Joined | None]
        if last is not None and last.catalog.layout == cat.layout:
            parts, joined_last = list(last.parts), list(last.joined)
        else:
            parts, joined_last = [None] * len(cat.owned), [None] * len(cat.owned)
        at = now if ages_at is None else ages_at
        order = [pos for pos in cat.order if cat.owned[pos]]
        encoded = _encoder.encode(ages(at, [engines[pos].checked_at for pos in order]))
        checks = encoded[1:-1].split(b",") if order else []
        for pos, checked in zip(order, checks, strict=True):
            part = parts[pos]
            if part is None or part[0] != cat.changed_at[pos]:
                part = parts[pos] = (cat.changed_at[pos], self._encode(cat, pos))
            pieces = part[1]
            if len(pieces) <= SMALL_PIECES:
                yield (_AGE + checked).join(pieces), False
                continue
            joined = joined_last[pos]
            if joined is not None and joined[0] is part and joined[1] == checked:
                yield joined[2], False
                continue
            joined = joined_last[pos] = (part, checked, (_AGE + checked).join(pieces))
            yield joined[2], True
        newest = self._encoded
        if newest is None or newest.catalog.version <= cat.version:
            self._encoded = _Encoded(cat, tuple(parts), tuple(joined_last))

    def _encode(self, cat: Catalog, pos: int) -> list[bytes]:
        """Engine ``pos``'s items, encoded and split where each one's age goes."""
        items = [wire(item, self.node, None) for item in cat.owned[pos]]
        return _encoder.encode(items)[1:-1].split(_PLACEHOLDER)

    def item(self, board: Board, now: float, model: str) -> _Item | None:
        """``GET /v1/models/{id}``: the listed item for ``model``, None if not listed."""
        cat = catalog(board, now)
        found = cat.items.get(model)
        if found is None:
            return None
        owner = board.current.engines[cat.positions[found.engine]]
        return wire(found, self.node, age(now, owner.checked_at))
