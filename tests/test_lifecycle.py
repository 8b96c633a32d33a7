"""Managed engines: simulators run as real child processes by nvpair, over real sockets."""

from __future__ import annotations

import itertools
import os
import signal
import sys

import httpx2
import trio
from tests.managed import (
    alive,
    free_port,
    group_members,
    log_until,
    managed_config,
    reading,
    sim_command,
    wait_state,
)

from nvpair import service

# A read that waited on the lifecycle would take as long as a start (load 1 s here) or a
# stop; reads from the snapshot take a few ms. The bound leaves room for a busy machine.
READ_BOUND_S = 0.3


async def test_sigkill_leads_to_down_then_restart_with_new_pid(
        nursery, tmp_path) -> None:
    settings = managed_config(tmp_path, "e", free_port(),
                              sim_command("vllm", "--load-s", "1.0", "--spawn-children", "2"))
    with trio.fail_after(30):
        running = await nursery.start(service.run, settings)
        async with reading(running.url) as reader:
            first = await wait_state(running.board, "e", "ready",
                                     where=lambda e: bool(e.models))
            assert first.pid and alive(first.pid)
            assert [m.id for m in first.models] == ["sim-model"]
            os.kill(first.pid, signal.SIGKILL)
            down = await wait_state(running.board, "e", "down")
            assert down.exit_code == -signal.SIGKILL and down.exited_at
            assert "killed by SIGKILL" in (down.error or "")
            again = await wait_state(running.board, "e", "ready",
                                     where=lambda e: e.pid != first.pid)
            assert again.restarts == 1 and again.pid and alive(again.pid)
            assert group_members(first.pid) == []  # the old group's children went with it
    assert reader.count > 10 and reader.worst < READ_BOUND_S, reader.worst


async def test_stop_and_start_through_the_api(nursery, tmp_path) -> None:
    settings = managed_config(tmp_path, "e", free_port(),
                              sim_command("vllm", "--load-s", "1.0", "--spawn-children", "2"))
    with trio.fail_after(30):
        running = await nursery.start(service.run, settings)
        async with reading(running.url) as reader:
            ready = await wait_state(running.board, "e", "ready", where=lambda e: bool(e.models))
            pid = ready.pid
            assert pid is not None and len(group_members(pid)) == 3
            async with httpx2.AsyncClient(base_url=running.url) as client:
                r = await client.post("/v1/engines/e/stop")
                assert r.status_code == 202 and r.json()["operation"] == "stopping"
                # the same status object as GET /v1/engines/e, this node's name included
                assert r.json()["node"] == settings.node != ""
                await wait_state(running.board, "e", "stopped")
                assert group_members(pid) == []
                models = (await client.get("/v1/models")).json()["data"]
                assert models == []
                assert (await client.post("/v1/engines/e/stop")).status_code == 202  # idempotent
                r = await client.post("/v1/engines/e/start")
                assert r.status_code == 202
                await wait_state(running.board, "e", "ready", where=lambda e: bool(e.models))
                logs = (await client.get("/v1/engines/e/logs?tail=50")).json()["lines"]
                assert any("[nvpair] starting:" in line for line in logs)
                assert (await client.get("/v1/engines/e/logs?tail=0")).status_code == 400
    assert reader.worst < READ_BOUND_S, reader.worst


async def test_a_start_that_fails_at_once_backs_off(nursery, tmp_path) -> None:
    settings = managed_config(tmp_path, "e", free_port(),
                              sim_command("vllm", "--load-s", "0", "--fail-on-load", "3"))
    with trio.fail_after(30):
        running = await nursery.start(service.run, settings)
        async with reading(running.url) as reader:
            starts = []  # when each attempt began
            for k in range(5):
                await wait_state(running.board, "e", "starting", "down",
                                 where=lambda e, k=k: e.restarts >= k)
                starts.append(trio.current_time())
        e = await wait_state(running.board, "e", "down")
    # backoff 0.2, 0.4, 0.8, 1.6 s between attempts (each also takes the start's own time):
    # the gaps grow by the doubled wait, where a fixed delay (or a spin) keeps them equal.
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    assert gaps[0] >= 0.2 and gaps[2] - gaps[0] >= 0.4 and gaps[3] - gaps[1] >= 0.8, gaps
    assert e.exit_code == 3 and "exited with code 3" in (e.error or "")
    assert reader.worst < READ_BOUND_S


async def test_a_start_that_never_becomes_ready_hits_its_budget(nursery, tmp_path) -> None:
    settings = managed_config(tmp_path, "e", free_port(),
                              sim_command("vllm", "--load-s", "600"),
                              extra="startup_budget_s = 1.5")
    with trio.fail_after(30):
        running = await nursery.start(service.run, settings)
        starting = await wait_state(running.board, "e", "starting", where=lambda e: e.pid)
        down = await wait_state(running.board, "e", "down")
        assert "not ready within its startup budget of 1.5 s" in (down.error or "")
        assert starting.pid is not None and not alive(starting.pid)


