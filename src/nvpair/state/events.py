"""The change journal behind ``GET /v1/events``: content changes numbered, kept in a ring,
and handed to each stream as one latest value per key.

The journal watches the board (and the peer table, through ``PeerSource``, and this node's
multi-node groups, through ``GroupSource``) and keeps what an event shows of each *key*
(``engine:NAME``, ``models``, ``peer:NODE``, ``group:NAME``). When a key's
content changes, ``seq`` grows by one and the change becomes an ``Event`` with that seq:
a probe that changes nothing (counters, ages) changes no content and sends nothing. The
last ``ring`` events (``RING_BYTES`` at most) are kept for resuming
(``Last-Event-ID: <boot_id>.<seq>``).

Each stream (``Stream``) holds at most one pending event per key, the newest: a stream
that is not read skips intermediate states and never queues. Everything here is sync but
``Journal.run``; ``subscribe`` hands out the snapshot or the replay and the live stream at
one moment, so a stream sees every seq once (or its key's newer value).
"""

from __future__ import annotations

import secrets
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec
import trio

from nvpair.base.changes import Changes
from nvpair.base.decoding import is_digits
from nvpair.errors import NvpairError
from nvpair.state.listing import model_state
from nvpair.state.memory import event_doc
from nvpair.state.snapshot import Board, EngineState, shown_state

#: event types a stream may ask for (``?types=``); ``snapshot`` and ``bye`` always come.
TYPES = frozenset({"engine", "models", "peer", "group", "reload"})
#: recent events kept for resuming (``Last-Event-ID``): at most this many, and at most
#: ``RING_BYTES`` of content (an engine of 10,000 models makes events of ~500 KB)
RING = 256
RING_BYTES = 2 * 1024 * 1024
MAX_BOOT_ID = 32
MAX_SEQ = 2**63 - 1

_encode = msgspec.json.Encoder().encode


@dataclass(frozen=True)
class Timing:
    """How streams are paced (``nvpair.http.sse``); tests shorten them."""

    #: a ``:`` comment when nothing was sent for this long
    heartbeat_s: float = 15.0
    #: a send the client has not taken for this long closes its connection
    drop_after_s: float = 30.0
    #: at most this many batches of events in any second (so a key changing 1,000 times a
    #: second reaches a stream as ~11 events: these at once, then one a second later)
    batches_per_s: int = 10
    #: ``retry:`` is a random whole number of milliseconds in this range, per stream
    retry_ms: tuple[int, int] = (1000, 3000)


class PeerSource(Protocol):
    """What the journal reads of the peer table (``nvpair.peers.feed`` adapts it)."""

    @property
    def version(self) -> int: ...

    async def wait_changed(self, since: int) -> int:
        """Wait until ``version`` differs from ``since`` (time-driven changes included)."""
        ...

    def peers(self, now: float) -> dict[str, dict[str, Any]]:
        """Each peer's event content by node: state and models, no ages or counters."""
        ...


class GroupSource(Protocol):
    """What the journal reads of this node's groups (``nvpair.peers.groups.Groups``)."""

    @property
    def version(self) -> int: ...

    async def wait_changed(self, since: int) -> int:
        """Wait until ``version`` differs from ``since`` (it moves after every step of a
        group's loop, whether or not anything changed)."""
        ...

    def contents(self, now: float) -> dict[str, dict[str, Any]]:
        """Each group's ``GET /v1/groups/{name}`` document by name."""
        ...


#: what moves with time alone in a group's document: left out of its event
GROUP_TIMES = frozenset({"state_age_s", "restart_in_s", "started_at", "ended_at"})


def group_content(doc: Any) -> Any:
    """What a ``group`` event shows: the group's document without ages and times, so that
    only a change of state, epoch, rank, pid, exit, memory or error sends an event."""
    if isinstance(doc, dict):
        return {k: group_content(v) for k, v in doc.items() if k not in GROUP_TIMES}
    if isinstance(doc, list):
        return [group_content(v) for v in doc]
    return doc


class Event(msgspec.Struct, frozen=True):
    """One content change: ``seq`` (of this boot), its type, its key and what it shows."""

    seq: int
    type: str
    key: str
    data: bytes  # the JSON of the content, encoded once
    engine: str | None = None  # the engine it is about (the ``?engine=`` filter)
    #: the event as a stream sends it (``id:``, ``event:``, ``data:``), encoded once
    wire: bytes = b""


