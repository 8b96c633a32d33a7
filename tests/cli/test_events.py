"""``nvpair events`` and ``nvpair status --watch`` as a person runs them (a subprocess)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import msgspec
import trio
from tests.managed import free_port, wait_state

from nvpair import service
from nvpair.config.settings import load_settings
from nvpair.sim import SimOptions, serve_sim


def settings(tmp: Path, port: int, sim_port: int) -> object:
    path = tmp / "nvpair.toml"
    path.write_text(f"listen = '127.0.0.1:{port}'\nnode = 'n1'\n[[engines]]\nname = 'e0'\n"
                    f"kind = 'vllm'\nport = {sim_port}\n")
    return load_settings(str(path))


def bump(running: service.Running) -> None:
    running.board.update("e0", lambda e: msgspec.structs.replace(e, restarts=e.restarts + 1))


class Lines:
    def __init__(self, proc: trio.Process) -> None:
        assert proc.stdout is not None
        self.stream = proc.stdout
        self.buffer = b""

    async def until(self, text: bytes) -> bytes:
        while text not in self.buffer:
            chunk = await self.stream.receive_some()
            assert chunk, self.buffer
            self.buffer += chunk
        before, _, self.buffer = self.buffer.partition(text)
        return before + text


async def start(nursery: trio.Nursery, tmp: Path, port: int, sim_port: int
                ) -> service.Running:
    running: service.Running = await nursery.start(service.run, settings(tmp, port, sim_port))
    await wait_state(running.board, "e0", "ready", where=lambda e: bool(e.models))
    return running


async def test_events_prints_one_line_each_and_resumes_across_a_restart(
        nursery, tmp_path) -> None:
    sim = await nursery.start(serve_sim, SimOptions(kind="vllm", model="m0"))
    port = free_port()
    with trio.fail_after(40):
        async with trio.open_nursery() as first:
            running = await start(first, tmp_path, port, sim.port)
            proc = await trio.lowlevel.open_process(
                [sys.executable, "-m", "nvpair", "events", "--json", "--types", "engine",
                 "--url", running.url], stdout=subprocess.PIPE, env={**os.environ})
            try:
                out = Lines(proc)
                snap = msgspec.json.decode(await out.until(b"\n"))
                assert snap["event"] == "snapshot"
                assert snap["data"]["engines"][0]["name"] == "e0"
                bump(running)
                line = msgspec.json.decode(await out.until(b"\n"))
                assert (line["event"], line["data"]["restarts"]) == ("engine", 1)
                running.stop()
                bye = msgspec.json.decode(await out.until(b"\n"))
                assert bye["event"] == "bye"
            except BaseException:
                proc.kill()
                raise
        try:  # a new nvpair on the same port: the client comes back on its own, a new boot
            async with trio.open_nursery() as second:
                running = await start(second, tmp_path, port, sim.port)
                again = msgspec.json.decode(await out.until(b"\n"))
                assert again["event"] == "snapshot"
                assert again["id"].split(".")[0] != snap["id"].split(".")[0]
                running.stop()
        finally:
            proc.kill()
            with trio.move_on_after(5, shield=True):
                await proc.wait()


async def test_status_watch_redraws_on_events(nursery, tmp_path) -> None:
    sim = await nursery.start(serve_sim, SimOptions(kind="vllm", model="m0"))
    with trio.fail_after(30):
        async with trio.open_nursery() as inner:
            running = await start(inner, tmp_path, free_port(), sim.port)
            proc = await trio.lowlevel.open_process(
                [sys.executable, "-m", "nvpair", "status", "--watch", "--url", running.url],
                stdout=subprocess.PIPE, env={**os.environ, "NO_COLOR": "1"})
            try:
                out = Lines(proc)
                table = await out.until(b"\n\n")
                assert b"ENGINE" in table and b"e0" in table
                bump(running)
                table = await out.until(b"\n\n")
                row = next(line for line in table.decode().splitlines() if "e0" in line)
                assert " 1 " in row  # the restarts column, redrawn
            finally:
                proc.kill()
                with trio.move_on_after(5, shield=True):
                    await proc.wait()
            running.stop()


async def test_each_event_line_starts_with_the_time_it_came(nursery, tmp_path) -> None:
    """A person reads when it happened first (newuser-3.md finding 22), the id for resuming
    last."""
    import re

    sim = await nursery.start(serve_sim, SimOptions(kind="vllm", model="m0"))
    with trio.fail_after(30):
        running = await start(nursery, tmp_path, free_port(), sim.port)
        proc = await trio.lowlevel.open_process(
            [sys.executable, "-m", "nvpair", "events", "--types", "engine", "--url",
             running.url], stdout=subprocess.PIPE, env={**os.environ})
        try:
            out = Lines(proc)
            snap = (await out.until(b"\n")).decode()
            bump(running)
            engine = (await out.until(b"\n")).decode()
        finally:
            proc.kill()
            with trio.move_on_after(5, shield=True):
                await proc.wait()
    assert re.fullmatch(r"\d\d:\d\d:\d\d snapshot node n1: e0=ready  \[\w+\.\d+\]\n", snap), snap
    assert re.fullmatch(r"\d\d:\d\d:\d\d engine e0 ready models=m0 restarts=1  \[\w+\.\d+\]\n",
                        engine), engine
