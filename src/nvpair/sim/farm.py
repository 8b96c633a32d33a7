"""``nvpair sim farm`` (also ``python -m nvpair.sim farm``): many simulated engines, one process.

``nvpair sim farm --kind sglang --count 256 [--base-port P] [--first I] [--models-per-engine N]
[--bad-every B] [--control]``

Runs ``--count`` simulators of one kind in one Trio nursery, each with its own port, HTTP
server, state and accounting (so a manager sees that many independent engines), and prints
one JSON line once every engine is ready: a list of ``{"index", "port", "control",
"model", "models", "behaviour"}``. Then it runs until SIGTERM or SIGINT and exits 0.

* Engine ``i`` (``--first`` onwards) serves model ``m-{i:03d}``; with ``--models-per-engine
  N`` (Ollama: installed models) it has ``N`` models named ``m-{i:03d}-{j:05d}``, and
  ``models`` is their count (``model`` the first).
* ``--base-port P``: engine ``i`` listens on ``P + i - first``; without it every port is
  picked free. ``--control`` gives each engine a control port (picked); by default a farm
  has none, so it holds one socket per engine plus its connections.
* ``--bad-every B``: every B-th engine misbehaves, alternately ``hung`` (answers the
  readiness and identity paths, never ``/v1/models``, ``/api/tags`` or the liveness paths)
  and ``slow`` (every answer ``--slow-s`` late); the rest are ``quick``.

Engines share the process's CPU: a farm is there to give a manager many real ports, not to
measure engines. One process holds hundreds (the benchmarks run 256 a process).
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Sequence
from typing import Any

import msgspec
import trio

from nvpair.sim.faults import Fault
from nvpair.sim.handle import SimHandle
from nvpair.sim.options import KINDS, SimOptions
from nvpair.sim.serve import serve_sim

#: what a hung engine never answers (the listing and liveness paths of every kind)
HUNG_PATHS = ("/v1/models", "/api/tags", "/ping", "/health", "/api/version", "/")


class Farm(msgspec.Struct, frozen=True, kw_only=True):
    kind: str
    count: int
    first: int = 0
    host: str = "127.0.0.1"
    base_port: int | None = None
    models_per_engine: int = 1
    bad_every: int = 0
    slow_s: float = 1.5
    control: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"--kind: unknown kind {self.kind!r}; one of {', '.join(KINDS)}")
        if self.count < 1:
            raise ValueError(f"--count must be >= 1, not {self.count}")
        if self.first < 0:
            raise ValueError(f"--first must be >= 0, not {self.first}")
        if self.models_per_engine < 1:
            raise ValueError(f"--models-per-engine must be >= 1, not {self.models_per_engine}")
        if self.models_per_engine > 1 and self.kind != "ollama":
            raise ValueError("--models-per-engine: only an ollama engine serves several models")
        if self.base_port is not None and not 1 <= self.base_port <= 65536 - self.count:
            raise ValueError(f"--base-port {self.base_port}: {self.count} ports from there "
                             "do not fit in 1-65535")
        if self.slow_s <= 0:
            raise ValueError(f"--slow-s must be > 0, not {self.slow_s}")


def behaviour(i: int, bad_every: int) -> str:
    """``quick``, or for every ``bad_every``-th engine alternately ``hung`` and ``slow``."""
    if bad_every <= 0 or i % bad_every != bad_every - 1:
        return "quick"
    return "hung" if (i // bad_every) % 2 == 0 else "slow"


def engine_options(farm: Farm, i: int) -> SimOptions:
    """The simulator options of engine ``i`` of ``farm``."""
    kind = behaviour(i, farm.bad_every)
    fault = {"hung": Fault("hang", paths=HUNG_PATHS),
             "slow": Fault("slow", seconds=farm.slow_s)}.get(kind)
    models = None
    model = f"m-{i:03d}"
    if farm.models_per_engine > 1:
        models = tuple(f"m-{i:03d}-{j:05d}" for j in range(farm.models_per_engine))
        model = models[0]
    port = 0 if farm.base_port is None else farm.base_port + i - farm.first
    return SimOptions(kind=farm.kind, host=farm.host, port=port,  # type: ignore[arg-type]
                      control_port=0 if farm.control else None, model=model, models=models,
                      fault=fault)


async def serve_farm(farm: Farm, *,
                     task_status: trio.TaskStatus[list[dict[str, Any]]]
                     = trio.TASK_STATUS_IGNORED) -> None:
    """Run every engine of ``farm`` until cancelled.

    Started value: the engines (index, port, control port or None, model, models, behaviour),
    once every one is ready and listening. Cancellation closes every port. Raises OSError
    when a port cannot be bound (``--base-port`` taken).
    """
    async with trio.open_nursery() as nursery:
        engines: list[dict[str, Any]] = []
        handles: list[SimHandle] = []
        for i in range(farm.first, farm.first + farm.count):
            options = engine_options(farm, i)
            handle: SimHandle = await nursery.start(serve_sim, options)
            handles.append(handle)
            engines.append({"index": i, "port": handle.port, "control": handle.control_port,
                            "model": options.model_name,
                            "models": len(options.models or (options.model_name,)),
                            "behaviour": behaviour(i, farm.bad_every)})
        for handle in handles:  # every port listens before the farm says where they are
            await handle.wait_phase("ready")
            await handle.settle()
        task_status.started(engines)
        await trio.sleep_forever()


async def _run(farm: Farm) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:
            engines = await nursery.start(serve_farm, farm)
            sys.stdout.write(msgspec.json.encode(engines).decode() + "\n")
            sys.stdout.flush()
            async for _ in signals:
                nursery.cancel_scope.cancel(reason="signal")
                break


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nvpair sim farm",
                                description="Run many simulated engines in one process.")
    p.add_argument("--kind", choices=KINDS, default="sglang")
    p.add_argument("--count", type=int, required=True)
    p.add_argument("--first", type=int, default=0, help="index of the first engine")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--base-port", type=int, default=None,
                   help="engine i listens on BASE + i - first (default: free ports)")
    p.add_argument("--models-per-engine", type=int, default=1, help="Ollama: installed models")
    p.add_argument("--bad-every", type=int, default=0,
                   help="every B-th engine is hung or slow, alternately (0: none)")
    p.add_argument("--slow-s", type=float, default=1.5, help="how late a slow engine answers")
    p.add_argument("--control", action="store_true", help="a control port per engine")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        farm = Farm(kind=args.kind, count=args.count, first=args.first, host=args.host,
                    base_port=args.base_port, models_per_engine=args.models_per_engine,
                    bad_every=args.bad_every, slow_s=args.slow_s, control=args.control)
    except ValueError as exc:
        print(f"nvpair sim farm: {exc}", file=sys.stderr)
        return 2
    try:
        trio.run(_run, farm)
    except KeyboardInterrupt:
        return 0
    except (OSError, ExceptionGroup) as exc:
        error = _first_os_error(exc)
        if error is None:
            raise
        print(f"nvpair sim farm: {error}", file=sys.stderr)
        return 1
    return 0


def _first_os_error(exc: BaseException) -> OSError | None:
    """The OSError in ``exc`` (a port that cannot be bound), through exception groups."""
    if isinstance(exc, OSError):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            found = _first_os_error(inner)
            if found is not None:
                return found
    return None
