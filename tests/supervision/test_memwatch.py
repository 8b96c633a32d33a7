"""The memory watch with real processes: managed simulators that leak (or not), an adopted
one found from its socket, an exit for memory, and a restart at a quiet moment. Windows are
scaled to seconds (``[memory] window_h`` of a few thousandths of an hour)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx2
import msgspec
import pytest
import trio
from tests.managed import FAST_PROBES, fast_manifest, free_port, sim_command, wait_state

from nvpair import service
from nvpair.config.settings import load_settings
from nvpair.errors import ConfigError
from nvpair.http.metrics import Metrics
from nvpair.state.events import Journal
from nvpair.state.memory import EngineMemory, NodeMemory
from nvpair.state.snapshot import Board
from nvpair.state.transitions import initial_state
from nvpair.supervision.memwatch import KILLED_FOR_MEMORY, MemoryWatch

#: a window of 10.8 s read every 0.1 s; a leak of 20 MiB/s exhausts ~20 GB well within 1 h
MEMORY = """
[memory]
interval_s = 0.1
window_h = 0.003
horizon_h = 1
{extra}
"""


def engines_text(tmp: Path, engines: list[tuple[str, list[str]]], extra: str = "") -> str:
    manifest = fast_manifest(tmp, "vllm")
    text = (f"listen = '127.0.0.1:0'\nlog_dir = '{tmp / 'logs'}'\nsweep_deadline_s = 2\n"
            + MEMORY.format(extra=extra))
    for name, command in engines:
        text += (f"[[engines]]\nname = '{name}'\nkind = '{manifest}'\nport = {free_port()}\n"
                 f"model = 'sim-model'\nmanaged = true\ncommand = {json.dumps(command)}\n"
                 + FAST_PROBES)
    path = tmp / "nvpair.toml"
    path.write_text(text)
    return str(path)


async def wait_memory(board: Board, name: str, where: Any, within: float) -> Any:
    """Until engine ``name``'s memory satisfies ``where`` (event-driven on the board)."""
    version = -1
    last = None
    try:
        with trio.fail_after(within):
            while True:
                snap = await board.wait_changed(version)
                version = snap.version
                e = snap.engine(name)
                last = None if e is None else e.memory
                if last is not None and where(last):
                    return last
    except trio.TooSlowError:
        raise AssertionError(f"{name}: memory never as wanted; last seen: {last}") from None


async def test_a_leak_of_20_mb_a_second_is_leaking_within_30_s_and_a_flat_engine_never(
        tmp_path: Path) -> None:
    settings = load_settings(engines_text(tmp_path, [
        ("leaky", sim_command("vllm", "--leak-mb-per-s", "20")),
        ("flat", sim_command("vllm"))]))
    with trio.fail_after(45):
        async with trio.open_nursery() as nursery:
            running = await nursery.start(service.run, settings)
            board = running.board
            trends: set[str] = set()
            watching = trio.CancelScope()

            async def watch_flat() -> None:
                version = -1
                with watching:
                    while True:
                        snap = await board.wait_changed(version)
                        version = snap.version
                        m = snap.engine("flat").memory  # type: ignore[union-attr]
                        if m is not None:
                            trends.add(m.trend)

            nursery.start_soon(watch_flat)
            await wait_state(board, "leaky", "ready")
            started = trio.current_time()
            leaking = await wait_memory(board, "leaky",
                                        lambda m: m.trend in ("leaking", "critical"), 30)
            took = trio.current_time() - started
            assert leaking.slope_bytes_per_h > 40e9  # 20 MiB/s is ~75 GB/h
            assert leaking.exhaustion_s is not None and leaking.source == "proc"
            assert leaking.top and leaking.top[0].pid == board.current.engine("leaky").pid  # type: ignore[union-attr]
            # the flat one over the same run, and a window more
            flat = board.current.engine("flat").memory  # type: ignore[union-attr]
            assert flat is not None and flat.rss_anon_bytes and flat.covered_s > 5
            async with httpx2.AsyncClient(base_url=running.url) as client:
                doc = (await client.get("/v1/engines")).json()
                metrics = (await client.get("/metrics")).text
            by_name = {e["name"]: e for e in doc["engines"]}
            assert by_name["leaky"]["memory"]["trend"] in ("leaking", "critical")
            assert by_name["flat"]["memory"]["trend"] == "flat"
            assert doc["memory"]["mem_available"] > 0 and doc["memory"]["reserve_bytes"] > 0
            assert 'nvpair_engine_memory_trend{engine="flat"} 0' in metrics
            assert "nvpair_node_memory_available_bytes" in metrics
            watching.cancel()
            running.stop()
    assert trends <= {"flat"}, trends
    assert took < 30


