"""Which engines may take a request for a model: read from the snapshot, never probed."""

from __future__ import annotations

import random

import msgspec

from nvpair.router.peering import PeerRoute
from nvpair.snapshot import LISTED_STATES, Snapshot
from nvpair.state import effective_state
from nvpair.traffic import Traffic, peer_key


class Choice(msgspec.Struct, frozen=True):
    """Engines to try in order (``engines``), or why there is none."""

    engines: tuple[str, ...] = ()
    known: bool = False  # the model is served (or was, or is configured) somewhere
    reason: str | None = None


class Known:
    """Model names each engine has ever listed, so a restarting engine's model gets a 503
    (come back soon), not a 404 (no such model)."""

    def __init__(self) -> None:
        self.names: dict[str, set[str]] = {}
        self._version = -1

    def learn(self, snap: Snapshot) -> None:
        """Once per snapshot version, not once per request."""
        if snap.version == self._version:
            return
        self._version = snap.version
        for e in snap.engines:
            if e.models:
                seen = self.names.setdefault(e.name, set())
                if len(seen) < 10_000:
                    seen.update(m.id for m in e.models)
                    seen.update(e.aliases)

    def engines_for(self, model: str) -> list[str]:
        return [name for name, models in self.names.items() if model in models]


def choose(snap: Snapshot, model: str, traffic: Traffic, known: Known, now: float,
           rng: random.Random) -> Choice:
    """Engines serving ``model`` (by id or alias), least requests in flight first.

    Suspect engines (failing real requests) go last; engines not ready are left out.
    """
    known.learn(snap)
    ready: list[tuple[int, int, float, str]] = []
    for e in snap.engines:
        if not any(m.id == model for m in e.models) and model not in e.aliases:
            continue
        if effective_state(e, now, e.overdue_after_s) not in LISTED_STATES:
            continue
        suspect = 1 if traffic.suspect(e.name, now) else 0
        ready.append((suspect, traffic.of(e.name).in_flight, rng.random(), e.name))
    if ready:
        ready.sort()
        return Choice(engines=tuple(name for *_, name in ready), known=True)
    owners = known.engines_for(model)
    if owners:
        states = ", ".join(f"{n} is {_state(snap, n, now)}" for n in owners)
        return Choice(known=True, reason=f"no engine serving {model!r} is ready ({states})")
    return Choice(reason=f"the model {model!r} does not exist on this node")


def _state(snap: Snapshot, name: str, now: float) -> str:
    e = snap.engine(name)
    return "gone" if e is None else effective_state(e, now, e.overdue_after_s)


def order_peers(ready: tuple[PeerRoute, ...], traffic: Traffic, now: float,
                rng: random.Random) -> list[PeerRoute]:
    """Peers in the order to try: suspects last, then least in flight, random ties."""
    def rank(route: PeerRoute) -> tuple[bool, int, float]:
        key = peer_key(route.node)
        return traffic.suspect(key, now), traffic.of(key).in_flight, rng.random()

    return sorted(ready, key=rank)
