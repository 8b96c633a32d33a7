"""The model-list sweep: every due engine is listed concurrently under one shared deadline.

An engine that misses the deadline keeps its previous list, marked stale. Reads never wait
for a sweep: they serve whatever the last sweep published.

Each engine's listing runs inside its own fault boundary (``nvpair.base.boundary.Part``): an
exception while listing one engine (a bug of nvpair's, or an answer no parser expected)
makes that engine ``unhealthy`` with the reason and its list stale; the other engines of
the batch are listed as if nothing happened, and the engine is listed again when due. The
sweep's own loop is supervised too: a bug there is logged and the loop restarted.

The sweep lists the engines whose probers are enrolled (``with sweep.enrolled(prober):``,
which ``nvpair.probing.prober.run_probes`` does while an engine's probes run); what a listing
does to the engine is ``nvpair.state.transitions``'s (``after_models``, ``models_missed``,
``listing_failed``).
"""

from __future__ import annotations

import hashlib
import heapq
import logging
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from functools import partial
from types import MappingProxyType

import trio

from nvpair.base.boundary import Part
from nvpair.base.histogram import SWEEP_BUCKETS_S, Histogram
from nvpair.config.manifest import ModelsFormat
from nvpair.errors import ProbeError
from nvpair.probing import probes
from nvpair.probing.prober import Prober
from nvpair.runtime import wakes
from nvpair.state.snapshot import LISTED_STATES, Board
from nvpair.state.transitions import Outcome, after_models, listing_failed, models_missed

#: States in which an engine is listed (and so re-listed when due).
LISTABLE = LISTED_STATES | {"unhealthy"}
#: An unchanged list is fetched again no more than this many of its bytes a second on
#: average (a list of a few KB: at the manifest's interval; Ollama's /api/tags of 10,000
#: models, 3.5 MB: every 108 s instead of 30) ...
UNCHANGED_BYTES_PER_S = 32 * 1024
#: ... and never later than this many intervals; a list that changed is listed again at
#: the manifest's interval
UNCHANGED_MAX_STRETCH = 4

log = logging.getLogger("nvpair.sweep")


