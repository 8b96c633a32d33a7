"""What real requests tell about engines: in-flight counts, outcomes and passive health.

The rule (docs/router.md): a connection refused or a 5xx answer counts against an engine;
a client that goes away never does, nor does a 4xx answer (429 included), which proves
nothing either way. ``suspect_after`` failures in a row make the engine *suspect* for
``cooldown_s``: it gets no traffic while another engine can serve the model. A success
(an answer below 400) clears it. While real requests succeed, the engine's health probe is
skipped (recorded as passive), at most three intervals in a row: real traffic proves health.
"""

from __future__ import annotations

from typing import Any

import msgspec
import trio

from nvpair.base.histogram import ACTIVATION_BUCKETS_S, ROUTER_BUCKETS_S, Histogram
from nvpair.config.settings import RouterConfig


def peer_key(node: str) -> str:
    """The traffic entry of requests routed to peer ``node`` (engines use their name)."""
    return f"peer {node}"


class EngineTraffic(msgspec.Struct):
    in_flight: int = 0
    requests: int = 0
    failures: int = 0
    consecutive_failures: int = 0
    client_gone: int = 0
    rejected: int = 0
    last_ok_at: float | None = None
    suspect_until: float | None = None
    last_error: str | None = None
    #: when a routed request last ended, whatever its outcome (an engine's idle time)
    last_ended_at: float | None = None


class Traffic:
    """Mutable, owned by the router; read by the prober (sync calls only, no awaits)."""

    def __init__(self, config: RouterConfig | None = None) -> None:
        self.config = config or RouterConfig()
        self.engines: dict[str, EngineTraffic] = {}
        #: every answer the router sent (/metrics): its time to the first byte of the body
        #: and in total, from the request's arrival (a wait in an on-demand queue, for a
        #: start or a free slot, included), and its status by (engine, code)
        self.first_byte = Histogram(ROUTER_BUCKETS_S)
        self.duration = Histogram(ROUTER_BUCKETS_S)
        self.codes: dict[tuple[str, int], int] = {}
        #: each wait of a request in an on-demand engine's queue (served, 503 or gone)
        self.queue_wait = Histogram(ROUTER_BUCKETS_S)
        #: each on-demand start that requests waited for, from its start to ready
        self.activation = Histogram(ACTIVATION_BUCKETS_S)

    def of(self, name: str) -> EngineTraffic:
        entry = self.engines.get(name)
        if entry is None:
            entry = self.engines[name] = EngineTraffic()
        return entry

    def suspect(self, name: str, now: float) -> bool:
        until = self.of(name).suspect_until
        return until is not None and now < until

    def started(self, name: str) -> None:
        entry = self.of(name)
        entry.in_flight += 1
        entry.requests += 1

    def finished(self, name: str, outcome: str, error: str | None = None) -> None:
        """``outcome``: ok, failed (counts against the engine), rejected (a 4xx answer:
        neither) or client_gone (never)."""
        entry = self.of(name)
        entry.in_flight -= 1
        now = trio.current_time()
        entry.last_ended_at = now
        if outcome == "ok":
            entry.consecutive_failures = 0
            entry.last_ok_at = now
            entry.suspect_until = None
        elif outcome == "failed":
            entry.failures += 1
            entry.consecutive_failures += 1
            entry.last_error = error
            if entry.consecutive_failures >= self.config.suspect_after:
                entry.suspect_until = now + self.config.cooldown_s
        elif outcome == "rejected":
            entry.rejected += 1
        else:
            entry.client_gone += 1

    def answered(self, name: str, status: int | None, started: float,
                 first_byte_at: float | None) -> None:
        """Count an answer sent to the client with ``status`` (None: none was sent)."""
        if status is None:
            return
        key = (name, status)
        self.codes[key] = self.codes.get(key, 0) + 1
        now = trio.current_time()
        self.duration.observe(now - started)
        if first_byte_at is not None:
            self.first_byte.observe(first_byte_at - started)

    def proves_healthy(self, name: str, now: float, interval: float) -> bool:
        """A real request succeeded within the last probe interval."""
        entry = self.engines.get(name)
        return (entry is not None and entry.last_ok_at is not None
                and now - entry.last_ok_at < interval and entry.consecutive_failures == 0)

    def doc(self, now: float) -> dict[str, Any]:
        return {
            name: {
                "in_flight": t.in_flight,
                "requests": t.requests,
                "failures": t.failures,
                "consecutive_failures": t.consecutive_failures,
                "client_gone": t.client_gone,
                "rejected": t.rejected,
                "last_ok_age_s": None if t.last_ok_at is None else round(now - t.last_ok_at, 3),
                "suspect": t.suspect_until is not None and now < t.suspect_until,
                "last_error": t.last_error,
            }
            for name, t in self.engines.items()
        }
