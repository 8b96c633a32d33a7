"""One engine process from spawn to reap: real child processes, and a fake one (the
``spawn`` seam) for what only the clock can show (a process stuck in the kernel)."""

from __future__ import annotations

import itertools
import math
import os
import signal
import sys
from collections.abc import Mapping, Sequence

import pytest
import trio
import trio.testing

from nvpair.base.boundary import Part
from nvpair.base.logs import EngineLog
from nvpair.supervision.orphans import EngineProcs
from nvpair.supervision.process import (
    KILL_WAIT_S,
    EngineProcess,
    Stopping,
    describe_exit,
    pump_output,
    run_engine_process,
    terminate,
)

# Beyond pid_max (2**22 at most): a signal to such a group finds none (ESRCH), so a fake
# pid can never reach a real process.
_FAKE_PIDS = itertools.count(2**30)


class FakeProcess:
    """A process that exits on cue: ``lives_s`` after it started (its exit code ``code``),
    when ``exit()`` is called, or on a signal in ``heeds`` (killed by it)."""

    def __init__(self, lives_s: float = math.inf, code: int = 1,
                 heeds: Sequence[int] = (signal.SIGTERM, signal.SIGKILL)) -> None:
        self.pid = next(_FAKE_PIDS)
        self.stdout = None
        self.started_at = trio.current_time()
        self.dies_at = self.started_at + lives_s
        self.code = code
        self.heeds = tuple(heeds)
        self.signals: list[int] = []
        self._code: int | None = None
        self._exited = trio.Event()

    @property
    def returncode(self) -> int | None:
        if self._code is None and trio.current_time() >= self.dies_at:
            self.exit(self.code)
        return self._code

    def exit(self, code: int) -> None:
        if self._code is None:
            self._code = code
            self._exited.set()

    async def wait(self) -> int:
        with trio.move_on_at(self.dies_at):
            await self._exited.wait()
        self.exit(self.code)
        assert self._code is not None
        return self._code

    def signal_group(self, sig: int) -> None:
        self.signals.append(sig)
        if sig in self.heeds:
            self.exit(-sig)


class FakeSpawn:
    """A ``Spawn`` of fake processes: the k-th lives ``lives[k]`` seconds (the last entry
    for the rest; forever by default); ``fail`` raises instead."""

    def __init__(self, lives: Sequence[float] = (math.inf,), *, code: int = 1,
                 heeds: Sequence[int] = (signal.SIGTERM, signal.SIGKILL),
                 fail: Exception | None = None) -> None:
        self.lives = tuple(lives)
        self.code = code
        self.heeds = heeds
        self.fail = fail
        self.started: list[FakeProcess] = []
        self.changed = trio.Event()

    async def __call__(self, argv: Sequence[str], env: Mapping[str, str]) -> FakeProcess:
        await trio.lowlevel.checkpoint()
        if self.fail is not None:
            raise self.fail
        k = min(len(self.started), len(self.lives) - 1)
        proc = FakeProcess(self.lives[k], self.code, self.heeds)
        self.started.append(proc)
        self.changed.set()
        self.changed = trio.Event()
        return proc

    @property
    def times(self) -> list[float]:
        return [p.started_at for p in self.started]

    async def wait_started(self, n: int) -> FakeProcess:
        """Until ``n`` processes have been started; the n-th."""
        while len(self.started) < n:
            await self.changed.wait()
        return self.started[n - 1]


def _run(argv: Sequence[str], log: EngineLog, procs: EngineProcs, reaper: trio.Nursery,
         *, grace_s: float = 5.0, spawn=None, env=None):  # type: ignore[no-untyped-def]
    kw = {} if spawn is None else {"spawn": spawn}
    return lambda task_status: run_engine_process(
        argv, dict(os.environ) if env is None else env, name="e", log_to=log,
        output=Part("engine e: output"), stopping=Stopping("SIGTERM", grace_s), procs=procs,
        reaper=reaper, task_status=task_status, **kw)


