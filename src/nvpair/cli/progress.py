"""Engine state changes, printed as they happen while ``nvpair serve`` runs."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from typing import TextIO

import trio
import trio.lowlevel

from nvpair.base import logsetup
from nvpair.cli.table import STATE_COLOURS, paint, use_colour
from nvpair.state.snapshot import Board, EngineState

log = logging.getLogger("nvpair.engines")


def state_line(e: EngineState) -> str:
    detail = ""
    if e.state in ("ready", "stale") and e.models:
        detail = "serving " + ", ".join(m.id for m in e.models[:4])
        if len(e.models) > 4:
            detail += f" and {len(e.models) - 4} more"
    elif e.error:
        detail = e.error
    return detail


async def print_transitions(board: Board, stream: TextIO = sys.stderr) -> None:
    """Print one line per engine state change (optional engines only once they answer)."""
    await each_transition(board, printer(board, stream))


async def follow_transitions(board: Board, stream: TextIO = sys.stderr) -> None:
    """``nvpair serve``'s: each change printed, or logged as a line of nvpair's log while
    that is JSON (``log_format``: stderr then holds JSON lines only; a reload may switch
    it, and the next change follows)."""
    say_printed = printer(board, stream)

    def say(e: EngineState, before: str | None) -> None:
        (log_line if logsetup.current_format() == "json" else say_printed)(e, before)

    await each_transition(board, say)


def printer(board: Board, stream: TextIO) -> Callable[[EngineState, str | None], None]:
    """Prints a change as a line for people: time, engine, state (coloured on a tty)."""
    colour = use_colour(stream)
    width = max((len(e.name) for e in board.current.engines), default=8)

    def say(e: EngineState, before: str | None) -> None:
        arrow = f"{before} -> " if before else ""
        state = paint(e.state, STATE_COLOURS.get(e.state), colour)
        stamp = time.strftime("%H:%M:%S")
        line = f"{stamp} {e.name.ljust(width)}  {arrow}{state}"
        if detail := state_line(e):
            line += f"  {paint(detail, 'dim', colour)}"
        print(line, file=stream, flush=True)

    return say


def log_line(e: EngineState, before: str | None) -> None:
    """Logs a change as a line of nvpair's log, with its engine and the event ``state``."""
    detail = state_line(e)
    log.info("%s -> %s%s", before or "-", e.state, f": {detail}" if detail else "",
             extra={"engine": e.name, "event": "state"})


async def each_transition(board: Board,
                          say: Callable[[EngineState, str | None], None]) -> None:
    """Call ``say(engine, state before)`` once per engine state change.

    Wakes on the board's listing version, not on every probe."""
    seen: dict[str, str] = {}
    version = -1
    while True:  # (states are listed: the listing version moves with each; counters not)
        version = await board.wait_listed(version)
        for e in board.current.engines:
            before = seen.get(e.name)
            if before == e.state or (e.optional and e.checked_at is None):
                continue
            seen[e.name] = e.state
            say(e, before)
        await trio.lowlevel.checkpoint()  # let a burst of changes land before printing the next