async def test_port_taken_is_reported_not_spawned(nursery, tmp_path) -> None:
    from nvpair.sim import SimOptions, serve_sim

    port = free_port()
    squatter = await nursery.start(serve_sim, SimOptions(kind="vllm", port=port,
                                                         model="squatter-7b"))
    await squatter.wait_phase("ready")
    settings = managed_config(tmp_path, "e", port, sim_command("vllm", "--load-s", "0"))
    with trio.fail_after(30):
        running = await nursery.start(service.run, settings)
        down = await wait_state(running.board, "e", "down", where=lambda e: bool(e.error))
        assert down.error == (f"port {port} is taken by another vLLM serving squatter-7b; "
                              "nvpair will not start a second engine there")
        assert running.runners["e"].starts == 0


async def test_adopted_engine_stop_unlists_without_signalling(nursery, tmp_path) -> None:
    from nvpair.config import load_settings
    from nvpair.sim import SimOptions, serve_sim

    port = free_port()
    sim = await nursery.start(serve_sim, SimOptions(kind="vllm", port=port, model="m"))
    await sim.wait_phase("ready")
    path = tmp_path / "nvpair.toml"
    path.write_text(f"listen = '127.0.0.1:0'\n[[engines]]\nname = 'a'\nkind = 'vllm'\n"
                    f"port = {port}\n")
    with trio.fail_after(20):
        running = await nursery.start(service.run, load_settings(str(path)))
        await wait_state(running.board, "a", "ready", where=lambda e: bool(e.models))
        async with httpx2.AsyncClient(base_url=running.url) as client:
            r = await client.post("/v1/engines/a/stop")
            assert r.status_code == 202 and "never signals" in r.json()["note"]
            await wait_state(running.board, "a", "stopped")
            assert (await client.get("/v1/models")).json()["data"] == []
            await client.post("/v1/engines/a/start")
            await wait_state(running.board, "a", "ready")


# An engine that says a lot, then its last words without a newline, and dies; on SIGTERM
# it says goodbye first.
CHATTY = """
import signal, sys
def bye(*_):
    print("got SIGTERM, saving state", flush=True)
    sys.exit(0)
signal.signal(signal.SIGTERM, bye)
for i in range(1500):  # more than a pipe holds; less than the ring
    print("line %d" % i + " " * 100)
sys.stdout.flush()
if sys.argv[1] == "crash":
    sys.stdout.write("Traceback: FATAL")
    sys.exit(3)
print("serving", flush=True)
signal.pause()
"""


def _engine_lines(lines: list[str]) -> list[str]:
    return [line.rstrip() for line in lines if not line.startswith("[nvpair]")]


async def test_the_last_output_of_an_engine_is_logged(nursery, tmp_path) -> None:
    settings = managed_config(tmp_path, "e", free_port(),
                              [sys.executable, "-c", CHATTY, "crash"])
    with trio.fail_after(30):
        running = await nursery.start(service.run, settings)
        await wait_state(running.board, "e", "down")
        async with httpx2.AsyncClient(base_url=running.url) as client:
            lines = (await client.get("/v1/engines/e/logs?tail=100000")).json()["lines"]
    first_run = lines[:lines.index(next(x for x in lines if " ended: " in x)) + 1]
    assert _engine_lines(first_run)[-2:] == ["line 1499", "Traceback: FATAL"]
    assert len(_engine_lines(first_run)) == 1501
    assert first_run[-1].endswith("ended: exited with code 3")


async def test_what_an_engine_says_while_it_stops_is_logged(nursery, tmp_path) -> None:
    settings = managed_config(tmp_path, "e", free_port(), [sys.executable, "-c", CHATTY, "run"])
    with trio.fail_after(30):
        running = await nursery.start(service.run, settings)
        async with httpx2.AsyncClient(base_url=running.url) as client:
            await log_until(client, "e", "serving")
            assert (await client.post("/v1/engines/e/stop")).status_code == 202
            await wait_state(running.board, "e", "stopped")
            lines = (await client.get("/v1/engines/e/logs?tail=3")).json()["lines"]
    assert _engine_lines(lines[:2]) == ["serving", "got SIGTERM, saving state"]
    assert " ended: " in lines[2]


async def test_what_an_engine_says_while_nvpair_shuts_down_is_logged(tmp_path) -> None:
    settings = managed_config(tmp_path, "e", free_port(), [sys.executable, "-c", CHATTY, "run"])
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            running = await nursery.start(service.run, settings)
            async with httpx2.AsyncClient(base_url=running.url) as client:
                await log_until(client, "e", "serving")
            running.stop()  # nvpair's own shutdown: it stops the engine on its way out
    lines = (settings.log_dir / "e.log").read_text().splitlines()
    assert [x.rstrip() for x in lines[-3:-1]] == ["serving", "got SIGTERM, saving state"]
    assert " ended: " in lines[-1]