async def test_an_adopted_engines_pid_is_found_from_its_socket(tmp_path: Path) -> None:
    port = free_port()
    manifest = fast_manifest(tmp_path, "vllm")
    path = tmp_path / "nvpair.toml"
    path.write_text("listen = '127.0.0.1:0'\nsweep_deadline_s = 2\n" + MEMORY.format(extra="")
                    + f"[[engines]]\nname = 'adopted'\nkind = '{manifest}'\nport = {port}\n"
                    f"model = 'sim-model'\n" + FAST_PROBES)
    argv = [sys.executable, "-m", "nvpair.sim", "vllm", "--model", "sim-model", "--port",
            str(port), "--no-control", "--resident-mb", "64"]
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            sim = await trio.lowlevel.open_process(argv, start_new_session=True)
            try:
                running = await nursery.start(service.run, load_settings(str(path)))
                await wait_state(running.board, "adopted", "ready")
                m = await wait_memory(running.board, "adopted",
                                      lambda m: m.source == "proc" and m.top, 10)
                assert m.top[0].pid == sim.pid and m.error is None
                assert m.rss_anon_bytes >= 64 * 1024 * 1024  # the sim's footprint is its own
                running.stop()
            finally:
                sim.kill()
                with trio.CancelScope(shield=True), trio.move_on_after(5):
                    await sim.wait()


async def test_an_engine_killed_from_outside_under_the_reserve_is_killed_for_memory(
        tmp_path: Path) -> None:
    # the reserve above what any machine has: the node's headroom is under it
    settings = load_settings(engines_text(
        tmp_path, [("victim", sim_command("vllm"))], extra=f"reserve_bytes = {2**60}"))
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            running = await nursery.start(service.run, settings)
            ready = await wait_state(running.board, "victim", "ready")
            await wait_memory(running.board, "victim", lambda m: m.rss_anon_bytes, 5)
            os.kill(ready.pid, signal.SIGKILL)
            down = await wait_state(running.board, "victim", "down")
            assert down.exit_code == -signal.SIGKILL
            assert KILLED_FOR_MEMORY in (down.error or ""), down.error
            assert "killed by SIGKILL" in (down.error or "")
            running.stop()


async def test_an_engine_killed_with_headroom_to_spare_is_not_killed_for_memory(
        tmp_path: Path) -> None:
    settings = load_settings(engines_text(
        tmp_path, [("victim", sim_command("vllm"))], extra="reserve_bytes = 0"))
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            running = await nursery.start(service.run, settings)
            ready = await wait_state(running.board, "victim", "ready")
            await wait_memory(running.board, "victim", lambda m: m.rss_anon_bytes, 5)
            os.kill(ready.pid, signal.SIGKILL)
            down = await wait_state(running.board, "victim", "down")
            assert down.error == "engine process killed by SIGKILL"
            running.stop()


