"""``GET /v1/queue``: who waits for which on-demand engine, in the order they will go.

Answered at once from the activator's memory (no engine, lock or other reader is waited
for): per engine its depth, its oldest wait, what its start waits for, and each waiting
request's place, key, priority (and the level ageing lifted it to) and age, never a
body; per key its waiting requests over all engines. The places are worked out for the
first ``SHOWN_WAITING`` of each engine (``more`` counts the rest).
"""

from __future__ import annotations

from typing import Any

import trio

from nvpair.http.asgi import Receive, Scope, Send, send_json, send_wrong_method
from nvpair.router.activation import ANONYMOUS, SHOWN_WAITING, Activator
from nvpair.router.fairqueue import level

PATH = "/v1/queue"


def queue_doc(activator: Activator | None, now: float) -> dict[str, Any]:
    """The answer of ``GET /v1/queue`` at trio time ``now``."""
    engines: dict[str, Any] = {}
    keys: dict[str, Any] = {}
    if activator is None:
        return {"engines": engines, "keys": keys}
    for name, spec in sorted(activator.specs.items()):
        queue = activator.queues.get(name)
        waiting = queue.waiting if queue is not None else None
        doc: dict[str, Any] = {"model": spec.model, "depth": 0, "oldest_wait_s": None,
                               "activating": bool(queue and queue.activating),
                               "blocked": None, "keys": {}, "waiting": [], "more": 0}
        engines[name] = doc
        if queue is None or waiting is None or not waiting:
            continue
        oldest = waiting.oldest()
        doc["depth"] = len(waiting)
        doc["oldest_wait_s"] = None if oldest is None else _age(now, oldest.at)
        doc["blocked"] = None if queue.blocked_by is None else queue.blocked_by()
        top = waiting.top()
        for key, line in waiting.lines.items():
            label = ANONYMOUS if key is None else key
            doc["keys"][label] = {"depth": len(line), "priority": line[0].priority,
                                  "oldest_wait_s": _age(now, line[0].at)}
            mine = keys.setdefault(label, {"depth": 0, "oldest_wait_s": 0.0, "engines": {}})
            mine["depth"] += len(line)
            mine["oldest_wait_s"] = max(mine["oldest_wait_s"], _age(now, line[0].at))
            mine["engines"][name] = len(line)
        order = waiting.order(now, SHOWN_WAITING)
        doc["waiting"] = [{"position": i, "key": t.key, "priority": t.priority,
                           "level": level(t, now, waiting.age_s, top),
                           "age_s": _age(now, t.at), "request_id": t.request_id}
                          for i, t in enumerate(order, 1)]
        doc["more"] = len(waiting) - len(order)
    return {"engines": engines, "keys": dict(sorted(keys.items()))}


def _age(now: float, at: float) -> float:
    return round(max(now - at, 0.0), 3)


class QueueView:
    """The ASGI handler of ``GET /v1/queue`` (a read)."""

    paths = frozenset({PATH})

    def __init__(self, activator: Activator | None) -> None:
        self.activator = activator

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["method"] != "GET":
            await send_wrong_method(send, "GET", PATH)
            return
        await send_json(send, 200, queue_doc(self.activator, trio.current_time()))
