"""``nvpair groups [NAME [stop|start|restart]]``: multi-node groups, for a person.

Read from ``GET /v1/groups`` (docs/groups.md): each group's state, epoch and ranks, what
went wrong in words, and the last epochs with why each ended. An action is a POST, which a
rank passes on to the head.
"""

from __future__ import annotations

import argparse
from typing import Any

import msgspec

from nvpair.cli.memory import size
from nvpair.cli.table import STATE_COLOURS, render
from nvpair.errors import InputError

GROUP_COLOURS = {**STATE_COLOURS, "forming": "cyan", "degraded": "yellow", "restarting": "cyan",
                 "failed": "red", "fenced": "red", "unknown": "yellow", "stopping": "cyan"}
HISTORY_SHOWN = 5


def _pid(value: object) -> str:
    return "-" if value is None else str(value)


def show(doc: dict[str, Any]) -> None:
    ready = f"{doc.get('ranks_ready', 0)}/{len(doc['ranks']) - 1} ranks ready"
    print(f"group {doc['name']}: {doc['state']}, epoch {doc.get('epoch')}, {ready}, "
          f"{doc.get('restarts') if doc.get('restarts') is not None else '-'} restarts "
          f"(this node: {doc['node']}, {doc['role']} {doc['rank']})")
    rows, colours = [], []
    for r in doc["ranks"]:
        rows.append((r["rank"], r["node"], r["state"], f"{r['state_age_s']:.1f}s",
                     _pid(r["pid"]), size(r.get("memory_bytes")), r["exit"] or ""))
        colours.append([None, None, GROUP_COLOURS.get(r["state"]), None, None, None, "dim"])
    print(render(("RANK", "NODE", "STATE", "FOR", "PID", "MEMORY", "EXIT"), rows,
                 colours=colours))
    if doc.get("error"):
        print(f"error: {doc['error']}")
    history = doc.get("history") or []
    if history:
        print("epochs (newest first):")
        for e in history[:HISTORY_SHOWN]:
            print(f"  {e['epoch']}: {e['reason'] or 'running'}")


def print_groups(args: argparse.Namespace, *, blank_line: bool) -> bool:
    """``nvpair status``'s groups table, under the engines: one row per group this node is
    in (nothing where there are none: ``/v1/groups`` then answers 404); whether it printed
    one."""
    from nvpair.cli.client import call

    try:
        doc = call(args, "GET", "/v1/groups")
    except InputError:
        return False
    groups = doc.get("groups") if isinstance(doc, dict) else None
    if not isinstance(groups, list) or not groups:
        return False
    rows, colours = [], []
    for g in groups:
        ranks = f"{g.get('ranks_ready', 0)}/{len(g['ranks']) - 1}"
        epoch = "-" if g.get("epoch") is None else str(g["epoch"])
        rows.append((g["name"], g["role"], str(g["rank"]), g["head"], g["state"], epoch, ranks,
                     g.get("error") or ""))
        colours.append([None, None, None, None, GROUP_COLOURS.get(g["state"]), None, None,
                        "dim"])
    if blank_line:
        print()
    print(render(("GROUP", "ROLE", "RANK", "HEAD", "STATE", "EPOCH", "RANKS READY", "ERROR"),
                 rows, colours=colours))
    return True


def run(args: argparse.Namespace) -> int:
    from nvpair.cli.client import call

    if args.action:
        doc = call(args, "POST", f"/v1/groups/{args.name}/{args.action}")
        print(f"{args.name}: {args.action} accepted by {doc.get('node')}")
        return 0
    doc = call(args, "GET", f"/v1/groups/{args.name}" if args.name else "/v1/groups")
    if args.json:
        print(msgspec.json.encode(doc).decode())
        return 0
    groups = [doc] if args.name else doc["groups"]
    if not groups:
        print("no groups on this node")
    for i, g in enumerate(groups):
        if i:
            print()
        show(g)
    return 0
