"""The state of every engine as one immutable snapshot, and the board that publishes it.

Writers (probe loops, the sweep, the lifecycle) build a new snapshot and publish it with a
*sync* call: one reference assignment and a version bump. Readers take ``board.current``
once and never await before they finish with it, so they never wait on anything.

Two versions move: the snapshot's (every published change: probe counters and ages too)
and the *listing* version, which moves only when something listed changes (an engine's
state as listed, its models, aliases, kind, staleness, visibility). What is built from
the listing (``/v1/models``, the advert, the router's model index) is built once per
listing version, and waiters (the advertiser, the sweep, the CLI) wake on it, not on
every probe. A ready engine turns stale with time alone (no good health probe for
``overdue_after_s``): the board notices that when the listing is read or waited on
(``listed``, ``wait_listed``), so no timer can be missed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import msgspec
import trio

from nvpair.base.changes import Changes
from nvpair.state.group import GroupTag
from nvpair.state.memory import EngineMemory, NodeMemory

State = Literal["starting", "ready", "stale", "unhealthy", "down", "stopped", "cold",
                "sleeping", "waking"]
#: States whose models are listed (a stale engine is last known good; a sleeping or waking
#: one serves once awake, docs/sleep.md).
LISTED_STATES: frozenset[str] = frozenset({"ready", "stale", "sleeping", "waking"})
#: States of an engine that holds its process but not its weights (docs/sleep.md).
ASLEEP_STATES: frozenset[str] = frozenset({"sleeping", "waking"})
#: States whose models ``/v1/models`` shows: also ``cold`` (an on-demand engine at rest,
#: started by a request for its model; docs/on-demand.md). Only LISTED_STATES are routed.
SHOWN_STATES: frozenset[str] = LISTED_STATES | {"cold"}

# The snapshot's structs hold only immutable values, never a reference back, so they can
# have no cycles: ``gc=False`` keeps them out of the cyclic collector, which at 1,024
# engines spent 30-225 ms per full collection walking them (and every other object).


class ProbeStats(msgspec.Struct, frozen=True, gc=False):
    """What one probe of one engine has done: the last result and counters since start."""

    path: str
    ok: bool | None = None
    http_status: int | None = None
    latency_ms: float | None = None
    at: float | None = None  # trio time of the last result
    consecutive_failures: int = 0
    consecutive_successes: int = 0
    requests: int = 0
    failures: int = 0
    timeouts: int = 0
    latency_ms_max: float = 0.0
    latency_ms_total: float = 0.0
    error: str | None = None
    #: ticks skipped because real requests had just succeeded (passive health).
    passive: int = 0


#: A model's own state on an engine that serves many, each loaded or not (llama-server in
#: router mode): ``cold`` (not loaded; a request loads it), ``loading``, ``ready`` (loaded),
#: ``sleeping``. Only a ready engine's models show their own (docs/multi-model.md).
ModelState = Literal["cold", "loading", "ready", "sleeping"]


class Model(msgspec.Struct, frozen=True, gc=False):
    id: str
    created: int = 0
    owned_by: str = ""
    #: its own state, as the engine's model list said (None: the engine's state is its own)
    state: ModelState | None = None


class Identity(msgspec.Struct, frozen=True, gc=False):
    model: str | None = None
    version: str | None = None
    #: how many requests the engine says it serves at once (llama-server's slots; None:
    #: it does not say)
    slots: int | None = None
    #: a multi-model router (llama-server without ``-m``): its models come and go, each in
    #: a state of its own (``Model.state``), at most ``models_max`` loaded at once (None:
    #: no limit said), loaded on request unless ``autoload`` is False
    router: bool = False
    models_max: int | None = None
    autoload: bool = True


class EngineState(msgspec.Struct, frozen=True, gc=False):
    """One engine as the node knows it: its state, models, identity and probe counters.

    Frozen: a change is a new value (``nvpair.state.transitions``'s pure transitions build it), put
    on
    the board with ``Board.update``. Times are trio times (monotonic) unless named wall
    times; readers compute ages from them at read time. ``state`` is as last published;
    the state a reader shows is ``shown_state`` (a ready engine overdue is stale)."""

    name: str
    kind: str
    url: str
    managed: bool
    state: State = "starting"
    since: float = 0.0  # trio time the state was entered
    models: tuple[Model, ...] = ()
    models_at: float | None = None  # trio time of the last successful listing
    models_stale: bool = False
    #: models the engine listed that are not listed here (odd entries, beyond the cap), and
    #: why, in one line (see probes.parse_listing)
    models_left_out: int = 0
    models_left_out_why: str | None = None
    identity: Identity | None = None
    mismatch: str | None = None  # identity mismatch, reported as an error
    #: who found it, and only they clear it: "identity" (who answers) or "models" (the
    #: model list, for kinds whose identity names no model); "listing" when the listing
    #: itself raised (state.listing_failed)
    mismatch_by: str | None = None
    #: a problem that does not change the state (e.g. the engine wants an API key nvpair
    #: lacks, so its model list cannot be read); shown as the error when there is no other.
    notice: str | None = None
    checked_at: float | None = None  # trio time of the last successful health/ready probe
    probes: tuple[tuple[str, ProbeStats], ...] = ()
    pid: int | None = None
    restarts: int = 0
    exit_code: int | None = None
    exited_at: float | None = None  # wall time
    error: str | None = None
    optional: bool = False
    aliases: tuple[str, ...] = ()
    #: a ready engine with no successful health probe for this long is reported stale.
    overdue_after_s: float = 30.0
    #: its memory as the memory watch last read it (not listed: it moves no listing)
    memory: EngineMemory | None = None
    #: False while it drains: the router sends it no new request (nvpair.supervision.lifecycle
    #: drain)
    admitting: bool = True
    #: requests waiting for this on-demand engine to be ready (nvpair.router.activation)
    queued: int = 0
    #: trio time the longest-waiting of them came (None: none waits); status shows its age
    queued_since: float | None = None
    #: of them, each API key's ("(no key)": requests without one), by name: (key, how many,
    #: trio time its longest-waiting came)
    queued_keys: tuple[tuple[str, int, float], ...] = ()
    #: the last activation, eviction or drain, in words (an event when it changes)
    activity: str | None = None
    #: the routed request its last queue change, activation, eviction or failed start was
    #: for (its x-request-id; in its events); None: none
    request_id: str | None = None
    #: the head of a multi-node group: its group, for its models' nvpair.group (docs/groups.md)
    group: GroupTag | None = None
    #: a managed engine's output lines dropped above the log rate cap since nvpair began
    #: its log, and the episode of drops in progress, in words (None: none); nvpair.base.logs
    log_dropped: int = 0
    log_dropping: str | None = None
    #: the engine's KV-cache use (0-1) as last read from its /metrics, where it opted in
    #: (nvpair.probing.kvcache); None: not read, or unknown
    kv_cache_usage: float | None = None

    def probe(self, name: str) -> ProbeStats | None:
        for n, stats in self.probes:
            if n == name:
                return stats
        return None


def shown_state(e: EngineState, now: float, overdue_after: float | None = None) -> State:
    """The state an engine is listed in: ``ready`` turns ``stale`` when no successful
    health probe came for ``overdue_after`` (by default the engine's ``overdue_after_s``).
    The one place of this rule (``state.effective_state`` calls it)."""
    overdue = e.overdue_after_s if overdue_after is None else overdue_after
    if (e.state == "ready" and e.checked_at is not None
            and now - e.checked_at > overdue):
        return "stale"
    return e.state


def listed_key(e: EngineState, now: float) -> tuple[object, ...]:
    """What the listing shows of one engine: equal keys, equal listings (the ages aside)."""
    return (e.state, shown_state(e, now), e.kind, e.models, e.models_stale, e.aliases,
            e.optional and e.checked_at is None, e.name, e.admitting, e.group)


def _same_types(a: tuple[object, ...], b: tuple[object, ...]) -> bool:
    """Equal keys whose models differ in type only (``created`` 1, 1.0 and True are
    equal to Python, not to the peers that check them) are not the same listing."""
    new, old = a[3], b[3]
    assert isinstance(new, tuple) and isinstance(old, tuple)
    return new is old or all(type(x.created) is type(y.created)
                             for x, y in zip(new, old, strict=True))


def _overdue_at(e: EngineState, shown: object) -> float:
    """When a ready engine turns stale with time alone (inf: not with time alone)."""
    if shown != "ready" or e.checked_at is None:
        return float("inf")
    return e.checked_at + e.overdue_after_s + 1e-6  # (stale just after: age > overdue)


def _now() -> float:
    try:
        return trio.current_time()
    except RuntimeError:  # outside trio (a board built before the run): nothing is overdue
        return float("-inf")


class Snapshot(msgspec.Struct, frozen=True, gc=False):
    """Every engine's state at one moment. ``version`` moves with every change;
    ``listing`` is the board's listing version when this snapshot was published (time
    alone can move the board's further: see ``Board.listed``)."""

    version: int
    engines: tuple[EngineState, ...]
    listing: int = 0
    #: the node's memory as the memory watch last read it (``node.memory``)
    memory: NodeMemory | None = None
    #: each engine's position by name, shared by every snapshot of one layout (the board
    #: makes it when the engines themselves change); None: ``engine`` searches
    index: dict[str, int] | None = None

    def engine(self, name: str) -> EngineState | None:
        """The engine named ``name`` (None: no such engine); O(1) on the board's."""
        if self.index is not None:
            i = self.index.get(name)
            return None if i is None else self.engines[i]
        for e in self.engines:
            if e.name == name:
                return e
        return None


class Touched:
    """The engines whose state changed since its consumer last took them, by name: for a
    consumer that handles changes one engine at a time (the event journal) instead of
    walking every engine at every change. ``Board.touched()`` makes one; the board adds
    to it at each publish (sync, O(engines changed)). ``everything`` is set when the
    engines themselves changed (added, removed, reordered): the consumer walks them all."""

    __slots__ = ("everything", "names")

    def __init__(self) -> None:
        self.everything = True  # (a new consumer has seen nothing yet)
        self.names: set[str] = set()

    def take(self) -> tuple[bool, set[str]]:
        """(everything, the names touched) since the last take; both are reset."""
        out = (self.everything, self.names)
        self.everything, self.names = False, set()
        return out


class Board:
    """Holds the current snapshot. Publishing is sync; waiting for a change is async."""

    def __init__(self, engines: tuple[EngineState, ...] = ()) -> None:
        self._changes = Changes(1)
        #: the listing version (see the module docstring)
        self.listing = Changes(1)
        self._index = {e.name: i for i, e in enumerate(engines)}
        self._current = Snapshot(version=1, engines=engines, listing=1, index=self._index)
        self._touched: list[Touched] = []
        now = _now()
        #: per engine (by position): its listed key, and the listing version it last moved
        self.keys = [listed_key(e, now) for e in engines]
        self.serials = [1] * len(engines)
        #: the listing version at which the engines themselves (names, order) last changed
        self.layout = 1
        self._due = min((_overdue_at(e, k[1]) for e, k in zip(engines, self.keys, strict=True)),
                        default=float("inf"))

    @property
    def current(self) -> Snapshot:
        return self._current

    def publish(self, snapshot_engines: tuple[EngineState, ...]) -> Snapshot:
        old = self._current.engines
        if len(old) == len(snapshot_engines) and all(
                a.name == b.name for a, b in zip(old, snapshot_engines, strict=True)):
            changed = [i for i, (a, b) in enumerate(zip(old, snapshot_engines, strict=True))
                       if a is not b]
            return self._publish(snapshot_engines, changed)
        self._index = {e.name: i for i, e in enumerate(snapshot_engines)}
        for touched in self._touched:
            touched.everything = True
        now = _now()
        self.keys = [listed_key(e, now) for e in snapshot_engines]
        version = self.listing.bump()
        self.serials = [version] * len(snapshot_engines)
        self.layout = version
        self._due = min((_overdue_at(e, k[1])
                         for e, k in zip(snapshot_engines, self.keys, strict=True)),
                        default=float("inf"))
        return self._publish(snapshot_engines, [])

    def _publish(self, engines: tuple[EngineState, ...], changed: list[int], *,
                 unlisted: bool = False) -> Snapshot:
        """``unlisted``: the changes touch no listed field and no probe time (memory)."""
        now = _now()
        moved = []
        for i in [] if unlisted else changed:
            key = listed_key(engines[i], now)
            if key != self.keys[i] or not _same_types(key, self.keys[i]):
                self.keys[i] = key
                moved.append(i)
            self._due = min(self._due, _overdue_at(engines[i], key[1]))
        if moved:
            version = self.listing.bump()
            for i in moved:
                self.serials[i] = version
        for touched in self._touched:
            touched.names.update(engines[i].name for i in changed)
        self._current = Snapshot(version=self._changes.version + 1, engines=engines,
                                 listing=self.listing.version, memory=self._current.memory,
                                 index=self._index)
        self._changes.bump()
        return self._current

    def publish_memory(self, engines: dict[str, EngineMemory], node: NodeMemory | None
                       ) -> Snapshot:
        """One memory reading of every watched engine and of the node, in one snapshot
        (sync). Memory is not listed: the listing version does not move."""
        old = self._current.engines
        new = list(old)
        changed = []
        for name, memory in engines.items():
            i = self._index.get(name)
            if i is not None and old[i].memory != memory:
                new[i] = msgspec.structs.replace(old[i], memory=memory)
                changed.append(i)
        self._current = msgspec.structs.replace(self._current, memory=node)
        return self._publish(tuple(new), changed, unlisted=True)

    def touched(self) -> Touched:
        """A new record of the engines changed from now on (see ``Touched``); it lives as
        long as the board (a consumer makes one for its lifetime)."""
        touched = Touched()
        self._touched.append(touched)
        return touched

    def update(self, name: str, change: Callable[[EngineState], EngineState]) -> EngineState:
        """Replace one engine's state with ``change(old)``; sync, so nothing interleaves."""
        engines = self._current.engines
        i = self._index[name]
        new = change(engines[i])
        if new == engines[i]:
            return new
        self._publish((*engines[:i], new, *engines[i + 1:]), [i])
        return new

    async def wait_changed(self, since_version: int) -> Snapshot:
        """Wait until the version differs from ``since_version``; return the newest snapshot."""
        await self._changes.wait_changed(since_version)
        return self._current

    def listed(self, now: float) -> int:
        """The listing version at ``now``: engines that turned stale with time since the
        last change move it here (so a reader never serves a ready that is overdue)."""
        if now >= self._due:
            self._recheck(now)
        return self.listing.version

    def _recheck(self, now: float) -> None:
        engines = self._current.engines
        due = float("inf")
        moved = []
        for i, e in enumerate(engines):
            if self.keys[i][1] == "ready" and e.checked_at is not None:
                key = listed_key(e, now)
                if key != self.keys[i]:
                    self.keys[i] = key
                    moved.append(i)
                due = min(due, _overdue_at(e, key[1]))
        self._due = due
        if moved:
            for touched in self._touched:  # (shown stale now: their content changed)
                touched.names.update(engines[i].name for i in moved)
            version = self.listing.bump()
            for i in moved:
                self.serials[i] = version

    async def wait_listed(self, since: int) -> int:
        """Wait until the listing version (``listed``) differs from ``since``; return it.

        Wakes on listed changes only (and when a ready engine turns stale with time), not
        on probe counters. Cancellation: a plain wait, nothing consumed."""
        while True:
            version = self.listed(trio.current_time())
            if version != since:
                return version
            with trio.move_on_at(self._due):
                await self.listing.wait_changed(since)
