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

A request waiting for a slot waits as one in an on-demand engine's queue does: at most
``queue_max`` wait per engine (then 429), each for at most ``queue_wait_s`` (then 503 with
why), and they are the engine's ``queued`` (``queued_oldest_s``) on the board.

What is loaded is nvpair's own account (the models it sent requests to, less those it
unloaded), taken again from the engine's model list whenever a newer list comes
(``EngineState.models_at``): the engine's own LRU and other clients show there. The list
is read again (``GET /models``) after each request the engine answered and after each load
or unload nvpair made, one read in flight per engine and at most one every
``REFRESH_MIN_S``, so what the engine did by itself meanwhile shows within about a second
of nvpair's next request, not at the sweep's next list (30 s). Only routed requests ask
for a read; a read of nvpair's API never does.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from functools import partial

import msgspec
import trio

from nvpair.base.boundary import Part
from nvpair.config.settings import ActivationConfig
from nvpair.errors import ProbeError
from nvpair.probing.probes import Listing, parse_listing
from nvpair.router.activation import QueueFull, Unavailable
from nvpair.router.request import current
from nvpair.state.snapshot import Board, EngineState
from nvpair.state.transitions import with_model_list, with_model_state

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
#: the model list of an engine is read again at most this often (after a request it
#: answered): one small GET (about 600 bytes a model) a second at most, beside the sweep's
#: one every 30 s
REFRESH_MIN_S = 1.0
#: how long such a read may take (the manifest's model-list timeout, 5 s, for llamacpp)
REFRESH_TIMEOUT_S = 5.0

log = logging.getLogger("nvpair.router")


class _Engine:
    """One router engine as nvpair accounts for it."""

    def __init__(self) -> None:
        self.loaded: dict[str, float] = {}  # model -> trio time nvpair last used it
        self.in_flight: dict[str, int] = {}
        self.listed_at: float | None = None  # the model list the account was last taken from
        #: requests waiting for a free slot: a token each -> when it came (trio time)
        self.waiting: dict[object, float] = {}
        #: the model list's reads: one in flight; another asked for meanwhile; the last
        self.refreshing = False
        self.refresh_again = False
        self.refreshed_at = float("-inf")