async def test_a_process_that_exits_is_logged_to_its_end_and_forgotten(
        nursery, tmp_path) -> None:
    log = EngineLog(None)
    procs = EngineProcs(tmp_path)
    code = "import sys; print('hello'); sys.stdout.write('last words'); sys.exit(3)"
    with trio.fail_after(20):
        async with trio.open_nursery() as lifetime:
            proc: EngineProcess = await lifetime.start(
                _run([sys.executable, "-c", code], log, procs, nursery))
            assert procs.live == {proc.pid: "e"}  # its state file, while it runs
            assert [p.name for p in (tmp_path / "engines").iterdir()] == [f"e.{proc.pid}.json"]
            assert await proc.wait() == 3
    assert proc.returncode == 3 and proc.stuck is None
    assert procs.live == {} and list((tmp_path / "engines").iterdir()) == []
    lines = log.tail(10).lines
    assert lines == ["hello", "last words",
                     f"[nvpair] process {proc.pid} ended: exited with code 3"]


IGNORES_TERM = """
import signal, sys
signal.signal(signal.SIGTERM, lambda *_: print("ignoring SIGTERM", flush=True))
print("up", flush=True)
while True:
    signal.pause()
"""


async def test_cancellation_stops_it_with_the_signal_then_sigkill(nursery, tmp_path) -> None:
    log = EngineLog(None)
    procs = EngineProcs(tmp_path)
    with trio.fail_after(20):
        async with trio.open_nursery() as lifetime:
            proc: EngineProcess = await lifetime.start(
                _run([sys.executable, "-c", IGNORES_TERM], log, procs, nursery, grace_s=0.5))
            while "up" not in log.tail(10).lines:
                await log.changed.wait()  # event-driven: a new line
            lifetime.cancel_scope.cancel()
    assert proc.returncode == -signal.SIGKILL and procs.live == {}
    lines = log.tail(10).lines
    assert lines[-2:] == ["ignoring SIGTERM",
                          f"[nvpair] process {proc.pid} ended: killed by SIGKILL"]


async def test_a_spawn_error_is_raised_by_start_and_nothing_is_recorded(
        nursery, tmp_path) -> None:
    procs = EngineProcs(tmp_path)
    with trio.fail_after(10), pytest.raises(ValueError):
        await nursery.start(_run([sys.executable, "-c", "pass"], EngineLog(None), procs, nursery,
                                 env={"A=B": "x"}))
    assert procs.live == {}


async def test_a_process_in_d_state_is_left_to_the_reaper(nursery, autojump_clock,
                                                         tmp_path) -> None:
    """SIGTERM, the grace, SIGKILL, KILL_WAIT_S, then nvpair goes on: the state file stays
    until the kernel lets the process go, and the late reap removes it."""
    log = EngineLog(None)
    procs = EngineProcs(None)
    spawn = FakeSpawn(heeds=())
    async with trio.open_nursery() as lifetime:
        proc: EngineProcess = await lifetime.start(_run(["srv"], log, procs, nursery,
                                                        grace_s=3, spawn=spawn))
        asked = trio.current_time()
        lifetime.cancel_scope.cancel()
    assert trio.current_time() - asked == pytest.approx(3 + KILL_WAIT_S)
    assert proc.stuck is not None and f"within {KILL_WAIT_S:g} s of SIGKILL" in proc.stuck
    assert procs.live == {proc.pid: "e"}  # kept: a later nvpair would stop it
    assert log.tail(1).lines == [f"[nvpair] {proc.stuck}"]
    fake = spawn.started[0]
    assert fake.signals == [signal.SIGTERM, signal.SIGKILL, signal.SIGKILL]
    fake.exit(-9)  # the kernel lets it go
    await trio.testing.wait_all_tasks_blocked()
    assert proc.stuck is None and procs.live == {}


async def test_terminate_reaps_a_process_that_heeds_the_signal(autojump_clock) -> None:
    fake = FakeProcess(heeds=(signal.SIGINT,))
    assert await terminate(fake, Stopping("SIGINT", 10)) is None
    assert fake.returncode == -signal.SIGINT and trio.current_time() == 0
    assert fake.signals == [signal.SIGINT, signal.SIGKILL]  # then the group's leftovers


