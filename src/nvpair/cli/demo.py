"""``nvpair demo``: nvpair with simulated engines managed as child processes."""

from __future__ import annotations

import sys


def run_demo(listen: str) -> int:
    print("nvpair demo: not available yet (the simulators land with issue 3)", file=sys.stderr)
    return 1