async def test_restart_when_quiet_restarts_a_leaking_engine_once_after_its_stream_ends(
        tmp_path: Path) -> None:
    settings = load_settings(engines_text(
        tmp_path, [("leaky", sim_command("vllm", "--leak-mb-per-s", "20", "--token-rate", "10"))],
        extra="action = 'restart_when_quiet'\nquiet_s = 0.5\nmin_restart_interval_h = 1"))
    body = json.dumps({"model": "sim-model", "stream": True, "max_tokens": 50,
                       "messages": [{"role": "user", "content": "hi"}]})
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            running = await nursery.start(service.run, settings)
            board = running.board
            first = await wait_state(board, "leaky", "ready")
            # a stream of 5 s, in flight when the leak is found (~11 s of readings)
            await wait_memory(board, "leaky", lambda m: m.covered_s >= 8, 20)
            chunks: list[str] = []
            ended_at: list[float] = []
            async with httpx2.AsyncClient(base_url=running.url, timeout=30) as client:
                async with client.stream("POST", "/v1/chat/completions", content=body,
                                         headers={"content-type": "application/json"}) as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            chunks.append(line)
                            e = board.current.engine("leaky")
                            # neither restarted nor drained while the stream is in flight
                            assert e is not None and e.pid == first.pid
                            assert getattr(e, "admitting", True)
                ended_at.append(trio.current_time())
            assert chunks[-1] == "data: [DONE]" and len(chunks) >= 52
            leaking = board.current.engine("leaky").memory  # type: ignore[union-attr]
            assert leaking is not None and leaking.trend in ("leaking", "critical")
            peak = leaking.rss_anon_bytes
            second = await wait_state(board, "leaky", "ready",
                                      where=lambda e: e.pid != first.pid, within=20)
            assert second.restarts == 1
            back = await wait_memory(board, "leaky", lambda m: m.processes and m.at and (
                board.current.engine("leaky").pid == second.pid), 5)  # type: ignore[union-attr]
            assert back.memory_restarts == 1 and "restarted for memory" in (back.action or "")
            # back to its baseline: a fraction of what it held when it was restarted
            assert back.rss_anon_bytes < peak / 2, (back.rss_anon_bytes, peak)
            # once per min_restart_interval_h: a second leak is not restarted within it
            await wait_memory(board, "leaky", lambda m: m.trend in ("leaking", "critical"), 25)
            await trio.sleep(1)
            assert board.current.engine("leaky").restarts == 1  # type: ignore[union-attr]
            running.stop()


def one_engine(tmp: Path, extra: str = "", engine: str = "managed = true\ncommand = ['x']"
               ) -> Any:
    manifest = fast_manifest(tmp, "vllm")
    path = tmp / "one.toml"
    path.write_text("listen = '127.0.0.1:0'\n" + MEMORY.format(extra=extra)
                    + f"[[engines]]\nname = 'e'\nkind = '{manifest}'\nport = {free_port()}\n"
                    + engine + "\n")
    return load_settings(str(path))


