"""What the API answers, computed from one snapshot: pure functions, no I/O, no awaits."""

from __future__ import annotations

from typing import Any

from nvpair.base.ages import age
from nvpair.state.listing import model_state, visible
from nvpair.state.memory import engine_doc, node_doc
from nvpair.state.snapshot import EngineState, Snapshot
from nvpair.state.transitions import effective_state


def engine_status(e: EngineState, snap: Snapshot, now: float, node: str) -> dict[str, Any]:
    """The status object of one engine (see docs/api.md)."""
    state = effective_state(e, now, e.overdue_after_s)
    return {
        "name": e.name,
        "kind": e.kind,
        "node": node,
        "url": e.url,
        "managed": e.managed,
        "state": state,
        "state_age_s": age(now, e.since),
        "models": [m.id for m in e.models],
        # each model's state: its own on a multi-model router (docs/multi-model.md)
        "model_states": {m.id: model_state(state, m.state) for m in e.models},
        "router": None if e.identity is None or not e.identity.router else {
            "models_max": e.identity.models_max, "autoload": e.identity.autoload},
        "models_stale": e.models_stale,
        "models_age_s": age(now, e.models_at),
        "models_left_out": e.models_left_out,
        "models_left_out_why": e.models_left_out_why,
        "aliases": list(e.aliases),
        "identity": None if e.identity is None else {
            "model": e.identity.model, "version": e.identity.version},
        "pid": e.pid,
        "checked_age_s": age(now, e.checked_at),
        "probes": {
            name: {
                "path": p.path,
                "ok": p.ok,
                "http_status": p.http_status,
                "latency_ms": None if p.latency_ms is None else round(p.latency_ms, 2),
                "age_s": age(now, p.at),
                "consecutive_failures": p.consecutive_failures,
                "requests": p.requests,
                "failures": p.failures,
                "timeouts": p.timeouts,
                "latency_ms_max": round(p.latency_ms_max, 2),
                "latency_ms_mean": (round(p.latency_ms_total / p.requests, 2)
                                    if p.requests else None),
                "error": p.error,
                "passive": p.passive,
            }
            for name, p in e.probes
        },
        "restarts": e.restarts,
        "exit_code": e.exit_code,
        "exited_at": e.exited_at,
        "error": "; ".join(x for x in (e.error, e.notice) if x) or None,
        "admitting": e.admitting,
        "queued": e.queued,
        "queued_oldest_s": age(now, e.queued_since),
        "activity": e.activity,
        # its KV-cache use 0-1, where it opted in (kv_cache_probe_s; nvpair.probing.kvcache)
        "kv_cache_usage": e.kv_cache_usage,
        # the head of a multi-node group (docs/groups.md): GET /v1/groups has the rest (a
        # rank's engine is on no board: only the head, rank 0, has one)
        "group": None if e.group is None else {
            "name": e.group.name, "role": "head", "rank": 0, "epoch": e.group.epoch,
            "ranks_ready": e.group.ranks_ready, "ranks": e.group.ranks},
        "memory": engine_doc(e.memory),
        "log": {"dropped": e.log_dropped, "dropping": e.log_dropping},
        "version": snap.version,
    }


def engines_doc(snap: Snapshot, now: float, node: str) -> dict[str, Any]:
    return {
        "node": node,
        "version": snap.version,
        "memory": node_doc(snap.memory),
        "engines": [engine_status(e, snap, now, node) for e in snap.engines if visible(e)],
    }
