"""``on_exit = "keep"``: managed engines that outlive nvpair, adopted by the next one.

Each end-to-end test runs ``python -m nvpair serve`` with a managed vLLM simulator whose
load takes LOAD_S: a start of the engine (what keep saves) is told from an adoption by
its pid and by the time nvpair takes to see it ready.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import httpx2
import msgspec
import trio
from tests.managed import alive, fast_manifest, free_port, group_members

from nvpair.config.settings import load_settings
from nvpair.supervision.orphans import (
    EngineProcs,
    Kept,
    Record,
    boot_id,
    command_digest,
    reclaim,
    stat,
)

#: the simulator's load: an engine started again is not ready for at least this long
LOAD_S = 3.0
#: the probes' interval: an adopted engine is ready within one of nvpair's start
PROBE_S = 1.0
STEP_S = 60  # the ceiling of each step on a loaded 2-core machine


def write_config(tmp: Path, port: int, control: int, *, on_exit: str = "keep") -> Path:
    command = [sys.executable, "-m", "nvpair.sim", "vllm", "--model", "{model}", "--host",
               "{host}", "--port", "{port}", "--control-port", str(control),
               "--load-s", str(LOAD_S), "--warmup-s", "0"]
    path = tmp / "nvpair.toml"
    path.write_text(
        f"listen = '127.0.0.1:0'\nstate_dir = '{tmp / 'state'}'\nlog_dir = '{tmp / 'logs'}'\n"
        f"on_exit = '{on_exit}'\n"
        f"[[engines]]\nname = 'e'\nkind = '{fast_manifest(tmp, 'vllm')}'\nport = {port}\n"
        f"model = 'm'\nmanaged = true\nstop_grace_s = 3\ncommand = {json.dumps(command)}\n"
        f"[engines.probes.ready]\ninterval_s = {PROBE_S}\ntimeout_s = 0.5\n"
        f"[engines.probes.health]\ninterval_s = {PROBE_S}\ntimeout_s = 0.5\n")
    return path


class Serve:
    """A running ``nvpair serve``: its process, its stderr lines, its URL."""

    def __init__(self, proc: trio.Process) -> None:
        self.proc = proc
        self.lines: list[str] = []
        self.url = ""
        self.ended = False
        self._more = trio.Event()

    async def read(self) -> None:
        assert self.proc.stderr is not None
        buffer = b""
        async for chunk in self.proc.stderr:
            buffer += chunk
            *done, buffer = buffer.split(b"\n")
            self.lines += [line.decode(errors="replace") for line in done]
            self._more.set()
            self._more = trio.Event()
        self.ended = True
        self._more.set()

    async def saw(self, text: str) -> str:
        while True:
            for line in self.lines:
                if text in line:
                    return line
            assert not self.ended, f"nvpair ended without saying {text!r}: {self.lines[-8:]}"
            await self._more.wait()

    async def engine(self) -> dict[str, object]:
        """The engine's status once it is ready (an external process: polled)."""
        async with httpx2.AsyncClient(base_url=self.url) as client:
            while True:
                doc: dict[str, object] = (await client.get("/v1/engines/e")).json()
                if doc["state"] == "ready":
                    return doc
                await trio.sleep(0.02)


@contextlib.asynccontextmanager
async def serving(config: Path, engines: list[int]) -> AsyncIterator[Serve]:
    """``nvpair serve`` for the block, once it listens (``engines``: pids to kill should the
    test fail)."""
    proc = await trio.lowlevel.open_process(
        [sys.executable, "-m", "nvpair", "serve", "--config", str(config)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    serve = Serve(proc)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(serve.read)
            line = await serve.saw("nvpair listening on ")
            serve.url = line.split("nvpair listening on ")[1].split()[0]
            yield serve
            nursery.cancel_scope.cancel(reason="test done")
    finally:
        if proc.returncode is None:
            proc.kill()
            with trio.CancelScope(shield=True):
                await proc.wait()


async def log_shows(url: str, text: str) -> list[str]:
    """Follow the engine's log over the API (long polls) until a line holds ``text``."""
    seen: list[str] = []
    after = 0
    async with httpx2.AsyncClient(base_url=url, timeout=15) as client:
        while not any(text in line for line in seen):
            r = await client.get(f"/v1/engines/e/logs?after={after}&wait_s=10")
            assert r.status_code == 200, r.text
            doc = r.json()
            seen += doc["lines"]
            after = doc["next"]
    return seen


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "nvpair", *args], capture_output=True,
                          text=True, timeout=60, check=False)


