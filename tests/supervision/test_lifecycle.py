"""Managed engines: simulators run as real child processes by nvpair, over real sockets."""

from __future__ import annotations

import itertools
import math
import os
import signal
import sys
from functools import partial

import httpx2
import msgspec
import pytest
import trio
import trio.testing
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
from nvpair.probing import probes

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
    starts: dict[int, float] = {}  # when attempt k began (it counts k restarts) ...
    downs: dict[int, float] = {}  # ... and when it was seen to have exited
    with trio.fail_after(30):
        running = await nursery.start(service.run, settings)
        async with reading(running.url) as reader:
            version = -1
            while len(starts) < 5:
                snap = await running.board.wait_changed(version)
                version, e = snap.version, snap.engine("e")
                assert e is not None
                if e.state == "starting":
                    starts.setdefault(e.restarts, e.since)
                elif e.state == "down" and e.restarts in starts:
                    downs.setdefault(e.restarts, e.since)
        e = await wait_state(running.board, "e", "down")
    # the wait from an exit to the next start doubles: 0.2, 0.4, 0.8, 1.6 s (a fixed delay
    # or a spin fails it); the states' own times, so a slow start of the process does not
    # count (the gaps between starts, start times and all, failed in CI)
    waits = [starts[k + 1] - downs[k] for k in range(4)]
    assert all(wait >= 0.2 * 2**k - 1e-3 for k, wait in enumerate(waits)), waits
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


async def test_an_engine_on_nvpairs_own_port_is_told_so(nursery, tmp_path) -> None:
    """An engine set on nvpair's own listen port is down with that reason, not "taken by
    another llama.cpp llama-server" (nvpair itself answering; newuser-3.md finding 2)."""
    port = free_port()
    settings = managed_config(tmp_path, "e", port, sim_command("vllm", "--load-s", "0"))
    settings = msgspec.structs.replace(settings, listen_port=port)
    with trio.fail_after(30):
        running = await nursery.start(service.run, settings)
        down = await wait_state(running.board, "e", "down", where=lambda e: bool(e.error))
        assert down.error == (f"port {port} is nvpair's own API (listen = 127.0.0.1:{port}): "
                              "give engine e another port")
        assert running.runners["e"].starts == 0


def test_addresses_that_collide_on_one_port() -> None:
    from nvpair.supervision.lifecycle import same_address

    assert same_address("127.0.0.1", "127.0.0.1") and same_address("0.0.0.0", "10.0.0.2")
    assert same_address("127.0.0.1", "localhost") and same_address("::1", "127.0.0.1")
    assert same_address("::", "127.0.0.1")
    assert not same_address("10.0.0.1", "10.0.0.2") and not same_address("127.0.0.1", "10.0.0.2")


async def test_adopted_engine_stop_unlists_without_signalling(nursery, tmp_path) -> None:
    from nvpair.config.settings import load_settings
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


# -- fault boundaries of the runner (issue 13) ----------------------------------------------


def _with_engine(settings, **changes):  # type: ignore[no-untyped-def]
    """The settings with the engine changed past what the config's checks would allow (to
    reach the runtime boundary the checks now stand in front of)."""
    spec = msgspec.structs.replace(settings.engines[0], **changes)
    return msgspec.structs.replace(settings, engines=(spec,))


async def test_a_spawn_that_raises_is_a_failed_start_with_backoff(nursery, tmp_path) -> None:
    """open_process raises ValueError for an environment name with '='; that is a start
    that failed (down, the reason in words, tried again later), not a dead node."""
    settings = _with_engine(managed_config(tmp_path, "e", free_port(),
                                           sim_command("vllm", "--load-s", "0")),
                            env={"A=B": "x"})
    with trio.fail_after(30):
        running = await nursery.start(service.run, settings)
        down = await wait_state(running.board, "e", "down", where=lambda e: bool(e.error))
        assert down.error is not None and "\n" not in down.error
        assert "cannot start" in down.error and "ValueError" in down.error, down.error
        async with httpx2.AsyncClient(base_url=running.url) as client:
            await log_until(client, "e", "[nvpair] " + down.error)
            await log_until(client, "e", "[nvpair] " + down.error)  # tried again (0.2 s)
            assert (await client.get("/healthz")).status_code == 200
        assert running.runners["e"].starts == 0


