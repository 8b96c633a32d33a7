"""Child processes, like SGLang's scheduler ranks: sleepers in the simulator's process group.

Lifecycle tests use them to check that a manager leaves no process behind.
"""

from __future__ import annotations

import subprocess
import sys

import trio

#: how long to wait for terminated children before killing them.
_GRACE_S = 2.0


def child_code(lifetime_s: float, ignore_sigterm: bool) -> str:
    ignore = "signal.signal(signal.SIGTERM, signal.SIG_IGN); " if ignore_sigterm else ""
    return f"import signal, time; {ignore}time.sleep({lifetime_s!r})"


async def run_children(
    count: int, *, lifetime_s: float, ignore_sigterm: bool = False, leave: bool = False,
    task_status: trio.TaskStatus[tuple[int, ...]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Spawn ``count`` children in this process group and keep them until cancelled.

    Started value: their pids. Cancellation: terminates them (killing those still alive
    after a grace period) and waits, unless ``leave`` (they outlive the simulator).
    Raises: OSError when a child cannot be spawned, before the started value (those
    already spawned are ended as on cancellation).
    """
    code = child_code(lifetime_s, ignore_sigterm)
    procs: list[trio.Process] = []
    try:
        for _ in range(count):
            procs.append(await trio.lowlevel.open_process(
                [sys.executable, "-c", code], stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            ))
        task_status.started(tuple(p.pid for p in procs))
        await trio.sleep_forever()
    finally:
        if not leave:
            with trio.CancelScope(shield=True):
                await _reap(procs, kill=ignore_sigterm)


async def _reap(procs: list[trio.Process], *, kill: bool) -> None:
    """SIGTERM (or SIGKILL when they ignore SIGTERM), a grace period, SIGKILL; then wait."""
    await trio.lowlevel.checkpoint()
    for proc in procs:
        if proc.returncode is None:
            proc.kill() if kill else proc.terminate()
    with trio.move_on_after(_GRACE_S):
        await trio.lowlevel.checkpoint()
        for proc in procs:
            await proc.wait()
    for proc in procs:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