def kill_all(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)


async def test_a_kept_engine_outlives_nvpair_and_is_adopted_each_time(tmp_path: Path) -> None:
    port, control = free_port(), free_port()
    config = write_config(tmp_path, port, control)
    engines: list[int] = []
    try:
        with trio.fail_after(STEP_S):
            async with serving(config, engines) as first:
                doc = await first.engine()
                pid = int(doc["pid"])  # type: ignore[call-overload]
                engines.append(pid)
                first.proc.send_signal(signal.SIGTERM)
                assert await first.proc.wait() == 0
                said = await first.saw("leaving 1 engine(s) running")
                assert f"e (pid {pid})" in said
        stop = {"SIGTERM": lambda p: p.send_signal(signal.SIGTERM),
                "SIGKILL": lambda p: p.kill(),
                # the OOM killer's stand-in: SIGKILL to nvpair's process alone
                "OOM": lambda p: os.kill(p.pid, signal.SIGKILL)}
        for round_, how in enumerate(("SIGKILL", "OOM", "SIGTERM")):
            # nvpair is down: the engine runs on, answers, and writes to its log
            assert alive(pid)
            async with httpx2.AsyncClient(timeout=5) as direct:
                r = await direct.get(f"http://127.0.0.1:{port}/v1/models")
                assert r.status_code == 200 and r.json()["data"][0]["id"] == "m"
                marker = f"/while-down-{round_}"
                r = await direct.post(f"http://127.0.0.1:{control}/__sim/fault",
                                      json={"mode": "slow", "seconds": 0.001,
                                            "paths": [marker]})
                assert r.status_code == 200
            with trio.fail_after(STEP_S):
                async with serving(config, engines) as serve:
                    listening = trio.current_time()
                    doc = await serve.engine()
                    took = trio.current_time() - listening
                    assert doc["pid"] == pid  # adopted: the same process
                    # within one probe interval, so no start: the engine's load is LOAD_S
                    assert took < PROBE_S, f"ready {took:.2f} s after nvpair listened"
                    lines = await log_shows(serve.url, marker)
                    assert any(f"adopted process {pid}" in line for line in lines)
                    shown = await trio.to_thread.run_sync(
                        cli, "logs", "e", "--url", serve.url, "-n", "500")
                    assert shown.returncode == 0 and marker in shown.stdout, shown
                    if how == "SIGTERM":  # the last: nvpair running, stop-engines via its API
                        break
                    stop[how](serve.proc)
                    await serve.proc.wait()
                    assert alive(pid)
        log = (tmp_path / "logs" / "e.log").read_text()
        assert log.count("[nvpair] starting:") == 1  # one start in four nvpairs
        assert log.count("phase loading -> ready") == 1, log  # the simulator loaded once
        with trio.fail_after(STEP_S):
            async with serving(config, engines) as serve:
                assert (await serve.engine())["pid"] == pid
                done = await trio.to_thread.run_sync(cli, "stop-engines", "--config",
                                                     str(config), "--url", serve.url)
                assert done.returncode == 0, done
                assert "stopped 1 engine(s): e" in done.stdout
                assert not alive(pid) and group_members(pid) == []
                async with httpx2.AsyncClient(base_url=serve.url) as client:
                    assert (await client.get("/v1/engines/e")).json()["state"] == "stopped"
        assert list((tmp_path / "state" / "engines").glob("*.json")) == []
    finally:
        kill_all(engines)


async def test_stop_engines_with_nvpair_gone_stops_them_from_their_records(
        tmp_path: Path) -> None:
    config = write_config(tmp_path, free_port(), free_port())
    engines: list[int] = []
    try:
        with trio.fail_after(STEP_S):
            async with serving(config, engines) as serve:
                pid = int((await serve.engine())["pid"])  # type: ignore[call-overload]
                engines.append(pid)
                serve.proc.send_signal(signal.SIGTERM)
                assert await serve.proc.wait() == 0
        assert alive(pid)
        done = await trio.to_thread.run_sync(cli, "stop-engines", "--config", str(config))
        assert done.returncode == 0, done
        assert "stopped 1 engine(s): e" in done.stdout
        assert not alive(pid) and group_members(pid) == []
        assert list((tmp_path / "state" / "engines").glob("*.json")) == []
        again = await trio.to_thread.run_sync(cli, "stop-engines", "--config", str(config))
        assert again.returncode == 0 and "no engine on record" in again.stdout
    finally:
        kill_all(engines)


