"""``nvpair check``: validate the configuration and say what nvpair would do."""

from __future__ import annotations

import os
import re
import shlex
import sys

import msgspec

from nvpair.cli.memory import size
from nvpair.cli.preflight import findings
from nvpair.cli.table import render
from nvpair.config.cluster import PeerTarget
from nvpair.config.command import SECRET_ENV, build_command
from nvpair.config.keys import KeySpec
from nvpair.config.settings import EngineSpec, Settings, placeholder_values

#: environment names whose values ``check`` never prints
_SECRET_NAME = re.compile(r"TOKEN|KEY|SECRET|PASS|CREDENTIAL|AUTH", re.IGNORECASE)


def steady_rate_per_hour(engine: EngineSpec) -> float:
    """Requests per hour an engine gets from nvpair once ready (``ready`` stops then)."""
    return sum(3600.0 / p.interval_s for n, p in engine.probes.named() if n != "ready")


def command_of(e: EngineSpec) -> dict[str, object] | None:
    """A managed engine's exact argv and the environment set on top of nvpair's own, with
    secrets shown as ``***`` (None for an adopted engine)."""
    if not e.managed:
        return None
    argv, extra = build_command(e.manifest, e.command, placeholder_values(e))
    secret = e.api_key
    shown = ["***" if secret and secret in part else part for part in argv]
    env = {**extra, **e.env}
    masked = {k: "***" if _SECRET_NAME.search(k) or (secret and secret in v) else v
              for k, v in sorted(env.items())}
    return {"argv": shown, "env": masked, "cwd": os.getcwd()}


def activation_of(e: EngineSpec) -> dict[str, object]:
    return {"activation": e.activation, "priority": e.priority,
            "memory_bytes": "measured" if e.memory_bytes is None else e.memory_bytes,
            "idle_unload_s": e.idle_unload_s}


def report(settings: Settings) -> dict[str, object]:
    engines = []
    for e in _local(settings).engines:
        engines.append(
            {
                "name": e.name,
                "kind": e.kind,
                "managed": e.managed,
                "on_exit": e.on_exit if e.managed else None,
                "command": command_of(e),
                **activation_of(e),
                "group": None if e.group is None else e.group.name,
                "url": e.url,
                "model": e.model,
                "optional": e.optional,
                "probes_per_hour": round(steady_rate_per_hour(e)),
                "probes": {
                    n: {
                        "method": p.method,
                        "path": p.path,
                        "cost": p.cost,
                        "interval_s": p.interval_s,
                        "timeout_s": p.timeout_s,
                        "per_hour": round(3600 / p.interval_s),
                    }
                    for n, p in e.probes.named()
                },
            }
        )
    return {
        "config": settings.source,
        "listen": f"{settings.listen_host}:{settings.listen_port}",
        "node": settings.node,
        "token": bool(settings.keys),
        "keys": [key_part(k) for k in settings.keys],
        "peers": [p.url for p in _peers(settings)],
        "engines": engines,
        "groups": [group_part(e) for e in settings.engines if e.group is not None],
        "memory_budget_bytes": settings.activation.memory_budget_bytes,
        "findings": [{"level": f.level, "text": f.text} for f in findings(settings)],
    }


def key_part(k: KeySpec) -> dict[str, object]:
    """What ``nvpair check`` shows of a key: never its token (docs/keys.md)."""
    return {"name": k.name, "role": k.role, "token_file": k.path, "priority": k.priority,
            "max_in_flight": k.max_in_flight, "requests_per_minute": k.requests_per_minute,
            "models": None if k.models is None else list(k.models)}


def _print_keys(settings: Settings) -> None:
    if not settings.keys:
        return
    rows = [(k.name, k.role, k.priority, "-" if k.max_in_flight is None else k.max_in_flight,
             "-" if k.requests_per_minute is None else k.requests_per_minute,
             "all" if k.models is None else ", ".join(k.models), k.path)
            for k in settings.keys]
    print(render(("KEY", "ROLE", "PRIORITY", "IN FLIGHT", "PER MINUTE", "MODELS", "TOKEN FILE"),
                 rows))
    print()


def _local(settings: Settings) -> Settings:
    """What this node runs as engines: a group's engine is adopted on its head (its group
    runner starts the process) and absent on its ranks (``Groups.local``)."""
    from nvpair.peers.groups import Groups

    return Groups(settings).local(settings)


def group_part(e: EngineSpec) -> dict[str, object]:
    """This node's part of ``e``'s group (docs/groups.md)."""
    g = e.group
    assert g is not None
    role = g.my_role
    probe = None
    if g.rank != 0 and role.ready == "probe" and role.probe is not None:
        probe = {"method": role.probe.method, "path": role.probe.path,
                 "interval_s": role.probe.interval_s, "timeout_s": role.probe.timeout_s,
                 "per_hour": round(3600 / role.probe.interval_s)}
    return {"name": g.name, "role": g.role, "rank": g.rank, "head": g.head_node,
            "ranks": list(g.ranks), "start_order": g.start_order,
            "ready": "engine probes" if g.rank == 0 else role.ready, "probe": probe}


def _group_line(part: dict[str, object]) -> str:
    ranks = part["ranks"]
    assert isinstance(ranks, list)
    of = f"of {len(ranks)}: {', '.join(ranks)}"
    if part["role"] == "head":
        return (f"group {part['name']}: this node is its head (rank 0 {of})\n  its engine "
                "(below) is started by the group and probed as any engine of its kind")
    probe = part["probe"]
    if isinstance(probe, dict):
        ready = (f"ready by {probe['method']} {probe['path']} every {probe['interval_s']:g}s "
                 f"(about {probe['per_hour']} requests per hour once ready)")
    elif part["ready"] == "listen":
        ready = "ready when its socket listens (read from /proc, never connected to)"
    else:
        ready = "ready while its process runs"
    return (f"group {part['name']}: this node is rank {part['rank']} ({of}), run for the "
            f"head {part['head']}\n  no engine of its own here; its process is {ready}")


