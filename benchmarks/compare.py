"""``python -m benchmarks.compare BEFORE.json AFTER.json``: two runs' targets side by side.

Re-evaluates the targets of both results files (:func:`benchmarks.targets.evaluate`) and
prints one Markdown table: each target with its figure in either run and whether the
second run met it. Targets only one run has are shown with a dash for the other.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec

from benchmarks.targets import evaluate


def _rows(path: Path) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    results = msgspec.json.decode(path.read_bytes())
    return results["meta"], {t["name"]: t for t in evaluate(results)}


def _result(t: dict[str, Any] | None) -> str:
    if t is None or t["kind"] == "info":
        return "-"
    return "met" if t["met"] else "not met"


def table(before: Path, after: Path) -> str:
    meta_a, a = _rows(before)
    meta_b, b = _rows(after)
    names = list(a) + [n for n in b if n not in a]
    lines = [f"| target | before ({meta_a['nvpair_commit']}) | after ({meta_b['nvpair_commit']})"
             " | after |", "|---|---|---|---|"]
    for name in names:
        ta, tb = a.get(name), b.get(name)
        target = (tb or ta or {}).get("target", "")
        lines.append(f"| {name}: {target} | {ta['figure'] if ta else '-'} ({_result(ta)}) | "
                     f"{tb['figure'] if tb else '-'} | {_result(tb)} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2:
        print("usage: python -m benchmarks.compare BEFORE.json AFTER.json", file=sys.stderr)
        return 2
    sys.stdout.write(table(Path(args[0]), Path(args[1])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
