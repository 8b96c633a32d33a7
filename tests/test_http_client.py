"""Regression tests for the HTTP client under cancellation (docs/router.md, "Choosing an engine").

httpx 0.28.1 (httpcore 1.0.9) and httpx2 < 2.6 leak pool slots when a request is cancelled
while another waits for the pool (httpcore #1093); every later request then fails with
PoolTimeout. nvpair cancels probes by deadline all the time, so these tests guard the pin.
The probes send through httpcore2's pool directly (``nvpair.probing.probes.ProbeClient``): the
tests drive that client, the way the prober does (``probes.request``).
"""

from __future__ import annotations

import contextlib
import os
import random
import subprocess
from pathlib import Path

import trio
import trio.testing
from tests.stub_http import serve_stub

from nvpair.config.manifest import ProbeSpec
from nvpair.config.settings import Config, EngineConfig, resolve
from nvpair.errors import ProbeError
from nvpair.probing import probes
from nvpair.probing.prober import Prober, open_client
from nvpair.state.snapshot import Board
from nvpair.state.transitions import initial_state


def connections(client: probes.ProbeClient) -> list[object]:
    return list(client.pool.connections)  # type: ignore[attr-defined]


async def get(client: probes.ProbeClient, path: str) -> probes.Answer:
    return await probes.request(client, ProbeSpec(path=path), path, api_key=None)


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def sockets(port: int, state: str) -> int:
    out = subprocess.run(["ss", "-tanH", f"state {state} ( dport = :{port} )"],
                         capture_output=True, text=True, check=False).stdout
    return len([line for line in out.splitlines() if line.strip()])


async def test_cancelled_waiter_leaves_no_stuck_pool_slot(nursery) -> None:
    """(a) Holder on /hang, waiter queued behind it; cancel both `gap` checkpoints apart."""
    port = await nursery.start(serve_stub)
    with trio.fail_after(30):
        async with probes.ProbeClient(f"http://127.0.0.1:{port}", timeout_s=5.0,
                                      max_connections=1) as client:
            for gap in range(6):
                for _ in range(10):
                    async with trio.open_nursery() as n:
                        holder, waiter = trio.CancelScope(), trio.CancelScope()

                        async def send(scope: trio.CancelScope, path: str) -> None:
                            with scope:
                                await get(client, path)

                        n.start_soon(send, holder, "/hang")
                        await trio.testing.wait_all_tasks_blocked()
                        n.start_soon(send, waiter, "/fast")
                        await trio.testing.wait_all_tasks_blocked()
                        holder.cancel()
                        for _ in range(gap):
                            await trio.lowlevel.checkpoint()
                        waiter.cancel()
            assert (await get(client, "/fast")).status == 200
            assert not any("CONNECTING" in repr(c) for c in connections(client))


async def test_cancellation_stress_leaves_no_orphans_and_no_fds(stub_port: int) -> None:
    """(b) 8 tasks, 4 connections, 600 mixed probes at a 50 ms deadline."""
    port = stub_port
    rng = random.Random(7)
    baseline = fd_count()
    with trio.fail_after(60):
        async with probes.ProbeClient(f"http://127.0.0.1:{port}", timeout_s=5.0) as client:
            paths = ["/fast"] * 40 + ["/slow"] * 20 + ["/hang"] * 30 + ["/close"] * 10

            async def worker() -> None:
                for _ in range(75):
                    with trio.move_on_after(0.05):
                        with contextlib.suppress(ProbeError):
                            await get(client, rng.choice(paths))

            async with trio.open_nursery() as n:
                for _ in range(8):
                    n.start_soon(worker)
            for _ in range(10):
                assert (await get(client, "/fast")).status == 200
            assert not any("CONNECTING" in repr(c) for c in connections(client))
            assert sockets(port, "close-wait") <= 1
        assert sockets(port, "close-wait") == 0
        assert sockets(port, "established") == 0
    assert fd_count() <= baseline


async def test_thousands_of_cancelled_probes_then_a_normal_probe(stub_port: int) -> None:
    """The prober itself against a hung engine: every probe times out, then it recovers."""
    port = stub_port
    cfg = Config(engines=(EngineConfig(name="e", kind="openai", port=port),))
    spec = resolve(cfg, "t", Path.cwd()).engines[0]
    board = Board((initial_state(spec),))
    baseline = fd_count()
    with trio.fail_after(60):
        async with open_client(spec) as client:
            prober = Prober(spec, board, client)
            hung = msgspec_replace(spec.probes.health, path="/hang", timeout_s=0.002)
            fast = msgspec_replace(spec.probes.health, path="/fast", timeout_s=1.0)
            for _ in range(1000):
                outcome, _ = await prober._attempt(hung, "/hang")
                assert outcome.kind == "timeout"
            outcome, _ = await prober._attempt(fast, "/fast")
            assert outcome.ok
            assert sockets(port, "close-wait") <= 1
        assert sockets(port, "established") == 0
    assert fd_count() <= baseline


def msgspec_replace(spec, **changes):  # type: ignore[no-untyped-def]
    import msgspec

    return msgspec.structs.replace(spec, **changes)
