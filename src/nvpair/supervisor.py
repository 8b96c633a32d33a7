"""One engine's supervisor: its probe client and its probe loops in one nursery."""

from __future__ import annotations

from collections.abc import MutableMapping

import httpx2
import trio

from nvpair.config import EngineSpec
from nvpair.prober import Prober, open_client, overdue_after
from nvpair.router.traffic import Traffic
from nvpair.snapshot import Board, EngineState


def initial_state(spec: EngineSpec) -> EngineState:
    return EngineState(
        name=spec.name,
        kind=spec.kind,
        url=spec.url,
        managed=spec.managed,
        state="starting",
        since=trio.current_time(),
        optional=spec.optional,
        aliases=spec.aliases,
        overdue_after_s=overdue_after(spec.probes.health.interval_s, spec.probes.health.timeout_s),
    )


async def run_probes(
    spec: EngineSpec,
    board: Board,
    registry: MutableMapping[str, Prober],
    *,
    transport: httpx2.AsyncBaseTransport | None = None,
    traffic: Traffic | None = None,
    task_status: trio.TaskStatus[Prober] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Probe one engine until cancelled. Started value: its Prober (registered for the sweep).

    Cancellation closes the engine's client, so no connection outlives the loops.
    """
    async with open_client(spec, transport) as client, trio.open_nursery() as nursery:
        prober = Prober(spec, board, client, traffic)
        registry[spec.name] = prober
        try:
            nursery.start_soon(prober.run_liveness)
            nursery.start_soon(prober.run_identity)
            task_status.started(prober)
            await trio.sleep_forever()
        finally:
            if registry.get(spec.name) is prober:
                del registry[spec.name]
