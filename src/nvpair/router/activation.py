"""Engines on demand: start a cold engine for a request, queue while it loads, unload when idle.

Used by the relay (``nvpair.router.relay.Router``) when no engine and no peer can take a
request for a model an on-demand engine serves (docs/on-demand.md):

* ``Activator.admit`` puts the request in the engine's bounded queue (full: ``QueueFull``,
  a 429) and makes sure the engine is started, exactly once however many requests arrive
  together (one activation task per engine). The request waits until the engine is ready
  and has a free slot (``Activator.capacity``: ``max_in_flight``, else the slots the engine
  says it has, else no limit); waiters go in arrival order, as many at once as there are
  free slots, the rest as requests on the engine end (``Activator.ended``). It waits at most
  ``queue_wait_s`` (``Unavailable`` 503 with Retry-After and why), or until the start fails
  (``Unavailable`` 503, the engine's last log line). A client that leaves is cancelled and
  leaves the queue at once (``Ticket.leave``).
* Before a start (or the wake of a sleeping engine: its requests queue the same way) the
  memory budget is checked (``nvpair.router.evict.plan``); victims drain (no new requests,
  those in flight finish however long they take), then each sleeps (through
  ``nvpair.supervision.sleeper.Sleepers``, never in an aborting mode) or stops as its tier
  says, then the engine starts or wakes. Nothing can make room: every waiter gets 503 with
  the reason. Once no request waits for the engine any more, drains still waiting for
  requests in flight are called off: nothing sleeps or stops for a start nobody wants.
* ``Activator.run`` unloads an engine that no routed request used for ``idle_unload_s``
  (a drain, then ``cold``). Only routed requests count as use (``used``), never probes.

Everything here is the router's: a request never waits on a lock, only on its own event.
The activation tasks run in ``run``'s nursery, each inside the ``activation`` boundary: a
bug fails that engine's waiters (503), never the router.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Literal, NamedTuple

import msgspec
import trio

from nvpair.base import words
from nvpair.base.boundary import Part
from nvpair.base.logformat import about
from nvpair.config.settings import ActivationConfig, EngineSpec, MemoryConfig
from nvpair.errors import NvpairError
from nvpair.router.evict import Candidate, Step, plan
from nvpair.router.fairqueue import FairQueue
from nvpair.router.swaps import Resident, SwapPolicy, Verdict, verdict
from nvpair.state.memory import NodeMemory
from nvpair.state.snapshot import ASLEEP_STATES, LISTED_STATES, Board, EngineState
from nvpair.state.traffic import Traffic
from nvpair.supervision.lifecycle import Busy, EngineRunner, Result
from nvpair.supervision.memproc import Meminfo, MemorySourceError, read_meminfo
from nvpair.supervision.memtrend import reserve_bytes
from nvpair.supervision.sleeper import Sleepers

log = logging.getLogger("nvpair.activation")

#: how often idle engines are looked for (at most; a shorter idle_unload_s looks sooner)
IDLE_CHECK_S = 5.0
#: the longest wait before room is looked for again, while engines that cannot be evicted
#: now stand in the way (their changes on the board wake it sooner)
ROOM_RECHECK_S = 1.0
#: swap batching: an engine whose last request ended this recently still counts as busy
#: (a closed-loop client's next request comes within milliseconds of its answer)
SWAP_QUIET_S = 0.5
#: Retry-After of a request that waited too long or whose engine could not start
RETRY_AFTER_S = 5
#: how requests without an API key are named where keys are (no key's name can be this)
ANONYMOUS = "(no key)"
#: waiting requests whose place is worked out for a reader (``GET /v1/queue``, a 503's
#: words): the first this many in the order they go; the rest are counted
SHOWN_WAITING = 256
#: states of an engine that is up: its memory reading is its whole footprint
UP_STATES = LISTED_STATES | {"unhealthy"}


@dataclass
class Residency:
    """An engine loaded for requests: since when, and routed requests started since."""

    since: float
    served: int = 0


class QueueFull(NvpairError):
    """The engine's queue is full (429)."""


class Unavailable(NvpairError):
    """The request cannot be served now (503 with Retry-After); the message says why."""

    #: the activation the request waited for, if one began (for its trace)
    activation: ActivationRecord | None = None


class Eviction(NamedTuple):
    """One engine stopped to make room: from its drain's start until it was at rest."""

    victim: str
    began: float
    ended: float
    in_flight: int
    footprint: int | None


@dataclass(eq=False)
class ActivationRecord:
    """One activation of an engine, as the requests that waited for it see it (their
    traces: ``nvpair.router.tracing``). Times are trio times."""

    engine: str
    began: float
    ended: float | None = None
    #: why it failed (None: it did not, or it goes on)
    failure: str | None = None
    #: the engine's own time from its start to ready (None: it did not get there)
    startup_s: float | None = None
    evictions: list[Eviction] = field(default_factory=list)


