"""The opt-in loop-lag probe (NVPAIR_LOOP_LAG_FILE): the longest gap between 5 ms ticks."""

from __future__ import annotations

import gc
import json
import time
from pathlib import Path

import pytest
import trio

from nvpair.runtime import looplag


def hold_the_loop(seconds: float) -> None:
    """A step that does not yield (what the probe is there to catch); asleep, it takes
    no CPU (as a process waiting for a core)."""
    time.sleep(seconds)


def spin(seconds: float) -> None:
    """A step that holds the loop with CPU work."""
    start = time.thread_time()
    while time.thread_time() - start < seconds:
        pass


async def test_a_blocking_step_shows_as_the_longest_gap(tmp_path: Path) -> None:
    path = tmp_path / "lag.jsonl"
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(looplag.probe, str(path), 0.005, 0.1)
            await trio.sleep(0.15)
            hold_the_loop(0.08)
            gc.collect()  # a full collection, timed as one
            await trio.sleep(0.15)
            spin(0.03)
            await trio.sleep(0.15)
            nursery.cancel_scope.cancel()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(lines) >= 2
    assert all(line["ticks"] > 0 and line["t"] > 0 for line in lines)
    assert max(line["max_ms"] for line in lines) >= 80
    assert min(line["max_ms"] for line in lines) < 80  # the seconds without the stall
    stalled = max(lines, key=lambda line: line["step_ms"])
    assert stalled["step_ms"] >= 80  # the step that held the loop, and whose it was
    assert "test_a_blocking_step_shows_as_the_longest_gap" in stalled["step_task"]
    assert stalled["gc_gen"] == 2 and stalled["gc_ms"] > 0
    # by the CPU spent in the gap: the sleep was no work, the spin was
    slept = max(lines, key=lambda line: line["max_ms"])
    assert slept["max_cpu_ms"] < slept["max_ms"] - 40
    busy = max(lines, key=lambda line: line["max_cpu_ms"])
    assert busy["max_cpu_ms"] >= 30 and busy["max_ms"] >= busy["max_cpu_ms"]
    assert busy is not slept


def touch(path: Path) -> None:
    path.touch()


def remove(path: Path) -> None:
    path.unlink()


async def test_paused_it_neither_ticks_nor_times_steps(tmp_path: Path,
                                                      autojump_clock) -> None:
    """While PATH.pause exists: no lines (a benchmark of idle CPU pauses it);
    when the file goes, it measures again."""
    path = tmp_path / "lag.jsonl"
    pause = Path(str(path) + looplag.PAUSE_SUFFIX)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(looplag.probe, str(path), 0.005, 1.0)
        await trio.sleep(2.5)
        running = len(path.read_text().splitlines())
        assert running >= 2
        touch(pause)
        await trio.sleep(1.5)  # the report under way ends; then nothing
        paused = len(path.read_text().splitlines())
        assert paused <= running + 1
        await trio.sleep(5)
        assert len(path.read_text().splitlines()) == paused
        remove(pause)
        await trio.sleep(3.5)  # noticed within a second (on the 1 s grid), then 1 s reports
        assert len(path.read_text().splitlines()) >= paused + 2
        nursery.cancel_scope.cancel()


async def test_without_the_variable_nothing_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(looplag.ENV, raising=False)
    with trio.fail_after(1):
        await looplag.from_env()  # returns at once


async def test_an_unwritable_file_is_a_warning(monkeypatch: pytest.MonkeyPatch,
                                               tmp_path: Path,
                                               caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv(looplag.ENV, str(tmp_path / "missing" / "lag.jsonl"))
    with trio.fail_after(1):
        await looplag.from_env()
    assert "loop-lag probe stopped" in caplog.text