def engine_content(e: EngineState, now: float) -> dict[str, Any]:
    """What an ``engine`` event shows: state, models, error, restarts; no probe counters,
    ages or times, so a probe that changes nothing changes nothing here. Of its output's
    drops only the episode (its start, in words with its numbers, and its end): the count
    moves every second of a flood."""
    shown = shown_state(e, now)
    return {"name": e.name, "kind": e.kind, "url": e.url, "managed": e.managed,
            "state": shown, "models": [m.id for m in e.models],
            "model_states": {m.id: model_state(shown, m.state) for m in e.models},
            "models_stale": e.models_stale, "aliases": list(e.aliases),
            "identity": None if e.identity is None else {
                "model": e.identity.model, "version": e.identity.version},
            "error": "; ".join(x for x in (e.error, e.notice) if x) or None,
            "restarts": e.restarts, "pid": e.pid, "exit_code": e.exit_code,
            "admitting": e.admitting, "queued": e.queued,
            "queued_keys": {k: n for k, n, _ in e.queued_keys}, "activity": e.activity,
            "request_id": e.request_id, "memory": event_doc(e.memory),
            "log": {"dropping": e.log_dropping}}


def content_key(e: EngineState, now: float) -> tuple[object, ...]:
    """What ``engine_content`` is built from: equal keys, equal content."""
    return (shown_state(e, now), e.models, e.models_stale, e.aliases, e.identity, e.error,
            e.notice, e.restarts, e.pid, e.exit_code, e.admitting, e.queued, e.queued_keys,
            e.activity, e.request_id, e.memory, e.kind, e.url, e.managed, e.log_dropping)


def parse_event_id(text: str) -> tuple[str, int] | None:
    """``<boot_id>.<seq>`` (a ``Last-Event-ID`` or ``?after``): (boot_id, seq), or None when
    it is not that shape (a client's id from elsewhere: it gets a fresh snapshot)."""
    boot, dot, seq = text.strip().rpartition(".")
    if (not dot or not boot or len(boot) > MAX_BOOT_ID or not boot.isascii()
            or not all(c.isalnum() or c in "-_" for c in boot)):
        return None
    if not is_digits(seq) or len(seq) > 19 or int(seq) > MAX_SEQ:
        return None
    return boot, int(seq)


class Stream:
    """One client's stream: the newest pending event per key, in seq order."""

    def __init__(self, types: frozenset[str] = TYPES, engine: str | None = None) -> None:
        self.types = types
        self.engine = engine
        self.pending: dict[str, Event] = {}
        self._ready = trio.Event()
        self.closed = False
        #: why it was closed (its ``bye`` says it): "shutdown", or "keys" (keys turned on)
        self.reason = "shutdown"

    def wants(self, event: Event) -> bool:
        if event.type not in self.types:
            return False
        return self.engine is None or event.type != "engine" or event.engine == self.engine

    def offer(self, event: Event) -> None:
        """Keep ``event`` as its key's pending value (a newer one replaces it and moves to
        the end, so pending events stay in seq order)."""
        if self.wants(event):
            self.pending.pop(event.key, None)
            self.pending[event.key] = event
            self._ready.set()

    def close(self, reason: str = "shutdown") -> None:
        self.closed = True
        self.reason = reason
        self._ready.set()

    def take(self) -> list[Event]:
        """Every pending event, oldest seq first; the stream is empty after."""
        events = list(self.pending.values())
        self.pending.clear()
        if not self.closed:
            self._ready = trio.Event()
        return events

    async def wait(self) -> None:
        """Until an event is pending or the stream is closed (returns at once if so)."""
        await self._ready.wait()


class Full(NvpairError):
    """``max_streams`` streams are open."""