async def test_readings_move_no_listing_and_a_process_gone_is_the_engines_state(
        tmp_path: Path) -> None:
    settings = one_engine(tmp_path)
    board = Board(tuple(initial_state(s) for s in settings.engines))
    watch = MemoryWatch(settings.memory, board, settings.engines)
    child = await trio.lowlevel.open_process(
        [sys.executable, "-c", "import time; x = b'x' * (32 << 20); print('held', flush=True); "
         "time.sleep(30)"], start_new_session=True, stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None
        with trio.fail_after(10):
            assert b"held" in await child.stdout.receive_some(100)
        board.update("e", lambda e: msgspec.structs.replace(e, pid=child.pid, state="ready"))
        listing = board.listing.version
        with trio.fail_after(10):
            for _ in range(3):
                before = board.current.version
                await watch.tick()
                assert board.current.version == before + 1  # one publish per tick
            m = board.current.engine("e").memory  # type: ignore[union-attr]
            assert m is not None and m.source == "proc" and m.error is None
            assert m.rss_anon_bytes >= 32 << 20 and m.top[0].pid == child.pid
            assert board.current.memory is not None and board.current.memory.mem_available
            assert board.listing.version == listing  # /v1/models is not rebuilt for memory
            child.kill()
            await child.wait()
            await watch.tick()
        m = board.current.engine("e").memory  # type: ignore[union-attr]
        assert m is not None and m.error is not None and "gone" in m.error, m
        assert watch.part.failure is None  # the watch itself works on
    finally:
        child.kill()
        with trio.CancelScope(shield=True), trio.move_on_after(5):
            await child.wait()


async def test_a_managed_engines_new_process_is_read_within_seconds_not_at_the_next_tick(
        tmp_path: Path) -> None:
    # newuser-3.md finding 17: with the default 15 s interval, a started engine showed "no
    # process known" until the next tick; here the interval is 60 s and the reading must
    # come within FIRST_READING_S (2 s) of the process being known
    settings = one_engine(tmp_path)
    config = msgspec.structs.replace(settings.memory, interval_s=60.0)
    board = Board(tuple(initial_state(s) for s in settings.engines))
    watch = MemoryWatch(config, board, settings.engines)
    child = await trio.lowlevel.open_process(
        [sys.executable, "-c", "import time; x = b'x' * (16 << 20); time.sleep(30)"],
        start_new_session=True)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(watch.run)
            first = await wait_memory(board, "e", lambda m: m.source == "none", within=10)
            assert first.why == "no process known"
            ticks = watch.ticks
            board.update("e", lambda e: msgspec.structs.replace(e, pid=child.pid,
                                                                state="starting"))
            m = await wait_memory(board, "e", lambda m: m.source == "proc", within=10)
            assert m.top[0].pid == child.pid
            assert watch.ticks == ticks + 1  # one early reading, not a burst of them
            nursery.cancel_scope.cancel()
    finally:
        child.kill()
        with trio.CancelScope(shield=True), trio.move_on_after(5):
            await child.wait()


async def test_an_adopted_engine_by_pid_file_and_one_by_a_missing_cgroup(tmp_path: Path) -> None:
    pid_file = tmp_path / "engine.pid"
    pid_file.write_text(str(os.getpid()))
    by_file = one_engine(tmp_path, engine=f"pid_file = '{pid_file}'")
    board = Board(tuple(initial_state(s) for s in by_file.engines))
    watch = MemoryWatch(by_file.memory, board, by_file.engines)
    with trio.fail_after(10):
        await watch.tick()
    m = board.current.engine("e").memory  # type: ignore[union-attr]
    assert m is not None and m.top[0].pid == os.getpid() and m.error is None
    by_cgroup = one_engine(tmp_path, engine="cgroup = '/no/such.scope'")
    board = Board(tuple(initial_state(s) for s in by_cgroup.engines))
    watch = MemoryWatch(by_cgroup.memory, board, by_cgroup.engines)
    with trio.fail_after(10):
        await watch.tick()
    m = board.current.engine("e").memory  # type: ignore[union-attr]
    assert m is not None and m.source == "cgroup" and "not found" in (m.error or ""), m


def test_memory_config_errors_are_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    for text, match in (("[memory]\nwindow_h = 0.003\n", r"memory\.window_h: 0\.003 h "
                         r"\(10\.8 s\) holds fewer than 8 readings of memory\.interval_s"),
                        ("[memory]\naction = 'reboot'\n", r"memory\.action"),
                        ("[memory]\nreserve_bytes = -1\n", r"memory\.reserve_bytes"),
                        ("[memory]\nwindow = 1\n", r"memory\.window: unknown key")):
        bad.write_text(text)
        with pytest.raises(ConfigError, match=match):
            load_settings(str(bad))
    with pytest.raises(ConfigError, match=r"pid_file: only for adopted engines"):
        one_engine(tmp_path, engine="managed = true\ncommand = ['x']\npid_file = 'a.pid'")


def memory_board(tmp: Path) -> Board:
    settings = one_engine(tmp)
    return Board(tuple(initial_state(s) for s in settings.engines))


async def test_a_trend_change_is_an_event_and_a_reading_alone_is_not(tmp_path: Path) -> None:
    board = memory_board(tmp_path)
    journal = Journal(board, node="n")
    now = trio.current_time()
    board.publish_memory({"e": EngineMemory(source="proc", rss_anon_bytes=1, trend="flat")},
                         NodeMemory(mem_available=5))
    journal.refresh(now)
    seq = journal.seq
    board.publish_memory({"e": EngineMemory(source="proc", rss_anon_bytes=2, trend="flat")},
                         NodeMemory(mem_available=6))
    journal.refresh(now)
    assert journal.seq == seq  # the readings move every tick: no event
    board.publish_memory({"e": EngineMemory(source="proc", rss_anon_bytes=3,
                                            trend="leaking")}, NodeMemory(mem_available=6))
    journal.refresh(now)
    assert journal.seq == seq + 1
    assert json.loads(journal.ring[-1].data)["memory"]["trend"] == "leaking"


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed")
async def test_the_memory_gauges_pass_promtool(tmp_path: Path) -> None:
    board = memory_board(tmp_path)
    board.publish_memory({"e": EngineMemory(source="proc", rss_anon_bytes=10 << 20,
                                            swap_bytes=1 << 20, trend="critical",
                                            slope_bytes_per_h=3.9e8)},
                         NodeMemory(mem_available=8 << 30, reserve_bytes=2 << 30,
                                    psi_some_avg10=0.5, trend="growing"))
    body = Metrics(board, node="n").render(board.current, 0.0, 1e9)
    text = body.decode()
    assert 'nvpair_engine_memory_anon_bytes{engine="e"} 11534336\n' in text
    assert 'nvpair_engine_memory_trend{engine="e"} 3\n' in text
    assert "nvpair_node_memory_available_bytes 8589934592\n" in text
    assert "nvpair_node_memory_trend 1\n" in text
    with trio.fail_after(10):
        r = await trio.run_process(["promtool", "check", "metrics"], stdin=body,
                                   capture_stdout=True, capture_stderr=True, check=False)
    assert r.returncode == 0, r.stdout + r.stderr


async def test_a_rise_of_the_cgroups_oom_kill_explains_any_exit(tmp_path: Path) -> None:
    settings = one_engine(tmp_path, extra="reserve_bytes = 0")
    watch = MemoryWatch(settings.memory, memory_board(tmp_path), settings.engines)
    cg = tmp_path / "cg"
    cg.mkdir()
    (cg / "memory.current").write_text("1000\n")
    (cg / "memory.events").write_text("oom 0\noom_kill 0\n")
    w = watch.engines["e"]
    w.cgroup, w.oom_kill = str(cg), 0  # as the last tick read them
    assert watch.explain_exit("e", -signal.SIGKILL) is None  # headroom to spare, no kill
    assert watch.explain_exit("e", 1) is None
    (cg / "memory.events").write_text("oom 1\noom_kill 1\n")
    for code in (1, -signal.SIGKILL):
        assert watch.explain_exit("e", code) == (
            f"{KILLED_FOR_MEMORY}: the cgroup's oom_kill count rose")
    assert watch.explain_exit("other", 1) is None


class _Runner:
    """Records what the action asks of an engine's runner."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, str]] = []

    def request(self, action: Any) -> object:
        self.asked.append(("request", action))
        return None

    def drain(self, *, then: str = "stop", reason: str = "drain requested") -> object:
        self.asked.append((then, reason))
        return None


def _leaking(trend: str = "leaking") -> Any:
    from nvpair.supervision.memtrend import Trend, TrendReading

    return TrendReading(trend=Trend(trend), slope_bytes_per_h=1e9, exhaustion_s=7200.0,
                        floor_bytes=1 << 30, covered_s=3600.0, why="rising")


async def test_the_wait_for_quiet_is_bounded_by_quiet_max_s(tmp_path: Path,
                                                            autojump_clock: Any) -> None:
    """An engine never quiet (a request always in flight) is drained for its restart once
    quiet_max_s has passed, not never; one that stops leaking meanwhile is not restarted."""
    from nvpair.state.traffic import Traffic

    settings = one_engine(tmp_path, extra="action = 'restart_when_quiet'\nquiet_s = 300\n"
                                          "quiet_max_s = 900")
    traffic = Traffic()
    traffic.started("e")  # busy for ever
    runner = _Runner()
    board = Board(tuple(initial_state(s) for s in settings.engines))
    board.update("e", lambda e: msgspec.structs.replace(e, state="ready", pid=100))
    watch = MemoryWatch(settings.memory, board, settings.engines, traffic=traffic,
                        runners={"e": runner})
    w = watch.engines["e"]
    w.trend, w.leader = "leaking", 100
    started = trio.current_time()
    with trio.fail_after(5000):  # (before the bound: waited for ever)
        await watch._restart_when_quiet(w, _leaking())
    assert trio.current_time() - started == pytest.approx(900, abs=0.2)
    assert runner.asked == [("restart", "memory")] and w.memory_restarts == 1

    # quiet at last after 100 s: the restart comes quiet_s later, within the bound
    runner.asked.clear()

    async def quiet_later() -> None:
        await trio.sleep(100)
        traffic.finished("e", "ok")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(quiet_later)
        started = trio.current_time()
        await watch._restart_when_quiet(w, _leaking())
    assert trio.current_time() - started == pytest.approx(400, abs=0.5)
    assert runner.asked == [("restart", "memory")]

    # no longer leaking during the wait: no restart, the action ends
    runner.asked.clear()
    traffic.started("e")

    async def recovers() -> None:
        await trio.sleep(50)
        w.trend = "flat"

    async with trio.open_nursery() as nursery:
        nursery.start_soon(recovers)
        await watch._restart_when_quiet(w, _leaking())
    assert runner.asked == [] and not w.acting and w.memory.action is None


def test_quiet_max_s_is_a_number_of_seconds(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        one_engine(tmp_path, extra="quiet_max_s = -1")
    assert "quiet_max_s" in str(caught.value) and "\n" not in str(caught.value)


async def test_a_memory_restart_waits_for_the_process_it_judged_not_a_new_one(
        tmp_path: Path, autojump_clock: Any) -> None:
    """The leaking process ends during the quiet wait (an on-demand engine unloaded when
    idle, an eviction, a crash) and a new one starts: the action ends without draining the
    new process (which is starting: never restarted for memory during startup)."""
    settings = one_engine(tmp_path, extra="action = 'restart_when_quiet'\nquiet_s = 300")
    runner = _Runner()
    board = Board(tuple(initial_state(s) for s in settings.engines))
    board.update("e", lambda e: msgspec.structs.replace(e, state="ready", pid=100))
    watch = MemoryWatch(settings.memory, board, settings.engines, runners={"e": runner})
    w = watch.engines["e"]
    w.trend, w.leader = "leaking", 100

    async def replaced() -> None:
        await trio.sleep(100)  # idle unload: cold, no process
        board.update("e", lambda e: msgspec.structs.replace(e, state="cold", pid=None))
        await trio.sleep(50)  # a request starts it again: a new process, starting
        board.update("e", lambda e: msgspec.structs.replace(e, state="starting", pid=200))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(replaced)
        with trio.fail_after(1000):
            await watch._restart_when_quiet(w, _leaking())
    assert runner.asked == [] and w.memory_restarts == 0
    assert trio.current_time() < 301


async def test_a_leaking_on_demand_engine_is_drained_to_cold_not_restarted(
        tmp_path: Path, autojump_clock: Any) -> None:
    """An on-demand engine leaking is drained to a stop (it rests cold; the next request
    starts a new process), not restarted into an engine nobody may need; a drain refused
    (Busy) leaves no stale 'waiting' action in its memory block."""
    from nvpair.supervision.lifecycle import Busy

    settings = one_engine(tmp_path, extra="action = 'restart_when_quiet'\nquiet_s = 10",
                          engine="managed = true\ncommand = ['x']\nactivation = 'on_demand'")
    runner = _Runner()
    board = Board(tuple(initial_state(s) for s in settings.engines))
    board.update("e", lambda e: msgspec.structs.replace(e, state="ready", pid=100))
    watch = MemoryWatch(settings.memory, board, settings.engines, runners={"e": runner})
    w = watch.engines["e"]
    w.trend, w.leader = "leaking", 100
    await watch._restart_when_quiet(w, _leaking())
    assert runner.asked == [("stop", "memory")] and w.memory_restarts == 1
    assert w.memory.action == "stopped (cold until a request starts it) for memory (1 so far)"

    class Refusing(_Runner):
        def drain(self, *, then: str = "stop", reason: str = "drain requested") -> object:
            return Busy("engine e is stopping already")

    watch.runners = {"e": Refusing()}
    await watch._restart_when_quiet(w, _leaking())
    assert w.memory.action is None and w.memory_restarts == 1
