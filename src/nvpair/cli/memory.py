"""``nvpair memory [NAME]``: each engine's memory and the node's, for a person.

Read from ``GET /v1/engines`` (the memory watch's last reading; docs/memory.md): what each
engine holds (anonymous memory plus swap), its floor, the slope of the floor, when the
headroom would run out at that slope, and the trend; then the node's headroom.
"""

from __future__ import annotations

import argparse
from typing import Any

import msgspec

from nvpair.cli.table import render
from nvpair.errors import InputError

TREND_COLOURS = {"flat": None, "growing": "yellow", "leaking": "red", "critical": "red"}


def size(n: float | None) -> str:
    """Bytes for a person: ``812 MB``, ``8.7 GB``."""
    if n is None:
        return "-"
    if abs(n) >= 1e9:
        return f"{n / 1e9:.1f} GB"
    if abs(n) >= 1e6:
        return f"{n / 1e6:.0f} MB"
    return f"{n / 1e3:.0f} kB"


def duration(s: float | None) -> str:
    if s is None:
        return "-"
    if s < 90:
        return f"{s:.0f} s"
    if s < 5400:
        return f"{s / 60:.0f} min"
    if s < 72 * 3600:
        return f"{s / 3600:.1f} h"
    return f"{s / 86400:.0f} d"


def slope(per_h: float | None) -> str:
    if per_h is None:
        return "-"
    return f"{per_h / 1e9:+.2f} GB/h" if abs(per_h) >= 1e8 else f"{per_h / 1e6:+.0f} MB/h"


def trend_cell(m: dict[str, Any] | None) -> str:
    """The TREND column of ``nvpair status``."""
    if m is None:
        return "-"
    return m["trend"] if not m.get("error") else f"{m['trend']}?"


def lines(doc: dict[str, Any], name: str | None) -> str:
    engines = [e for e in doc["engines"] if name is None or e["name"] == name]
    if name is not None and not engines:
        raise InputError(f"no engine {name!r} here")
    rows: list[tuple[str, ...]] = []
    colours: list[list[str | None]] = []
    for e in engines:
        m = e.get("memory")
        if m is None:
            rows.append((e["name"], "-", "-", "-", "-", "-", "not watched"))
            colours.append([None, None, None, None, None, None, "dim"])
            continue
        held = None if m["rss_anon_bytes"] is None else m["rss_anon_bytes"] + (
            m["swap_bytes"] or 0)
        note = m.get("error") or m.get("action") or m.get("why") or ""
        rows.append((e["name"], size(held), size(m["floor_bytes"]),
                     slope(m["slope_bytes_per_h"]), duration(m["exhaustion_s"]), m["trend"],
                     note))
        colours.append([None, None, None, None, None, TREND_COLOURS.get(m["trend"]), "dim"])
    out = render(("ENGINE", "HELD", "FLOOR", "SLOPE", "RUNS OUT IN", "TREND", "WHY"), rows,
                 colours=colours) if rows else "no engines"
    node = doc.get("memory")
    if node and node.get("mem_available") is not None:
        unified = "; unified memory (the GPU's is the host's)" if node["unified_memory"] else ""
        out += (f"\nnode: {size(node['mem_available'])} available, reserve "
                f"{size(node['reserve_bytes'])}, headroom {size(node['headroom_bytes'])}; "
                f"{node['trend']} ({slope(node['slope_bytes_per_h'])}"
                + (f", runs out in {duration(node['exhaustion_s'])}"
                   if node["exhaustion_s"] is not None else "") + f"){unified}")
        if node.get("psi_some_avg10"):
            out += f"; memory pressure {node['psi_some_avg10']:.1f} %"
    return out


def run(args: argparse.Namespace) -> int:
    from nvpair.cli.client import call

    doc = call(args, "GET", "/v1/engines")
    if args.json:
        picked = [e for e in doc["engines"] if args.name is None or e["name"] == args.name]
        print(msgspec.json.encode({"node": doc.get("memory"), "engines": {
            e["name"]: e.get("memory") for e in picked}}).decode())
        return 0
    print(lines(doc, args.name))
    return 0