class Sweep:
    """Decides which engines are due and lists them in batches that share one deadline."""

    def __init__(self, board: Board, deadline_s: float) -> None:
        self.board = board
        self._probers: dict[str, Prober] = {}
        #: the enrolled probers by engine name (read-only: enrol with ``enrolled``)
        self.probers: Mapping[str, Prober] = MappingProxyType(self._probers)
        self.deadline_s = deadline_s
        self._next_due: dict[str, float] = {}
        self._in_flight: set[str] = set()
        self._was_listable: dict[str, bool] = {}
        #: (due time, engine) of every listable engine not in flight, soonest first; an
        #: entry that no longer matches ``_next_due`` (or whose engine is in flight or no
        #: longer listable) is dropped when it comes up
        self._due_heap: list[tuple[float, str]] = []
        #: the engines whose state changed since ``due`` last looked (the board's), and
        #: those enrolled or gone since: ``due`` looks at these only, not every engine
        self._touched = board.touched()
        self._enrolment: set[str] = set()
        #: one boundary per engine's listing, and one for the sweep's own loop
        self._parts: dict[str, Part] = {}
        self.part = Part("model-list sweep", logger=log)
        #: the loop's wait (for the listing, or the next due time); cancelled to wake it
        self._waiting = trio.CancelScope()
        #: how long each batch took, from its start to its last answer or the deadline
        self.durations = Histogram(SWEEP_BUCKETS_S)
        #: per engine, the digest of the last body that parsed, with its path and listing:
        #: an engine that answers the same bytes again is not parsed again (10,000 models
        #: cost about 20 ms of the loop to parse; a digest of their 3.5 MB, about 2 ms)
        self._parsed: dict[str, tuple[bytes, str, probes.Listing]] = {}
        #: per engine, the size of its last list when it came back unchanged (absent: it
        #: changed, or failed): such a list is fetched again later (``interval``)
        self._unchanged: dict[str, int] = {}

    @contextmanager
    def enrolled(self, prober: Prober) -> Iterator[None]:
        """List ``prober``'s engine (when due) while the block runs; a prober of the same
        engine enrolled later replaces it, and is not removed when this block ends."""
        name = prober.spec.name
        self._probers[name] = prober
        self._enrolment.add(name)
        self._waiting.cancel()  # it may be due at once
        try:
            yield
        finally:
            if self._probers.get(name) is prober:
                del self._probers[name]
                self._enrolment.add(name)

    def _part(self, name: str) -> Part:
        part = self._parts.get(name)
        if part is None:
            part = self._parts[name] = Part(f"engine {name}: model list",
                                            partial(self._publish_failure, name), logger=log)
        return part

    def _publish_failure(self, name: str, reason: str | None) -> None:
        """A listing that raised: the engine is unhealthy with the reason, its list stale;
        a later good listing (and the next good health probe) recovers it."""
        if reason is None:
            return
        prober = self.probers.get(name)
        spec = None if prober is None else prober.spec.probes.models
        self.board.update(name, partial(listing_failed, spec=spec, reason=reason,
                                        now=trio.current_time()))

    def due(self, now: float) -> list[str]:
        """The engines to list now (sync). O(engines changed since the last call, and
        engines due), not O(engines): at 1,024 engines a walk of them all was about a
        millisecond of the loop at each of the sweep's several wake-ups a second."""
        everything, names = self._touched.take()
        names |= self._enrolment
        self._enrolment = set()
        snap = self.board.current
        if everything:  # (the engines themselves changed: each one looked at again)
            names.update(e.name for e in snap.engines)
            names.update(self._was_listable)
        for name in names:
            e = snap.engine(name)
            prober = self._probers.get(name)
            # (an engine whose manifest has no models probe is never due: a due time left
            # in the past would wake the sweep at once, forever)
            listable = (e is not None and e.state in LISTABLE and prober is not None
                        and prober.spec.probes.models is not None)
            if listable and not self._was_listable.get(name, False):
                self._set_due(name, now)  # just became reachable: list it at once
            if e is None:
                self._was_listable.pop(name, None)
                self._next_due.pop(name, None)
            else:
                self._was_listable[name] = listable
        out: list[str] = []
        heap = self._due_heap
        while heap and heap[0][0] <= now:
            at, name = heapq.heappop(heap)
            if self._current(at, name):
                out.append(name)
                del self._next_due[name]  # (in flight until its batch sets the next one)
        return out

    def _set_due(self, name: str, at: float) -> None:
        self._next_due[name] = at
        heapq.heappush(self._due_heap, (at, name))

    def _current(self, at: float, name: str) -> bool:
        """Whether a heap entry still stands: its engine listable, not in flight, and
        due at ``at``."""
        return (self._was_listable.get(name, False) and name not in self._in_flight
                and self._next_due.get(name) == at)

    def next_wake(self) -> float:
        """When the soonest listable engine not in flight is due (inf: none is)."""
        heap = self._due_heap
        while heap and not self._current(*heap[0]):
            heapq.heappop(heap)
        return heap[0][0] if heap else float("inf")

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """List due engines until cancelled. Started value: None, once the sweep waits for
        its first change (engines enrolled before or after are listed alike).

        Cancellation: cancel the surrounding scope; batches in flight are cancelled with
        it and publish nothing more. Raises: nothing (a failing listing is its engine's
        state; a bug of the loop itself is logged and the loop restarted)."""
        async with trio.open_nursery() as nursery:
            task_status.started()
            await self.part.supervise(partial(self._loop, nursery))

    async def _loop(self, nursery: trio.Nursery) -> None:
        while True:
            now = trio.current_time()
            names = self.due(now)
            if names:
                self._in_flight.update(names)
                nursery.start_soon(self._batch, {n: self.probers[n] for n in names})
            self.part.ok()
            # due times change with what is listed (states), enrolment, a batch's end
            # (which wake this) and time; probe counters do not wake the sweep
            with trio.move_on_at(self.next_wake()) as self._waiting:
                await self.board.wait_listed(self.board.listed(now))

    async def _batch(self, probers: dict[str, Prober]) -> None:
        """List ``names`` concurrently; whatever has not answered by the deadline is stale."""
        names = list(probers)
        done: set[str] = set()
        started = trio.current_time()
        try:
            with trio.move_on_after(self.deadline_s):
                async with trio.open_nursery() as nursery:
                    for prober in probers.values():
                        nursery.start_soon(self._list_one, prober, done)
        finally:
            now = trio.current_time()
            with self.part.guard():  # (a bug here is the sweep's, not the node's)
                self.durations.observe(now - started)
            self._waiting.cancel()  # the loop recomputes when these are due
            for name in names:  # each engine's bookkeeping in its boundary: all of it runs
                self._in_flight.discard(name)
                with self._part(name).guard():
                    spec = probers[name].spec.probes.models
                    assert spec is not None  # due() picks only engines with a models probe
                    self._set_due(name, wakes.on_grid(
                        started + self.interval(name, spec.interval_s),
                        wakes.grid_for(spec.interval_s, probers[name].probe_rate)))
                    if name not in done:
                        self._mark_missed(probers[name], now)

    async def _list_one(self, prober: Prober, done: set[str]) -> None:
        """List one engine inside its boundary: whatever it raises stays its own failure."""
        name = prober.spec.name
        part = self._part(name)
        with part.guard():
            await self._list(prober)
            part.ok()
        done.add(name)

    async def _list(self, prober: Prober) -> None:
        spec = prober.spec.probes.models
        assert spec is not None
        self._unchanged.pop(prober.spec.name, None)  # (until it comes back unchanged)
        outcome, answer = await prober.probe("models")
        now = trio.current_time()
        listing = None
        path = prober.path("models")
        if answer is not None:
            try:
                listing = self._parse(prober.spec.name, answer.body, spec.format, path)
            except ProbeError as exc:
                outcome = Outcome(ok=False, kind=exc.kind, http_status=answer.status,
                                  latency_ms=answer.latency_ms, error=str(exc),
                                  path=outcome.path)
        self.board.update(prober.spec.name, partial(
            after_models, spec=prober.spec, outcome=outcome, now=now, path=path,
            listing=listing))

    def interval(self, name: str, interval_s: float) -> float:
        """When to list ``name`` again: the manifest's interval, or for a list that came
        back unchanged, later the larger it is: at most UNCHANGED_BYTES_PER_S of it a
        second on average, never past UNCHANGED_MAX_STRETCH intervals. A changed or
        failed listing, or an engine that comes back, is at the manifest's interval."""
        size = self._unchanged.get(name)
        if size is None:
            return interval_s
        return min(max(interval_s, size / UNCHANGED_BYTES_PER_S),
                   interval_s * UNCHANGED_MAX_STRETCH)

    def _parse(self, name: str, body: bytes, fmt: ModelsFormat, path: str) -> probes.Listing:
        """``probes.parse_listing``, or its last result when the body is the same bytes (it
        is a pure function of the body, the format and the path). SHA-256: 2.2 ms for a
        3.5 MB list here against BLAKE2b's 5.2 (the CPU's SHA instructions)."""
        digest = hashlib.sha256(body).digest()
        last = self._parsed.get(name)
        if last is not None and last[0] == digest and last[1] == path:
            self._unchanged[name] = len(body)
            return last[2]
        listing = probes.parse_listing(body, fmt, path)
        self._parsed[name] = (digest, path, listing)
        return listing

    def _mark_missed(self, prober: Prober, now: float) -> None:
        spec = prober.spec.probes.models
        assert spec is not None
        self.board.update(prober.spec.name, partial(
            models_missed, spec=spec, deadline_s=self.deadline_s, now=now))
