"""What a reload changes: the running settings against the new ones, engine by engine and
section by section. Pure: it reads two ``Settings`` and says what differs; the service
applies it (docs/lifecycle.md, "Reload").

An engine is one of:

* ``unchanged``: not touched at all (same process, same probes on the same schedule);
* ``restart``: what its process is changed (its kind, address, command line, environment,
  group, activation): drained, stopped and started again (a multi-node group: a new
  epoch, ``group_change``);
* ``update``: something nvpair does about it changed (probes, priority, limits, aliases,
  on-demand and stop settings): taken in place, its process left alone;
* ``added`` or ``removed``.

A managed engine's process is compared by the command line nvpair would run (argv and
environment, from its manifest and config), so an edit that gives the same argv (an
argument moved in the table, a default written out) restarts nothing.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from nvpair.config.command import CommandError, build_command
from nvpair.config.group import definition, role_manifest, role_values
from nvpair.config.settings import EngineSpec, Settings, placeholder_values

Verdict = Literal["unchanged", "restart", "update", "added", "removed"]

#: what makes an engine another engine for nvpair: a change restarts it (adopted: nvpair
#: forgets the old one and adopts the new one; it never signals it)
IDENTITY = ("kind", "host", "port", "managed", "activation")
#: besides IDENTITY, what goes into a managed engine's command line (the argv decides)
PROCESS = ("model", "command", "args", "env", "api_key", "api_key_file", "sleep",
           "sleep_flags", "idle_sleep_s", "sleep_level", "manifest")
#: besides the command line, what a managed engine is started with: its output goes to a
#: pipe (stop) or to its own file (keep), so a change takes a restart
STARTED_WITH = ("on_exit",)

#: the settings outside the engines, by the name a reload says they are (``sections``)
SECTIONS: dict[str, tuple[str, ...]] = {
    "listen": ("listen_host", "listen_port"),
    "state_dir": ("state_dir",),
    "node": ("node",),
    "keys": ("token", "keys"),
    "allowed_hosts": ("allowed_hosts",),
    "peers": ("cluster",),
    "router": ("router",),
    "activation": ("activation",),
    "memory": ("memory",),
    "sweep": ("sweep_deadline_s",),
    "log_rate": ("log_lines_per_s", "log_bytes_per_s"),
    "log": ("log_format", "access_log"),
    "log_dir": ("log_dir",),
    "http": ("keep_alive_s", "max_connections", "max_streams", "header_timeout_s",
             "body_timeout_s"),
    "tracing": ("tracing",),
}
#: sections a reload cannot change, and why (the line a refused reload answers)
REFUSED = {
    "listen": "listen changed: a reload cannot move the API; restart nvpair",
    "state_dir": ("state_dir changed: the engines' records stay where nvpair started; "
                  "restart nvpair"),
    "node": "node changed: peers know this node by its name; restart nvpair",
}


class EngineChange(msgspec.Struct, frozen=True):
    """One engine's verdict and the fields that differ (spec field names)."""

    name: str
    verdict: Verdict
    fields: tuple[str, ...] = ()


class ConfigDiff(msgspec.Struct, frozen=True):
    """Every engine's verdict (the running order, then the added ones), the sections
    outside the engines that changed, and why the reload is refused (empty: it is not)."""

    engines: tuple[EngineChange, ...]
    sections: tuple[str, ...] = ()
    refused: tuple[str, ...] = ()

    def named(self, verdict: Verdict) -> list[EngineChange]:
        return [e for e in self.engines if e.verdict == verdict]

    @property
    def empty(self) -> bool:
        return not self.sections and all(e.verdict == "unchanged" for e in self.engines)

    def summary(self) -> str:
        """One line: "reload: 1 added (qwen), 1 restarted (gemma: args), 1 removed (old),
        12 unchanged" (and the sections: "; router, keys applied")."""
        words = {"added": "added", "restart": "restarted", "update": "updated",
                 "removed": "removed"}
        parts = []
        for verdict, word in words.items():
            changes = self.named(verdict)  # type: ignore[arg-type]
            if changes:
                names = ", ".join(f"{c.name}: {', '.join(c.fields)}" if c.fields else c.name
                                  for c in changes)
                parts.append(f"{len(changes)} {word} ({names})")
        parts.append(f"{len(self.named('unchanged'))} unchanged")
        line = "reload: " + ", ".join(parts)
        if self.sections:
            line += f"; {', '.join(self.sections)} applied"
        return line

    def doc(self) -> dict[str, object]:
        """The JSON a reload answers: each verdict's engines (with what changed), the
        unchanged count, the sections applied, and the summary line."""
        doc: dict[str, object] = {
            verdict: {c.name: list(c.fields) for c in self.named(verdict)}
            for verdict in ("added", "restart", "update", "removed")}
        doc["unchanged"] = len(self.named("unchanged"))
        doc["sections"] = list(self.sections)
        doc["summary"] = self.summary()
        return doc


