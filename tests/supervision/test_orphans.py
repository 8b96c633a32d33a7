"""Engines a killed nvpair left running: state files, reclaiming orphans, the subreaper."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx2
import msgspec
import pytest
import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st
from tests.managed import alive, free_port, group_members

from nvpair.supervision.orphans import (
    EngineProcs,
    Record,
    StateFileError,
    boot_id,
    parse_record,
    parse_stat,
    reclaim,
    same_command,
    stat,
)

# -- the state file's parser (outside input: anything may be in that directory) ----------


def _record(**changes: object) -> Record:
    me = stat(os.getpid())
    assert me is not None
    doc = dict(engine="e", pid=os.getpid(), start_time=me.start_time, boot_id=boot_id(),
               argv=("x",), nvpair_pid=os.getpid(), nvpair_start_time=me.start_time)
    doc.update(changes)
    return Record(**doc)  # type: ignore[arg-type]


def test_a_record_reads_back() -> None:
    record = _record(argv=("llama-server", "-m", "a model", "\N{SNOWMAN}"))
    assert parse_record(msgspec.json.encode(record), "f") == record


@pytest.mark.parametrize(("data", "says"), [
    (b"", "f: is not JSON"),
    (b"\xff\xfe", "f: is not UTF-8"),
    (b"[" * 5000 + b"]" * 5000, "f: "),
    (b'{"engine": "e"}', "f: pid: missing required key"),
    (b'{"engine": "E!", "pid": 1}', "f: engine: expected str matching regex"),
    (b"x" * (2 << 20), "f: over 1048576 bytes"),
])
def test_a_bad_state_file_is_one_line(data: bytes, says: str) -> None:
    with pytest.raises(StateFileError) as info:
        parse_record(data, "f")
    assert str(info.value).startswith(says)
    assert "\n" not in str(info.value)


_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
                     lambda inner: st.lists(inner) | st.dictionaries(st.text(), inner),
                     max_leaves=20)
_fields = st.fixed_dictionaries({}, optional={
    "engine": _json | st.from_regex(r"[a-z0-9][a-z0-9_-]{0,62}", fullmatch=True),
    "pid": _json | st.integers(), "start_time": _json | st.integers(),
    "boot_id": _json, "argv": _json | st.lists(st.text()),
    "nvpair_pid": _json | st.integers(), "nvpair_start_time": _json | st.integers(),
    "version": _json})


@given(st.binary(max_size=300) | _fields.map(lambda d: json.dumps(d).encode()))
def test_the_parser_returns_a_record_or_says_what_is_wrong(data: bytes) -> None:
    try:
        record = parse_record(data, "f")
    except StateFileError as exc:
        assert "\n" not in str(exc) and str(exc).startswith("f: ")
    else:
        assert record.pid >= 1 and record.argv


@given(st.text(), st.lists(st.integers(-5, 1 << 40), min_size=50, max_size=52))
def test_proc_stat_fields_are_counted_from_the_last_parenthesis(comm: str, nums: list[int]
                                                                ) -> None:
    line = f"42 ({comm}) S " + " ".join(map(str, nums))
    s = parse_stat(line)
    assert s is not None
    assert (s.ppid, s.pgrp, s.session, s.start_time) == (nums[0], nums[1], nums[2], nums[18])


def test_proc_stat_of_this_process() -> None:
    s = stat(os.getpid())
    assert s is not None and s.ppid == os.getppid() and s.session == os.getsid(0)


# -- reclaiming: real processes -------------------------------------------------------------


def _write(state: Path, record: Record) -> Path:
    path = state / "engines" / f"{record.engine}.{record.pid}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(msgspec.json.encode(record))
    return path


@asynccontextmanager
async def _sleeper() -> AsyncIterator[trio.Process]:
    """A process in its own session, as an engine is (ended with the block)."""
    proc = await trio.lowlevel.open_process(["sleep", "60"], start_new_session=True)
    try:
        yield proc
    finally:
        proc.kill()
        with trio.CancelScope(shield=True), trio.move_on_after(5):
            await proc.wait()


def _dead_nvpair() -> dict[str, int]:
    """A recorded nvpair that is not running: our pid with another start time."""
    me = stat(os.getpid())
    assert me is not None
    return {"nvpair_pid": os.getpid(), "nvpair_start_time": me.start_time + 1}


async def test_an_orphan_of_a_dead_nvpair_is_stopped(tmp_path: Path) -> None:
    async with _sleeper() as proc:
        s = stat(proc.pid)
        assert s is not None
        path = _write(tmp_path, _record(pid=proc.pid, start_time=s.start_time,
                                        argv=("sleep", "60"), **_dead_nvpair()))
        with trio.fail_after(10):
            stopped = await reclaim(EngineProcs(tmp_path))
            assert await proc.wait() == -signal.SIGTERM
        assert [r.pid for r in stopped] == [proc.pid]
        assert not path.exists()


async def test_kill_now_cuts_an_orphans_grace_period_short(tmp_path: Path) -> None:
    """A second signal while nvpair starts (it is stopping a dead nvpair's orphans): an
    orphan that ignores SIGTERM gets SIGKILL at once, not after its grace (10 s here)."""
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); " \
           "print('deaf', flush=True); time.sleep(60)"
    proc = await trio.lowlevel.open_process([sys.executable, "-c", code],
                                            start_new_session=True, stdout=subprocess.PIPE)
    try:
        with trio.fail_after(5):  # well under the grace period
            assert proc.stdout is not None
            assert await proc.stdout.receive_some()  # it printed: SIGTERM is ignored now
            s = stat(proc.pid)
            assert s is not None
            _write(tmp_path, _record(pid=proc.pid, start_time=s.start_time,
                                     argv=(sys.executable, "-c", code), **_dead_nvpair()))
            procs = EngineProcs(tmp_path)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(reclaim, procs)
                await trio.testing.wait_all_tasks_blocked()  # SIGTERM sent, in its grace
                assert proc.returncode is None
                procs.kill_now.set()
                assert await proc.wait() == -signal.SIGKILL
    finally:
        proc.kill()
        with trio.CancelScope(shield=True), trio.move_on_after(5):
            await proc.wait()


async def test_a_reused_pid_is_never_signalled(tmp_path: Path) -> None:
    async with _sleeper() as proc:
        s = stat(proc.pid)
        assert s is not None
        # the same pid, but it started at another time: another process than the one on record
        path = _write(tmp_path, _record(pid=proc.pid, start_time=s.start_time - 1,
                                        argv=("sleep", "60"), **_dead_nvpair()))
        with trio.fail_after(10):
            assert await reclaim(EngineProcs(tmp_path)) == []
        assert alive(proc.pid)
        assert not path.exists()  # the process on record has ended: nothing to keep


async def test_a_running_nvpairs_engines_are_left_alone(tmp_path: Path) -> None:
    async with _sleeper() as proc:
        s = stat(proc.pid)
        assert s is not None
        path = _write(tmp_path, _record(pid=proc.pid, start_time=s.start_time))  # we run
        with trio.fail_after(10):
            assert await reclaim(EngineProcs(tmp_path)) == []
        assert alive(proc.pid)
        assert path.exists()


async def test_a_file_that_is_not_a_state_file_is_removed_with_one_line(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    bad = tmp_path / "engines" / "x.1.json"
    bad.parent.mkdir()
    bad.write_bytes(b"<html>")
    with trio.fail_after(10):
        assert await reclaim(EngineProcs(tmp_path)) == []
    assert not bad.exists()
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == [
        f"{bad}: is not JSON: <html>; removed"]


async def test_record_and_forget(tmp_path: Path) -> None:
    procs = EngineProcs(tmp_path)
    async with _sleeper() as proc:
        procs.record("e", proc.pid, ["sleep", "60"])
        path = tmp_path / "engines" / f"e.{proc.pid}.json"
        record = parse_record(path.read_bytes(), str(path))
        assert (record.pid, record.argv, record.nvpair_pid) == (proc.pid, ("sleep", "60"),
                                                                os.getpid())
        assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temp file left
    procs.forget("e", proc.pid)
    assert not path.exists()


async def test_an_unwritable_state_dir_does_not_stop_the_engine(tmp_path: Path) -> None:
    (tmp_path / "engines").write_text("a file where the directory should be")
    procs = EngineProcs(tmp_path)
    procs.record("e", os.getpid(), ["x"])  # logged, not raised
    assert procs.live == {os.getpid(): "e"}


# -- nvpair serve, SIGKILLed, then started again --------------------------------------------

ENGINE_READY_S = 30


def _config(tmp: Path, command: list[str], port: int) -> Path:
    path = tmp / "nvpair.toml"
    path.write_text(
        f"listen = '127.0.0.1:0'\nlog_dir = '{tmp / 'logs'}'\nstate_dir = '{tmp / 'state'}'\n"
        f"[[engines]]\nname = 'e'\nkind = 'vllm'\nport = {port}\nmodel = 'm'\nmanaged = true\n"
        f"stop_grace_s = 3\ncommand = {json.dumps(command)}\n"
        "[engines.probes.ready]\ninterval_s = 0.1\ntimeout_s = 0.1\n")
    return path


async def _serve(config: Path) -> tuple[trio.Process, str]:
    api = f"127.0.0.1:{free_port()}"
    proc = await trio.lowlevel.open_process(
        [sys.executable, "-m", "nvpair", "serve", "--config", str(config), "--listen", api],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return proc, f"http://{api}"


async def _ready(url: str, proc: trio.Process) -> dict[str, object]:
    """Poll the engine's status until it is ready (an external process: nothing to wait on)."""
    async with httpx2.AsyncClient(base_url=url) as client:
        while True:
            assert proc.returncode is None and proc.poll() is None, "nvpair exited"
            try:
                doc: dict[str, object] = (await client.get("/v1/engines/e")).json()
            except httpx2.TransportError:
                doc = {}
            if doc.get("state") == "ready":
                return doc
            await trio.sleep(0.05)


async def _end(proc: trio.Process | None) -> None:
    """Stop nvpair as a user would (SIGTERM: it stops its engines); SIGKILL if it hangs."""
    if proc is None or proc.returncode is not None:
        return
    proc.send_signal(signal.SIGTERM)
    with trio.move_on_after(20):
        await proc.wait()
    if proc.returncode is None:
        proc.kill()


def _sim(port_arg: str = "{port}") -> list[str]:
    return [sys.executable, "-m", "nvpair.sim", "vllm", "--model", "m", "--port", port_arg,
            "--no-control", "--spawn-children", "1"]


async def test_the_next_nvpair_stops_what_a_killed_one_left(tmp_path: Path) -> None:
    config = _config(tmp_path, _sim(), free_port())
    first = second = None
    pids: list[int] = []
    try:
        with trio.fail_after(ENGINE_READY_S):
            first, url = await _serve(config)
            doc = await _ready(url, first)
        old = int(doc["pid"])  # type: ignore[call-overload]
        pids = group_members(old)
        assert len(pids) == 2  # the engine and its child
        first.kill()
        await first.wait()
        assert all(alive(p) for p in pids)  # its own session: SIGKILL of nvpair spares it
        state = list((tmp_path / "state" / "engines").iterdir())
        assert [p.name for p in state] == [f"e.{old}.json"]

        with trio.fail_after(ENGINE_READY_S):
            second, url = await _serve(config)
            doc = await _ready(url, second)
        assert doc["pid"] != old
        assert not any(alive(p) for p in pids)  # the orphan and its child were stopped
        assert [p.name for p in (tmp_path / "state" / "engines").iterdir()] == [
            f"e.{doc['pid']}.json"]
        log = (tmp_path / "logs" / "e.log").read_text()
        assert f"process {old} ended" not in log  # the second nvpair never had it as a child

        second.send_signal(signal.SIGTERM)
        with trio.fail_after(20):
            assert await second.wait() == 0
        assert list((tmp_path / "state" / "engines").iterdir()) == []  # a clean exit: none
    finally:
        with trio.CancelScope(shield=True), trio.move_on_after(45):
            await _end(first)
            await _end(second)
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


# An engine that leaves two daemons behind (fork, setsid, fork: out of its process group and
# session, so a stop of the engine's group does not reach them), then becomes the simulator.
DAEMONIZING = """
import os, signal, sys
out = sys.argv[1]
for i in (1, 2):
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            null = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(null, fd)
            with open(f"{out}/daemon{i}.tmp", "w") as f:
                f.write(str(os.getpid()))
            os.rename(f"{out}/daemon{i}.tmp", f"{out}/daemon{i}.pid")
            signal.pause()
        os._exit(0)
    os.wait()
os.execv(sys.executable, [sys.executable, *sys.argv[2:]])
"""


async def test_what_an_engine_double_forks_comes_back_to_nvpair_and_is_reaped(
        tmp_path: Path) -> None:
    script = tmp_path / "engine.py"
    script.write_text(DAEMONIZING)
    command = [sys.executable, str(script), str(tmp_path), *_sim()[1:]]
    config = _config(tmp_path, command, free_port())
    daemons: list[int] = []
    proc = None
    try:
        with trio.fail_after(ENGINE_READY_S):
            proc, url = await _serve(config)
            await _ready(url, proc)
        daemons = [int((tmp_path / f"daemon{i}.pid").read_text()) for i in (1, 2)]
        for pid in daemons:
            s = stat(pid)
            assert s is not None and s.ppid == proc.pid  # nvpair is their subreaper
        os.kill(daemons[0], signal.SIGTERM)
        with trio.fail_after(10):
            # gone, not a zombie: nvpair reaped it (not our child: nothing to wait on)
            while stat(daemons[0]) is not None:  # noqa: ASYNC110
                await trio.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        with trio.fail_after(20):
            assert await proc.wait() == 0
        assert not alive(daemons[1])  # stopped when nvpair exited
    finally:
        with trio.CancelScope(shield=True), trio.move_on_after(25):
            await _end(proc)
        for pid in daemons:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


# -- where the state files go ---------------------------------------------------------------


def test_the_state_dir_is_systemd_s_then_xdg_s_then_the_config_s(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from nvpair.config.settings import load_settings

    config = tmp_path / "nvpair.toml"
    config.write_text("listen = '127.0.0.1:0'\n")
    monkeypatch.delenv("STATE_DIRECTORY", raising=False)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    s = load_settings(str(config))
    assert (s.state_dir, s.log_dir) == (tmp_path / "xdg" / "nvpair",
                                        tmp_path / "xdg" / "nvpair" / "logs")
    monkeypatch.setenv("STATE_DIRECTORY", "/var/lib/nvpair")  # StateDirectory=nvpair
    s = load_settings(str(config))
    assert (s.state_dir, s.log_dir) == (Path("/var/lib/nvpair"), Path("/var/lib/nvpair/logs"))
    config.write_text("listen = '127.0.0.1:0'\nstate_dir = 'st'\nlog_dir = '/l'\n")
    s = load_settings(str(config))
    assert (s.state_dir, s.log_dir) == (tmp_path / "st", Path("/l"))


def test_a_script_shown_by_its_interpreter_is_the_same_command() -> None:
    """``nvpair sim ...`` runs as ``python3 /venv/bin/nvpair sim ...`` once started: the
    same command, not a changed one (newuser-3.md finding 16); other changes still are."""
    started = ["nvpair", "sim", "vllm", "--port", "9"]
    assert same_command(started, started)
    assert same_command(started, ["/usr/bin/python3", "/v/bin/nvpair", "sim", "vllm",
                                  "--port", "9"])
    assert same_command(started, ["python3", "-I", "/v/bin/nvpair", "sim", "vllm",
                                  "--port", "9"])
    assert not same_command(started, ["/usr/bin/python3", "/v/bin/nvpair", "sim", "sglang",
                                      "--port", "9"])
    assert not same_command(started, ["/usr/bin/python3", "/v/bin/other", "sim", "vllm",
                                      "--port", "9"])
    assert not same_command(started, ["nvpair", "sim"])
    assert not same_command([], ["x"])


def test_a_kept_record_carries_a_ranks_epoch_and_an_older_one_still_parses() -> None:
    """A group rank's kept record adds its epoch and its head's boot; a record written
    before them (no such fields) parses with neither; an unknown field is still refused."""
    old = {"engine": "g", "pid": 42, "start_time": 7, "boot_id": "b", "argv": ["x"],
           "nvpair_pid": 41, "nvpair_start_time": 6, "on_exit": "keep",
           "kept": {"digest": "a" * 64, "restarts": 1, "output": "/s/g.out", "offset": 9}}
    record = parse_record(json.dumps(old).encode(), "old.json")
    assert record.kept is not None and (record.kept.epoch, record.kept.head_boot) == (None, None)
    old["kept"] = {**old["kept"], "epoch": 12, "head_boot": "boot-of-head"}  # type: ignore[dict-item]
    record = parse_record(json.dumps(old).encode(), "new.json")
    assert record.kept is not None and (record.kept.epoch, record.kept.head_boot) == (
        12, "boot-of-head")
    old["kept"] = {**old["kept"], "epochs": 3}  # type: ignore[dict-item]
    with pytest.raises(StateFileError, match=r"new\.json"):
        parse_record(json.dumps(old).encode(), "new.json")
