"""Engine simulators: SGLang, vLLM, llama.cpp, Ollama, TGI and a plain OpenAI server.

They speak HTTP/1.1 on real sockets and behave like the engines where it matters to a
manager (engine-surfaces.md §6): which endpoints exist, what they cost, what they answer in
each phase, and the traps. Faults can be injected and every request is accounted.

Run one in a Trio nursery::

    handle = await nursery.start(serve_sim, SimOptions(kind="sglang"))
    handle.url, handle.stats(), handle.set_fault("hang", paths=["/health"])

or as a process: ``python -m nvpair.sim sglang --port 30000`` (see :mod:`nvpair.sim.cli`).
Module map: ``http`` (h11 server core), ``port`` (the engine port), ``engine`` (request
pipeline), ``openai_api``, one module per kind (llama.cpp's inference in ``llamacpp_api``,
its router mode in ``llamacpp_router``),
``state``, ``sleep``, ``faults``, ``accounting``, ``lifecycle``, ``dist`` (multi-node),
``children``, ``control``, ``handle``, ``serve``, ``cli``. docs/simulators.md describes them all.
"""

from nvpair.sim.accounting import PathStats
from nvpair.sim.faults import FAULT_MODES, Fault, FaultMode
from nvpair.sim.handle import SimHandle, SimStats
from nvpair.sim.options import KINDS, PHASES, Kind, Phase, SimOptions
from nvpair.sim.serve import serve_sim

__all__ = [
    "FAULT_MODES",
    "KINDS",
    "PHASES",
    "Fault",
    "FaultMode",
    "Kind",
    "PathStats",
    "Phase",
    "SimHandle",
    "SimOptions",
    "SimStats",
    "serve_sim",
]
