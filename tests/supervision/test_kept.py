"""A kept engine's output file, followed through the log pump, and an adopted process."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import trio

from nvpair.base.logs import EngineLog, RateCap
from nvpair.supervision import kept
from nvpair.supervision.kept import UNKNOWN_EXIT, AdoptedProcess, OutputTail, open_output
from nvpair.supervision.orphans import stat


def no_save(offset: int) -> None:
    pass


async def test_the_file_is_read_from_the_offset_masked_and_to_its_end(tmp_path: Path) -> None:
    path = tmp_path / "e.out"
    before = b"said before the offset\n"
    path.write_bytes(before + b"key sk-SECRET-1 in a line\nplain\nunfinished")
    log = EngineLog(None, redact=("sk-SECRET-1",))
    ended = trio.Event()
    ended.set()  # the process has ended: the stream ends at the end of the file
    tail = OutputTail(path, len(before), ended, no_save)
    with trio.fail_after(5):
        await log.pump(tail)
    assert log.tail(10).lines == ["key *** in a line", "plain", "unfinished"]
    assert tail.offset == path.stat().st_size


async def test_lines_written_later_are_followed_and_the_offset_saved(tmp_path: Path) -> None:
    path = tmp_path / "e.out"
    fd = open_output(path)
    saved: list[int] = []
    log = EngineLog(None)
    ended = trio.Event()
    tail = OutputTail(path, 0, ended, saved.append)
    try:
        with trio.fail_after(5):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(log.pump, tail)
                os.write(fd, b"one\n")
                while log.written < 1:
                    await log.changed.wait()
                os.write(fd, b"two\n")
                while log.written < 2:
                    await log.changed.wait()
                ended.set()
    finally:
        os.close(fd)
    assert log.tail(5).lines == ["one", "two"]
    assert saved and saved[0] == 4  # the first read's offset went to the record at once


async def test_a_chatty_engine_s_file_is_read_under_the_rate_cap(tmp_path: Path) -> None:
    path = tmp_path / "e.out"
    path.write_bytes(b"".join(b"line %d\n" % i for i in range(20_000)))
    log = EngineLog(None, rate=RateCap(lines_per_s=1000, bytes_per_s=1 << 20))
    ended = trio.Event()
    ended.set()
    with trio.fail_after(10):
        await log.pump(OutputTail(path, 0, ended, no_save))
    assert log.dropped >= 15_000  # a second's worth kept, the rest dropped and counted
    assert "line 19999" in log.tail(2).lines  # the newest kept (then the drops' note)


async def test_a_large_file_read_to_its_end_is_emptied(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kept, "OUTPUT_MAX_BYTES", 100)
    path = tmp_path / "e.out"
    fd = open_output(path)
    log = EngineLog(None)
    ended = trio.Event()
    tail = OutputTail(path, 0, ended, no_save)
    try:
        with trio.fail_after(5):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(log.pump, tail)
                os.write(fd, b"x" * 150 + b"\n")
                while log.written < 1:
                    await log.changed.wait()
                # read to its end, it is emptied at the next look (a file: polled)
                while path.stat().st_size != 0:  # noqa: ASYNC110
                    await trio.sleep(0.01)
                assert tail.offset == 0
                os.write(fd, b"after\n")  # appended: it lands at the start
                while log.written < 2:
                    await log.changed.wait()
                ended.set()
    finally:
        os.close(fd)
    assert log.tail(5).lines == ["x" * 150, "after"]


async def test_an_adopted_process_is_waited_for_and_its_exit_is_unknown() -> None:
    proc = await trio.lowlevel.open_process(["sleep", "60"], start_new_session=True)
    try:
        s = stat(proc.pid)
        assert s is not None
        stranger = AdoptedProcess(proc.pid, s.start_time + 1)  # another start time
        assert stranger.returncode == UNKNOWN_EXIT  # not the process on record: gone
        stranger.signal_group(signal.SIGTERM)  # never signalled
        assert stat(proc.pid) is not None and proc.poll() is None
        adopted = AdoptedProcess(proc.pid, s.start_time)
        assert adopted.returncode is None and adopted.stdout is None
        adopted.signal_group(signal.SIGTERM)
        with trio.fail_after(5):
            assert await adopted.wait() == UNKNOWN_EXIT
    finally:
        proc.kill()
        with trio.CancelScope(shield=True), trio.move_on_after(5):
            await proc.wait()
