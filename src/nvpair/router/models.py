"""Multi-model engines (llama-server in router mode): which of an engine's models are
loaded, nvpair's requests in flight per model, and the rule that nvpair never sends a
request that would make the engine evict a model with requests in flight.

Such an engine loads a model on request, and when ``models_max`` are loaded it makes room
by evicting the least recently used. Older llama-server builds evicted by count even a
model with a request in flight, cutting it (ggml-org/llama.cpp#21678); an explicit
``POST /models/unload`` cuts one in every build (observed: docs/multi-model.md). So a
request for a model that is not loaded, when every slot holds a model nvpair has requests
in flight on, waits here until one of them is idle; nvpair then unloads that one itself
(``POST /models/unload``) and sends the request. The decision and its bookkeeping are one
sync step, so two requests never both take the last free slot.

What is loaded is nvpair's own account (the models it sent requests to, less those it
unloaded), taken again from the engine's model list whenever a newer list comes
(``EngineState.models_at``): the engine's own LRU and other clients show there.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from functools import partial

import trio

from nvpair.errors import ProbeError
from nvpair.probing.probes import parse_listing
from nvpair.router.request import current
from nvpair.state.snapshot import Board, EngineState
from nvpair.state.transitions import with_model_state

#: model states that hold one of the engine's slots
HOLDING = frozenset({"ready", "loading", "sleeping"})
#: a waiting request reads the board again this often: an eviction by the engine itself
#: (its LRU, another client's unload) shows only in the next model list
RECHECK_S = 1.0

#: ``(engine, path, model)``: POST ``{"model"}`` to ``path`` (GET it with model None) ->
#: the engine's HTTP status (0: no answer) and body
Control = Callable[[str, str, "str | None"], Awaitable[tuple[int, bytes]]]
#: with ``--no-models-autoload``, a model nvpair loads is looked at this often until it is
#: loaded (the 270M model loads in about 0.8 s; a request sent before gets 503)
LOAD_POLL_S = 0.25

log = logging.getLogger("nvpair.router")


class _Engine:
    """One router engine as nvpair accounts for it."""

    def __init__(self) -> None:
        self.loaded: dict[str, float] = {}  # model -> trio time nvpair last used it
        self.in_flight: dict[str, int] = {}
        self.listed_at: float | None = None  # the model list the account was last taken from


class ModelSlots:
    """nvpair's account of its multi-model engines' slots (see the module's docstring)."""

    def __init__(self, board: Board, load_budgets: Mapping[str, float] | None = None) -> None:
        self.board = board
        #: per engine: how long nvpair waits for a model it loads (its startup budget)
        self.load_budgets = load_budgets or {}
        self._engines: dict[str, _Engine] = {}
        self._changed = trio.Event()

    def in_flight(self, engine: str, model: str) -> int:
        e = self._engines.get(engine)
        return 0 if e is None else e.in_flight.get(model, 0)

    def _account(self, e: EngineState) -> _Engine:
        acc = self._engines.setdefault(e.name, _Engine())
        if e.models_at is not None and e.models_at != acc.listed_at:  # a newer list
            acc.listed_at = e.models_at
            listed = {m.id for m in e.models if m.state in HOLDING}
            busy = {m for m, n in acc.in_flight.items() if n}
            acc.loaded = {m: acc.loaded.get(m, float("-inf")) for m in listed | busy}
        return acc

    def _place(self, e: EngineState, model: str) -> tuple[bool, str | None]:
        """Whether a request for ``model`` may go now, and the model to unload first.
        Sync: what it decides is in the account before anything awaits."""
        ident = e.identity
        assert ident is not None
        acc = self._account(e)
        now = trio.current_time()
        if model in acc.loaded or ident.models_max is None:
            acc.loaded[model] = now
            return True, None
        if len(acc.loaded) < ident.models_max:
            acc.loaded[model] = now
            return True, None
        idle = [m for m in acc.loaded if not acc.in_flight.get(m)]
        if not idle:
            return False, None  # every slot busy: wait for one to be idle
        victim = min(idle, key=lambda m: acc.loaded[m])
        del acc.loaded[victim]
        acc.loaded[model] = now
        return True, victim

    def answered(self, name: str | None, model: str, status: int) -> None:
        """A routed request's answer: a router answers from a model only once it is loaded,
        so one that answered (not a 5xx, not a request that never got an answer) shows
        the model ready at once, not at the next model list."""
        e = None if name is None else self.board.current.engine(name)
        if (name is None or e is None or e.identity is None or not e.identity.router
                or not 200 <= status < 500):
            return
        self.board.update(name, partial(with_model_state, model=model, state="ready"))

    @asynccontextmanager
    async def held(self, name: str | None, model: str, control: Control
                   ) -> AsyncIterator[None]:
        """Hold a request for ``model`` on engine ``name`` while it runs: at once for a
        single-model engine; for a router, once a slot is free or can be freed without
        evicting a model with requests in flight (then unloading that one first)."""
        e = None if name is None else self.board.current.engine(name)
        if name is None or e is None or e.identity is None or not e.identity.router:
            yield
            return
        routed = current()
        trace = None if routed is None else routed.trace  # (its spans: queue, eviction, load)
        came = waited = trio.current_time()
        while True:
            e = self.board.current.engine(name)
            assert e is not None and e.identity is not None
            go, victim = self._place(e, model)
            if go:
                break
            changed = self._changed
            with trio.move_on_after(RECHECK_S):
                await changed.wait()
            waited = trio.current_time()
        if trace is not None and waited > came:  # (it waited for a slot)
            trace.span("queue", came, waited, attrs=[("nvpair.engine", name),
                                                     ("nvpair.model", model)])
        acc = self._engines[name]
        acc.in_flight[model] = acc.in_flight.get(model, 0) + 1
        try:
            if victim is not None:
                began = trio.current_time()
                status, _ = await control(name, "/models/unload", victim)
                log.info("engine %s: unloaded %s for %s (idle; HTTP %s)", name, victim,
                         model, status or "no answer")
                if trace is not None:
                    trace.span("eviction", began, trio.current_time(), attrs=[
                        ("nvpair.engine", name), ("nvpair.model", victim)],
                        error=None if status == 200 else f"HTTP {status or 'no answer'}")
                if status == 200:
                    self.board.update(name, partial(with_model_state, model=victim,
                                                    state="cold"))
            if not e.identity.autoload:
                began = trio.current_time()
                await _load(name, model, control, self.load_budgets.get(name, 600.0))
                if trace is not None:
                    trace.span("activation", began, trio.current_time(), attrs=[
                        ("nvpair.engine", name), ("nvpair.activation", "load"),
                        ("nvpair.model", model)])
            yield
        finally:
            left = acc.in_flight[model] - 1
            if left:
                acc.in_flight[model] = left
            else:
                del acc.in_flight[model]
            if model in acc.loaded:
                acc.loaded[model] = trio.current_time()
            self._changed.set()
            self._changed = trio.Event()


async def _load(name: str, model: str, control: Control, budget_s: float) -> None:
    """Load ``model`` on an engine that loads nothing by itself (``--no-models-autoload``)
    and return once its model list says it is loaded, or after ``budget_s`` (the request
    then goes, and gets the engine's own answer)."""
    if _state(await control(name, "/models", None), model) == "ready":
        return
    await control(name, "/models/load", model)  # (400 "already running": someone did)
    with trio.move_on_after(budget_s):
        while True:  # (the engine's own state, over HTTP: nothing to wait on but time)
            if _state(await control(name, "/models", None), model) in ("ready", None):
                return
            await trio.sleep(LOAD_POLL_S)


def _state(answer: tuple[int, bytes], model: str) -> str | None:
    """``model``'s state in a model-list answer; None when the list cannot say."""
    status, body = answer
    if status != 200:
        return None
    try:
        listing = parse_listing(body, "openai", "/models")
    except ProbeError:
        return None
    return next((m.state for m in listing.models if m.id == model), None)
