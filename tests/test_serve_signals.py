"""``nvpair serve`` as a real process: no signal and no error leaves a managed engine running.

Each test runs ``python -m nvpair serve`` with one managed llama.cpp simulator that ignores
SIGTERM (``--ignore-sigterm``), so its stop lasts its whole grace period: a signal or an
error during that stop is where an engine used to be left behind, in its own session.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import httpx2
import msgspec
import trio
from tests.managed import FAST_PROBES, alive, fast_manifest, free_port, group_members, sim_command

from nvpair.supervision.orphans import Record, boot_id, stat

#: the engine's stop grace: long enough that a stop which waits it out is told apart from
#: one that kills at once (the checks below allow KILLED_WITHIN_S)
GRACE_S = 10.0
KILLED_WITHIN_S = 5.0


def write_config(tmp: Path, *sim_args: str, listen: str = "127.0.0.1:0") -> Path:
    command = sim_command("llamacpp", "--ignore-sigterm", *sim_args)
    text = (f"listen = '{listen}'\nstate_dir = '{tmp / 'state'}'\n"
            f"log_dir = '{tmp / 'logs'}'\n"
            f"[[engines]]\nname = 'e'\nkind = '{fast_manifest(tmp, 'llamacpp')}'\n"
            f"port = {free_port()}\nmodel = 'm'\nmanaged = true\nstop_grace_s = {GRACE_S}\n"
            f"command = {json.dumps(command)}\n" + FAST_PROBES)
    path = tmp / "nvpair.toml"
    path.write_text(text)
    return path


class Serve:
    """A running ``nvpair serve``: its process, and its stderr read line by line."""

    def __init__(self, proc: trio.Process) -> None:
        self.proc = proc
        self.lines: list[str] = []
        self.ended = False
        self._more = trio.Event()
        self.url = ""
        #: the engine processes seen (each killed at the end, should a test fail)
        self.engines: list[int] = []
        self._reading = trio.CancelScope()
        self._read = trio.Event()

    async def read(self) -> None:
        assert self.proc.stderr is not None
        buffer = b""
        with self._reading:
            async for chunk in self.proc.stderr:
                buffer += chunk
                *done, buffer = buffer.split(b"\n")
                self.lines += [line.decode(errors="replace") for line in done]
                self._more.set()
                self._more = trio.Event()
        self.ended = True
        self._more.set()
        self._read.set()

    async def hang_up(self) -> None:
        """Close nvpair's stderr (our end of the pipe): its next write fails."""
        self._reading.cancel(reason="hanging up")
        await self._read.wait()
        assert self.proc.stderr is not None
        await self.proc.stderr.aclose()

    async def saw(self, text: str) -> str:
        """Until a line of stderr holds ``text``; fails if stderr ends first."""
        while True:
            for line in self.lines:
                if text in line:
                    return line
            assert not self.ended, f"nvpair ended without saying {text!r}: {self.lines[-8:]}"
            await self._more.wait()

    async def engine_pid(self, state: str = "ready") -> int:
        """The engine's pid once it is in ``state`` (its status, over the API)."""
        async with httpx2.AsyncClient(base_url=self.url) as client:
            while True:
                doc = (await client.get("/v1/engines/e")).json()
                if doc["state"] == state and doc["pid"]:
                    self.engines.append(doc["pid"])
                    return int(doc["pid"])
                await trio.sleep(0.05)  # an external process: nothing to wait on but it


