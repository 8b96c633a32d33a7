"""Which engines may take a request for a model: read from the snapshot, never probed."""

from __future__ import annotations

import random
from collections.abc import Iterable

import msgspec

from nvpair.config.settings import EngineSpec
from nvpair.router.peering import PeerRoute
from nvpair.state.snapshot import ASLEEP_STATES, LISTED_STATES, Snapshot
from nvpair.state.traffic import Traffic, peer_key
from nvpair.state.transitions import effective_state


class Choice(msgspec.Struct, frozen=True):
    """Engines to try in order (``engines``), or why there is none."""

    engines: tuple[str, ...] = ()
    known: bool = False  # the model is served (or was, or is configured) somewhere
    reason: str | None = None
    #: with no engine to try: the engines that have listed the model (or are configured to)
    owners: tuple[str, ...] = ()


class Known:
    """Which engines serve each model now (``serving``: model id or alias -> engines in a
    listed state), and the model names each engine has ever listed (``names``), so a
    restarting engine's model gets a 503 (come back soon), not a 404 (no such model).

    Kept once per listing version (``Snapshot.listing``), engine by engine: a request
    looks its model up, it never scans the engines' models.

    ``specs``: the engines as configured. Their models and aliases are known names from
    the start (a 503 for a restarting engine, not a 404), and a ready engine whose model
    list has not been read yet (``models_at`` None: the list comes a moment after the
    engine turns ready, or the engine's list keeps failing) serves its configured model:
    a client that saw the engine ready is not refused for the moment between the two.
    """

    def __init__(self, specs: Iterable[EngineSpec] = ()) -> None:
        specs = tuple(specs)
        self.configured = {s.name: s.model for s in specs if s.model}
        self.names: dict[str, set[str]] = {}
        for s in specs:
            if s.model or s.aliases:
                self.names[s.name] = {*s.aliases, *([s.model] if s.model else [])}
        self.serving: dict[str, dict[str, None]] = {}
        self._listing = -1
        self._layout: tuple[str, ...] = ()
        #: by engine position: (models, aliases, listed, list not read yet) as last
        #: indexed, and what it serves
        self._seen: list[tuple[object, object, bool, bool]] = []
        self._served: list[set[str]] = []

    def learn(self, snap: Snapshot) -> None:
        """Once per listing version, not once per request (a snapshot not from a board,
        listing 0, is looked at every time)."""
        if snap.listing == self._listing and snap.listing:
            return
        self._listing = snap.listing
        layout = tuple(e.name for e in snap.engines)
        if layout != self._layout:
            self._layout = layout
            self.serving = {}
            self._seen = [((), (), False, False)] * len(layout)
            self._served = [set() for _ in layout]
        for pos, e in enumerate(snap.engines):
            listed = e.state in LISTED_STATES and e.admitting  # (a draining engine: not)
            unread = e.models_at is None
            seen = self._seen[pos]
            if (seen[0] is e.models and seen[1] is e.aliases and seen[2] == listed
                    and seen[3] == unread):
                continue
            self._seen[pos] = (e.models, e.aliases, listed, unread)
            if e.models:
                ever = self.names.setdefault(e.name, set())
                if len(ever) < 10_000:
                    ever.update(m.id for m in e.models)
                    ever.update(e.aliases)
            served = {m.id for m in e.models} | set(e.aliases) if listed else set()
            if listed and unread and e.name in self.configured:
                served.add(self.configured[e.name])
            for model in self._served[pos] - served:
                engines = self.serving[model]
                del engines[e.name]
                if not engines:
                    del self.serving[model]
            for model in served - self._served[pos]:
                self.serving.setdefault(model, {})[e.name] = None
            self._served[pos] = served

    def engines_for(self, model: str) -> list[str]:
        return [name for name, models in self.names.items() if model in models]


def choose(snap: Snapshot, model: str, traffic: Traffic, known: Known, now: float,
           rng: random.Random) -> Choice:
    """Engines serving ``model`` (by id or alias), least requests in flight first.

    Suspect engines (failing real requests) go last; engines not ready are left out.
    """
    known.learn(snap)
    ready: list[tuple[int, int, int, float, str]] = []
    for name in known.serving.get(model, ()):
        suspect = 1 if traffic.suspect(name, now) else 0
        e = snap.engine(name)  # (awake engines before sleeping ones: docs/sleep.md)
        asleep = 1 if e is not None and e.state in ASLEEP_STATES else 0
        ready.append((suspect, asleep, traffic.of(name).in_flight, rng.random(), name))
    if ready:
        ready.sort()
        return Choice(engines=tuple(name for *_, name in ready), known=True)
    owners = known.engines_for(model)
    if owners:
        states = ", ".join(f"{n} is {_state(snap, n, now)}" for n in owners)
        return Choice(known=True, reason=f"no engine serving {model!r} is ready ({states})",
                      owners=tuple(owners))
    return Choice(reason=f"the model {model!r} does not exist on this node")


def _state(snap: Snapshot, name: str, now: float) -> str:
    e = snap.engine(name)
    if e is None:
        return "gone"
    if not e.admitting:
        return "draining"
    state = effective_state(e, now, e.overdue_after_s)
    # (listed, yet not serving it: its model list names other models)
    return f"{state} but does not list it" if state in LISTED_STATES else state


def order_peers(ready: tuple[PeerRoute, ...], traffic: Traffic, now: float,
                rng: random.Random) -> list[PeerRoute]:
    """Peers in the order to try: suspects last, then least in flight, random ties."""
    def rank(route: PeerRoute) -> tuple[bool, int, float]:
        key = peer_key(route.node)
        return traffic.suspect(key, now), traffic.of(key).in_flight, rng.random()

    return sorted(ready, key=rank)