def _peers(settings: Settings) -> tuple[PeerTarget, ...]:
    return settings.cluster.peers if settings.cluster is not None else ()


def run(settings: Settings, *, as_json: bool, show_commands: bool = False) -> int:
    """Print the report; 2 when something would fail at ``serve`` (an ``error:`` line)."""
    if as_json:
        doc = report(settings)
        sys.stdout.write(msgspec.json.encode(doc).decode() + "\n")
        found = doc["findings"]
        assert isinstance(found, list)
        return 2 if any(f["level"] == "error" for f in found) else 0
    _print_report(settings, show_commands=show_commands)
    found = findings(settings)
    sys.stdout.flush()
    for f in found:
        print(f, file=sys.stderr)
    return 2 if any(f.level == "error" for f in found) else 0


def _print_report(settings: Settings, *, show_commands: bool) -> None:
    auth = (f"bearer token required: {len(settings.keys)} key"
            f"{'s' if len(settings.keys) != 1 else ''}" if settings.keys
            else "no token (loopback only)")
    print(f"config   {settings.source}")
    print(f"listen   http://{settings.listen_host}:{settings.listen_port}  ({auth})")
    print(f"node     {settings.node}")
    if peers := _peers(settings):
        print(f"peers    {', '.join(p.url for p in peers)}")
    print()
    _print_keys(settings)
    parts = [group_part(e) for e in settings.engines if e.group is not None]
    for part in parts:
        print(_group_line(part))
    if parts:
        print()
    settings = _local(settings)
    if not settings.engines:
        print("no engines run here" if parts else "no engines configured")
        return
    rows = []
    for e in settings.engines:
        mode = "managed" if e.managed else ("adopt if found" if e.optional else "adopted")
        if e.activation == "on_demand":
            mode = "managed, on demand"
        if e.managed and e.on_exit == "keep":  # (docs/lifecycle.md)
            mode += ", kept on exit"
        if e.group is not None:
            mode = f"head of group {e.group.name}"
        rows.append((e.name, e.kind, mode, e.url, e.model or "(as served)"))
    print(render(("ENGINE", "KIND", "MODE", "URL", "MODEL"), rows))
    print()
    _print_on_demand(settings)
    if show_commands:
        _print_commands(settings)
    prow: list[tuple[object, ...]] = []
    colours: list[list[str | None]] = []
    for e in settings.engines:
        for n, p in e.probes.named():
            per_hour = "until ready" if n == "ready" else f"{3600 / p.interval_s:.0f}"
            prow.append(
                (e.name, n, f"{p.method} {p.path}", p.cost, f"{p.interval_s:g}s",
                 f"{p.timeout_s:g}s", per_hour)
            )
            cost_colour = {"cheap": None, "queued": "yellow", "generating": "red"}[p.cost]
            colours.append([None, None, None, cost_colour, None, None, None])
    print(render(("ENGINE", "PROBE", "REQUEST", "COST", "EVERY", "TIMEOUT", "PER HOUR"), prow,
                 colours=colours))
    print()
    for e in settings.engines:
        print(f"{e.name}: about {steady_rate_per_hour(e):.0f} probe requests per hour once ready")


def _print_on_demand(settings: Settings) -> None:
    """The on-demand engines: the budget they share, and each one's priority, footprint
    and idle unload (docs/on-demand.md)."""
    on_demand = [e for e in settings.engines if e.activation == "on_demand"]
    if not on_demand:
        return
    a = settings.activation
    budget = a.memory_budget_bytes
    shown = ("auto (free memory less the reserve)" if budget == "auto"
             else f"{size(budget)} ({budget:,} bytes)")
    print(f"on demand: started by a request, memory budget {shown}, queue {a.queue_max} "
          f"requests per key and model for up to {a.queue_wait_s:g} s (a level of priority "
          f"every {a.priority_age_s:g} s waited)")
    if a.swap_batch or a.min_residency_s:
        print(f"  swap batching: a loaded engine serves {a.swap_batch} requests and stays "
              f"{a.min_residency_s:g} s before a swap, unless a request waited "
              f"{a.max_swap_wait_s:g} s")
    for e in on_demand:
        footprint = ("measured once it runs" if e.memory_bytes is None
                     else f"{size(e.memory_bytes)} ({e.memory_bytes:,} bytes)")
        idle = (f"unloaded after {e.idle_unload_s:g} s idle" if e.idle_unload_s
                else "never unloaded for idleness")
        print(f"  {e.name}: priority {e.priority}, footprint {footprint}, {idle}")
    print()


def _print_commands(settings: Settings) -> None:
    managed = [(e, command_of(e)) for e in settings.engines if e.managed]
    if not managed:
        print("no managed engines: nvpair starts no program")
        print()
        return
    hidden = ", ".join(sorted(SECRET_ENV))
    print(f"commands (run without a shell in {os.getcwd()}; the environment is nvpair's own "
          f"without {hidden}, plus the keys shown)")
    for e, cmd in managed:
        assert cmd is not None
        argv, env = cmd["argv"], cmd["env"]
        assert isinstance(argv, list) and isinstance(env, dict)
        print(f"  {e.name}: {' '.join(_quoted(a) for a in argv)}")
        if env:
            print(f"  {' ' * len(e.name)}  env: "
                  + ", ".join(f"{k}={v}" for k, v in env.items()))
    print()


def _quoted(arg: str) -> str:
    """An argument as a shell would need it to be one word (for reading; nvpair runs no
    shell)."""
    return shlex.quote(arg)