@dataclass(eq=False)
class Ticket:
    """One request's place in an engine's queue: ``waiting``; ``sent`` (its turn came, the
    router does not count it in flight yet: it holds a slot here); ``started`` (the router
    counts it in flight: its slot is the engine's in-flight count); ``gone``."""

    queue: EngineQueue
    ready: trio.Event = field(default_factory=trio.Event)
    #: when it came (trio time): the oldest waiting one's is the engine's ``queued_since``
    at: float = field(default_factory=trio.current_time)
    failure: str | None = None
    stage: Literal["waiting", "sent", "started", "gone"] = "waiting"
    #: the name of the API key it came with (None: no key): its line in the queue
    key: str | None = None
    #: its key's priority (``nvpair.router.fairqueue``: higher goes first, with ageing)
    priority: int = 0
    #: the id of the request that waits (its log lines name it: the start it caused too)
    request_id: str | None = field(default_factory=lambda: getattr(about.get(), "request_id",
                                                                   None))
    #: the activation it waited for (None: the engine was up when it came)
    activation: ActivationRecord | None = None

    def started(self) -> None:
        """The router counts its request in flight now (``Traffic.started``)."""
        if self.stage == "sent":
            self.stage = "started"
            self.queue.sent -= 1

    def leave(self) -> None:
        """Out of the queue (a client gone, a wait too long, the request over), at once; a
        slot it held and never used goes to the next in line."""
        stage, self.stage = self.stage, "gone"
        if stage == "waiting":
            self.queue.waiting.remove(self)
            self.queue.publish(self.request_id)
        elif stage == "sent":
            self.queue.sent -= 1
            self.queue.freed()


@dataclass(eq=False)
class EngineQueue:
    name: str
    #: puts its count on the board, with the request that entered or left (None: the
    #: request the board names stays)
    publish: Callable[[str | None], None]
    #: a slot came free (a request sent never got to the engine): let the next go
    freed: Callable[[], None]
    #: in the order they go (``nvpair.router.fairqueue``: priority, ageing, turns by key)
    waiting: FairQueue[Ticket] = field(default_factory=lambda: FairQueue(10.0))
    #: tickets sent that the router does not count in flight yet (each holds a slot)
    sent: int = 0
    activating: bool = False
    #: while its start waits for victims of an eviction: why, in words, at the time asked
    blocked_by: Callable[[], str] | None = None
    #: the activation going on, or the last one
    record: ActivationRecord | None = None

    def release(self, room: int | None) -> None:
        """Let the first ``room`` waiters go (None: all), in the queue's order."""
        let, now = 0, trio.current_time()
        while self.waiting and (room is None or let < room):
            ticket = self.waiting.pop(now)
            ticket.stage = "sent"
            self.sent += 1
            ticket.ready.set()
            let += 1
        self.publish(None)

    def fail_all(self, reason: str) -> None:
        now = trio.current_time()
        while self.waiting:
            ticket = self.waiting.pop(now)
            ticket.stage = "gone"
            ticket.failure = reason
            ticket.ready.set()
        self.publish(None)


def reading(e: EngineState | None) -> int | None:
    """The memory watch's reading of the engine: anonymous memory plus swap (None: none)."""
    memory = getattr(e, "memory", None)
    rss = getattr(memory, "rss_anon_bytes", None)
    if not isinstance(rss, int):
        return None
    swap = getattr(memory, "swap_bytes", None)
    return rss + (swap if isinstance(swap, int) else 0)


def footprint(e: EngineState | None, spec: EngineSpec,
              remembered: int | None = None) -> int | None:
    """The engine's footprint awake, in bytes: the larger of what it is seen to hold and
    its configured ``memory_bytes`` (a number given is a floor, never replaced by a smaller
    reading: the watch reads host memory, and a GPU engine's weights are not in it). Seen:
    up (ready, stale, unhealthy) with a reading, the reading; otherwise (cold: no process;
    starting: a loading process's reading is only part of it; asleep: what it holds
    asleep) what it measured when it was last up (``remembered``), or the reading now
    where that is larger. None: unknown (``"measured"`` and nothing seen yet)."""
    now = reading(e)
    declared = spec.memory_bytes
    if now is not None and e is not None and e.state in UP_STATES - ASLEEP_STATES:
        seen: int | None = now
    else:
        seen = max((n for n in (remembered, now) if n is not None), default=None)
        if remembered is None and declared is None:
            return None  # a loading engine's partial reading is no footprint
    if seen is None:
        return declared
    return seen if declared is None else max(seen, declared)


def auto_budget(using: int, reserve: int | str, info: Meminfo | None,
                node: NodeMemory | None) -> int:
    """The ``"auto"`` memory budget: what on-demand engines use now (``using``) plus what
    is available, minus the reserve, at least 0."""
    return max(host_headroom(reserve, info, node) + using, 0)