async def test_a_bug_in_the_runner_is_the_engines_failure(nursery, tmp_path, caplog) -> None:
    """Anything the runner raises (here: a command template with a placeholder that has no
    value, which the config check would have refused) makes the engine down with the
    reason, logged once with its traceback, and the runner tries again after a backoff."""
    settings = _with_engine(managed_config(tmp_path, "e", free_port(),
                                           sim_command("vllm", "--load-s", "0")),
                            command=("srv", "{no_such_value}"))
    with trio.fail_after(30):
        running = await nursery.start(service.run, settings)
        down = await wait_state(running.board, "e", "down", where=lambda e: bool(e.error))
        assert "internal error in nvpair (CommandError" in (down.error or ""), down.error
        async with httpx2.AsyncClient(base_url=running.url) as client:
            assert (await client.get("/healthz")).status_code == 200
            r = await client.post("/v1/engines/e/stop")  # a request ends the backoff
            assert r.status_code == 202
            await wait_state(running.board, "e", "stopped")
    bugs = [r for r in caplog.records if "unexpected error" in r.getMessage()]
    assert len(bugs) == 1 and bugs[0].exc_info is not None


async def test_a_squatter_that_breaks_the_port_check_is_still_a_taken_port(
        nursery, tmp_path, monkeypatch) -> None:
    """Whatever identifying the process on the port raises, the port is taken: reported,
    never spawned into (with the decode of before its RecursionError fix)."""
    from tests.stub_http import serve_stub

    monkeypatch.setattr(probes, "decode_json",  # as before: RecursionError passes
                        lambda body, what, error=None: msgspec.json.decode(body))
    port = await nursery.start(partial(serve_stub, body=b"[" * 5000 + b"]" * 5000))
    settings = managed_config(tmp_path, "e", port, sim_command("vllm", "--load-s", "0"))
    with trio.fail_after(30):
        running = await nursery.start(service.run, settings)
        down = await wait_state(running.board, "e", "down", where=lambda e: bool(e.error))
    assert down.error is not None and down.error.startswith(
        f"port {port} is taken by a server nvpair could not identify (internal error in "
        "nvpair (RecursionError"), down.error
    assert running.runners["e"].starts == 0


