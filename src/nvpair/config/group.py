"""``[engines.group]``: the config of a multi-node group, resolved to ``GroupSettings``.

One config, the same on every node: ``ranks`` names the nodes in rank order (``ranks[0]``
is the head) and each node finds its own rank from its ``node`` name, or from
``NVPAIR_NODE_RANK``. Every mistake is one line naming the key.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from typing import Annotated, Literal

import msgspec

from nvpair.config.cluster import NODE_PATTERN
from nvpair.config.manifest import Base, GroupRole, Manifest, Port, Seconds, StartOrder
from nvpair.errors import CommandError, ConfigError

RANK_ENV = "NVPAIR_NODE_RANK"
#: ranks >= 1 and the head; a group of more than this many nodes is refused (a typo, surely).
MAX_RANKS = 256
Role = Literal["head", "rank"]
NodeName = Annotated[str, msgspec.Meta(pattern=NODE_PATTERN)]


class RestartBackoff(Base, frozen=True):
    initial_s: Seconds = 10.0
    max_s: Seconds = 300.0
    #: the backoff starts again at initial_s once the group has been ready this long.
    reset_after_s: Seconds = 600.0


class MaxRestarts(Base, frozen=True):
    count: Annotated[int, msgspec.Meta(ge=1, le=10_000)] = 10
    per_s: Seconds = 3600.0


class GroupConfig(Base, frozen=True):
    """``[engines.group]`` inside a managed ``[[engines]]`` entry."""

    ranks: Annotated[tuple[NodeName, ...], msgspec.Meta(min_length=2, max_length=MAX_RANKS)]
    dist_port: Port
    #: "auto": this node's index in ranks (NVPAIR_NODE_RANK overrides either).
    rank: Literal["auto"] | Annotated[int, msgspec.Meta(ge=0)] = "auto"
    restart: Literal["group", "head"] = "group"
    rank_lost_grace_s: Seconds = 5.0
    fence_after_s: Seconds = 30.0
    restart_backoff: RestartBackoff = RestartBackoff()
    max_restarts: MaxRestarts = MaxRestarts()


class GroupSettings(msgspec.Struct, frozen=True):
    """A group as this node runs it."""

    name: str
    ranks: tuple[str, ...]
    #: this node's rank (0: the head)
    rank: int
    dist_port: int
    start_order: StartOrder
    head: GroupRole
    member: GroupRole
    restart: Literal["group", "head"] = "group"
    rank_lost_grace_s: float = 5.0
    fence_after_s: float = 30.0
    backoff: RestartBackoff = RestartBackoff()
    max_restarts: MaxRestarts = MaxRestarts()

    @property
    def role(self) -> Role:
        return "head" if self.rank == 0 else "rank"

    @property
    def nnodes(self) -> int:
        return len(self.ranks)

    @property
    def head_node(self) -> str:
        return self.ranks[0]

    @property
    def my_role(self) -> GroupRole:
        return self.head if self.rank == 0 else self.member


def _my_rank(group: GroupConfig, node: str, env: Mapping[str, str], where: str) -> int:
    text = env.get(RANK_ENV, "").strip()
    if text:
        if not re.fullmatch(r"[0-9]{1,4}", text) or int(text) >= len(group.ranks):
            raise ConfigError(f"{RANK_ENV}={text!r}: expected a rank 0-{len(group.ranks) - 1} "
                              f"of {where}.ranks")
        return int(text)
    if group.rank != "auto":
        if group.rank >= len(group.ranks):
            raise ConfigError(f"{where}.rank: {group.rank} is not a rank of ranks "
                              f"(0-{len(group.ranks) - 1})")
        return group.rank
    if node not in group.ranks:
        raise ConfigError(f"{where}.ranks: this node ({node!r}) is in no rank; name it there, "
                          f"set node in the config, or set {RANK_ENV}")
    return group.ranks.index(node)


def resolve_group(group: GroupConfig, *, engine: str, manifest: Manifest, managed: bool,
                  command: tuple[str, ...] | None, values: Mapping[str, object], node: str,
                  env: Mapping[str, str], peers: bool, where: str) -> GroupSettings:
    """``group`` as this node runs it; raises ConfigError (one line) for a group that cannot
    run: duplicate ranks, this node in none, a kind without group roles, no peers, no
    ``managed``, a start template with a placeholder that has no value."""
    where = f"{where}.group"
    seen: set[str] = set()
    for i, name in enumerate(group.ranks):
        if name in seen:
            raise ConfigError(f"{where}.ranks[{i}]: {name!r} is in ranks twice; one node "
                              "runs one rank")
        seen.add(name)
    if manifest.group is None:
        raise ConfigError(f"{where}: the {manifest.kind} manifest has no group roles, so it "
                          "cannot run across nodes (built-in: sglang, vllm, llamacpp)")
    if not managed:
        raise ConfigError(f"{where}: a group needs managed = true (nvpair starts its ranks)")
    if command:
        raise ConfigError(f"{where}: command cannot be used with a group: each role starts "
                          "from the manifest's group.roles (use a manifest file as kind)")
    if not peers:
        raise ConfigError(f"{where}: a group needs peers: set [cluster] and the other nodes "
                          "as [[peers]] (or the etcd backend) on every node")
    rank = _my_rank(group, node, env, where)
    settings = GroupSettings(
        name=engine, ranks=group.ranks, rank=rank, dist_port=group.dist_port,
        start_order=manifest.group.start_order, head=manifest.group.roles.head,
        member=manifest.group.roles.rank, restart=group.restart,
        rank_lost_grace_s=group.rank_lost_grace_s, fence_after_s=group.fence_after_s,
        backoff=group.restart_backoff, max_restarts=group.max_restarts)
    if group.restart_backoff.initial_s > group.restart_backoff.max_s:
        raise ConfigError(f"{where}.restart_backoff: initial_s is above max_s")
    from nvpair.config.command import build_command

    for name, role in (("head", settings.head), ("rank", settings.member)):
        sample = role_values(settings, role, values, rank=0 if name == "head" else 1,
                             dist_host="127.0.0.1", rank_hosts=["127.0.0.1"] * len(group.ranks))
        try:
            build_command(role_manifest(manifest, role), None, sample)
        except CommandError as exc:
            raise ConfigError(f"{where}: role {name}: {exc}") from None
    return settings


#: what stands for a node's own address in a definition (each node has its own)
_ANY_HOST = "<host>"


def definition(group: GroupSettings, manifest: Manifest, values: Mapping[str, object]) -> str:
    """What every node of a group must agree on, as a short digest: its ranks and
    rendezvous port and the command line a rank runs (the rank role's argv and the
    manifest's environment, from the engine's values, with each node's own address left
    out). The head's own arguments are not in it (a rank's process does not change with
    them), nor anything a node sets for itself (its ``env``, ``on_exit``, the timings).
    A reload that changes it on one node leaves the group to wait until the others agree
    (docs/groups.md, "Reload")."""
    from nvpair.config.command import build_command

    own = {**values, "host": _ANY_HOST}
    sample = role_values(group, group.member, own, rank=1, dist_host=_ANY_HOST,
                         rank_hosts=[_ANY_HOST] * group.nnodes)
    try:
        argv, env = build_command(role_manifest(manifest, group.member), None, sample)
    except CommandError:
        argv, env = [], {}
    blob = msgspec.json.encode([group.ranks, group.dist_port, group.start_order, argv,
                                sorted(env.items())])
    return hashlib.sha256(blob).hexdigest()[:16]


def role_manifest(manifest: Manifest, role: GroupRole) -> Manifest:
    """The manifest with the role's start template in place of the engine's own."""
    return msgspec.structs.replace(manifest, start=role.start)


def role_values(group: GroupSettings, role: GroupRole, values: Mapping[str, object], *,
                rank: int, dist_host: str, rank_hosts: list[str]) -> dict[str, object]:
    """The placeholder values of one role: the role's defaults, the engine's values, and
    the group's own (``rank_hosts``: every rank's host, in rank order)."""
    out: dict[str, object] = dict(role.start.defaults)
    out.update(values)
    out.update(rank=rank, nnodes=group.nnodes, dist_port=group.dist_port, dist_host=dist_host,
               dist_addr=f"{_bracket(dist_host)}:{group.dist_port}",
               rank_addrs=",".join(f"{_bracket(h)}:{group.dist_port}" for h in rank_hosts[1:]))
    return out


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host else host