async def test_with_on_exit_stop_sigterm_stops_the_engine(tmp_path: Path) -> None:
    config = write_config(tmp_path, free_port(), free_port(), on_exit="stop")
    engines: list[int] = []
    try:
        with trio.fail_after(STEP_S):
            async with serving(config, engines) as serve:
                pid = int((await serve.engine())["pid"])  # type: ignore[call-overload]
                engines.append(pid)
                serve.proc.send_signal(signal.SIGTERM)
                assert await serve.proc.wait() == 0
        assert not alive(pid)
        assert not any("running (on_exit = keep)" in line for line in serve.lines)
    finally:
        kill_all(engines)


# -- which records are adopted (real processes, no nvpair) ---------------------------------


@contextlib.asynccontextmanager
async def sleeper() -> AsyncIterator[trio.Process]:
    """A process in its own session, as an engine is (ended with the block)."""
    proc = await trio.lowlevel.open_process(["sleep", "60"], start_new_session=True)
    try:
        yield proc
    finally:
        proc.kill()
        with trio.CancelScope(shield=True), trio.move_on_after(5):
            await proc.wait()


def kept_record(pid: int, **changes: object) -> Record:
    s = stat(pid)
    assert s is not None
    doc = dict(engine="e", pid=pid, start_time=s.start_time, boot_id=boot_id(),
               argv=("sleep", "60"), nvpair_pid=os.getpid(),
               nvpair_start_time=(stat(os.getpid()) or s).start_time + 1,  # a dead nvpair
               on_exit="keep", kept=Kept(digest=command_digest(["sleep", "60"], {})))
    doc.update(changes)
    return Record(**doc)  # type: ignore[arg-type]


async def reclaimed(tmp_path: Path, record: Record) -> EngineProcs:
    config = write_config(tmp_path, free_port(), free_port())
    spec = load_settings(str(config)).engines[0]
    assert spec.on_exit == "keep"
    path = tmp_path / "state" / "engines" / f"e.{record.pid}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(msgspec.json.encode(record))
    procs = EngineProcs(tmp_path / "state")
    with trio.fail_after(10):
        stopped = await reclaim(procs, [spec])
    assert stopped == []  # never signalled: it is not the engine, or it is adopted
    return procs


async def test_a_kept_process_on_record_is_adoptable(tmp_path: Path) -> None:
    async with sleeper() as proc:
        record = kept_record(proc.pid)
        procs = await reclaimed(tmp_path, record)
        assert procs.take("e") == record
        assert proc.returncode is None and alive(proc.pid)


async def test_a_live_pid_with_another_start_time_is_not_adopted(tmp_path: Path) -> None:
    async with sleeper() as proc:
        s = stat(proc.pid)
        assert s is not None
        procs = await reclaimed(tmp_path, kept_record(proc.pid, start_time=s.start_time + 1))
        assert procs.take("e") is None
        assert alive(proc.pid)  # someone else's process: left alone
        assert list((tmp_path / "state" / "engines").glob("*.json")) == []  # record dropped


async def test_a_live_pid_running_another_command_is_not_adopted(tmp_path: Path) -> None:
    async with sleeper() as proc:
        record = kept_record(proc.pid, argv=("python", "-m", "nvpair.sim", "vllm"))
        procs = await reclaimed(tmp_path, record)
        assert procs.take("e") is None
        assert alive(proc.pid)
        assert list((tmp_path / "state" / "engines").glob("*.json")) == []


async def test_an_adopted_engine_that_dies_is_noticed_and_started_again(
        tmp_path: Path) -> None:
    config = write_config(tmp_path, free_port(), free_port())
    engines: list[int] = []
    try:
        with trio.fail_after(STEP_S):
            async with serving(config, engines) as first:
                pid = int((await first.engine())["pid"])  # type: ignore[call-overload]
                engines.append(pid)
                first.proc.kill()
                await first.proc.wait()
        with trio.fail_after(STEP_S):
            async with serving(config, engines) as serve:
                assert (await serve.engine())["pid"] == pid
                os.killpg(pid, signal.SIGKILL)  # not nvpair's child: seen through its pidfd
                async with httpx2.AsyncClient(base_url=serve.url) as client:
                    while True:  # an external process: polled
                        doc = (await client.get("/v1/engines/e")).json()
                        if doc["state"] == "ready" and doc["pid"] != pid:
                            break
                        await trio.sleep(0.05)
                engines.append(int(doc["pid"]))
                assert doc["restarts"] == 1
                lines = await log_shows(serve.url, "its exit status is unknown")
                assert any(f"process {pid} ended" in line for line in lines)
                serve.proc.kill()
                await serve.proc.wait()
        with trio.fail_after(STEP_S):  # the count goes on from the record
            async with serving(config, engines) as third:
                again = await third.engine()
                assert again["pid"] == doc["pid"] and again["restarts"] == 1
    finally:
        kill_all(engines)


