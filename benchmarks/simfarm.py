"""Many simulated engines in one process (for the scale scenario).

``python -m benchmarks.simfarm --first I --count C [--bad-every 4]``

Runs ``C`` SGLang simulators (``nvpair.sim.serve_sim``, each on its own port, with its own
HTTP server, state and accounting) in one Trio nursery, and prints one JSON line: the
engines with their port, model and behaviour. Engine ``i`` serves model ``m-{i:03d}``.
With ``--bad-every 4``, every fourth engine misbehaves, alternately:

* ``hung``: answers ``/ready`` and ``/model_info`` (so it becomes ready and joins the
  model-list sweep) but never answers ``/v1/models`` or ``/ping``;
* ``slow``: every answer comes 1.5 s late (inside nvpair's probe timeouts, outside any
  reasonable read latency).

Several simulators share a process and so its CPU: that is fine for nvpair's side of the
measurement (it sees K independent ports), and the farm processes are not what is measured.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

import msgspec
import trio

from nvpair.sim import Fault, SimHandle, SimOptions, serve_sim

HUNG = Fault("hang", paths=("/v1/models", "/ping"))
SLOW = Fault("slow", seconds=1.5)


def behaviour(i: int, bad_every: int) -> str:
    if bad_every <= 0 or i % bad_every != bad_every - 1:
        return "quick"
    return "hung" if (i // bad_every) % 2 == 0 else "slow"


async def run(first: int, count: int, bad_every: int) -> None:
    async with trio.open_nursery() as nursery:
        engines: list[dict[str, Any]] = []
        handles: list[SimHandle] = []
        for i in range(first, first + count):
            kind = behaviour(i, bad_every)
            fault = {"hung": HUNG, "slow": SLOW}.get(kind)
            options = SimOptions(kind="sglang", model=f"m-{i:03d}", control_port=None,
                                 fault=fault)
            handle: SimHandle = await nursery.start(serve_sim, options)
            handles.append(handle)
            engines.append({"index": i, "port": handle.port, "model": f"m-{i:03d}",
                            "behaviour": kind})
        for handle in handles:  # every port listens before the farm says where they are
            await handle.wait_phase("ready")
            await handle.settle()
        sys.stdout.write(msgspec.json.encode(engines).decode() + "\n")
        sys.stdout.flush()
        await trio.sleep_forever()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.simfarm")
    p.add_argument("--first", type=int, default=0)
    p.add_argument("--count", type=int, required=True)
    p.add_argument("--bad-every", type=int, default=4)
    args = p.parse_args(argv)
    try:
        trio.run(run, args.first, args.count, args.bad_every)
    except KeyboardInterrupt:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
