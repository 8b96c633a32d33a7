"""The control server, on its own port so it can never be mistaken for an engine route and
stays up while the engine port hangs or refuses.

* ``GET /__sim/stats``: :class:`~nvpair.sim.handle.SimStats` as JSON.
* ``GET /__sim/wait?phase=ready[,busy...]``: the same, once the phase is one of those and the
  engine port's listener matches it (for tests and benchmarks in other processes).
* ``POST /__sim/fault`` ``{"mode": ..., "paths": [...], "seconds": .., "status": ..,
  "exit_code": .., "model": ..}``: sets that mode's fault (``"none"`` clears all);
  answers ``{"faults": [...]}``. ``DELETE /__sim/fault`` clears all.
* ``POST /__sim/phase`` ``{"phase": ...}``: answers ``{"phase": ...}``.

Fault and phase changes answer once the engine port's listener reflects them (so a client
that sets ``refuse`` is refused on its next connect).
* ``POST /__sim/reset-stats``: zeros the accounting; answers ``{"ok": true}``.
* ``POST /__sim/stop``: what SIGTERM does; answers ``{"ok": true}``.

Bad bodies get 400 ``{"error": "..."}``; unknown paths 404.
"""

from __future__ import annotations

from typing import cast

import msgspec
import trio

from nvpair.sim.faults import Fault
from nvpair.sim.handle import SimHandle
from nvpair.sim.http import HttpServer, Reply, Request
from nvpair.sim.options import PHASES, Phase
from nvpair.sim.port import open_listener


class _PhaseBody(msgspec.Struct, forbid_unknown_fields=True):
    phase: Phase


class ControlApp:
    def __init__(self, handle: SimHandle) -> None:
        self._handle = handle

    async def __call__(self, request: Request, reply: Reply) -> None:
        handle, route = self._handle, (request.method, request.path)
        try:
            if route == ("GET", "/__sim/stats"):
                await reply.send(200, msgspec.json.encode(handle.stats()))
            elif route == ("GET", "/__sim/wait"):
                phases = request.query.get("phase", "ready").split(",")
                if not set(phases) <= set(PHASES):
                    raise ValueError(f"unknown phase in {phases}; one of {', '.join(PHASES)}")
                await handle.wait_phase(*cast(list[Phase], phases))
                await handle.settle()
                await reply.send(200, msgspec.json.encode(handle.stats()))
            elif route == ("POST", "/__sim/fault"):
                handle.set_fault(msgspec.json.decode(request.body, type=Fault))
                await handle.settle()
                await self._faults(reply)
            elif route == ("DELETE", "/__sim/fault"):
                handle.clear_faults()
                await handle.settle()
                await self._faults(reply)
            elif route == ("POST", "/__sim/phase"):
                body = msgspec.json.decode(request.body, type=_PhaseBody)
                handle.set_phase(body.phase)
                await handle.settle()
                await reply.send_json(200, {"phase": handle.phase})
            elif route == ("POST", "/__sim/reset-stats"):
                handle.reset_stats()
                await reply.send_json(200, {"ok": True})
            elif route == ("POST", "/__sim/stop"):
                handle.stop()
                await reply.send_json(200, {"ok": True})
            else:
                await reply.send_json(404, {"error": f"no control route {request.path}"})
        except (msgspec.DecodeError, ValueError) as exc:
            await reply.send_json(400, {"error": str(exc)})

    async def _faults(self, reply: Reply) -> None:
        faults = self._handle.stats().faults
        await reply.send(200, msgspec.json.encode({"faults": faults}))


async def serve_control(
    handle: SimHandle, host: str, port: int,
    *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the control routes until cancelled.

    Started value: the bound port, once it listens. Cancellation closes the listener and
    every connection. Raises: OSError when the port cannot be bound, before the started
    value; a bad control request is a 4xx answer, never raised."""
    listener = await open_listener(host, port)
    server = HttpServer(ControlApp(handle))
    task_status.started(listener.socket.getsockname()[1])
    await trio.serve_listeners(server.serve_connection, [listener])
