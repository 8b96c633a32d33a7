import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from nvpair.base.logs import CUT_MARK, LINE_MAX, Drops, EngineLog, Lines, RateCap, masked


def test_ring_keeps_the_last_lines_and_masks_secrets(tmp_path: Path) -> None:
    log = EngineLog(tmp_path / "e.log", ring=3, redact=("sk-secret",))
    for i in range(5):
        log.write(f"line {i} key=sk-secret")
    assert log.tail(10).lines == [f"line {i} key=***" for i in (2, 3, 4)]
    assert log.tail(1).lines == ["line 4 key=***"]
    log.close()
    text = (tmp_path / "e.log").read_text()
    assert "sk-secret" not in text and text.count("\n") == 5


def test_a_secret_added_by_a_reload_is_masked_and_the_old_one_still(tmp_path: Path) -> None:
    log = EngineLog(tmp_path / "e.log", redact=("sk-old",))
    log.add_secret("sk-new")
    log.write("old=sk-old new=sk-new")
    assert log.tail(1).lines == ["old=*** new=***"]
    log.close()
    assert "sk-" not in (tmp_path / "e.log").read_text()


async def test_a_lower_rate_cap_from_a_reload_takes_effect_at_once(
        autojump_clock: trio.testing.MockClock) -> None:
    log = EngineLog(None, rate=RateCap(1_000_000, 1 << 30), name="e")
    log.set_rate(RateCap(10, 1 << 30))
    send, receive = trio.testing.memory_stream_pair()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(log.pump, receive)
        await send.send_all(b"".join(b"line %d\n" % i for i in range(100)))
        await send.aclose()
    assert log.dropped == 90 and log.rate == RateCap(10, 1 << 30)


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


def test_a_moved_log_writes_on_in_the_new_file_and_says_so_in_both(tmp_path: Path) -> None:
    old, new = tmp_path / "a" / "e.log", tmp_path / "b" / "e.log"
    log = EngineLog(old)
    log.write("one")
    log.move(new)
    log.write("two")
    assert old.read_text().splitlines() == ["one", f"[nvpair] this log continues in {new}"]
    assert new.read_text().splitlines() == [f"[nvpair] this log continues here (before: {old})",
                                            "two"]
    assert log.tail(5).lines[0] == "one" and log.tail(5).lines[-1] == "two"  # (the ring)
    log.move(Path("/proc/no-such-dir/e.log"))  # cannot be made: in memory from here on
    log.write("three")
    assert "three" not in new.read_text() and log.tail(1).lines == ["three"]
    assert log.tail(2).lines[0].startswith("[nvpair] cannot write /proc/no-such-dir/e.log: ")
    log.close()


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


# -- a flood: bounded steps, a rate cap, one file write a read --------------------------


class StepTimes(trio.abc.Instrument):
    """The CPU time of each step of one task (its own work, whatever else the machine
    runs), and the longest."""

    def __init__(self, task: trio.lowlevel.Task) -> None:
        self.task = task
        self.started: float | None = None  # (the step that added it is not timed)
        self.steps = 0
        self.longest = 0.0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        if task is self.task:
            self.started = time.thread_time()

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        if task is self.task and self.started is not None:
            self.steps += 1
            self.longest = max(self.longest, time.thread_time() - self.started)


async def pump_timed(log: EngineLog, stream: trio.abc.ReceiveStream, *,
                     task_status: trio.TaskStatus[StepTimes]) -> None:
    steps = StepTimes(trio.lowlevel.current_task())
    trio.lowlevel.add_instrument(steps)
    try:
        task_status.started(steps)
        await log.pump(stream)
    finally:
        trio.lowlevel.remove_instrument(steps)


@pytest.mark.parametrize("argv", [
    ["yes", "flood"],  # 6 bytes a line, as fast as a pipe takes them
    [sys.executable, "-c", "import sys\nline = b'x' * 65536 + b'\\n'\n"
                           "while True: sys.stdout.buffer.write(line)"],  # 64 KiB lines
], ids=["yes", "64KiB-lines"])
async def test_a_flood_is_pumped_in_short_steps_and_what_is_over_the_cap_dropped(
        tmp_path: Path, argv: list[str]) -> None:
    """Before: a read of ``yes`` was 10,000 lines written in one step (~30 ms), and a
    line past the cap was masked character by character (~5 ms)."""
    log = EngineLog(tmp_path / "e.log", rate=RateCap(1000, 256 * 1024), name="noisy",
                    redact=("sk-secret",))
    told: list[Drops] = []
    log.on_drops = told.append
    proc = await trio.lowlevel.open_process(argv, stdout=subprocess.PIPE)
    assert proc.stdout is not None
    try:
        with trio.fail_after(20):
            async with trio.open_nursery() as nursery:
                steps = await nursery.start(pump_timed, log, proc.stdout)
                start = trio.current_time()
                await trio.sleep(1.5)
                nursery.cancel_scope.cancel()
    finally:
        proc.kill()
        with trio.CancelScope(shield=True), trio.fail_after(5):
            await proc.wait()
    elapsed = trio.current_time() - start
    print(f"{argv[0]}: {steps.steps} steps, the longest {steps.longest * 1e3:.2f} ms CPU, "
          f"{log.written} lines kept, {log.dropped} dropped")
    assert steps.steps > 50
    assert steps.longest < 0.002, f"a step of {steps.longest * 1000:.1f} ms"
    assert log.dropped > 0
    # kept: a second's burst, then the cap (and the episode's line in words)
    assert log.written <= 1000 * (1 + elapsed) + 2
    assert told and told[0].dropped > 0
    assert re.fullmatch(r"engine noisy wrote [\d,]+ lines/s \([\d,.]+ MB/s\); [\d,]+ dropped; "
                        r"the newest kept", told[0].episode or "")
    assert any(line == "[nvpair] " + told[0].episode for line in log.tail(2000).lines)
    log.close()
    assert (tmp_path / "e.log").stat().st_size < 2 * 256 * 1024 * (1 + elapsed)


