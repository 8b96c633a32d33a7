"""``serve_sim``: one simulated engine, with its port, control server, rendezvous and children."""

from __future__ import annotations

from functools import partial

import trio

from nvpair.sim.children import run_children
from nvpair.sim.control import serve_control
from nvpair.sim.dist import Rendezvous, WorkerLink, split_addr
from nvpair.sim.engine import Engine
from nvpair.sim.handle import SimHandle
from nvpair.sim.http import HttpServer
from nvpair.sim.leak import Leak
from nvpair.sim.lifecycle import run_lifecycle
from nvpair.sim.llamacpp import LlamaCpp
from nvpair.sim.llamacpp_router import LlamaCppRouter
from nvpair.sim.ollama import Ollama
from nvpair.sim.openai_compat import OpenAICompat
from nvpair.sim.options import SimOptions
from nvpair.sim.port import EnginePort, run_port
from nvpair.sim.sglang import SGLang, SGLangWorker
from nvpair.sim.state import SimState
from nvpair.sim.tgi import TGI
from nvpair.sim.vllm import VLLM, VLLMHeadless


def make_engine(options: SimOptions, state: SimState) -> Engine:
    """The engine class for the options' kind and role (rank >= 1, headless)."""
    engine: type[Engine]
    if options.kind == "sglang":
        engine = SGLangWorker if options.is_worker else SGLang
    elif options.kind == "vllm":
        engine = VLLMHeadless if options.headless else VLLM
    elif options.kind == "llamacpp" and options.models_dir is not None:
        engine = LlamaCppRouter
    else:
        engine = {"llamacpp": LlamaCpp, "ollama": Ollama, "tgi": TGI,
                  "openai": OpenAICompat}[options.kind]
    return engine(options, state)


async def serve_sim(
    options: SimOptions, *, task_status: trio.TaskStatus[SimHandle] = trio.TASK_STATUS_IGNORED
) -> None:
    """Run one simulated engine.

    Started value: a :class:`SimHandle`, once the engine port is reserved (bound, so its
    number is known; listening only if the kind listens while loading), the control port
    listens, and, for rank 0 of a multi-node group, the rendezvous port listens.

    Returns when the simulated process exits by itself: after a stop (``handle.stop()``,
    SIGTERM in the CLI), a crash, the dead phase, a failed load, or rank 0 going away;
    ``handle.exit_code`` says how. With ``options.hard_exit`` a crash ends the process.

    Cancellation: closes the ports and connections; children are terminated unless
    ``leave_children``.

    Raises: OSError when a port cannot be bound (the engine's, the control port, the
    rendezvous), before the started value, in Trio's exception groups when a nursery
    was open. A fault the engine simulates is its behaviour, never an exception here.
    """
    state = SimState(options)
    engine = make_engine(options, state)
    leak = Leak(resident_mb=options.resident_mb, mb_per_s=options.leak_mb_per_s,
                bytes_per_request=options.leak_bytes_per_request)
    port = EnginePort(options.host, options.port)
    try:
        engine.port = 0 if engine.headless else await port.reserve()
        handle = SimHandle(engine, port)
        if options.fault is not None:
            state.set_fault(options.fault)
        async with trio.open_nursery() as nursery:
            if leak.active:
                nursery.start_soon(leak.run)
            if engine.sleep is not None:  # (sleeping frees the baseline, waking holds it)
                engine.sleep.attach(on_sleep=leak.release_resident, on_wake=leak.hold_resident)
                nursery.start_soon(engine.sleep.run)
            if options.control_port is not None:
                handle.control_port = await nursery.start(
                    serve_control, handle, options.host, options.control_port
                )
            link: WorkerLink | None = None
            if options.is_head:
                handle.rendezvous = Rendezvous(state, options.on_worker_loss)
                host, dist_port = split_addr(options.dist_init_addr or f"{options.host}:0")
                handle.dist_port = await nursery.start(handle.rendezvous.serve, host, dist_port)
            elif options.is_worker and options.dist_init_addr:
                host, dist_port = split_addr(options.dist_init_addr)
                link = WorkerLink(state, host, dist_port, options.node_rank)
                nursery.start_soon(link.run)
            if options.spawn_children > 0:
                handle.child_pids = await nursery.start(partial(
                    run_children, options.spawn_children, lifetime_s=options.child_lifetime_s,
                    ignore_sigterm=options.children_ignore_sigterm,
                    leave=options.leave_children,
                ))
            if not engine.headless:
                idle = options.idle_timeout_s
                server = HttpServer(leak.wrap(engine), on_connection=state.count_connection,
                                    idle_timeout_s=engine.keep_alive_s if idle is None else idle)
                await nursery.start(run_port, port, server, state, engine.wants_listening)
            nursery.start_soon(run_lifecycle, engine, handle.rendezvous, link)
            task_status.started(handle)
            await state.exited.wait()
            nursery.cancel_scope.cancel(reason=f"simulated engine exited ({state.exit_code})")
    finally:
        port.close()

