from pathlib import Path

import pytest
import trio
import trio.testing

from nvpair.logs import CUT_MARK, LINE_MAX, EngineLog, Lines


def test_ring_keeps_the_last_lines_and_masks_secrets(tmp_path: Path) -> None:
    log = EngineLog(tmp_path / "e.log", ring=3, redact=("sk-secret",))
    for i in range(5):
        log.write(f"line {i} key=sk-secret")
    assert log.tail(10).lines == [f"line {i} key=***" for i in (2, 3, 4)]
    assert log.tail(1).lines == ["line 4 key=***"]
    log.close()
    text = (tmp_path / "e.log").read_text()
    assert "sk-secret" not in text and text.count("\n") == 5


def test_file_rotates_at_its_cap(tmp_path: Path) -> None:
    log = EngineLog(tmp_path / "e.log", max_bytes=100)
    for i in range(30):
        log.write(f"{i:05d} " + "x" * 20)
    log.close()
    assert (tmp_path / "e.log.1").exists()
    assert (tmp_path / "e.log").stat().st_size <= 100 + 30


async def test_pump_splits_lines_across_chunks(tmp_path: Path) -> None:
    log = EngineLog(None)
    send, receive = trio.testing.memory_stream_pair()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(log.pump, receive)
        await send.send_all(b"hel")
        await send.send_all(b"lo\nwor")
        await send.send_all(b"ld\r\npartial")
        await send.aclose()
    assert log.tail(5).lines == ["hello", "world", "partial"]


def test_lines_are_numbered_so_a_follower_never_skips_or_repeats() -> None:
    log = EngineLog(None, ring=3)
    log.write("same")
    log.write("same")
    assert log.tail(10) == Lines(["same", "same"], 0, 2, 0)
    log.write("same")  # the same text again is still a new line
    assert log.after(2) == Lines(["same"], 2, 3, 0)
    assert log.after(3) == Lines([], 3, 3, 0)
    for i in range(4):
        log.write(f"x{i}")  # 7 lines written; the ring keeps numbers 4-6
    assert log.after(3) == Lines(["x1", "x2", "x3"], 4, 7, 1)  # line 3 (x0) fell out
    assert log.tail(2) == Lines(["x2", "x3"], 5, 7, 0)
    with pytest.raises(ValueError, match="line 8 is not in this log"):
        log.after(8)


def test_a_long_line_is_cut_with_a_secret_across_the_cut_masked_whole() -> None:
    secret = "sk-SECRET-KEY"
    log = EngineLog(None, redact=(secret,))
    log.write("x" * (LINE_MAX - 5) + secret + " tail")
    log.write("y" * LINE_MAX + secret)  # the secret starts past the cut: dropped with it
    first, second = log.tail(2).lines
    assert first == "x" * (LINE_MAX - 5) + "***" + CUT_MARK
    assert second == "y" * LINE_MAX + CUT_MARK


async def test_pump_cuts_an_endless_line_and_never_leaks_a_secret_split_by_reads() -> None:
    secret = "sk-SECRET-KEY"
    log = EngineLog(None, redact=(secret,))
    send, receive = trio.testing.memory_stream_pair()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(log.pump, receive)
        await send.send_all(b"x" * (LINE_MAX - 2) + secret[:4].encode())  # no newline yet
        await trio.testing.wait_all_tasks_blocked()
        await send.send_all(secret[4:].encode() + b" and more" * 2000)  # still no newline
        await trio.testing.wait_all_tasks_blocked()
        await send.send_all(b" and the end\nnext\n")
        await send.aclose()
    assert log.tail(5).lines == ["x" * (LINE_MAX - 2) + "***" + CUT_MARK, "next"]


async def test_pump_keeps_an_unfinished_last_line_when_cancelled() -> None:
    log = EngineLog(None)
    send, receive = trio.testing.memory_stream_pair()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(log.pump, receive)
        await send.send_all(b"done\nTraceback: FATAL")
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()
    assert log.tail(5).lines == ["done", "Traceback: FATAL"]


def test_a_full_disk_keeps_lines_in_memory_and_says_so() -> None:
    log = EngineLog(Path("/dev/full"))  # every write: ENOSPC
    log.write("one")
    log.write("two")
    assert log.tail(5).lines == [
        "one", "[nvpair] cannot write /dev/full: No space left on device; keeping lines in "
        "memory only", "two"]


def test_a_log_dir_that_cannot_be_made_keeps_lines_in_memory() -> None:
    log = EngineLog(Path("/proc/no-such-dir/e.log"))
    log.write("one")
    assert log.tail(5).lines[1:] == ["one"]
    assert log.tail(5).lines[0].startswith("[nvpair] cannot write /proc/no-such-dir/e.log: ")


async def test_wide_characters_before_a_secret_do_not_let_a_cut_leak_it() -> None:
    secret = "sk-" + "S" * 29
    log = EngineLog(None, redact=(secret,))
    send, receive = trio.testing.memory_stream_pair()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(log.pump, receive)
        # 2 bytes a character: the secret starts before character LINE_MAX but past byte
        # LINE_MAX, and the line goes on without a newline past any cut
        await send.send_all(("é" * (LINE_MAX - 20) + secret).encode() + b"x" * 4 * LINE_MAX)
        await trio.testing.wait_all_tasks_blocked()
        await send.send_all(b"\nnext\n")
        await send.aclose()
    first, second = log.tail(2).lines
    assert first == "é" * (LINE_MAX - 20) + "***" + CUT_MARK and second == "next"
