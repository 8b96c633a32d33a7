"""Commands that talk to a running nvpair: status, models, start, stop, restart, drain, wake,
sleep, logs."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any
from urllib.parse import quote

import httpx2
import msgspec

from nvpair.cli.memory import TREND_COLOURS, trend_cell
from nvpair.cli.table import STATE_COLOURS, render
from nvpair.config.settings import find_config_path, load_settings, url_host
from nvpair.errors import ConfigError, InputError


def base_url(args: argparse.Namespace) -> tuple[str, str | None]:
    """nvpair's URL and token: --url, else the config's listen address and admin key."""
    token = os.environ.get("NVPAIR_TOKEN")
    if args.url:
        return args.url.rstrip("/"), token
    if find_config_path(args.config) is None:
        return "http://127.0.0.1:14322", token
    settings = load_settings(args.config)
    host = "127.0.0.1" if settings.listen_host in ("0.0.0.0", "::") else settings.listen_host
    host = url_host(host)
    # the config's own key: token_file, else the first admin key (the CLI stops engines)
    admin = next((k.token for k in settings.keys if k.role == "admin"), None)
    return f"http://{host}:{settings.listen_port}", token or admin


def call(args: argparse.Namespace, method: str, path: str, *, timeout: float = 10.0) -> Any:
    status, doc = answer(args, method, path, timeout=timeout)
    if status >= 400:
        message = doc.get("error", {}).get("message") if isinstance(doc, dict) else None
        raise InputError(f"{method} {path}: {status}: {message or doc}")
    return doc


def answer(args: argparse.Namespace, method: str, path: str, *, timeout: float = 10.0
           ) -> tuple[int, Any]:
    """nvpair's answer to one request: its status and its JSON body (InputError when it
    cannot be reached or answers other than JSON)."""
    url, token = base_url(args)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        response = httpx2.request(method, url + path, headers=headers, timeout=timeout,
                                  trust_env=False)
    except httpx2.ConnectError:
        raise InputError(f"cannot reach nvpair at {url} (is `nvpair serve` running?)") from None
    except (httpx2.HTTPError, httpx2.InvalidURL) as exc:
        raise InputError(f"{method} {url}{path}: {exc}") from None
    try:
        doc = msgspec.json.decode(response.content)
    except msgspec.DecodeError:
        raise InputError(
            f"{method} {url}{path}: answered {response.status_code}, not JSON") from None
    return response.status_code, doc


def _age(value: float | None) -> str:
    if value is None:
        return "-"
    if value < 60:
        return f"{value:.1f}s"
    return f"{value / 60:.0f}m"


#: the header of ``nvpair status`` (README.md shows it; tests/test_docs.py holds the two
#: together)
STATUS_HEADER = ("ENGINE", "KIND", "STATE", "MODELS", "CHECKED", "PROBES", "RESTARTS", "QUEUE",
                 "MEMORY", "ERROR")


def shown_state(e: dict[str, Any]) -> str:
    """The STATE cell: ``draining`` while an up engine admits no new request (its drain,
    then stop or restart), else the engine's state."""
    if e.get("admitting") is False and e["state"] in ("ready", "stale", "starting"):
        return "draining"
    return str(e["state"])


def shown_error(e: dict[str, Any]) -> str:
    """The ERROR cell: a refused probe while an engine starts is how a loading engine looks
    (vLLM and SGLang open their port once the model is loaded), not an error."""
    error = str(e["error"] or "")
    if e["state"] == "starting" and error.startswith("cannot connect"):
        return "not listening yet (loading)"
    return error


def _queue(e: dict[str, Any]) -> str:
    """Requests waiting for this engine (to start, or to finish its drain), and the oldest
    one's wait."""
    queued = e.get("queued") or 0
    if not queued:
        return "-"
    oldest = e.get("queued_oldest_s")
    return f"{queued} ({_age(oldest)})" if oldest is not None else str(queued)


def print_status(engines: list[dict[str, Any]]) -> None:
    rows, colours = [], []
    for e in engines:
        health = e["probes"].get("health") or e["probes"].get("ready") or {}
        state = shown_state(e)
        rows.append((e["name"], e["kind"], state, ", ".join(e["models"]) or "-",
                     _age(e["checked_age_s"]), str(health.get("requests", 0)),
                     str(e["restarts"]), _queue(e), trend_cell(e.get("memory")),
                     shown_error(e)))
        colours.append([None, None, STATE_COLOURS.get(state), None, None, None, None, None,
                        TREND_COLOURS.get(trend_cell(e.get("memory"))), "dim"])
    print(render(STATUS_HEADER, rows, colours=colours))


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except (KeyError, TypeError, AttributeError):  # JSON, but not nvpair's
        url, _ = base_url(args)
        raise InputError(f"{url} does not answer like nvpair (an engine's URL?)") from None