class ModelSlots:
    """nvpair's account of its multi-model engines' slots (see the module's docstring)."""

    def __init__(self, board: Board, load_budgets: Mapping[str, float] | None = None, *,
                 queue: ActivationConfig | None = None) -> None:
        self.board = board
        #: per engine: how long nvpair waits for a model it loads (its startup budget)
        self.load_budgets = load_budgets or {}
        #: ``queue_max`` and ``queue_wait_s`` of the requests that wait for a slot
        self.queue = queue or ActivationConfig()
        self._engines: dict[str, _Engine] = {}
        self._changed = trio.Event()
        #: where the model lists are read again (``attach``); None: never
        self._nursery: trio.Nursery | None = None
        self._control: Control | None = None
        self._lists = Part("router: model lists", logger=log)

    def attach(self, nursery: trio.Nursery | None, control: Control | None) -> None:
        """Read the engines' model lists again in ``nursery`` with ``control`` (the
        router's, while it runs; None, None: no more)."""
        self._nursery, self._control = nursery, control

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
        if name is None or e is None or e.identity is None or not e.identity.router:
            return
        self.refresh(name)  # (what the engine did meanwhile: its LRU, another client)
        if not 200 <= status < 500:
            return
        self.board.update(name, partial(with_model_state, model=model, state="ready"))

    def refresh(self, name: str) -> None:
        """Read engine ``name``'s model list again soon: at once when none was read for
        ``REFRESH_MIN_S``, else then; one read in flight, the asks meanwhile one more."""
        acc = self._engines.setdefault(name, _Engine())
        if self._nursery is None or self._control is None:
            return
        if acc.refreshing:
            acc.refresh_again = True
            return
        acc.refreshing = True
        self._nursery.start_soon(self._refresh, name, acc, self._control)

    async def _refresh(self, name: str, acc: _Engine, control: Control) -> None:
        try:
            while True:
                acc.refresh_again = False
                await trio.sleep_until(max(trio.current_time(),
                                              acc.refreshed_at + REFRESH_MIN_S))
                acc.refreshed_at = trio.current_time()
                with self._lists.guard():  # a bug here is this read's, never the router's
                    with trio.move_on_after(REFRESH_TIMEOUT_S):
                        listing = _listing(await control(name, "/models", None))
                        if listing is not None:
                            self.board.update(name, partial(
                                with_model_list, listing=listing, now=trio.current_time()))
                            self._wake_waiters()  # (a slot the engine freed by itself)
                    self._lists.ok()
                if not acc.refresh_again:
                    return
        finally:
            acc.refreshing = False

    def _wake_waiters(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def _publish_queue(self, name: str, acc: _Engine) -> None:
        """The requests waiting for a slot, as the engine's ``queued`` on the board."""
        count = len(acc.waiting)
        since = min(acc.waiting.values()) if acc.waiting else None
        self.board.update(name, lambda e: e if (e.queued, e.queued_since) == (count, since)
                          else msgspec.structs.replace(e, queued=count, queued_since=since))

    async def _wait_for_slot(self, name: str, model: str
                             ) -> tuple[EngineState, str | None, bool]:
        """Wait until a request for ``model`` may go to engine ``name``: the engine as it
        was then, the model to unload first, and whether it waited. Raises QueueFull
        (``queue_max`` wait already) or Unavailable (none freed within ``queue_wait_s``,
        with why)."""
        e = self.board.current.engine(name)
        assert e is not None and e.identity is not None
        go, victim = self._place(e, model)
        if go:
            return e, victim, False
        acc = self._engines[name]
        limit, wait_s = self.queue.queue_max, self.queue.queue_wait_s
        if len(acc.waiting) >= limit:
            raise QueueFull(f"{len(acc.waiting)} requests are waiting for a free model slot "
                            f"of engine {name} (queue_max {limit})")
        token = object()
        acc.waiting[token] = trio.current_time()
        self._publish_queue(name, acc)
        try:
            with trio.move_on_after(wait_s):
                while True:
                    changed = self._changed
                    with trio.move_on_after(RECHECK_S):
                        await changed.wait()
                    e = self.board.current.engine(name)
                    assert e is not None and e.identity is not None
                    go, victim = self._place(e, model)
                    if go:
                        return e, victim, True
            busy = ", ".join(sorted(m for m, n in acc.in_flight.items() if n))
            raise Unavailable(
                f"engine {name} had no free model slot for {model} within queue_wait_s "
                f"({wait_s:g} s): every slot held a model with requests in flight "
                f"({busy or 'none now'})")
        finally:
            del acc.waiting[token]
            self._publish_queue(name, acc)

    @asynccontextmanager
    async def held(self, name: str | None, model: str, control: Control
                   ) -> AsyncIterator[None]:
        """Hold a request for ``model`` on engine ``name`` while it runs: at once for a
        single-model engine; for a router, once a slot is free or can be freed without
        evicting a model with requests in flight (then unloading that one first). Raises
        QueueFull or Unavailable (``_wait_for_slot``) before holding anything."""
        e = None if name is None else self.board.current.engine(name)
        if name is None or e is None or e.identity is None or not e.identity.router:
            yield
            return
        routed = current()
        trace = None if routed is None else routed.trace  # (its spans: queue, eviction, load)
        came = trio.current_time()
        e, victim, waited = await self._wait_for_slot(name, model)
        assert e.identity is not None
        if trace is not None and waited:  # (it waited for a slot)
            trace.span("queue", came, trio.current_time(), attrs=[("nvpair.engine", name),
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
            if victim is not None or not e.identity.autoload:
                self.refresh(name)  # (its list after nvpair's own unload or load)
            yield
        finally:
            left = acc.in_flight[model] - 1
            if left:
                acc.in_flight[model] = left
            else:
                del acc.in_flight[model]
            if model in acc.loaded:
                acc.loaded[model] = trio.current_time()
            self._wake_waiters()


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


def _listing(answer: tuple[int, bytes]) -> Listing | None:
    """A model-list answer parsed; None when it is not one (not a 200, not a list)."""
    status, body = answer
    if status != 200:
        return None
    try:
        return parse_listing(body, "openai", "/models")
    except ProbeError:
        return None


def _state(answer: tuple[int, bytes], model: str) -> str | None:
    """``model``'s state in a model-list answer; None when the list cannot say."""
    listing = _listing(answer)
    if listing is None:
        return None
    return next((m.state for m in listing.models if m.id == model), None)