async def test_an_engine_whose_command_changed_while_nvpair_was_down_is_restarted(
        tmp_path: Path) -> None:
    port, control = free_port(), free_port()
    config = write_config(tmp_path, port, control)
    engines: list[int] = []
    try:
        with trio.fail_after(STEP_S):
            async with serving(config, engines) as first:
                pid = int((await first.engine())["pid"])  # type: ignore[call-overload]
                engines.append(pid)
                first.proc.send_signal(signal.SIGTERM)
                await first.proc.wait()
        text = config.read_text().replace('"--warmup-s", "0"', '"--warmup-s", "0.1"')
        assert text != config.read_text()
        config.write_text(text)
        with trio.fail_after(STEP_S):
            async with serving(config, engines) as serve:
                await serve.saw("its command changed while nvpair was down")
                async with httpx2.AsyncClient(base_url=serve.url) as client:
                    while True:  # an external process: polled
                        doc = (await client.get("/v1/engines/e")).json()
                        if doc["state"] == "ready" and doc["pid"] != pid:
                            break
                        await trio.sleep(0.05)
                engines.append(int(doc["pid"]))
                assert not alive(pid)  # the old one was stopped, not left beside it
    finally:
        kill_all(engines)


async def test_an_on_demand_engine_left_running_is_adopted_not_shown_cold(
        tmp_path: Path) -> None:
    config = write_config(tmp_path, free_port(), free_port())
    config.write_text(config.read_text().replace("managed = true\n",
                                                 "managed = true\nactivation = 'on_demand'\n"))
    engines: list[int] = []
    try:
        with trio.fail_after(STEP_S):
            async with serving(config, engines) as first:
                async with httpx2.AsyncClient(base_url=first.url) as client:
                    assert (await client.post("/v1/engines/e/start")).status_code == 202
                pid = int((await first.engine())["pid"])  # type: ignore[call-overload]
                engines.append(pid)
                first.proc.send_signal(signal.SIGTERM)
                assert await first.proc.wait() == 0
        with trio.fail_after(STEP_S):
            async with serving(config, engines) as serve:
                listening = trio.current_time()
                doc = await serve.engine()  # (cold would never become ready by itself)
                assert doc["pid"] == pid
                assert trio.current_time() - listening < PROBE_S
                done = await trio.to_thread.run_sync(cli, "stop-engines", "--config",
                                                     str(config), "--url", serve.url)
                assert done.returncode == 0, done
                assert not alive(pid)
    finally:
        kill_all(engines)


async def test_a_kept_engine_a_reload_removes_or_restarts_is_stopped_not_left_running(
        tmp_path: Path) -> None:
    """``on_exit = "keep"`` is about nvpair's own exit: an engine a reload takes out of
    the config (or restarts for a change) is drained and stopped, never left running
    beside its successor (whose port it would hold)."""
    port = free_port()
    config = write_config(tmp_path, port, free_port())
    text = config.read_text()
    engines: list[int] = []
    try:
        with trio.fail_after(STEP_S):
            async with serving(config, engines) as serve:
                first = int((await serve.engine())["pid"])  # type: ignore[call-overload]
                engines.append(first)
                assert '"--warmup-s", "0"' in text
                config.write_text(text.replace('"--warmup-s", "0"', '"--warmup-s", "0.01"'))
                async with httpx2.AsyncClient(base_url=serve.url, timeout=30) as client:
                    r = await client.post("/v1/admin/reload")
                    assert r.status_code == 200, r.text
                    assert list(r.json()["restart"]) == ["e"], r.text
                    second = first
                    while second == first:  # (its successor: polled, an outside process)
                        doc = await serve.engine()
                        second = int(doc["pid"])  # type: ignore[call-overload]
                        await trio.sleep(0.05)
                    engines.append(second)
                    assert not alive(first)
                    config.write_text(text.split("[[engines]]")[0])
                    r = await client.post("/v1/admin/reload")
                    assert r.status_code == 200, r.text
                    gone = False
                    while not gone:  # (off the API once it has stopped: polled from outside)
                        gone = (await client.get("/v1/engines/e")).status_code == 404
                        await trio.sleep(0.05)
                    assert not alive(second)
    finally:
        kill_all(engines)