async def test_kill_now_cuts_the_grace_period_short(nursery, autojump_clock) -> None:
    """A second signal to nvpair (``EngineProcs.kill_now``) SIGKILLs an engine that is in
    its grace period at once, and one whose stop starts later right after its stop signal;
    each is still reaped."""
    kill_now = trio.Event()
    deaf = FakeProcess(heeds=(signal.SIGKILL,))  # ignores SIGTERM, as a stuck engine does
    done = trio.Event()

    async def stop() -> None:
        assert await terminate(deaf, Stopping("SIGTERM", 30), kill_now) is None
        done.set()

    nursery.start_soon(stop)
    await trio.sleep(5)  # in its grace period
    assert deaf.signals == [signal.SIGTERM] and deaf.returncode is None
    kill_now.set()
    await done.wait()
    assert trio.current_time() == 5 and deaf.returncode == -signal.SIGKILL
    later = FakeProcess(heeds=(signal.SIGKILL,))
    assert await terminate(later, Stopping("SIGTERM", 30), kill_now) is None
    assert trio.current_time() == 5 and later.returncode == -signal.SIGKILL
    assert later.signals[:2] == [signal.SIGTERM, signal.SIGKILL]  # its stop signal first


@pytest.mark.parametrize(("code", "words"), [
    (0, "exited with code 0"), (3, "exited with code 3"), (-9, "killed by SIGKILL"),
    (-15, "killed by SIGTERM"), (-200, "killed by signal 200"), (None, "is still running")])
def test_describe_exit(code: int | None, words: str) -> None:
    assert describe_exit(code) == words


async def test_the_stray_reaper_never_takes_an_engine_that_is_being_spawned(
        nursery, tmp_path) -> None:
    """The reaper (on SIGCHLD) runs while a spawn waits for its thread; an engine that has
    already exited then is not on record yet. It must not be reaped as a stray: before, it
    was, and the engine's exit code was lost (reported as 0)."""
    from nvpair.supervision.orphans import reap_once
    from nvpair.supervision.process import spawn_process

    log = EngineLog(None)
    procs = EngineProcs(tmp_path)

    async def spawn(argv: Sequence[str], env: Mapping[str, str]):  # type: ignore[no-untyped-def]
        proc = await spawn_process(argv, env)
        fd = os.pidfd_open(proc.pid)  # readable once it has exited
        try:
            await trio.lowlevel.wait_readable(fd)
        finally:
            os.close(fd)
        reap_once(procs)  # what a SIGCHLD meanwhile makes the reaper do
        return proc

    with trio.fail_after(20):
        async with trio.open_nursery() as lifetime:
            proc: EngineProcess = await lifetime.start(_run(
                [sys.executable, "-c", "import sys; sys.exit(3)"], log, procs, nursery,
                spawn=spawn))
            assert await proc.wait() == 3
    assert log.tail(10).lines[-1] == f"[nvpair] process {proc.pid} ended: exited with code 3"
    assert procs.live == {} and list((tmp_path / "engines").iterdir()) == []


async def test_the_output_works_again_once_its_lines_are_logged_again(
        autojump_clock, pump_fails_once) -> None:
    """After a failure of the pump, the output is dropped for the backoff, then copied again;
    once a line has been copied, the part says so (its notice goes). Before, the notice
    'engine output is not logged' stayed for the life of the process."""
    published: list[str | None] = []
    part = Part("engine e: output", published.append)
    send, receive = trio.testing.memory_stream_one_way_pair()
    log = EngineLog(None)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(pump_output, receive, log, part)
        await trio.testing.wait_all_tasks_blocked()
        assert len(published) == 1 and "pump bug" in (published[0] or "")
        await trio.sleep(2)  # past the backoff (1 s and its jitter)
        await send.send_all(b"logged again\nand on\n")
        while "and on" not in log.tail(10).lines:
            await log.changed.wait()
        await trio.testing.wait_all_tasks_blocked()
        assert published[-1] is None and part.failure is None
        await send.aclose()
    assert log.tail(10).lines == ["logged again", "and on"]
