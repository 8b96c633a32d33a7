"""The fault boundary: every kind of error a part can raise stays inside the part."""

from __future__ import annotations

import logging
import random

import pytest
import trio
import trio.testing

from nvpair.base.boundary import Backoff, Part, expected, failure_line
from nvpair.errors import ProbeError

ERRORS: list[Exception] = [
    ProbeError("body", "GET /v1/models: the answer is not JSON"),
    RecursionError("maximum recursion depth exceeded while deserializing an object"),
    TypeError("argument of type 'int' is not iterable"),
    ValueError("illegal environment variable name"),
    KeyError("models"),
    UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte"),
    OSError(24, "Too many open files"),
    ExceptionGroup("nursery", [ZeroDivisionError("division by zero")]),
    AssertionError(),
]


@pytest.mark.parametrize("error", ERRORS, ids=lambda e: type(e).__name__)
async def test_each_kind_of_error_is_the_parts_failure_and_is_retried(
        error: Exception, autojump_clock: trio.testing.MockClock,
        caplog: pytest.LogCaptureFixture) -> None:
    published: list[str | None] = []
    part = Part("engine x: model list", published.append, initial_s=1.0, max_s=8.0,
                rng=random.Random(1))
    runs = 0

    async def loop() -> None:
        nonlocal runs
        runs += 1
        if runs <= 4:
            raise error
        part.ok()

    started = trio.current_time()
    with caplog.at_level(logging.INFO, logger="nvpair"):
        await part.supervise(loop)
    # failed four times, retried with a growing backoff (1, 2, 4, 8 s plus jitter), then ran
    assert runs == 5
    waited = trio.current_time() - started
    assert 15.0 <= waited <= 15.0 * 1.2 + 1e-9
    assert published[:4] == [failure_line(error)] * 4 and published[-1] is None
    assert part.failure is None and part.failures == 4
    # logged once per transition: one failure record, one recovery record
    records = [r for r in caplog.records if r.name == "nvpair"]
    assert len(records) == 2
    failure, recovery = records
    if expected(error):
        assert failure.levelno == logging.WARNING and failure.exc_info is None
        assert failure_line(error) in failure.getMessage()
    else:
        assert failure.levelno == logging.ERROR and failure.exc_info is not None
        assert "internal error in nvpair" in failure_line(error)
    assert recovery.levelno == logging.INFO and "works again" in recovery.getMessage()


async def test_cancellation_passes_through_the_boundary(
        autojump_clock: trio.testing.MockClock) -> None:
    part = Part("peer n2")
    entered = trio.Event()

    async def loop() -> None:
        entered.set()
        await trio.sleep_forever()

    with trio.move_on_after(5) as scope:
        await part.supervise(loop)
    assert scope.cancelled_caught and entered.is_set() and part.failures == 0


async def test_base_exceptions_are_not_swallowed() -> None:
    part = Part("x")

    async def loop() -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        await part.supervise(loop)
    with pytest.raises(BaseExceptionGroup), part.guard():
        raise BaseExceptionGroup("mixed", [KeyboardInterrupt(), ValueError("x")])


def test_guard_records_and_stops_the_error() -> None:
    published: list[str | None] = []
    part = Part("engine x: spawn", published.append)
    with part.guard():
        raise ValueError("embedded null byte")
    assert part.failure is not None and "ValueError: embedded null byte" in part.failure
    assert published == [part.failure]


def test_a_publish_that_raises_is_contained(caplog: pytest.LogCaptureFixture) -> None:
    def publish(reason: str | None) -> None:
        raise RuntimeError("board is gone")

    part = Part("x", publish)
    with caplog.at_level(logging.ERROR, logger="nvpair"), part.guard():
        raise ProbeError("body", "bad")
    assert part.failure == "bad"
    assert any("could not publish" in r.getMessage() for r in caplog.records)


def test_same_failure_is_logged_once_a_new_one_again(caplog: pytest.LogCaptureFixture) -> None:
    part = Part("x")
    with caplog.at_level(logging.WARNING, logger="nvpair"):
        for message in ("a", "a", "a", "b", "b"):
            with part.guard():
                raise ProbeError("body", message)
    assert [r.getMessage() for r in caplog.records] == ["x: a", "x: b"]


def test_descriptions_are_one_short_line() -> None:
    text = failure_line(ValueError("line one\nline two " + "x" * 1000))
    assert "\n" not in text and len(text) <= 300
    assert failure_line(ExceptionGroup("g", [ExceptionGroup("h", [ProbeError("s", "deep")])])) \
        == "deep"


def test_backoff_doubles_to_its_maximum_with_jitter_and_resets() -> None:
    backoff = Backoff(0.5, 4.0, jitter=0.2, rng=random.Random(7))
    delays = [backoff.next() for _ in range(6)]
    for delay, base in zip(delays, [0.5, 1, 2, 4, 4, 4], strict=True):
        assert base <= delay <= base * 1.2
    backoff.reset()
    assert backoff.next() <= 0.6
    with pytest.raises(ValueError):
        Backoff(0, 1)
