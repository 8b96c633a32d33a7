"""Helpers for tests that run nvpair with simulators as managed child processes."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx2
import trio
from tests.ports import free_port as free_port  # the tests take it from here

from nvpair.config.manifest import builtin_dir
from nvpair.config.settings import Settings, load_settings


def fast_manifest(tmp: Path, kind: str = "vllm", **restart: float) -> Path:
    """The built-in manifest with quick restarts and a short stop grace, for tests."""
    doc = json.loads((builtin_dir() / f"{kind}.json").read_text())
    doc["restart"] = {"initial_s": 0.2, "max_s": 1.6, "reset_after_s": 60, **restart}
    doc["stop"] = {"signal": "SIGTERM", "grace_s": 3}
    path = tmp / f"{kind}-fast.json"
    path.write_text(json.dumps(doc))
    return path


def sim_command(kind: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "nvpair.sim", kind, "--model", "{model}", "--host", "{host}",
            "--port", "{port}", "--no-control", *extra]


FAST_PROBES = """
[engines.probes.ready]
interval_s = 0.1
timeout_s = 0.1
[engines.probes.health]
interval_s = 0.3
timeout_s = 0.3
"""


def managed_config(tmp: Path, name: str, port: int, command: list[str], *, kind: str = "vllm",
                   model: str = "sim-model", extra: str = "", **restart: float) -> Settings:
    manifest = fast_manifest(tmp, kind, **restart)
    text = (f"listen = '127.0.0.1:0'\nlog_dir = '{tmp / 'logs'}'\nsweep_deadline_s = 2\n"
            f"[[engines]]\nname = '{name}'\nkind = '{manifest}'\nport = {port}\n"
            f"model = '{model}'\nmanaged = true\ncommand = {json.dumps(command)}\n{extra}\n"
            + FAST_PROBES)
    path = tmp / "nvpair.toml"
    path.write_text(text)
    return load_settings(str(path))


async def states_during(board, seconds: float, index: int = 0) -> list[str]:  # type: ignore[no-untyped-def]
    """Every state engine ``index`` is published in for ``seconds`` (it may wait forever
    otherwise: the window is the point)."""
    states: list[str] = []
    version = board.current.version
    with trio.move_on_after(seconds):
        while True:
            snap = await board.wait_changed(version)
            version = snap.version
            states.append(snap.engines[index].state)
    return states


async def wait_state(board, name: str, *states: str, where=None,  # type: ignore[no-untyped-def]
                     within: float = 20.0):
    """Wait (event-driven) until the engine is in one of ``states`` (and ``where`` holds).

    Fails after ``within`` seconds with the last state seen, so a failure says why.
    """
    version = -1
    last = None
    try:
        with trio.fail_after(within):
            while True:
                snap = await board.wait_changed(version)
                version = snap.version
                last = snap.engine(name)
                if last is not None and last.state in states and (where is None or where(last)):
                    return last
    except trio.TooSlowError:
        raise AssertionError(f"{name} never reached {states}; last seen: {last}") from None


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead for our purposes
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def group_members(pgid: int) -> list[int]:
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(entry.name))
    return members


@asynccontextmanager
async def reading(url: str) -> AsyncIterator[Reader]:
    """Poll nvpair's reads for the duration of the block (structured: stops at its end)."""
    reader = Reader(url)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(reader.run)
        yield reader
        nursery.cancel_scope.cancel(reason="block ended")


class Reader:
    """Reads status and /v1/models in a loop and keeps the worst latency seen."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.worst = 0.0
        self.count = 0

    async def run(self) -> None:
        async with httpx2.AsyncClient(base_url=self.url, timeout=5) as client:
            while True:
                for path in ("/v1/models", "/v1/engines"):
                    start = trio.current_time()
                    r = await client.get(path)
                    assert r.status_code == 200
                    self.worst = max(self.worst, trio.current_time() - start)
                    self.count += 1
                await trio.sleep(0.02)


async def log_until(client: httpx2.AsyncClient, engine: str, line: str
                    ) -> tuple[list[str], dict[str, Any]]:
    """Follow an engine's log over the API (long polls) until ``line`` is written: every
    line so far, and the last answer (its ``next`` is where to follow on)."""
    doc: dict[str, Any] = {"next": 0}
    seen: list[str] = []
    while line not in seen:
        r = await client.get(f"/v1/engines/{engine}/logs?after={doc['next']}&wait_s=10")
        assert r.status_code == 200, r.text
        doc = r.json()
        seen += doc["lines"]
    return seen, doc