async def test_lines_over_the_cap_are_dropped_the_newest_kept_and_said_once(
        autojump_clock: trio.testing.MockClock) -> None:
    log = EngineLog(None, rate=RateCap(100, 1 << 20), name="e")
    told: list[Drops] = []
    log.on_drops = told.append
    send, receive = trio.testing.memory_stream_pair()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(log.pump, receive)
        await send.send_all(b"".join(b"l%d\n" % i for i in range(300)))
        await trio.testing.wait_all_tasks_blocked()
        assert log.tail(1000).lines == [f"l{i}" for i in range(200, 300)]  # the newest
        assert log.dropped == 200
        assert told == []  # not yet: an episode is said once it has lasted a second
        await trio.sleep(0.5)
        await send.send_all(b"more\n")  # within the cap again (50 tokens back)
        await trio.testing.wait_all_tasks_blocked()
        assert log.tail(1)[0] == ["more"] and log.dropped == 200
        await trio.sleep(2)
        await send.aclose()
    words = "engine e wrote 301 lines/s (0.0 MB/s); 200 dropped; the newest kept"
    assert told == [Drops(200, words), Drops(200, None)]  # said, then over
    assert log.tail(1)[0] == ["[nvpair] " + words]


async def test_bytes_over_the_cap_are_dropped_the_newest_kept() -> None:
    log = EngineLog(None, rate=RateCap(1000, 4096))
    send, receive = trio.testing.memory_stream_pair()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(log.pump, receive)
        await send.send_all(b"".join(b"%04d" % i + b"x" * 995 + b"\n" for i in range(10)))
        await trio.testing.wait_all_tasks_blocked()
        assert [line[:4] for line in log.tail(100).lines] == ["0006", "0007", "0008", "0009"]
        assert log.dropped == 6
        nursery.cancel_scope.cancel()


def write_calls() -> int:
    """This process's write system calls so far (/proc/self/io)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("syscw:"):
            return int(line.split()[1])
    raise AssertionError("no syscw in /proc/self/io")


async def test_the_file_is_written_once_a_read_not_once_a_line(tmp_path: Path) -> None:
    log = EngineLog(tmp_path / "e.log")
    send, receive = trio.testing.memory_stream_pair()
    lines = [f"line {i:04d}" for i in range(2000)]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(log.pump, receive)
        await trio.testing.wait_all_tasks_blocked()
        before = write_calls()
        await send.send_all("".join(line + "\n" for line in lines).encode())  # one read
        await trio.testing.wait_all_tasks_blocked()
        writes = write_calls() - before
        nursery.cancel_scope.cancel()
    log.close()
    assert writes <= 2  # before: 2,000 (a write and a flush a line)
    assert log.tail(2000).lines == lines
    assert (tmp_path / "e.log").read_text().splitlines() == lines


# -- masking: linear, bounded by the cap, the same as the simple walk -------------------


def masked_by_walk(line: str, secrets: tuple[str, ...], limit: int) -> str:
    """The simple reference: walk the first ``limit`` characters; where a secret starts,
    write ``***`` and step over all of it."""
    out: list[str] = []
    i = 0
    while i < min(len(line), limit):
        secret = next((s for s in secrets if line.startswith(s, i)), None)
        out.append(line[i] if secret is None else "***")
        i += 1 if secret is None else len(secret)
    return "".join(out)


pieces = st.sampled_from(["a", "b", "ab", "ba", "sk", "sk-", "-", "é", "x" * 7])


@settings(max_examples=400, deadline=None)
@given(st.lists(pieces, max_size=30).map("".join),
       st.lists(st.lists(st.sampled_from("ab-ské"), min_size=1, max_size=5).map("".join),
                min_size=1, max_size=3).map(tuple),
       st.integers(0, 40))
def test_masking_is_the_walk_and_never_shows_a_secret(line: str, secrets: tuple[str, ...],
                                                      limit: int) -> None:
    got = masked(line, secrets, limit)
    assert got == masked_by_walk(line, secrets, limit)
    if len(secrets) == 1:  # (two secrets can overlap: the walk masks the first found)
        assert secrets[0] not in got


@settings(max_examples=100, deadline=None)
@given(st.integers(-40, 10), st.text(alphabet="xyé", max_size=40))
def test_a_secret_across_the_cut_is_masked_whole_in_a_long_line(at: int, tail: str) -> None:
    secret = "sk-" + "S" * 29
    log = EngineLog(None, redact=(secret,))
    line = "y" * (LINE_MAX + at) + secret + tail
    log.write(line)
    got = log.tail(1).lines[0]
    assert got == masked_by_walk(line, (secret,), LINE_MAX) + (
        CUT_MARK if len(line) > LINE_MAX else "")
    assert secret not in got and ("***" in got) == (at < 0)


def test_masking_a_long_line_costs_the_cap_not_the_line() -> None:
    """Before: ~5 ms a line past the cap (a Python loop over its first 8,192 characters)."""
    secret = "sk-secret-key"
    log = EngineLog(None, redact=(secret,))
    for size in (20_000, 10_000_000):
        line = ("é" * 100 + secret) * (size // 113)
        costs = []
        for _ in range(5):
            start = time.thread_time()
            log.write(line)
            costs.append(time.thread_time() - start)
        assert min(costs) < 0.0005, f"{size} characters: {min(costs) * 1000:.2f} ms"
        assert secret not in log.tail(1).lines[0]
