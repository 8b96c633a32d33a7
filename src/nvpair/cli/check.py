"""``nvpair check``: validate the configuration and say what nvpair would do."""

from __future__ import annotations

import sys

import msgspec

from nvpair.cli.table import render
from nvpair.cluster import PeerTarget
from nvpair.command import key_in_argv
from nvpair.config import EngineSpec, Settings


def steady_rate_per_hour(engine: EngineSpec) -> float:
    """Requests per hour an engine gets from nvpair once ready (``ready`` stops then)."""
    return sum(3600.0 / p.interval_s for n, p in engine.probes.named() if n != "ready")


def report(settings: Settings) -> dict[str, object]:
    engines = []
    for e in _local(settings).engines:
        engines.append(
            {
                "name": e.name,
                "kind": e.kind,
                "managed": e.managed,
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
        "token": settings.token is not None,
        "peers": [p.url for p in _peers(settings)],
        "engines": engines,
        "groups": [group_part(e) for e in settings.engines if e.group is not None],
        "warnings": key_warnings(settings),
    }


def key_warnings(settings: Settings) -> list[str]:
    """One line for each engine nvpair starts that gets its API key in its argv."""
    from nvpair.group.spec import role_manifest

    lines = []
    for e in _local(settings).engines:
        if e.api_key is None or not (e.managed or e.group is not None):
            continue
        # a group's head: its group starts the process, from the role's template
        manifest = e.manifest if e.group is None else role_manifest(e.manifest, e.group.head)
        command = e.command if e.group is None else None
        if key_in_argv(manifest, command):
            how = ("its command has {api_key}" if command else
                   f"the {e.kind} manifest passes {{api_key}} as an argument"
                   + ("; SGLang takes its key no other way" if e.kind == "sglang" else ""))
            lines.append(f"warning: engine {e.name}: its API key is on the engine's command "
                         f"line ({how}), where any local user can read it (ps, "
                         "/proc/PID/cmdline)")
    return lines


def _local(settings: Settings) -> Settings:
    """What this node runs as engines: a group's engine is adopted on its head (its group
    runner starts the process) and absent on its ranks (``Groups.local``)."""
    from nvpair.group.link import Groups

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


def run(settings: Settings, *, as_json: bool) -> int:
    for line in key_warnings(settings):
        print(line, file=sys.stderr)
    if as_json:
        sys.stdout.write(msgspec.json.encode(report(settings)).decode() + "\n")
        return 0
    auth = "bearer token required" if settings.token else "no token (loopback only)"
    print(f"config   {settings.source}")
    print(f"listen   http://{settings.listen_host}:{settings.listen_port}  ({auth})")
    print(f"node     {settings.node}")
    if peers := _peers(settings):
        print(f"peers    {', '.join(p.url for p in peers)}")
    print()
    parts = [group_part(e) for e in settings.engines if e.group is not None]
    for part in parts:
        print(_group_line(part))
    if parts:
        print()
    settings = _local(settings)
    if not settings.engines:
        print("no engines run here" if parts else "no engines configured")
        return 0
    rows = []
    for e in settings.engines:
        mode = "managed" if e.managed else ("adopt if found" if e.optional else "adopted")
        if e.group is not None:
            mode = f"head of group {e.group.name}"
        rows.append((e.name, e.kind, mode, e.url, e.model or "(as served)"))
    print(render(("ENGINE", "KIND", "MODE", "URL", "MODEL"), rows))
    print()
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
    return 0
