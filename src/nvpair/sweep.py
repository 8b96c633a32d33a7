"""The model-list sweep: every due engine is listed concurrently under one shared deadline.

An engine that misses the deadline keeps its previous list, marked stale. Reads never wait
for a sweep: they serve whatever the last sweep published.

Each engine's listing runs inside its own fault boundary (``nvpair.boundary.Part``): an
exception while listing one engine (a bug of nvpair's, or an answer no parser expected)
makes that engine ``unhealthy`` with the reason and its list stale; the other engines of
the batch are listed as if nothing happened, and the engine is listed again when due. The
sweep's own loop is supervised too: a bug there is logged and the loop restarted.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from functools import partial

import msgspec
import trio

from nvpair import probes
from nvpair.boundary import Part
from nvpair.errors import ProbeError
from nvpair.prober import Prober
from nvpair.snapshot import LISTED_STATES, Board, EngineState, Model
from nvpair.state import Outcome, count, enter, with_auth_notice

#: States in which an engine is listed (and so re-listed when due).
LISTABLE = LISTED_STATES | {"unhealthy"}

log = logging.getLogger("nvpair.sweep")


class Sweep:
    """Decides which engines are due and lists them in batches that share one deadline."""

    def __init__(self, board: Board, probers: Mapping[str, Prober], deadline_s: float) -> None:
        self.board = board
        self.probers = probers
        self.deadline_s = deadline_s
        self._next_due: dict[str, float] = {}
        self._in_flight: set[str] = set()
        self._was_listable: dict[str, bool] = {}
        #: one boundary per engine's listing, and one for the sweep's own loop
        self._parts: dict[str, Part] = {}
        self.part = Part("model-list sweep", logger=log)

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
        now = trio.current_time()
        outcome = Outcome(ok=False, kind="error", error=reason)

        def change(e: EngineState) -> EngineState:
            if spec is not None:
                e = count(e, "models", spec.path, outcome, now)
            e = msgspec.structs.replace(e, models_stale=bool(e.models))
            if e.state == "stopped":
                return e
            return enter(e, "unhealthy", now, error=reason)

        self.board.update(name, change)

    def due(self, now: float) -> list[str]:
        names = []
        for e in self.board.current.engines:
            # (an engine whose manifest has no models probe is never due: a due time left
            # in the past would wake the sweep at once, forever)
            listable = (e.state in LISTABLE and e.name in self.probers
                        and self.probers[e.name].spec.probes.models is not None)
            if listable and not self._was_listable.get(e.name, False):
                self._next_due[e.name] = now  # just became reachable: list it at once
            self._was_listable[e.name] = listable
            if (listable and e.name not in self._in_flight
                    and now >= self._next_due.get(e.name, now)):
                names.append(e.name)
        return names

    def next_wake(self) -> float:
        pending = [t for n, t in self._next_due.items()
                   if self._was_listable.get(n) and n not in self._in_flight]
        return min(pending, default=float("inf"))

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            task_status.started()
            await self.part.supervise(partial(self._loop, nursery))

    async def _loop(self, nursery: trio.Nursery) -> None:
        version = -1
        while True:
            now = trio.current_time()
            names = self.due(now)
            if names:
                self._in_flight.update(names)
                nursery.start_soon(self._batch, {n: self.probers[n] for n in names})
            self.part.ok()
            version = self.board.current.version
            with trio.move_on_at(self.next_wake()):
                await self.board.wait_changed(version)

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
            for name in names:  # each engine's bookkeeping in its boundary: all of it runs
                self._in_flight.discard(name)
                with self._part(name).guard():
                    spec = probers[name].spec.probes.models
                    assert spec is not None  # due() picks only engines with a models probe
                    self._next_due[name] = started + spec.interval_s
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
        name = prober.spec.name
        spec = prober.spec.probes.models
        assert spec is not None
        outcome, answer = await prober.probe("models")
        now = trio.current_time()
        models: tuple[Model, ...] | None = None
        listing = None
        if answer is not None:
            try:
                listing = probes.parse_listing(answer.body, spec.format, prober._paths["models"])
                models = listing.models
            except ProbeError as exc:
                outcome = Outcome(ok=False, kind=exc.kind, http_status=answer.status,
                                  latency_ms=answer.latency_ms, error=str(exc),
                                  path=outcome.path)
        mismatch = None
        want = prober.spec.model
        ident = prober.spec.probes.identity
        if (models is not None and want and not (ident and ident.model_pointers)
                and not any(probes.same_model(want, m.id) for m in models)):
            served = ", ".join(m.id for m in models) or "no model"
            mismatch = f"{prober.where} serves {served}, expected {want}"

        def change(e: EngineState) -> EngineState:
            e = count(e, "models", spec.path, outcome, now)
            e = with_auth_notice(e, outcome, prober._paths["models"])
            if models is None:
                return msgspec.structs.replace(e, models_stale=bool(e.models))
            e = msgspec.structs.replace(e, models=models, models_at=now, models_stale=False)
            if listing is not None:
                e = msgspec.structs.replace(e, models_left_out=listing.left_out,
                                            models_left_out_why=listing.why)
            if mismatch:
                e = msgspec.structs.replace(e, mismatch=mismatch, mismatch_by="models")
                return enter(e, "unhealthy", now, error=mismatch)
            if e.mismatch_by == "models":
                e = msgspec.structs.replace(e, mismatch=None, mismatch_by=None)
            return e

        self.board.update(name, change)

    def _mark_missed(self, prober: Prober, now: float) -> None:
        name = prober.spec.name
        spec = prober.spec.probes.models
        assert spec is not None
        outcome = Outcome(ok=False, kind="timeout", error=(
            f"model list did not answer within the {self.deadline_s:g} s sweep deadline"))

        def change(e: EngineState) -> EngineState:
            e = count(e, "models", spec.path, outcome, now)
            return msgspec.structs.replace(e, models_stale=True)

        self.board.update(name, change)
