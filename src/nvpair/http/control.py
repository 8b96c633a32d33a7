"""The API's controller: engine requests in HTTP terms, and the engines' logs.

Supervision answers a request with a domain result (``nvpair.supervision.lifecycle.Accepted`` or
``Busy``); this module says what that is on the wire: ``Accepted`` is 202 with the engine's
status object (the one ``GET /v1/engines/{name}`` returns) and the operation in progress,
``Busy`` is 409 with the reason in OpenAI's error shape (``engine_busy``). It never waits:
the request only records what is wanted, and the body comes from the current snapshot.
"""

from __future__ import annotations

from typing import Any, cast

import trio

from nvpair.base.logs import EngineLog
from nvpair.http.asgi import error_doc
from nvpair.http.views import engine_status
from nvpair.state.snapshot import Board
from nvpair.supervision.lifecycle import Accepted, Action, Busy, EngineRunner
from nvpair.supervision.sleeper import Sleepers

ADOPTED_NOTE = ("adopted engine: nvpair never signals it; stop unlists it and stops probing, "
                "start resumes probing")


class Control:
    """The API's ``Controller``: requests and logs for every engine, by name."""

    def __init__(self, runners: dict[str, EngineRunner], board: Board, node: str,
                 sleepers: Sleepers | None = None) -> None:
        self.runners = runners
        self.board = board
        self.node = node
        #: engines' wake and sleep (docs/sleep.md); None: none of them sleeps
        self.sleepers = sleepers

    async def command(self, name: str, action: str) -> tuple[int, dict[str, Any]]:
        """Ask engine ``name``'s runner for ``action`` (start, stop, restart, drain, wake or
        sleep): 202 with the engine's status, or 409 with why not. Raises KeyError for an
        unknown engine (the API checks the name first)."""
        runner = self.runners[name]
        if action in ("wake", "sleep"):  # (docs/sleep.md)
            if self.sleepers is None:
                result: Accepted | Busy = Busy(f"engine {name} cannot sleep or wake here")
            else:
                result = (self.sleepers.wake(name) if action == "wake"
                          else self.sleepers.sleep(name))
        elif action == "drain":  # finish the routed requests in flight, then stop
            result = runner.drain(then="stop", reason="asked by the operator")
        else:
            result = runner.request(cast(Action, action))
        if isinstance(result, Busy):
            return 409, error_doc(409, result.reason, "engine_busy")
        snap = self.board.current
        engine = snap.engine(name)
        assert engine is not None
        doc = engine_status(engine, snap, trio.current_time(), self.node)
        doc["operation"] = result.operation
        if not runner.spec.managed and action not in ("wake", "sleep"):
            doc["note"] = ADOPTED_NOTE
        return 202, doc

    async def wake_model(self, model: str) -> tuple[int, dict[str, Any]]:
        """Wake what serves ``model`` (``Sleepers.wake_model``): 202 with the status of the
        engine concerned, the operation and the model; 409 with why not; 404 (OpenAI's
        ``model_not_found``) for a model no engine here lists."""
        woken = None if self.sleepers is None else self.sleepers.wake_model(model)
        if woken is None:
            return 404, error_doc(404, f"The model `{model}` does not exist.",
                                  "model_not_found")
        if isinstance(woken.result, Busy):
            return 409, error_doc(409, woken.result.reason, "engine_busy")
        snap = self.board.current
        engine = snap.engine(woken.engine)
        assert engine is not None
        doc = engine_status(engine, snap, trio.current_time(), self.node)
        doc["operation"] = woken.result.operation
        doc["model"] = model
        return 202, doc

    def log(self, name: str) -> EngineLog | None:
        """The engine's log (None for an unknown or adopted engine: it has none)."""
        runner = self.runners.get(name)
        return None if runner is None else runner.log