def _run(args: argparse.Namespace) -> int:
    cmd = args.command
    if cmd == "events" or (cmd == "status" and args.watch and not args.json):
        from nvpair.cli import events

        return events.run_events(args) if cmd == "events" else events.watch_status(args)
    if cmd == "status":
        doc = call(args, "GET", f"/v1/engines/{args.name}" if args.name else "/v1/engines")
        engines = [doc] if args.name else doc["engines"]
        if args.json:
            print(msgspec.json.encode(doc).decode())
            return 0
        if engines:
            print_status(engines)
        from nvpair.cli.groups import print_groups

        # a rank of a multi-node group has no engine of its own: its groups table says why
        groups_shown = not args.name and print_groups(args, blank_line=bool(engines))
        if not engines and not groups_shown:
            print("no engines answer yet")
        return 0
    if cmd == "models":
        doc = call(args, "GET", "/v1/models?scope=cluster" if args.cluster else "/v1/models")
        if args.json:
            print(msgspec.json.encode(doc).decode())
            return 0
        rows = [(m["id"], m["nvpair"]["engine"], m["nvpair"].get("node", ""), m["nvpair"]["state"])
                for m in doc["data"]]
        print(render(("MODEL", "ENGINE", "NODE", "STATE"), rows) if rows else "no models listed")
        return 0
    if cmd == "wake":  # an engine's name, else a model's id (docs/sleep.md)
        doc = wake(args)
        print(f"{args.name}: wake accepted ({doc.get('operation')}); engine {doc.get('name')} "
              f"{doc.get('state')}")
        return 0
    if cmd in ("start", "stop", "restart", "drain", "sleep"):
        doc = call(args, "POST", f"/v1/engines/{args.name}/{cmd}")
        print(f"{args.name}: {cmd} accepted ({doc.get('operation')}); state {doc.get('state')}")
        return 0
    if cmd == "reload":  # (a bad config: the server's one line, exit 2, nothing changed)
        return reload(args)
    if cmd == "logs":
        return follow_logs(args)
    if cmd == "memory":
        from nvpair.cli import memory

        return memory.run(args)
    if cmd == "groups":
        from nvpair.cli import groups

        return groups.run(args)
    raise ConfigError(f"unknown command {cmd}")


def reload(args: argparse.Namespace) -> int:
    """``nvpair reload``: its summary line. The key it sends is the config's (or
    ``NVPAIR_TOKEN``), so a reload that changes the admin key is refused by the running
    nvpair, which knows only the old one: the error says how to ask it then."""
    status, doc = answer(args, "POST", "/v1/admin/reload", timeout=60.0)
    if status == 401:
        raise InputError("POST /v1/admin/reload: 401: the running nvpair did not take the "
                         "key sent (the config's admin key, or NVPAIR_TOKEN); a reload that "
                         "changes or removes that key is asked with the running one: give it "
                         "in NVPAIR_TOKEN, or send nvpair SIGHUP (systemctl reload nvpair)")
    if status >= 400:
        message = doc.get("error", {}).get("message") if isinstance(doc, dict) else None
        raise InputError(f"POST /v1/admin/reload: {status}: {message or doc}")
    print(doc["summary"])
    return 0


def wake(args: argparse.Namespace) -> Any:
    """``nvpair wake NAME``: the engine NAME; when no engine has that name, the model NAME
    (``POST /v1/models/{id}/wake``: its engine, or a multi-model engine's load of it)."""
    path = f"/v1/engines/{quote(args.name, safe='')}/wake"
    status, doc = answer(args, "POST", path)
    if status == 404 and _code(doc) == "engine_not_found":
        path = f"/v1/models/{quote(args.name, safe='/')}/wake"
        status, doc = answer(args, "POST", path)
        if status == 404:
            raise InputError(f"no engine or model named {args.name!r} on this node")
    if status >= 400:
        raise InputError(f"POST {path}: {status}: {_message(doc)}")
    return doc


def _code(doc: Any) -> object:
    return doc.get("error", {}).get("code") if isinstance(doc, dict) else None


def _message(doc: Any) -> object:
    return (doc.get("error", {}).get("message") if isinstance(doc, dict) else None) or doc


#: How long one ``logs -f`` request waits for a new line before it asks again.
FOLLOW_WAIT_S = 10


def follow_logs(args: argparse.Namespace) -> int:
    doc = call(args, "GET", f"/v1/engines/{args.name}/logs?tail={max(1, args.tail)}")
    _print_lines(doc)
    while doc.get("more"):  # an answer holds at most 4 MB: the next page
        doc = call(args, "GET", f"/v1/engines/{args.name}/logs?after={doc['next']}")
        _print_lines(doc)
    if not args.follow:
        return 0
    try:
        while True:
            doc = call(args, "GET", f"/v1/engines/{args.name}/logs?after={doc['next']}"
                       f"&wait_s={FOLLOW_WAIT_S}", timeout=FOLLOW_WAIT_S + 10.0)
            _print_lines(doc)
    except KeyboardInterrupt:
        return 0


def _print_lines(doc: dict[str, Any]) -> None:
    if doc.get("missed"):
        print(f"[nvpair: {doc['missed']} lines came and went faster than they were read]",
              file=sys.stderr)
    for line in doc["lines"]:
        print(line)
    sys.stdout.flush()