class Journal:
    """Content changes of the board and the peers, numbered per boot (see the module)."""

    def __init__(self, board: Board, *, node: str, peers: PeerSource | None = None,
                 groups: GroupSource | None = None, ring: int = RING,
                 max_streams: int = 64, boot_id: str | None = None,
                 timing: Timing = Timing()) -> None:
        self.board = board
        self.timing = timing
        self.node = node
        self.peers = peers
        self.groups = groups
        self.boot_id = boot_id or secrets.token_hex(6)
        self.max_streams = max_streams
        #: its version is ``seq``: the number of content changes this boot
        self.changes = Changes(0)
        self.ring: deque[Event] = deque(maxlen=ring)
        self._ring_bytes = 0
        self.streams: set[Stream] = set()
        #: moves when a stream opens or ends (``wait_streams``)
        self.streams_changed = Changes(0)
        self.closed = False
        self._reloads = 0  # reloads of the config this boot (``reloaded``)
        self._data: dict[str, bytes] = {}
        #: per engine, what its content was built from (``content_key``): a probe that
        #: moves only counters re-encodes nothing (10,000 models: 0.2 MB a probe before)
        self._content_keys: dict[str, tuple[object, ...]] = {}
        #: the engines changed since the last refresh: a refresh costs the engines that
        #: changed, not all of them (at 1,024 engines a walk of all at each probe result
        #: was a quarter of nvpair's idle CPU)
        self._touched = board.touched()
        self._listing = -1
        self._peer_version = -1
        self._group_version = -1
        self.refresh(_now(), initial=True)

    @property
    def seq(self) -> int:
        return self.changes.version

    def event_id(self, seq: int | None = None) -> str:
        return f"{self.boot_id}.{self.seq if seq is None else seq}"

    # -- writes (sync) ------------------------------------------------------------------

    def refresh(self, now: float, *, initial: bool = False) -> None:
        """Compare every key's content with the last; one event per changed key."""
        listing = self.board.listed(now)  # (first: it may touch engines overdue now)
        relisted = listing != self._listing
        everything, names = self._touched.take()
        snap = self.board.current
        if everything:
            names = {e.name for e in snap.engines}
            for name in [n for n in self._content_keys if n not in names]:
                del self._content_keys[name]
                self._put("engine", "engine:" + name,
                          _encode({"name": name, "removed": True}), initial, name)
        order = snap.index or {e.name: i for i, e in enumerate(snap.engines)}
        for name in sorted(names, key=lambda n: order.get(n, -1)):  # (the board's order)
            e = snap.engine(name)
            if e is None:
                continue
            built_from = content_key(e, now)
            if self._content_keys.get(name) == built_from:
                continue
            self._content_keys[name] = built_from
            self._put("engine", "engine:" + name, _encode(engine_content(e, now)), initial,
                      name)
        if relisted:
            self._listing = listing
            self._put("models", "models", _encode({"node": self.node, "version": listing}),
                      initial)
        if self.peers is not None and self.peers.version != self._peer_version:
            self._peer_version = self.peers.version
            current = self.peers.peers(now)
            for node, content in current.items():
                self._put("peer", "peer:" + node, _encode(content), initial)
            for key in [k for k in self._data if k.startswith("peer:")
                        and k.removeprefix("peer:") not in current]:
                self._put("peer", key, _encode({"node": key.removeprefix("peer:"),
                                                "state": "forgotten", "models": []}), initial)
        if self.groups is not None and self.groups.version != self._group_version:
            self._group_version = self.groups.version
            for name, doc in self.groups.contents(now).items():
                self._put("group", "group:" + name, _encode(group_content(doc)), initial)

    def _put(self, type_: str, key: str, data: bytes, initial: bool,
             engine: str | None = None) -> None:
        if self._data.get(key) == data:
            return
        self._data[key] = data
        if initial:
            return
        seq = self.changes.bump()
        event = Event(seq, type_, key, data, engine, b"id: %s.%d\nevent: %s\ndata: %s\n\n" % (
            self.boot_id.encode(), seq, type_.encode(), data))
        if len(self.ring) == self.ring.maxlen:
            self._ring_bytes -= len(self.ring[0].data)
        self.ring.append(event)
        self._ring_bytes += len(data)
        while self._ring_bytes > RING_BYTES and len(self.ring) > 1:
            self._ring_bytes -= len(self.ring.popleft().data)
        for stream in self.streams:
            stream.offer(event)

    def reloaded(self, doc: dict[str, Any]) -> None:
        """One ``reload`` event: what a reload of the config changed (``ConfigDiff.doc``)."""
        self._reloads += 1
        self._put("reload", "reload", _encode({"node": self.node, "reload": self._reloads,
                                               **doc}), False)

    def close(self) -> None:
        """Shutting down: every stream gets ``bye`` and ends; new ones are refused."""
        self.closed = True
        for stream in self.streams:
            stream.close()

    def end_streams(self, reason: str) -> None:
        """Every open stream gets ``bye`` (saying ``reason``) and ends; new ones are still
        served. A reload that turns the keys on: the streams opened without a key end,
        and their clients come back with one."""
        for stream in self.streams:
            stream.close(reason)

    # -- reads --------------------------------------------------------------------------

    def snapshot(self, stream: Stream) -> bytes:
        """The ``snapshot`` event's data: every key's current content (filtered)."""
        def pick(prefix: str) -> list[bytes]:
            return [v for k, v in self._data.items() if k.startswith(prefix)]
        engines = pick("engine:") if stream.engine is None else [
            self._data[k] for k in ("engine:" + stream.engine,) if k in self._data]
        peers = pick("peer:") if "peer" in stream.types else []
        groups = b"" if self.groups is None or "group" not in stream.types else b"".join(
            (b',"groups":[', b",".join(pick("group:")), b"]"))
        return b"".join((b'{"node":', _encode(self.node), b',"boot_id":',
                         _encode(self.boot_id), b',"seq":', str(self.seq).encode(),
                         b',"engines":[', b",".join(engines), b'],"models":',
                         self._data.get("models", b"null"), b',"peers":[',
                         b",".join(peers), b"]", groups, b"}"))

    def missed(self, last_event_id: str | None) -> list[Event] | None:
        """The events after ``last_event_id``, when this boot's ring still holds all of
        them (an empty list: nothing missed); None when a snapshot is needed instead."""
        parsed = None if last_event_id is None else parse_event_id(last_event_id)
        if parsed is None or parsed[0] != self.boot_id or parsed[1] > self.seq:
            return None
        after = parsed[1]
        if after == self.seq:
            return []
        if not self.ring or self.ring[0].seq > after + 1:
            return None
        return [e for e in self.ring if e.seq > after]

    def subscribe(self, types: frozenset[str] = TYPES, engine: str | None = None,
                  last_event_id: str | None = None) -> tuple[Stream, list[Event] | None]:
        """A new stream and what it gets first: the missed events (filtered), or None for
        a snapshot (``snapshot(stream)``, taken now). Raises ``Full`` at ``max_streams``."""
        if len(self.streams) >= self.max_streams:
            raise Full(f"{len(self.streams)} event streams are open (max_streams)")
        stream = Stream(types, engine)
        if self.closed:
            stream.close()
        self.streams.add(stream)
        self.streams_changed.bump()
        missed = self.missed(last_event_id)
        return stream, None if missed is None else [e for e in missed if stream.wants(e)]

    def unsubscribe(self, stream: Stream) -> None:
        self.streams.discard(stream)
        self.streams_changed.bump()

    async def wait_streams(self, done: Callable[[int], bool]) -> None:
        """Until ``done(number of open streams)``; a plain wait, cancelled like any."""
        while not done(len(self.streams)):
            await self.streams_changed.wait()

    # -- the loop -----------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        """Refresh on every change of the board's snapshot or listing (an engine turning
        stale with time included) and of the peer table, until cancelled.

        Started value: None, once the journal is current. Cancellation: a plain wait;
        the journal keeps what it had. Raises: nothing of its own (a bug in a refresh
        propagates to the caller's fault boundary)."""
        wake = Changes()
        board, peers, groups = self.board, self.peers, self.groups

        async def follow(wait: Callable[[int], Awaitable[object]], version: int,
                         now_version: Callable[[], int]) -> None:
            while True:
                await wait(version)
                version = now_version()
                wake.bump()

        self.refresh(trio.current_time())
        async with trio.open_nursery() as nursery:
            # one task per source for the journal's life (not a nursery per change)
            nursery.start_soon(follow, board.wait_changed, board.current.version,
                               lambda: board.current.version)
            nursery.start_soon(follow, board.wait_listed, self._listing,
                               lambda: board.listed(trio.current_time()))
            if peers is not None:
                nursery.start_soon(follow, peers.wait_changed, peers.version,
                                   lambda: peers.version)
            if groups is not None:
                nursery.start_soon(follow, groups.wait_changed, groups.version,
                                   lambda: groups.version)
            task_status.started()
            seen = wake.version
            while True:
                await wake.wait_changed(seen)
                seen = wake.version
                self.refresh(trio.current_time())


def _now() -> float:
    try:
        return trio.current_time()
    except RuntimeError:
        return float("-inf")
