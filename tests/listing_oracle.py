"""The definition of ``/v1/models`` that the listing's tests hold nvpair to, byte for byte.

nvpair serves ``nvpair.state.listing.ModelsBody``, built engine by engine and cached per listing
version; this builds the same document in one plain pass over a snapshot, with nothing
cached, so that any difference is the listing's bug. No production code calls it.
"""

from __future__ import annotations

from typing import Any

from nvpair.base.ages import age
from nvpair.state.snapshot import SHOWN_STATES, Snapshot
from nvpair.state.transitions import effective_state


def models_doc(snap: Snapshot, now: float, node: str) -> dict[str, Any]:
    """OpenAI's list shape; one item per model id, ready engines first.

    The definition of ``/v1/models``, in one pass over a snapshot: the API serves
    ``nvpair.state.listing.ModelsBody`` (built engine by engine), which must give these bytes
    (tests/test_listing.py holds it to them)."""
    items: dict[str, dict[str, Any]] = {}
    order = sorted(snap.engines,
                   key=lambda e: effective_state(e, now, e.overdue_after_s) != "ready")
    for e in order:
        state = effective_state(e, now, e.overdue_after_s)
        if state not in SHOWN_STATES or (e.group is not None and not e.admitting):
            continue  # (a group's head: listed only while its group is ready, admitting)
        names: list[tuple[str, int, str, str | None]] = [
            (m.id, m.created, m.owned_by, None) for m in e.models]
        if e.models:
            names += [(a, e.models[0].created, e.models[0].owned_by, e.models[0].id)
                      for a in e.aliases]
        for model_id, created, owned_by, alias_of in names:
            if model_id in items:
                items[model_id]["nvpair"]["engines"].append(e.name)
                continue
            items[model_id] = {
                "id": model_id,
                "object": "model",
                "created": created,
                "owned_by": owned_by or e.kind,
                "nvpair": {
                    "engine": e.name,
                    "engines": [e.name],
                    "kind": e.kind,
                    "node": node,
                    "state": state,
                    "stale": state == "stale" or e.models_stale,
                    "checked_age_s": age(now, e.checked_at),
                    "alias_of": alias_of,
                },
            }
            if e.group is not None:  # a group's head (docs/groups.md)
                items[model_id]["nvpair"]["group"] = {
                    "name": e.group.name, "epoch": e.group.epoch,
                    "ranks_ready": e.group.ranks_ready, "ranks": e.group.ranks}
    return {"object": "list", "data": list(items.values())}