def host_headroom(reserve: int | str, info: Meminfo | None, node: NodeMemory | None) -> int:
    """The host RAM available beyond the reserve (may be below 0): what the ``"auto"``
    budget adds to what engines use, and what level-1 sleeps may move to host RAM.

    Available: ``info`` (``/proc/meminfo`` read now), else the memory watch's last node
    reading, else nothing. The reserve: the ``[memory]`` table's ``reserve_bytes``, and for
    ``"auto"`` the watch's own rule (``nvpair.supervision.memtrend.reserve_bytes``, earlyoom's
    line).
    Where the watch read a cgroup limit, the room left under it caps the headroom."""
    if info is not None:
        available, anon = info.mem_available, info.anon_pages
    elif node is not None and node.mem_available is not None:
        available, anon = node.mem_available, node.anon_pages or 0
    else:
        available, anon = 0, 0
    kept = reserve_bytes(available, anon) if reserve == "auto" else int(reserve)
    headroom = available - kept
    if node is not None and node.cgroup_max is not None and node.cgroup_current is not None:
        headroom = min(headroom, node.cgroup_max - node.cgroup_current)
    return headroom


class Activator:
    """The on-demand engines' queues, starts, evictions and idle unloads."""

    def __init__(self, board: Board, specs: Iterable[EngineSpec],
                 runners: Mapping[str, EngineRunner], traffic: Traffic,
                 config: ActivationConfig, memory: MemoryConfig | None = None,
                 sleepers: Sleepers | None = None) -> None:
        self.board = board
        #: engines' sleep and wake: eviction's cheaper tiers, and the wake of a sleeping
        #: engine on demand (docs/sleep.md; None: every eviction is a stop)
        self.sleepers = sleepers
        #: the reserve of the "auto" budget is the memory watch's (``reserve_bytes``)
        self.memory = memory or MemoryConfig()
        self.specs = {s.name: s for s in specs if s.activation == "on_demand"}
        self.runners = runners
        self.traffic = traffic
        self.config = config
        self.queues: dict[str, EngineQueue] = {}
        #: when a routed request last used each engine (or it became ready for one)
        self.last_used: dict[str, float] = {}
        #: each engine's footprint as last measured while it was up (``remember``): what it
        #: is planned with once cold or while it starts again
        self.measured: dict[str, int] = {}
        #: what each engine held when last measured asleep: what it is planned with asleep
        self.residual: dict[str, int] = {}
        #: how long each engine's last start by nvpair took to be ready (seconds)
        self.load_s: dict[str, float] = {}
        #: engines whose room is made (planned, taken at once), until they are up or failed:
        #: they count against the budget while still cold, so two starts never share room
        self._reserved: set[str] = set()
        #: swap batching (``nvpair.router.swaps``): each loaded engine's residency, and an
        #: event that moves when a routed request starts or ends on any of them
        self.swaps = SwapPolicy(config.swap_batch, config.min_residency_s,
                                config.max_swap_wait_s)
        self.residency: dict[str, Residency] = {}
        self._served_moved = trio.Event()
        #: engines whose start waits for a victim to serve its batch: since when
        self._held_since: dict[str, float] = {}
        #: why each victim of a swap that goes ahead was let go (its activity says so)
        self._swap_why: dict[str, str] = {}
        self._part = Part("activation", logger=log)
        self._nursery: trio.Nursery | None = None
        self._reconfigured = trio.Event()

    # -- the relay's side -----------------------------------------------------------------

    def candidate(self, owners: Iterable[str]) -> str | None:
        """The on-demand engine to wait for, for a model these engines serve, if any: one
        that is cold, starting (for requests, or for ``nvpair start`` or a restart), or
        draining (an eviction, an idle unload: the request waits, and starts it again once
        it is cold)."""
        snap = self.board.current
        for name in owners:
            if name not in self.specs:
                continue
            e = snap.engine(name)
            if e is None:
                continue
            queue = self.queues.get(name)
            if (e.state in ("cold", "starting") or (queue is not None and queue.activating)
                    or (not e.admitting and e.state in LISTED_STATES)
                    or self.asleep(name)):
                return name
        return None

    def reconfigure(self, engines: Iterable[EngineSpec], config: ActivationConfig,
                    memory: MemoryConfig) -> None:
        """A reload: the on-demand engines, the queue and swap settings as configured now
        (sync; a queue keeps its waiting requests, ordered by the new ageing from now)."""
        self.specs = {s.name: s for s in engines if s.activation == "on_demand"}
        self.config, self.memory = config, memory
        self.swaps = SwapPolicy(config.swap_batch, config.min_residency_s,
                                config.max_swap_wait_s)
        for queue in self.queues.values():
            queue.waiting.age_s = config.priority_age_s
        reconfigured, self._reconfigured = self._reconfigured, trio.Event()
        reconfigured.set()

    def asleep(self, name: str) -> bool:
        """On-demand engine ``name`` sleeps (or wakes): a request for it waits in its
        queue while room is made, and it is woken once (docs/on-demand.md, "Tiers")."""
        e = self.board.current.engine(name)
        return name in self.specs and e is not None and e.state in ASLEEP_STATES

    def holds(self, name: str) -> bool:
        """A new request for engine ``name`` (ready now) waits in its queue: requests still
        wait there (it queues behind them, in the queue's order), or the engine's slots
        are all taken (``capacity``: it waits its turn by priority and key, not the
        engine's own first come first served)."""
        queue = self.queues.get(name)
        if queue is not None and queue.waiting:
            return True
        if name not in self.specs:
            return False
        slots = self.capacity(name)
        sent = 0 if queue is None else queue.sent
        return slots is not None and self._in_flight(name) + sent >= slots

    def used(self, name: str) -> None:
        """A routed request started on engine ``name`` (probes never call this)."""
        if name in self.specs:
            now = self.last_used[name] = trio.current_time()
            self.residency.setdefault(name, Residency(now)).served += 1
            self._served()

    def ended(self, name: str) -> None:
        """A routed request on engine ``name`` ended (the router counts it out of flight
        first): the engine is idle from now, and its slot goes to the next in its queue."""
        if name in self.specs:
            self.last_used[name] = trio.current_time()
            self._serve(name)
            self._served()

    def _served(self) -> None:
        """Wake the starts that wait for a victim to serve its batch (it served one more,
        or has one fewer in flight)."""
        moved, self._served_moved = self._served_moved, trio.Event()
        moved.set()

    def capacity(self, name: str) -> int | None:
        """How many requests engine ``name`` serves at once, as its queue counts them: its
        ``max_in_flight``, else the slots it says it has (llama-server's ``total_slots``
        in ``/props``, read by the identity probe), else Ollama's ``OLLAMA_NUM_PARALLEL``
        in its configured environment; None: no limit (vLLM and SGLang batch whatever
        comes, so every waiting request goes at once)."""
        spec = self.specs[name]
        if spec.max_in_flight is not None:
            return spec.max_in_flight
        e = self.board.current.engine(name)
        if e is not None and e.identity is not None and e.identity.slots is not None:
            return e.identity.slots
        parallel = spec.env.get("OLLAMA_NUM_PARALLEL", "") if spec.kind == "ollama" else ""
        return int(parallel) if parallel.isdigit() and int(parallel) > 0 else None

    def _serve(self, name: str) -> None:
        """Let the requests waiting for engine ``name`` go, as many as it has free slots,
        once it is ready and admitting; if it is not and nothing brings it up, start its
        activation (it went cold or drains since the waiters came)."""
        queue = self.queues.get(name)
        if queue is None or queue.activating or not queue.waiting:
            return
        e = self.board.current.engine(name)
        if (e is None or e.state not in LISTED_STATES or not e.admitting
                or e.state in ASLEEP_STATES):
            self._activate(name)
            return
        slots = self.capacity(name)
        if slots is None:
            queue.release(None)
            return
        room = slots - self._in_flight(name) - queue.sent
        if room > 0:
            queue.release(room)

    def queue(self, name: str) -> EngineQueue:
        queue = self.queues.get(name)
        if queue is None:
            def publish(request_id: str | None = None) -> None:
                q = self.queues[name]
                count = len(q.waiting)
                oldest = q.waiting.oldest()
                since = None if oldest is None else oldest.at
                keys = tuple(sorted((ANONYMOUS if k is None else k, len(line), line[0].at)
                                    for k, line in q.waiting.lines.items()))
                self.board.update(name, lambda e: e if (e.queued, e.queued_since, e.queued_keys)
                                  == (count, since, keys) else _replace(
                                      e, queued=count, queued_since=since, queued_keys=keys,
                                      request_id=request_id or e.request_id))
            queue = self.queues[name] = EngineQueue(
                name, publish, partial(self._serve, name),
                FairQueue(self.config.priority_age_s))
        return queue

    async def admit(self, name: str, key: str | None = None, priority: int = 0) -> Ticket:
        """Wait in engine ``name``'s queue until it is ready and it is this request's turn
        (a free slot; the turns: ``nvpair.router.fairqueue``, by ``key`` and its
        ``priority``).

        Returns the ticket (call ``started`` once the router counts the request in flight,
        ``leave`` in a ``finally``). Raises ``QueueFull`` (429) or ``Unavailable`` (503: the
        wait was too long, the start failed, nothing could make room). Cancelled (the
        client left): the ticket leaves the queue at once."""
        queue = self.queue(name)
        mine = queue.waiting.count(key)  # (queue_max is each key's: one cannot fill it)
        if mine >= self.config.queue_max:
            whose = "" if key is None else f" of key {key!r}"
            raise QueueFull(f"{mine} requests{whose} are waiting for engine {name} to "
                            f"start (queue_max {self.config.queue_max})")
        ticket = Ticket(queue, key=key, priority=priority,
                        activation=queue.record if queue.activating else None)
        queue.waiting.add(ticket)
        queue.publish(ticket.request_id)
        self._serve(name)
        try:
            with trio.move_on_after(self.config.queue_wait_s):
                await ticket.ready.wait()
        except BaseException:
            ticket.leave()
            raise
        if not ticket.ready.is_set():
            why = self._why_waited(name, ticket)
            ticket.leave()
            raise _unavailable(why, ticket)
        if ticket.failure is not None:
            raise _unavailable(ticket.failure, ticket)
        return ticket

    def _why_waited(self, name: str, ticket: Ticket) -> str:
        """Why ``ticket`` waited ``queue_wait_s`` for engine ``name`` in vain, in words."""
        queue = self.queue(name)
        wait = f"queue_wait_s ({self.config.queue_wait_s:g} s)"
        e = self.board.current.engine(name)
        slots = self.capacity(name)
        if (not queue.activating and e is not None and e.state in LISTED_STATES
                and e.admitting and slots is not None):
            order = queue.waiting.order(trio.current_time(), SHOWN_WAITING)
            ahead = order.index(ticket) if ticket in order else len(order)
            before = f", and {words.requests(ahead)} waited before this one" if ahead else ""
            return (f"engine {name} had no free slot within {wait}: its {slots} "
                    f"{'slot was' if slots == 1 else 'slots were'} busy{before}")
        blocked = None if queue.blocked_by is None else queue.blocked_by()
        return f"engine {name} was not ready within {wait}" + (
            f": {blocked}" if blocked else "")

    # -- the activation -------------------------------------------------------------------

    def _activate(self, name: str) -> None:
        queue = self.queue(name)
        if self._nursery is None:
            queue.fail_all("the router is not running")
            return
        queue.activating = True
        record = queue.record = ActivationRecord(name, trio.current_time())
        for ticket in queue.waiting:
            ticket.activation = record
        self._nursery.start_soon(self._activation, name)

    async def _activation(self, name: str) -> None:
        queue = self.queue(name)
        began = trio.current_time()
        #: what the waiters hear when the boundary caught a bug of ours
        failure: str | None = f"engine {name} could not be started (a bug in nvpair's " \
                              "activation; see nvpair's log)"
        try:
            with self._part.guard():
                failure = await self._bring_up(name)
                self._part.ok()
        finally:
            queue.activating = False
            self._reserved.discard(name)
            self._held_since.pop(name, None)  # (a held swap's episode ends with the start)
            if queue.record is not None:
                queue.record.ended, queue.record.failure = trio.current_time(), failure
        if failure is not None:
            oldest = queue.waiting.oldest()
            first = None if oldest is None else oldest.request_id
            log.warning("%s: %s", name, failure, extra={"engine": name, "request_id": first})
            if first is not None:  # (its event names the request whose start failed)
                self.board.update(name, partial(_replace, request_id=first))
            queue.fail_all(failure)
            return
        self.last_used[name] = trio.current_time()
        self.residency[name] = Residency(self.last_used[name])  # (loaded now: its batch)
        self.traffic.activation.observe(self.last_used[name] - began)  # (/metrics)
        self._serve(name)

    async def _bring_up(self, name: str) -> str | None:
        """Make room, start (or wake) the engine, wait until it is ready: None, or why it
        failed. An engine that drains meanwhile (evicted, unloaded) is waited for, then
        started."""
        runner = self.runners[name]
        started = False
        started_at = 0.0
        while True:
            e = self.board.current.engine(name)
            if e is None:
                return f"engine {name} is gone"
            if e.state in ASLEEP_STATES and self.sleepers is not None:
                failure = await self._make_room(name)
                if failure is not None:
                    return failure
                why = await self.sleepers.awake(name)  # (joins a wake in progress)
                if why is not None:
                    return f"engine {name} was asleep and did not wake: {why}"
                waiting = self.queue(name).waiting
                first = waiting.oldest()
                took = self.sleepers.woke_in.get(name)
                log.info("woke %s for a request (queued %d)%s", name, len(waiting),
                         "" if took is None else f" in {took:.2f} s", extra={
                             "engine": name,
                             "request_id": None if first is None else first.request_id})
            elif e.state == "cold":
                if started:  # it came back cold without being ready
                    return self._failed(name, e)
                failure = await self._make_room(name)
                if failure is not None:
                    return failure
                waiting = self.queue(name).waiting
                first = waiting.oldest()
                key = None if first is None else first.key  # (whose request woke it)
                result = runner.request("start")
                if isinstance(result, Busy):
                    return result.reason
                started, started_at = True, trio.current_time()
                activity = (f"started {name} for a request"
                            f"{'' if key is None else f' of key {key!r}'} "
                            f"(queued {len(waiting)})")
                rid = None if first is None else first.request_id  # (the first request's)
                self.board.update(name, partial(_replace, activity=activity, request_id=rid))
                log.info("%s", activity, extra={"engine": name, "request_id": rid})
            settled = await self._settled(name, just_started=started)
            if settled == "ready":
                if started:  # (what the next plan weighs its come-back with)
                    self.load_s[name] = trio.current_time() - started_at
                return None
            if settled == "drained":  # (the operator's drain while it started: no failure)
                if not self.queue(name).waiting:
                    return f"engine {name} was drained before it was ready"
                started = False
                continue  # cold: started again for the requests that wait
            if settled == "stopped":
                return f"engine {name} was stopped (nvpair stop); start it with nvpair start"
            if settled == "asleep":  # (put to sleep while its requests came: woken above)
                started = False
                continue
            if settled == "down":
                return self._failed(name, self.board.current.engine(name) or e)
            # "cold": a drain ended; start it (again) for the requests waiting

    async def _settled(self, name: str, *, just_started: bool) -> str:
        """Until the engine is ready and admitting, asleep (it went to sleep meanwhile, an
        eviction's), down, stopped or cold: which (cold after a drain seen meanwhile:
        ``drained``). Just started, it is still cold until its runner takes the start: that
        cold is not it."""
        version = -1
        left_cold = not just_started
        drained = False
        starting_at: float | None = None  # (the engine's own time: from here to ready)
        while True:
            snap = await self.board.wait_changed(version)
            version = snap.version
            e = snap.engine(name)
            if e is not None and e.state != "cold":
                left_cold = True
                drained = drained or not e.admitting
                if e.state == "starting" and starting_at is None:
                    starting_at = e.since
            if e is None or e.state in ("down", "stopped") or (e.state == "cold" and left_cold):
                if e is not None and e.state == "cold" and drained:
                    return "drained"
                return "down" if e is None else e.state
            if e.state in ASLEEP_STATES and e.admitting:
                return "asleep"
            if e.state in LISTED_STATES and e.admitting:
                record = self.queue(name).record
                if record is not None and starting_at is not None:
                    record.startup_s = e.since - starting_at
                return "ready"

    def _failed(self, name: str, e: EngineState) -> str:
        """A start that failed, in words; the engine goes back to cold (not the restart
        loop): the next request tries again. The engine's error already names its own last
        meaningful line of output (not nvpair's ``[nvpair] process N ended`` bookkeeping)."""
        self.runners[name].unload()
        return f"engine {name} failed to start: {e.error or e.state}"

    def remember(self) -> None:
        """Keep each up engine's measured footprint, and what each sleeping one holds
        (every idle pass and before a plan): only readings taken in the state it is in."""
        snap = self.board.current
        for name in self.specs:
            e = snap.engine(name)
            now = reading(e)
            if now is None or e is None:
                continue
            at = getattr(e.memory, "at", None)
            if at is not None and at < e.since:  # (read before it fell asleep or woke)
                continue
            if e.state in UP_STATES - ASLEEP_STATES:
                self.measured[name] = now
            elif e.state == "sleeping":
                self.residual[name] = now

    def footprint(self, name: str) -> int | None:
        """Engine ``name``'s footprint for a plan (``footprint``, with what it measured)."""
        return footprint(self.board.current.engine(name), self.specs[name],
                         self.measured.get(name))

    def _running(self, name: str) -> list[Candidate]:
        """The other on-demand engines that hold memory now, as the planner sees them."""
        self.remember()
        snap = self.board.current
        sleepers = self.sleepers
        running = []
        for other, spec in self.specs.items():
            e = snap.engine(other)
            if other == name or e is None or (e.state in ("cold", "stopped")
                                              and other not in self._reserved):
                continue
            queue = self.queues.get(other)
            # (a request sent, not yet in flight, counts: it is on its way to the engine)
            awaited = queue is not None and (queue.activating or bool(queue.waiting)
                                             or queue.sent > 0)
            busy_sleeper = sleepers is not None and other in sleepers.running  # (waking)
            asleep = e.state == "sleeping" and not busy_sleeper
            # asleep: what it held when the memory watch read it asleep (nothing until seen)
            held = self.residual.get(other, 0) if asleep else self.footprint(other)
            running.append(Candidate(
                other, spec.priority, held, self.last_used.get(other, 0.0),
                self._in_flight(other),
                evictable=e.admitting and not awaited and not busy_sleeper,
                levels=() if sleepers is None else sleepers.levels(other), asleep=asleep,
                residual=self.residual.get(other),
                wake_s=None if sleepers is None else sleepers.woke_in.get(other),
                load_s=self.load_s.get(other), pin=spec.pin))
        return running

    async def _make_room(self, name: str) -> str | None:
        """Put victims to sleep or stop them, drained, until ``name`` fits the budget;
        None, or why it cannot.

        When only engines that cannot be evicted now stand in the way (starting, awaited
        by requests of their own, draining), it waits for them while requests wait for
        ``name`` (each for at most its queue_wait_s): they become victims once served."""
        while True:
            running = self._running(name)
            need = self.footprint(name)
            budget = self.budget(running)
            decided = plan(name, need, budget, running, host_headroom=self.host_headroom(),
                           now=trio.current_time())
            if decided.reason is None:
                held = self._swap_held(name, running, decided.victims)
                if held is None:
                    self._reserved.add(name)  # (before any await: the room is this engine's)
                    break
                if not self.queue(name).waiting:  # (swap batching: the victims serve on)
                    return f"no request waits for {name} any more"
                await self._hold(name, held)
                continue
            fits_alone = (budget if need is None else need) <= budget
            blocked = fits_alone and any(not c.evictable for c in running)
            if not blocked or not self.queue(name).waiting:
                return f"no room for {name}: {decided.reason}"
            with trio.move_on_after(ROOM_RECHECK_S):  # (a queue's change is a board change)
                await self.board.wait_changed(self.board.current.version)
        failure = await self._evict(name, decided.steps)
        for victim in decided.victims:  # (the event says why the swap happened)
            why = self._swap_why.pop(victim, None)
            if failure is None and self.swaps.holds and why is not None:
                self.board.update(victim, partial(_swap_activity, name, why))
        return failure

    def _swap_held(self, name: str, running: list[Candidate],
                   victims: tuple[str, ...]) -> Verdict | None:
        """Swap batching (``nvpair.router.swaps``): the verdict that holds the eviction of
        one of ``victims`` for ``name`` now, or None (each may go: the log line says why)."""
        now = trio.current_time()
        oldest = self.queue(name).waiting.oldest()
        waited = 0.0 if oldest is None else now - oldest.at
        verdicts = {}
        for c in running:
            if c.name not in victims:
                continue
            r = self.residency.get(c.name) or Residency(now)
            # busy: a request in flight, or one ended a moment ago (a client's next request
            # follows its answer within milliseconds; the gap between them is no idleness)
            quiet = now - self.last_used.get(c.name, 0.0)
            busy = c.in_flight > 0 or quiet < SWAP_QUIET_S
            v = verdict(self.swaps, Resident(c.name, r.since, r.served, busy), name, waited,
                        now)
            if not v.evict:
                if c.in_flight == 0:  # (held only by the moment: look again once it is over)
                    v = Verdict(False, v.why, min(v.until or now, now + SWAP_QUIET_S - quiet))
                return v
            verdicts[c.name] = v.why
        self._held_since.pop(name, None)
        for victim, why in verdicts.items():
            log.info("swap: %s evicted for %s: %s", victim, name, why,
                     extra={"engine": victim})
            self._swap_why[victim] = why
            self.residency.pop(victim, None)
        return None

    async def _hold(self, name: str, held: Verdict) -> None:
        """Wait while the swap for ``name`` is held: until the victim served one more or
        ended one, the hold's end, or ``ROOM_RECHECK_S``."""
        now, queue = trio.current_time(), self.queue(name)
        if name not in self._held_since:
            self._held_since[name] = now
            log.info("swap for %s held: %s", name, held.why, extra={"engine": name})
            self.board.update(name, partial(_replace, activity=f"waiting: {held.why}"))
        queue.blocked_by = lambda: f"swap batching: {held.why}"
        moved = self._served_moved
        try:
            with trio.move_on_at(min(held.until or now + ROOM_RECHECK_S, now + ROOM_RECHECK_S)):
                await moved.wait()
        finally:
            queue.blocked_by = None

    async def _evict(self, name: str, steps: tuple[Step, ...]) -> str | None:
        """Drain the victims together, with no deadline (nothing generating is cut), then
        put each to sleep or stop it as its step says, and wait until each is at rest;
        None, or why not. While a victim's requests are in flight, the requests for
        ``name`` wait in its queue, each up to its queue_wait_s; once none waits, the drains
        still waiting are called off (nothing sleeps or stops for a start nobody wants any
        more). A sleep that fails falls back to a stop."""
        reason = f"to make room for {name}"
        activities: dict[str, str] = {}
        tiers: dict[str, Step] = {}
        record = self.queue(name).record
        now = trio.current_time()
        began: dict[str, tuple[int, int | None]] = {}  # (in flight, footprint) at the start
        for step in steps:
            began[step.name] = (self._in_flight(step.name), self.footprint(step.name))
            result = self._take(step, reason)
            if isinstance(result, Busy):
                self._call_off(tiers, name, f"no room for {name} after all")
                return f"no room for {name}: {result.reason}"
            tiers[step.name] = step
            activities[step.name] = f"evicted {step.name} ({step.tier}) {reason}: {step.why}"
            log.info("evicting %s (%s) %s: %s", step.name, step.tier, reason, step.why,
                     extra={"engine": step.name})
        queue = self.queue(name)
        queue.blocked_by = partial(self._blocked_by, tiers)
        try:
            while True:
                snap = self.board.current
                left = [v for v, step in tiers.items() if not _at_rest(snap.engine(v), step)]
                if not left:
                    break
                if not queue.waiting:
                    self._call_off(tiers, name, f"no request waits for {name} any more")
                    return f"no request waits for {name} any more"
                for v in left:  # a sleep that failed (the engine admits again): a stop
                    step = tiers[v]
                    e = snap.engine(v)
                    if (step.action == "sleep" and self.sleepers is not None
                            and v not in self.sleepers.running and e is not None
                            and e.admitting and e.state not in ASLEEP_STATES):
                        why = f"{e.activity or 'its sleep failed'}, so stopped instead"
                        tiers[v] = Step(v, "stop", None, why)
                        activities[v] = f"evicted {v} (stop) {reason}: {why}"
                        log.warning("%s: %s", v, why)
                        if isinstance(self._take(tiers[v], reason), Busy):
                            self._call_off(tiers, name, f"no room for {name} after all")
                            return f"no room for {name}: {v} could not be stopped"
                with trio.move_on_after(ROOM_RECHECK_S):  # (a queue's change is a board change)
                    await self.board.wait_changed(snap.version)
        finally:
            queue.blocked_by = None
        ended = trio.current_time()
        for v in tiers:
            if record is not None:
                record.evictions.append(Eviction(v, now, ended, *began[v]))
        oldest = queue.waiting.oldest()
        first = None if oldest is None else oldest.request_id  # (whose start)
        for victim, activity in activities.items():
            log.info("%s", activity, extra={"engine": victim, "request_id": first})
            self.board.update(victim, partial(_replace, activity=activity, request_id=first))
        return None

    def _take(self, step: Step, reason: str) -> Result:
        """Begin one victim's step: a drained sleep at its level, or a drain to a stop."""
        if step.action == "sleep" and self.sleepers is not None:
            return self.sleepers.sleep(step.name, step.level, reason=reason)
        return self.runners[step.name].drain(then="stop", reason=reason, bounded=False)

    def _blocked_by(self, victims: Mapping[str, Step]) -> str:
        """What a start waits for while its victims drain, in words."""
        snap = self.board.current
        left = [v for v, step in victims.items() if not _at_rest(snap.engine(v), step)]
        busy = [f"{v}'s {words.requests(n)}" for v in left if (n := self._in_flight(v))]
        if busy:
            return f"waiting for {' and '.join(busy)} in flight to finish to make room"
        return f"waiting for {', '.join(left) or 'the victims'} to stop or sleep to make room"

    def _call_off(self, victims: Mapping[str, Step], name: str, reason: str) -> None:
        """Call off the drains (to a stop or a sleep) these victims began to make room for
        ``name`` and that still wait for requests in flight."""
        for victim, step in victims.items():
            if step.action == "sleep" and self.sleepers is not None:
                self.sleepers.call_off(victim, reason)
            else:
                self.runners[victim].call_off(f"to make room for {name}", reason)

    def budget(self, running: list[Candidate]) -> int:
        """The memory on-demand engines may use together: the configured number, or
        ("auto", ``auto_budget``) what is available now plus what they use, minus the
        ``[memory]`` table's reserve."""
        configured = self.config.memory_budget_bytes
        if isinstance(configured, int):
            return configured
        using = sum(c.footprint or 0 for c in running)
        return auto_budget(using, self.memory.reserve_bytes, _meminfo(),
                           self.board.current.memory)

    def host_headroom(self) -> int | None:
        """The host RAM available beyond the ``[memory]`` reserve now, for level-1 sleeps
        (None: neither ``/proc/meminfo`` nor the memory watch says)."""
        info, node = _meminfo(), self.board.current.memory
        if info is None and (node is None or node.mem_available is None):
            return None
        return host_headroom(self.memory.reserve_bytes, info, node)

    def _in_flight(self, name: str) -> int:
        entry = self.traffic.engines.get(name)
        return 0 if entry is None else entry.in_flight

    # -- idle unload ----------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the activations and unload idle engines until cancelled.

        Started value: None, once requests may be admitted. Cancellation ends the
        activations (their waiters' requests are cancelled with the router). Raises:
        nothing but Cancelled (a bug in a pass is the boundary's, logged, retried)."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            try:
                while True:  # (the engines' idle_unload_s as configured now: a reload's)
                    idle = [s.idle_unload_s for s in self.specs.values() if s.idle_unload_s > 0]
                    with trio.move_on_after(min([IDLE_CHECK_S, *(s / 4 for s in idle)])):
                        await self._reconfigured.wait()  # (a reload: the look is timed anew)
                    with self._part.guard():
                        self.remember()
                        self.unload_idle(trio.current_time())
            finally:
                self._nursery = None

    def unload_idle(self, now: float) -> list[str]:
        """Drain (then cold) every ready on-demand engine no routed request used for its
        ``idle_unload_s``, with nothing in flight or waiting; the names drained."""
        snap = self.board.current
        drained = []
        for name, spec in self.specs.items():
            if spec.idle_unload_s <= 0:
                continue
            e = snap.engine(name)
            queue = self.queues.get(name)
            if (e is None or e.state not in LISTED_STATES or not e.admitting
                    or self._in_flight(name)
                    or (queue is not None and (queue.waiting or queue.sent))):
                continue
            last = self.last_used.setdefault(name, now)  # (ready, never used: from now)
            idle = now - last
            if idle < spec.idle_unload_s:
                continue
            reason = f"idle for {words.duration(idle)}"
            if not isinstance(self.runners[name].drain(then="stop", reason=reason), Busy):
                drained.append(name)
                self.residency.pop(name, None)  # (its next load is a new batch)
        return drained


def _unavailable(why: str, ticket: Ticket) -> Unavailable:
    exc = Unavailable(why)
    exc.activation = ticket.activation
    return exc


def _replace(e: EngineState, **changes: object) -> EngineState:
    return msgspec.structs.replace(e, **changes)


def _swap_activity(name: str, why: str, e: EngineState) -> EngineState:
    """The victim's activity once evicted for ``name``, with why the swap went ahead."""
    return _replace(e, activity=f"{e.activity or f'evicted for {name}'}; swap: {why}")


def _at_rest(e: EngineState | None, step: Step | None = None) -> bool:
    """No process holds the engine's memory any more, or (``step`` a sleep) it sleeps."""
    if step is not None and step.action == "sleep" and e is not None and e.state == "sleeping":
        return True
    return e is None or e.state in ("cold", "stopped", "down")


def _meminfo() -> Meminfo | None:
    """``/proc/meminfo`` now (a procfs read: microseconds); None: none, or one we cannot
    parse (the memory watch's reading stands in)."""
    try:
        return read_meminfo()
    except MemorySourceError:
        return None
