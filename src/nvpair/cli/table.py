"""Plain tables for people, with colour only where a terminal is attached."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import TextIO

_COLOURS = {"green": "32", "yellow": "33", "red": "31", "dim": "2", "bold": "1", "cyan": "36"}

STATE_COLOURS = {
    "ready": "green",
    "stale": "yellow",
    "starting": "cyan",
    "unhealthy": "red",
    "down": "red",
    "stopped": "dim",
    "sleeping": "dim",
    "waking": "cyan",
    "draining": "yellow",
}


def use_colour(stream: TextIO) -> bool:
    return stream.isatty() and "NO_COLOR" not in os.environ and os.environ.get("TERM") != "dumb"


def paint(text: str, colour: str | None, enabled: bool) -> str:
    if not enabled or colour is None or colour not in _COLOURS:
        return text
    return f"\x1b[{_COLOURS[colour]}m{text}\x1b[0m"


def render(
    headers: Sequence[str],
    rows: Sequence[Sequence[object]],
    *,
    colours: Sequence[Sequence[str | None]] | None = None,
    stream: TextIO | None = None,
) -> str:
    """Columns padded to their widest cell; colour codes never count toward the width."""
    out = stream or sys.stdout
    enabled = use_colour(out)
    cells = [[str(c) for c in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in cells:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))
    head = "  ".join(paint(h.ljust(w), "bold", enabled)
                     for h, w in zip(headers, widths, strict=True))
    lines = [head.rstrip()]
    for r, row in enumerate(cells):
        parts = []
        for i, cell in enumerate(row):
            colour = colours[r][i] if colours else None
            parts.append(paint(cell.ljust(widths[i]), colour, enabled))
        lines.append("  ".join(parts).rstrip())
    return "\n".join(lines)
