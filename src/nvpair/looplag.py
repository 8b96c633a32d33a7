"""An opt-in loop-lag probe: how long the event loop went without running a 5 ms timer.

With ``NVPAIR_LOOP_LAG_FILE=PATH`` in its environment, ``nvpair serve`` runs a task that
sleeps 5 ms in a loop and measures the gap between its wake-ups. Once a second it appends
one JSON line to ``PATH``: ``{"t": <unix time>, "max_ms": <longest gap in that second>,
"ticks": <wake-ups>}``. A gap is what any task waiting on the loop waited at worst, the
timer's own 5 ms included, so an idle loop shows about 5 ms and a step that held the loop
for 40 ms shows about 45. Without the variable nothing runs. The benchmarks
(docs/benchmarks.md) read the file to report the longest stall beside the latencies.
"""

from __future__ import annotations

import json
import logging
import os
import time

import trio

log = logging.getLogger("nvpair.looplag")

ENV = "NVPAIR_LOOP_LAG_FILE"
TICK_S = 0.005
REPORT_S = 1.0


def _append(fd: int, line: dict[str, float | int]) -> None:
    """One short line to a local file opened with O_APPEND: a few microseconds."""
    os.write(fd, (json.dumps(line) + "\n").encode())


async def probe(path: str, tick_s: float = TICK_S, report_s: float = REPORT_S) -> None:
    """Measure until cancelled, appending a line to ``path`` every ``report_s`` seconds.

    Never returns by itself; cancellation ends it (the last partial second is written).
    Raises OSError only when ``path`` cannot be opened.
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    worst, ticks = 0.0, 0
    last = trio.current_time()
    report_at = last + report_s
    try:
        while True:
            await trio.sleep(tick_s)
            now = trio.current_time()
            worst, ticks = max(worst, now - last), ticks + 1
            last = now
            if now >= report_at:
                _append(fd, {"t": round(time.time(), 3), "max_ms": round(worst * 1000, 3),
                             "ticks": ticks})
                worst, ticks = 0.0, 0
                report_at = now + report_s
    finally:
        if ticks:
            _append(fd, {"t": round(time.time(), 3), "max_ms": round(worst * 1000, 3),
                         "ticks": ticks})
        os.close(fd)


async def from_env() -> None:
    """The probe if ``NVPAIR_LOOP_LAG_FILE`` is set; otherwise returns at once. A file that
    cannot be written is a warning, never an error of the service."""
    path = os.environ.get(ENV)
    if path:
        try:
            await probe(path)
        except OSError as exc:
            log.warning("loop-lag probe stopped: %s: %s", path, exc)
