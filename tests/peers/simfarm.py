"""Simulated engines for the peers tests, all in one process (so the test process that
measures latencies runs no engine):

``python -m tests.peers.simfarm --host 127.0.0.1 --count 8``

prints one JSON line ``[{"port": P, "control": C, "model": "m-0"}, ...]`` once every engine is
ready, then runs until killed. Engine ``i`` serves model ``m-i`` and has a control port
(``POST /__sim/fault``) so a test can make it refuse connections.
"""

from __future__ import annotations

import argparse
import sys

import msgspec
import trio

from nvpair.sim import SimHandle, SimOptions, serve_sim


async def run(host: str, count: int) -> None:
    async with trio.open_nursery() as nursery:
        handles: list[SimHandle] = []
        for i in range(count):
            options = SimOptions(kind="vllm", host=host, model=f"m-{i}")
            handles.append(await nursery.start(serve_sim, options))
        for handle in handles:
            await handle.wait_phase("ready")
            await handle.settle()
        farm = [{"port": h.port, "control": h.control_port, "model": f"m-{i}"}
                for i, h in enumerate(handles)]
        sys.stdout.write(msgspec.json.encode(farm).decode() + "\n")
        sys.stdout.flush()
        await trio.sleep_forever()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--count", type=int, required=True)
    args = parser.parse_args()
    trio.run(run, args.host, args.count)


if __name__ == "__main__":
    main()