@contextlib.asynccontextmanager
async def serving(config: Path, *, listening: bool = True) -> AsyncIterator[Serve]:
    """``nvpair serve --config config`` for the block (``listening``: once its API listens)."""
    proc = await trio.lowlevel.open_process(
        [sys.executable, "-m", "nvpair", "serve", "--config", str(config)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    serve = Serve(proc)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(serve.read)
            if listening:
                line = await serve.saw("nvpair listening on ")
                serve.url = line.split("nvpair listening on ")[1].split()[0]
            yield serve
            nursery.cancel_scope.cancel(reason="test done")
    finally:
        if proc.returncode is None:
            proc.kill()
            with trio.CancelScope(shield=True):
                await proc.wait()
        for pid in serve.engines:  # left behind (the test has failed): not left running
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)


async def engine_log_says(tmp: Path, text: str) -> None:
    path = tmp / "logs" / "e.log"
    # a file other processes write (nvpair's API is gone by then): nothing to wait on but it
    while not (path.exists() and text in path.read_text(errors="replace")):  # noqa: ASYNC110
        await trio.sleep(0.05)


def assert_gone(pid: int) -> None:
    assert not alive(pid), f"engine process {pid} was left running"
    assert group_members(pid) == []


async def test_sighup_reloads_the_config_and_touches_no_unchanged_engine(
        tmp_path: Path) -> None:
    """SIGHUP reads the config again (docs/lifecycle.md, "Reload"): the unchanged engine
    keeps its process; an added engine is started; a bad config is refused with its line
    and nvpair goes on as it was. (It used to be ignored: the added engine never came.)"""
    config = write_config(tmp_path, "--load-s", "0.2")
    with trio.fail_after(60):
        async with serving(config) as serve:
            pid = await serve.engine_pid()
            added = (f"[[engines]]\nname = 'f'\nkind = 'llamacpp'\nport = {free_port()}\n"
                     f"model = 'm2'\nmanaged = true\n"
                     f"command = {json.dumps(sim_command('llamacpp'))}\n")
            config.write_text(config.read_text() + added)
            serve.proc.send_signal(signal.SIGHUP)
            line = await serve.saw("reload: 1 added (f), 1 unchanged")
            assert "(SIGHUP)" in line
            async with httpx2.AsyncClient(base_url=serve.url) as client:
                doc = (await client.get("/v1/engines/e")).json()
                assert doc["state"] == "ready" and doc["pid"] == pid  # not touched
                # an external process: nothing to wait on but it
                while (f := (await client.get("/v1/engines/f")).json())["state"] != "ready":  # noqa: ASYNC110
                    await trio.sleep(0.05)
                serve.engines.append(f["pid"])
                config.write_text(config.read_text() + "[[engines]]\nname = 'bad'\n")
                serve.proc.send_signal(signal.SIGHUP)
                refused = await serve.saw("refused, the running config kept")
                assert "engines[2]" in refused and "kind" in refused  # check's one line
                doc = (await client.get("/v1/engines")).json()
                assert [e["name"] for e in doc["engines"]] == ["e", "f"]
                assert all(e["state"] == "ready" for e in doc["engines"])
            assert serve.proc.returncode is None and alive(pid)
            serve.proc.send_signal(signal.SIGTERM)
            await engine_log_says(tmp_path, "SIGTERM received: ignored")
            serve.proc.send_signal(signal.SIGTERM)  # (not to wait out the grace)
            assert await serve.proc.wait() == 0
    assert_gone(pid)
    assert_gone(f["pid"])


async def test_a_second_sigterm_kills_the_engines_now_and_reaps_them(tmp_path: Path) -> None:
    with trio.fail_after(60):
        async with serving(write_config(tmp_path, "--load-s", "0.2")) as serve:
            pid = await serve.engine_pid()
            serve.proc.send_signal(signal.SIGTERM)
            await serve.saw("got SIGTERM, shutting down")
            await engine_log_says(tmp_path, "SIGTERM received: ignored")  # in its grace
            serve.proc.send_signal(signal.SIGTERM)
            second = trio.current_time()
            await serve.saw("second signal: killing engines now")
            code = await serve.proc.wait()
            took = trio.current_time() - second
    assert_gone(pid)
    assert code == 0
    assert took < KILLED_WITHIN_S  # killed, not the grace period of GRACE_S waited out
    log = (tmp_path / "logs" / "e.log").read_text()
    assert f"process {pid} ended: killed by SIGKILL" in log
    assert not list((tmp_path / "state" / "engines").glob("*.json"))  # reaped: off record


async def test_an_error_while_serving_stops_the_engines_and_a_signal_hurries_it(
        tmp_path: Path) -> None:
    # The error: stderr goes away (a closed terminal, a reader that died), so printing the
    # engine's next state change raises. nvpair ends with it, stopping its engine first;
    # a SIGTERM during that stop kills the engine now rather than ending nvpair at once.
    with trio.fail_after(60):
        async with serving(write_config(tmp_path, "--load-s", "3")) as serve:
            pid = await serve.engine_pid("starting")
            await serve.hang_up()  # "ready" is printed to a closed pipe
            await engine_log_says(tmp_path, "SIGTERM received: ignored")  # stopping it
            serve.proc.send_signal(signal.SIGTERM)
            signalled = trio.current_time()
            code = await serve.proc.wait()
            took = trio.current_time() - signalled
    assert_gone(pid)
    assert code > 0  # ended by the error (not by the signal)
    assert took < KILLED_WITHIN_S
    assert f"process {pid} ended: killed by SIGKILL" in (tmp_path / "logs" / "e.log").read_text()


async def test_a_taken_api_port_ends_nvpair_before_any_engine_starts(tmp_path: Path) -> None:
    """The API listens before any engine starts, so a failed bind never leaves one."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = write_config(tmp_path, "--load-s", "0.2", listen=f"127.0.0.1:{port}")
        with trio.fail_after(30):
            done = await trio.run_process(
                [sys.executable, "-m", "nvpair", "serve", "--config", str(config)],
                capture_stderr=True, check=False)
    assert done.returncode == 1
    last = done.stderr.decode().strip().splitlines()[-1]
    assert last == f"nvpair: error: cannot listen on 127.0.0.1:{port}: Address already in use"
    log = tmp_path / "logs" / "e.log"
    assert not log.exists() or "starting:" not in log.read_text()  # never spawned
    assert not list((tmp_path / "state").glob("engines/*.json"))


async def test_signals_while_it_stops_a_dead_nvpairs_orphan_leave_none(tmp_path: Path) -> None:
    """nvpair starts by stopping what a killed nvpair left (its state files): a SIGTERM then
    ends nvpair once that orphan is stopped, and a second one kills the orphan now."""
    deaf = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "print('deaf', flush=True); time.sleep(60)")
    orphan = await trio.lowlevel.open_process([sys.executable, "-c", deaf],
                                              start_new_session=True, stdout=subprocess.PIPE)
    try:
        with trio.fail_after(60):
            assert orphan.stdout is not None
            assert await orphan.stdout.receive_some()  # it ignores SIGTERM from now on
            s, me = stat(orphan.pid), stat(os.getpid())
            assert s is not None and me is not None
            record = Record(engine="e", pid=orphan.pid, start_time=s.start_time,
                            boot_id=boot_id(), argv=(sys.executable, "-c", deaf),
                            nvpair_pid=os.getpid(), nvpair_start_time=me.start_time + 1)
            (tmp_path / "state" / "engines").mkdir(parents=True)
            (tmp_path / "state" / "engines" / f"e.{orphan.pid}.json").write_bytes(
                msgspec.json.encode(record))  # of an nvpair that is gone (not our start time)
            async with serving(write_config(tmp_path), listening=False) as serve:
                await serve.saw(f"process {orphan.pid} (started by nvpair")  # SIGTERM sent
                serve.proc.send_signal(signal.SIGTERM)
                await serve.saw("got SIGTERM, shutting down")
                assert orphan.returncode is None  # still being stopped, in its grace
                serve.proc.send_signal(signal.SIGTERM)
                await serve.saw("second signal: killing engines now")
                assert await orphan.wait() == -signal.SIGKILL
                assert await serve.proc.wait() == 0
            assert not any("nvpair listening on" in line for line in serve.lines)
    finally:
        orphan.kill()
        with trio.CancelScope(shield=True):
            await orphan.wait()
