"""The phase machine's clock: loading, (workers), warming, ready; the timers that crash or hang
the engine; the dead phase's exit; and the shutdown that a stop request (SIGTERM) starts.

Timers only drive the start. A phase set from outside (handle or control port) is sticky:
setting ``ready`` while loading ends loading at once, and setting ``loading`` later closes the
port until another phase is set.
"""

from __future__ import annotations

import trio

from nvpair.sim.dist import Rendezvous, WorkerLink
from nvpair.sim.engine import Engine
from nvpair.sim.options import Phase
from nvpair.sim.state import SimState


async def run_lifecycle(
    engine: Engine, rendezvous: Rendezvous | None = None, link: WorkerLink | None = None
) -> None:
    """Run until a stop is requested, then the engine's shutdown (which requests the exit)."""
    state = engine.state
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_start, engine, rendezvous, link)
        nursery.start_soon(_exit_when_dead, engine)
        nursery.start_soon(_crash_on_fault, state)
        opts = engine.options
        if opts.crash_after_s is not None:
            nursery.start_soon(_crash_after, state, opts.crash_after_s)
        if opts.hang_after_s is not None:
            nursery.start_soon(_hang_after, state, opts.hang_after_s)
        await state.stop_requested.wait()
        nursery.cancel_scope.cancel(reason="stop requested")
    if rendezvous is not None:
        await rendezvous.farewell()
    await engine.shutdown()


async def _stay(state: SimState, phase: Phase, seconds: float) -> None:
    """Stay in ``phase`` for ``seconds`` unless it is changed from outside first."""
    with trio.move_on_after(seconds):
        await state.wait_until(lambda: state.phase != phase)


async def _start(engine: Engine, rendezvous: Rendezvous | None, link: WorkerLink | None) -> None:
    state, opts = engine.state, engine.options
    if link is not None:
        await link.joined.wait()
    await _stay(state, "loading", opts.startup_s if opts.kind == "ollama" else opts.load_s)
    if state.phase == "loading" and opts.fail_on_load is not None:
        state.request_exit(opts.fail_on_load)
        return
    if rendezvous is not None:
        needed = opts.workers_needed
        await state.wait_until(
            lambda: len(rendezvous.ready) >= needed or state.phase != "loading"
        )
    if link is not None:
        await link.send_ready()
    if state.phase != "loading":
        return
    state.set_phase("warming" if engine.has_warmup else "ready")
    await _stay(state, "warming", opts.warmup_s)
    if _phase(state) == "warming":
        state.set_phase("ready")


def _phase(state: SimState) -> Phase:
    """The phase now (a call, so type narrowing from before an await does not stick)."""
    return state.phase


async def _exit_when_dead(engine: Engine) -> None:
    """Dead: vLLM and TGI answer 503 for ``exit_after_dead_s``, then exit 1; others at once."""
    state = engine.state
    while True:
        await state.wait_until(lambda: state.phase == "dead")
        if engine.serves_while_dead:
            await _stay(state, "dead", engine.options.exit_after_dead_s)
        if state.phase == "dead":
            state.request_exit(1)
            return


async def _crash_on_fault(state: SimState) -> None:
    """A ``crash`` fault without paths: exit after its ``seconds`` (at once by default)."""
    while True:
        await state.wait_until(lambda: _pathless_crash(state))
        fault = state.fault("crash")
        assert fault is not None
        await trio.sleep_until(state.faults.since("crash") + (fault.seconds or 0.0))
        if state.fault("crash") is fault:
            state.request_exit(1 if fault.exit_code is None else fault.exit_code, hard=True)
            return
        await trio.lowlevel.checkpoint()


def _pathless_crash(state: SimState) -> bool:
    fault = state.fault("crash")
    return fault is not None and not fault.paths


async def _crash_after(state: SimState, seconds: float) -> None:
    await trio.sleep(seconds)
    state.request_exit(1, hard=True)


async def _hang_after(state: SimState, seconds: float) -> None:
    await trio.sleep(seconds)
    state.set_phase("hung")