async def test_engines_do_not_inherit_nvpairs_token(nursery, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("NVPAIR_TOKEN", "the-users-secret")
    show = "import os; print('token:', os.environ.get('NVPAIR_TOKEN'), flush=True)"
    settings = managed_config(tmp_path, "e", free_port(), [sys.executable, "-c", show])
    with trio.fail_after(30):
        running = await nursery.start(service.run, settings)
        async with httpx2.AsyncClient(base_url=running.url) as client:
            lines, _ = await log_until(client, "e", "token: None")
    assert not any("the-users-secret" in line for line in lines)


async def test_a_stop_does_not_wait_forever_for_a_process_in_d_state(
        nursery, autojump_clock, tmp_path) -> None:
    """A process the kernel holds (D state) takes the signals and never exits: the stop
    gives up KILL_WAIT_S after SIGKILL, and the engine says so while it is stopped."""
    from tests.supervision.test_process import FakeSpawn

    from nvpair.state.snapshot import Board
    from nvpair.state.transitions import initial_state
    from nvpair.supervision.lifecycle import KILL_WAIT_S, Accepted, EngineRunner

    settings = managed_config(tmp_path, "e", free_port(), ["srv"])
    spec = settings.engines[0]
    board = Board((initial_state(spec),))
    spawn = FakeSpawn(heeds=())
    runner = EngineRunner(spec, board, None, None, spawn=spawn)
    await nursery.start(runner.run)
    await wait_state(board, "e", "starting", where=lambda e: e.pid is not None)
    asked = trio.current_time()
    assert runner.request("stop") == Accepted("stopping")
    stopped = await wait_state(board, "e", "stopped")
    assert trio.current_time() - asked <= spec.stop_grace_s + KILL_WAIT_S + 0.1
    assert stopped.error is not None and "did not exit within" in stopped.error
    assert "SIGKILL" in stopped.error
    assert [signal.Signals(s).name for s in spawn.started[0].signals] == [
        spec.manifest.stop.signal, "SIGKILL", "SIGKILL"]


async def test_the_generating_budget_outlives_restarts(nursery, autojump_clock) -> None:
    """An adopted old SGLang (no /ready or /ping; /health generates) with the opt-in,
    restarted every 3 s: still at most one generating request per 30 s (each restart
    made a new prober that had forgotten the last one)."""
    from tests.fakes import FakeEngine, engine_spec

    from nvpair.state.snapshot import Board
    from nvpair.state.transitions import initial_state
    from nvpair.supervision.lifecycle import Accepted, EngineRunner

    spec = engine_spec("sglang", allow_generating_probes=True)
    fake = FakeEngine({"/health": (200, ""), "/model_info": (200, {
        "model_path": "m", "is_generation": True})})
    board = Board((initial_state(spec),))
    runner = EngineRunner(spec, board, None, None, transport=fake.transport())
    await nursery.start(runner.run)
    for _ in range(100):
        await trio.sleep(3)
        assert isinstance(runner.request("restart"), Accepted)
    times = fake.times["/health"]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert len(times) >= 300 / 31 - 1 and min(gaps) >= 30 - 1e-9, gaps


TICKER = """
import itertools, time
for i in itertools.count():
    print("tick %d" % i, flush=True)
    time.sleep(0.05)
"""


async def test_a_failing_output_pump_leaves_the_engine_running(nursery, tmp_path,
                                                              pump_fails_once) -> None:
    """Copying the output fails (a bug): the engine is not stopped, the output is drained
    meanwhile, the engine says so in its notice, and its output is logged again later."""
    settings = managed_config(tmp_path, "e", free_port(), [sys.executable, "-c", TICKER],
                              extra="startup_budget_s = 60")
    with trio.fail_after(30):
        running = await nursery.start(service.run, settings)
        # (the pump's notice can be published before the process's pid is)
        noticed = await wait_state(running.board, "e", "starting",
                                   where=lambda e: bool(e.notice) and e.pid is not None)
        assert "engine output is not logged: internal error in nvpair (RuntimeError: pump bug" \
            in (noticed.notice or "")
        async with httpx2.AsyncClient(base_url=running.url) as client:
            lines, doc = await log_until(client, "e", "[nvpair] starting: " + " ".join(
                settings.engines[0].command or ()))
            while not any(line.startswith("tick ") for line in lines):  # logged again
                r = await client.get(f"/v1/engines/e/logs?after={doc['next']}&wait_s=10")
                doc = r.json()
                lines = doc["lines"]
        e = running.board.current.engine("e")
        assert e is not None and e.pid == noticed.pid and alive(e.pid)
        assert e.state == "starting" and running.runners["e"].starts == 1


# -- restarts and backoff in virtual time (a fake process through the spawn seam) ------------


def _fake_runner(spawn, engine):  # type: ignore[no-untyped-def]
    """A managed vLLM whose process is ``spawn``'s and whose HTTP side is ``engine``."""
    from tests.fakes import engine_spec

    from nvpair.state.snapshot import Board
    from nvpair.state.transitions import initial_state
    from nvpair.supervision.lifecycle import EngineRunner

    spec = engine_spec("vllm", managed=True, port=free_port(), model="m",
                       command=["srv", "--port", "{port}"])
    board = Board((initial_state(spec),))
    return EngineRunner(spec, board, None, None, transport=engine.transport(), spawn=spawn)


def _refusing():  # type: ignore[no-untyped-def]
    from tests.fakes import FakeEngine

    engine = FakeEngine()
    engine.refuse = True  # nothing listens: a process that never gets to serve
    return engine


async def test_a_crash_loop_backs_off_doubling_to_its_max(nursery, autojump_clock) -> None:
    from tests.supervision.test_process import FakeSpawn

    spawn = FakeSpawn(lives=(0,), code=7)  # exits at once, every time
    runner = _fake_runner(spawn, _refusing())
    await nursery.start(runner.run)
    await spawn.wait_started(10)
    restart = runner.spec.manifest.restart
    waits = [b - a for a, b in itertools.pairwise(spawn.times)]
    assert waits == pytest.approx([min(restart.initial_s * 2**k, restart.max_s)
                                   for k in range(9)])
    assert restart.max_s in waits  # it got to the cap, and stayed there
    e = await wait_state(runner.board, "e", "down", where=lambda e: e.restarts == 9)
    assert e.error == "engine process exited with code 7" and e.exit_code == 7


async def test_the_backoff_resets_after_reset_after_s_of_readiness(nursery,
                                                                  autojump_clock) -> None:
    """A process that served (ready) for reset_after_s resets the backoff; one that served
    less does not."""
    from tests.fakes import FakeEngine, vllm_routes
    from tests.supervision.test_process import FakeSpawn

    runner = _fake_runner(FakeSpawn(), FakeEngine(vllm_routes()))  # the spec, for its numbers
    restart = runner.spec.manifest.restart
    served = restart.reset_after_s
    lives = (0.5, 0.5, 0.5, served + 10, 0.5, served - 10, 0.5)
    spawn = FakeSpawn(lives=lives)
    runner = _fake_runner(spawn, FakeEngine(vllm_routes()))
    await nursery.start(runner.run)
    long_lived = await spawn.wait_started(4)
    e = await wait_state(runner.board, "e", "ready", within=served)
    assert e.pid == long_lived.pid and runner.starts == 4
    await spawn.wait_started(len(lives) + 1)
    waits = [b - a - life for (a, b), life in zip(itertools.pairwise(spawn.times), lives,
                                                  strict=True)]
    i = restart.initial_s
    assert waits == pytest.approx([i, 2 * i, 4 * i, i, 2 * i, 4 * i, 8 * i])


async def test_a_stop_during_the_backoff_ends_it(nursery, autojump_clock) -> None:
    from tests.supervision.test_process import FakeSpawn

    from nvpair.supervision.lifecycle import Accepted, Busy

    spawn = FakeSpawn(lives=(0,))
    runner = _fake_runner(spawn, _refusing())
    await nursery.start(runner.run)
    await spawn.wait_started(4)  # down, now waiting 8 s before the 5th start
    await wait_state(runner.board, "e", "down")
    asked = trio.current_time()
    assert runner.request("stop") == Accepted("stopping")
    busy = runner.request("start")  # while the stop is in progress
    assert isinstance(busy, Busy) and busy.reason == (
        "engine e is stopping; start it once it has stopped")
    await wait_state(runner.board, "e", "stopped")
    assert trio.current_time() == asked  # the backoff did not run out first
    await trio.sleep(600)
    assert len(spawn.started) == 4  # stopped stays stopped
    assert runner.request("stop") == Accepted("stop")  # idempotent: nothing to do
    started = trio.current_time()
    assert runner.request("start") == Accepted("starting")
    await spawn.wait_started(5)
    assert trio.current_time() == started  # a start asked for does not wait a backoff


async def test_a_restart_during_a_start_stops_the_process_and_starts_at_once(
        nursery, autojump_clock) -> None:
    import signal as signals

    from tests.supervision.test_process import FakeSpawn

    from nvpair.supervision.lifecycle import Accepted

    spawn = FakeSpawn()  # never exits by itself; SIGTERM ends it
    runner = _fake_runner(spawn, _refusing())  # never ready: still starting
    await nursery.start(runner.run)
    first = await spawn.wait_started(1)
    await wait_state(runner.board, "e", "starting", where=lambda e: e.pid == first.pid)
    await trio.sleep(5)
    seen = []  # the states the engine shows meanwhile

    async def watch() -> None:
        version = runner.board.current.version
        while True:
            snap = await runner.board.wait_changed(version)
            version = snap.version
            e = snap.engine("e")
            assert e is not None
            seen.append(e.state)

    nursery.start_soon(watch)
    await trio.testing.wait_all_tasks_blocked()
    asked = trio.current_time()
    assert runner.request("restart") == Accepted("restarting")
    assert runner.request("restart") == Accepted("restarting")  # idempotent
    second = await spawn.wait_started(2)
    assert trio.current_time() == asked  # no backoff
    await wait_state(runner.board, "e", "starting", where=lambda e: e.pid == second.pid)
    assert seen and set(seen) == {"starting"}  # never down: a restart is not a crash
    assert first.returncode == -signals.SIGTERM
    assert first.signals == [signals.SIGTERM, signals.SIGKILL]  # then its group's leftovers
    e = await wait_state(runner.board, "e", "starting", where=lambda e: e.pid == second.pid)
    assert e.restarts == 1 and e.error is None
    await trio.sleep(600)
    assert len(spawn.started) == 2 and second.returncode is None


async def test_a_start_that_misses_its_budget_is_stopped_in_virtual_time(
        nursery, autojump_clock) -> None:
    import signal as signals

    from tests.supervision.test_process import FakeSpawn

    spawn = FakeSpawn()
    runner = _fake_runner(spawn, _refusing())
    await nursery.start(runner.run)
    first = await spawn.wait_started(1)
    budget = runner.spec.startup_budget_s
    down = await wait_state(runner.board, "e", "down", within=budget + 60)
    assert trio.current_time() == pytest.approx(first.started_at + budget)
    assert (down.error or "").startswith(f"not ready within its startup budget of {budget:g} s")
    assert first.signals[0] == signals.SIGTERM and down.exit_code == -signals.SIGTERM
    await spawn.wait_started(2)
    assert spawn.times[1] - trio.current_time() == 0
    assert spawn.times[1] == pytest.approx(first.started_at + budget
                                           + runner.spec.manifest.restart.initial_s)


async def test_first_of_returns_the_first_value_and_cancels_the_rest(autojump_clock) -> None:
    from nvpair.supervision.lifecycle import first_of

    cancelled = []

    async def after(delay: float, value: str) -> str:
        try:
            await trio.sleep(delay)
        except trio.Cancelled:
            cancelled.append(value)
            raise
        return value

    assert await first_of(partial(after, 3, "slow"), partial(after, 1, "fast"),
                          partial(after, 2, "middle")) == "fast"
    assert trio.current_time() == 1 and sorted(cancelled) == ["middle", "slow"]


async def test_a_restart_during_the_backoff_starts_at_once(nursery, autojump_clock) -> None:
    from tests.supervision.test_process import FakeSpawn

    from nvpair.supervision.lifecycle import Accepted

    spawn = FakeSpawn(lives=(0, 0, 0, math.inf))
    runner = _fake_runner(spawn, _refusing())
    await nursery.start(runner.run)
    await spawn.wait_started(3)
    await wait_state(runner.board, "e", "down", where=lambda e: e.restarts == 2)  # waits 4 s
    asked = trio.current_time()
    assert runner.request("restart") == Accepted("restarting")
    await spawn.wait_started(4)
    assert trio.current_time() == asked


async def test_a_ready_engine_outlives_its_startup_budget(nursery, autojump_clock) -> None:
    """The budget bounds the start only: an engine that became ready keeps running past it."""
    from tests.fakes import FakeEngine, vllm_routes
    from tests.supervision.test_process import FakeSpawn

    spawn = FakeSpawn()  # runs until stopped
    runner = _fake_runner(spawn, FakeEngine(vllm_routes()))
    await nursery.start(runner.run)
    first = await spawn.wait_started(1)
    await wait_state(runner.board, "e", "ready")
    await trio.sleep(runner.spec.startup_budget_s * 2)
    e = runner.board.current.engine("e")
    assert e is not None and (e.state, e.pid, e.error) == ("ready", first.pid, None)
    assert len(spawn.started) == 1 and first.returncode is None


async def test_a_port_check_that_keeps_failing_is_logged_once(
        nursery, autojump_clock, monkeypatch, caplog) -> None:
    """A port taken by a server whose check raises (a bug): the engine is down with the
    reason at each retry, and the failure is logged once, not once per retry with a 'works
    again' between (before, every retry logged the traceback and a recovery)."""
    import logging

    from tests.supervision.test_process import FakeSpawn

    from nvpair.supervision import lifecycle

    caplog.set_level(logging.INFO, logger="nvpair")
    tries = 0
    fifth = trio.Event()

    async def identify(spec):  # type: ignore[no-untyped-def]
        nonlocal tries
        tries += 1
        if tries == 5:
            fifth.set()
        raise RuntimeError("identify bug")

    monkeypatch.setattr(lifecycle, "_identify", identify)
    spawn = FakeSpawn()
    runner = _fake_runner(spawn, _refusing())
    listeners = await trio.open_tcp_listeners(runner.spec.port, host="127.0.0.1")
    try:
        await nursery.start(runner.run)
        e = await wait_state(runner.board, "e", "down")
        assert "could not identify" in (e.error or "") and "identify bug" in (e.error or "")
        await fifth.wait()
        assert spawn.started == []
        messages = [r.getMessage() for r in caplog.records if r.name.startswith("nvpair")]
        assert sum("unexpected error" in m for m in messages) == 1, messages
        assert not any("works again" in m for m in messages), messages
    finally:
        for listener in listeners:
            await listener.aclose()


async def test_a_start_request_ends_the_runners_backoff(nursery, autojump_clock,
                                                        monkeypatch) -> None:
    """After a bug in the runner, a start request (like stop and restart) ends the wait
    before the next try, as docs/lifecycle.md says; before, a start for an engine that is
    meant to run anyway was a no-op and the backoff (up to 60 s) ran out first."""
    from tests.supervision.test_process import FakeSpawn

    from nvpair.errors import CommandError
    from nvpair.supervision import lifecycle
    from nvpair.supervision.lifecycle import Accepted

    tries: list[float] = []
    fourth = trio.Event()

    def build(*args):  # type: ignore[no-untyped-def]
        tries.append(trio.current_time())
        if len(tries) == 4:
            fourth.set()
        raise CommandError("start.args.x needs a value for {no_such_value}")

    monkeypatch.setattr(lifecycle, "build_command", build)
    runner = _fake_runner(FakeSpawn(), _refusing())
    await nursery.start(runner.run)
    await fourth.wait()  # waiting 8 s before the fifth try now
    asked = trio.current_time()
    assert runner.request("start") == Accepted("start")
    await trio.testing.wait_all_tasks_blocked()
    assert len(tries) == 5 and tries[-1] == asked


async def test_an_engine_that_floods_its_output_is_capped_and_said_so(nursery,
                                                                      tmp_path) -> None:
    """``yes`` as a managed engine: its lines above the cap are dropped and counted, in its
    status, its event and /metrics, while nvpair answers at once."""
    settings = msgspec.structs.replace(
        managed_config(tmp_path, "e", free_port(), ["yes", "flood"]), log_lines_per_s=100)
    with trio.fail_after(30):
        running = await nursery.start(service.run, settings)
        await wait_state(running.board, "e", "starting", where=lambda e: e.log_dropping)
        async with httpx2.AsyncClient(base_url=running.url) as client:
            for _ in range(20):
                with trio.fail_after(READ_BOUND_S):
                    assert (await client.get("/healthz")).status_code == 200
            status = (await client.get("/v1/engines/e")).json()
            metrics = (await client.get("/metrics")).text
            lines = (await client.get("/v1/engines/e/logs?tail=100000")).json()["lines"]
    assert status["log"]["dropped"] > 0
    assert status["log"]["dropping"].startswith("engine e wrote ")
    assert status["log"]["dropping"].endswith(" dropped; the newest kept")
    dropped = next(int(float(line.split()[-1])) for line in metrics.splitlines()
                   if line.startswith('nvpair_engine_log_dropped_lines_total{engine="e"}'))
    assert dropped > 0
    assert sum(1 for line in lines if line.startswith("[nvpair] engine e wrote ")) == 1
    assert len(lines) <= 2000
