"""``nvpair events`` (one line per event, resumed after a dropped connection) and
``nvpair status --watch`` (the status table, redrawn when an event says something changed)."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx2
import msgspec

from nvpair.base.decoding import is_digits
from nvpair.cli.client import base_url, call, print_status
from nvpair.errors import InputError

#: how long to wait before reconnecting when the server sent no ``retry:``
DEFAULT_RETRY_S = 2.0


class Sse(msgspec.Struct):
    event: str = "message"
    id: str | None = None
    data: str = ""


def parse(lines: Iterator[str], on_retry: Callable[[int], None]) -> Iterator[Sse]:
    """Server-sent events from a stream's lines (comments skipped)."""
    current, fields = Sse(), False
    for line in lines:
        if line == "":
            if fields:
                yield current
            current, fields = Sse(), False
            continue
        if line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "retry" and is_digits(value):
            on_retry(int(value))
            continue
        fields = True
        if name == "event":
            current.event = value
        elif name == "id":
            current.id = value
        elif name == "data":
            current.data = value if not current.data else current.data + "\n" + value


def follow(args: argparse.Namespace, path: str, show: Callable[[Sse], None]) -> int:
    """Read ``path``'s events until interrupted, resuming with ``Last-Event-ID`` after a
    dropped connection or a restart of nvpair (it then sends a fresh snapshot)."""
    url, token = base_url(args)
    last: str | None = None
    retry_s = DEFAULT_RETRY_S

    def set_retry(ms: int) -> None:
        nonlocal retry_s
        retry_s = ms / 1000

    while True:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        if last is not None:
            headers["Last-Event-ID"] = last
        try:
            with httpx2.stream("GET", url + path, headers=headers, trust_env=False,
                               timeout=httpx2.Timeout(10.0, read=60.0)) as r:
                if r.status_code >= 400:
                    r.read()
                    raise InputError(f"GET {path}: {r.status_code}: {_message(r)}")
                for event in parse(r.iter_lines(), set_retry):
                    if event.id:
                        last = event.id
                    show(event)
        except httpx2.ConnectError:
            if last is None:
                raise InputError(f"cannot reach nvpair at {url} (is `nvpair serve` running?)"
                                 ) from None
        except httpx2.HTTPError as exc:
            print(f"[nvpair: the stream broke ({exc or type(exc).__name__}); resuming]",
                  file=sys.stderr)
        time.sleep(retry_s)


def _message(r: httpx2.Response) -> str:
    try:
        doc = msgspec.json.decode(r.content)
        return str(doc["error"]["message"])
    except (msgspec.DecodeError, KeyError, TypeError):
        return r.text[:200]


def summary(event: Sse) -> str:
    """One line of words for an event."""
    try:
        doc: Any = msgspec.json.decode(event.data) if event.data else {}
    except msgspec.DecodeError:
        return event.data[:200]
    if event.event == "engine":
        if doc.get("removed"):
            return f"{doc['name']} removed"
        models = ", ".join(doc.get("models") or []) or "-"
        error = f" error={doc['error']}" if doc.get("error") else ""
        return (f"{doc['name']} {doc['state']} models={models} "
                f"restarts={doc['restarts']}{error}")
    if event.event == "peer":
        return f"{doc['node']} {doc['state']} models={len(doc.get('models') or [])}"
    if event.event == "snapshot":
        states = " ".join(f"{e['name']}={e['state']}" for e in doc.get("engines", []))
        return f"node {doc.get('node')}: {states or 'no engines'}"
    if event.event == "models":
        return f"listing version {doc.get('version')}"
    if event.event == "bye":
        return f"node {doc.get('node')} is shutting down"
    if event.event == "reload":
        return str(doc.get("summary"))
    return event.data[:200]


def run_events(args: argparse.Namespace) -> int:
    query = []
    if args.types:
        query.append(f"types={args.types}")
    if args.engine:
        query.append(f"engine={args.engine}")
    path = "/v1/events" + ("?" + "&".join(query) if query else "")

    def show(event: Sse) -> None:
        if args.json:
            data = msgspec.json.decode(event.data) if event.data else None
            line = msgspec.json.encode({"id": event.id, "event": event.event, "data": data})
            print(line.decode())
        else:
            # the time it came first (the id, for resuming, last: it means nothing to a reader)
            print(f"{time.strftime('%H:%M:%S')} {event.event} {summary(event)}"
                  f"  [{event.id or '-'}]")
        sys.stdout.flush()

    try:
        return follow(args, path, show)
    except KeyboardInterrupt:
        return 0


def watch_status(args: argparse.Namespace) -> int:
    """The status table, redrawn on each event that changes what it shows."""
    # (the node's multi-node groups too, as nvpair status shows them, unless one engine)
    path = "/v1/events?types=engine" + (f"&engine={args.name}" if args.name else ",group")
    tty = sys.stdout.isatty()

    def show(event: Sse) -> None:
        if event.event not in ("snapshot", "engine", "group", "bye"):
            return
        if event.event == "bye":
            print("[nvpair is shutting down; waiting for it to come back]", file=sys.stderr)
            return
        doc = call(args, "GET", f"/v1/engines/{args.name}" if args.name else "/v1/engines")
        engines = [doc] if args.name else doc["engines"]
        if tty:
            sys.stdout.write("\x1b[H\x1b[2J")
        if engines:
            print_status(engines)
        from nvpair.cli.groups import print_groups

        groups_shown = not args.name and print_groups(args, blank_line=bool(engines))
        if not engines and not groups_shown:
            print("no engines answer yet")
        if not tty:
            print()
        sys.stdout.flush()

    try:
        return follow(args, path, show)
    except KeyboardInterrupt:
        return 0
