"""The simulators' memory knobs, on real processes: the memory is resident (RssAnon grows),
not merely reserved."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx2
import pytest
import trio
from tests.managed import free_port

from nvpair.sim.leak import PAGE, Leak
from nvpair.supervision.memproc import read_status

MIB = 1024 * 1024


@asynccontextmanager
async def sim(*knobs: str) -> AsyncIterator[tuple[trio.Process, str]]:
    """A simulator process with ``knobs``, serving (its /health answers), killed after."""
    port = free_port()
    proc = await trio.lowlevel.open_process(
        [sys.executable, "-m", "nvpair.sim", "vllm", "--port", str(port), "--no-control",
         "--load-s", "0", "--warmup-s", "0", *knobs],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        with trio.fail_after(20):
            async with httpx2.AsyncClient(base_url=url) as client:
                while True:  # until it serves (it listens once loaded)
                    try:
                        if (await client.get("/health")).status_code == 200:
                            break
                    except httpx2.ConnectError:
                        await trio.sleep(0.05)
        yield proc, url
    finally:
        proc.kill()
        with trio.CancelScope(shield=True), trio.move_on_after(5):
            await proc.wait()


def anon(proc: trio.Process) -> int:
    return read_status(proc.pid).rss_anon_bytes or 0


async def test_resident_mb_is_held_and_per_request_leaks_grow_with_requests() -> None:
    async with sim() as (baseline, _), sim(
            "--resident-mb", "100", "--leak-bytes-per-request", str(2 * MIB)) as (resident, url):
        held = anon(resident)
        assert held - anon(baseline) >= 95 * MIB, (held, anon(baseline))
        with trio.fail_after(10):
            async with httpx2.AsyncClient(base_url=url) as client:
                for _ in range(25):
                    assert (await client.get("/health")).status_code == 200
        grown = anon(resident)
        assert grown - held >= 45 * MIB, (grown, held)  # 25 requests of 2 MiB, touched


async def test_leak_mb_per_s_grows_at_its_rate() -> None:
    async with sim("--leak-mb-per-s", "40") as (proc, _):
        first = anon(proc)
        start = trio.current_time()
        await trio.sleep(1.0)  # the rate is the point: a second of it
        rate = (anon(proc) - first) / (trio.current_time() - start)
        assert 25 * MIB <= rate <= 55 * MIB, rate / MIB


def test_knobs_refuse_negative_values() -> None:
    with pytest.raises(ValueError, match="must be >= 0"):
        Leak(mb_per_s=-1)
    leak = Leak()
    leak.allocate(3 * PAGE + 1)
    assert leak.bytes == 3 * PAGE + 1 and not leak.active