def diff(old: Settings, new: Settings) -> ConfigDiff:
    """What changes from ``old`` to ``new``. ``refused`` holds a line per section a reload
    cannot change (``REFUSED``); the service then changes nothing."""
    before = {e.name: e for e in old.engines}
    after = {e.name: e for e in new.engines}
    changes = [engine_change(spec, after.get(name)) for name, spec in before.items()]
    changes += [EngineChange(name, "added") for name in after if name not in before]
    sections = tuple(name for name, fields in SECTIONS.items()
                     if any(getattr(old, f) != getattr(new, f) for f in fields))
    refused = [REFUSED[s] for s in sections if s in REFUSED]
    # a setting no section names (one added since) is never dropped without a word
    covered = {f for fields in SECTIONS.values() for f in fields} | {"source", "engines"}
    refused += [f"{f} changed: a reload cannot apply it; restart nvpair"
                for f in old.__struct_fields__
                if f not in covered and getattr(old, f) != getattr(new, f)]
    return ConfigDiff(tuple(changes), tuple(s for s in sections if s not in REFUSED),
                      tuple(refused))


def engine_change(old: EngineSpec, new: EngineSpec | None) -> EngineChange:
    """One engine's verdict (``new`` None: removed)."""
    if new is None:
        return EngineChange(old.name, "removed")
    if old == new:
        return EngineChange(old.name, "unchanged")
    fields = tuple(f for f in old.__struct_fields__ if getattr(old, f) != getattr(new, f))
    if old.group is not None or new.group is not None:
        return group_change(old, new, fields)
    identity = tuple(f for f in fields if f in IDENTITY)
    if identity:
        return EngineChange(old.name, "restart", identity)
    if old.managed and command_line(old) != command_line(new):
        named = tuple(f for f in fields if f in PROCESS and f != "manifest")
        return EngineChange(old.name, "restart", named or ("manifest",))
    started = tuple(f for f in fields if f in STARTED_WITH)
    if old.managed and started:
        return EngineChange(old.name, "restart", started)
    return EngineChange(old.name, "update", fields)


def group_change(old: EngineSpec, new: EngineSpec, fields: tuple[str, ...]) -> EngineChange:
    """A multi-node group's verdict on this node: ``restart`` (a new epoch) when what its
    processes run changed here (the group's ``definition``, this node's rank, or this
    node's own command line: the head's, or the rank's and its ``on_exit``), else
    ``update`` (its timings, backoff, fencing, probes: taken in place). The head's engine
    as the fleet runs it (adopted, ``managed`` false) restarts only for its address or
    kind: its process is the group runner's."""
    if old.group is None or new.group is None or old.group.rank != new.group.rank:
        return EngineChange(old.name, "restart", ("group",))
    identity = tuple(f for f in fields if f in IDENTITY)
    if identity:
        return EngineChange(old.name, "restart", identity)
    if old.managed and group_process(old) != group_process(new):
        named = tuple(f for f in fields if f in (*PROCESS, *STARTED_WITH, "group")
                      and f != "manifest")
        return EngineChange(old.name, "restart", named or ("manifest",))
    return EngineChange(old.name, "update", fields)


def group_process(spec: EngineSpec) -> tuple[object, ...]:
    """What a group's processes are, as this node starts them: the group's definition,
    this node's rank, its role's command line (sample addresses, as ``nvpair check``
    builds it) and, on a rank, how its output goes (``on_exit``)."""
    group = spec.group
    assert group is not None
    values = placeholder_values(spec)
    role = group.my_role
    try:
        argv, env = build_command(role_manifest(spec.manifest, role), None, role_values(
            group, role, values, rank=group.rank, dist_host="127.0.0.1",
            rank_hosts=["127.0.0.1"] * group.nnodes))
    except CommandError:
        argv, env = [], {}
    return (definition(group, spec.manifest, values), group.rank, tuple(argv),
            tuple(sorted({**env, **spec.env}.items())),
            spec.on_exit if group.rank else None)


def command_line(spec: EngineSpec) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    """What a managed engine's process is started with: its argv and its environment (the
    manifest's and the config's); a template that cannot be built is compared as empty."""
    try:
        argv, env = build_command(spec.manifest, spec.command, placeholder_values(spec))
    except CommandError:
        argv, env = [], {}
    return tuple(argv), tuple(sorted({**env, **spec.env}.items()))
