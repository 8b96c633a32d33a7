"""``[engines.group]``: this node's rank from its name or NVPAIR_NODE_RANK, the roles'
templates from the manifest, and a one-line error for every group that cannot run."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nvpair.config.command import build_command
from nvpair.config.group import RANK_ENV, role_manifest, role_values
from nvpair.config.manifest import decode_manifest, load_manifest
from nvpair.config.settings import decode_config, resolve
from nvpair.errors import ConfigError, ManifestError

PEERS = """
[cluster]
token_file = "token"
[[peers]]
url = "http://127.0.0.1:1"
"""


def config(tmp_path: Path, *, node: str = "spark-2", kind: str = "sglang", group: str = "",
           peers: bool = True, extra: str = "managed = true\n", receive_only: bool = False
           ) -> str:
    (tmp_path / "token").write_text("secret\n")
    cluster = '[cluster]\ntoken_file = "token"\n' if receive_only else ""
    return (f'node = "{node}"\n' + (PEERS if peers else cluster)
            + f'[[engines]]\nname = "big"\nkind = "{kind}"\nmodel = "m"\n{extra}'
            + '[engines.args]\ntp = 4\n[engines.group]\n'
            + (group or 'ranks = ["spark-1", "spark-2", "spark-3"]\ndist_port = 50000\n'))


def settings(tmp_path: Path, **kw: object):
    text = config(tmp_path, **kw)  # type: ignore[arg-type]
    return resolve(decode_config(text.encode(), "n.toml"), "n.toml", tmp_path)


def error(tmp_path: Path, **kw: object) -> str:
    with pytest.raises(ConfigError) as info:
        settings(tmp_path, **kw)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_the_rank_is_the_nodes_place_in_ranks(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv(RANK_ENV, raising=False)
    g = settings(tmp_path).engines[0].group
    assert g is not None and (g.rank, g.role, g.nnodes, g.head_node) == (1, "rank", 3, "spark-1")
    head = settings(tmp_path, node="spark-1").engines[0].group
    assert head is not None and head.role == "head" and head.restart == "group"
    assert (head.rank_lost_grace_s, head.fence_after_s) == (5.0, 30.0)
    assert (head.backoff.initial_s, head.backoff.max_s, head.backoff.reset_after_s) == (
        10.0, 300.0, 600.0)
    assert (head.max_restarts.count, head.max_restarts.per_s) == (10, 3600.0)


def test_the_environment_overrides_the_name(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(RANK_ENV, "2")
    g = settings(tmp_path, node="somewhere-else").engines[0].group
    assert g is not None and g.rank == 2
    monkeypatch.setenv(RANK_ENV, "3")
    assert error(tmp_path) == (
        f"{RANK_ENV}='3': expected a rank 0-2 of n.toml: engines[0].group.ranks")


@pytest.mark.parametrize(("kw", "expected"), [
    ({"node": "laptop"}, "n.toml: engines[0].group.ranks: this node ('laptop') is in no rank;"),
    ({"group": 'ranks = ["a", "spark-2", "a"]\ndist_port = 1\n'},
     "n.toml: engines[0].group.ranks[2]: 'a' is in ranks twice"),
    ({"kind": "ollama"}, "n.toml: engines[0].group: the ollama manifest has no group roles"),
    ({"peers": False}, "n.toml: engines[0].group: a group needs peers"),
    ({"peers": False, "receive_only": True}, "n.toml: engines[0].group: a group needs peers"),
    ({"extra": 'managed = true\nactivation = "on_demand"\n'},
     "n.toml: engines[0].activation: a group runs always"),
    ({"extra": ""}, "n.toml: engines[0].group: a group needs managed = true"),
    ({"extra": 'managed = true\ncommand = ["x"]\n'},
     "n.toml: engines[0].group: command cannot be used with a group"),
    ({"group": 'ranks = ["spark-2"]\ndist_port = 1\n'}, "n.toml: engines[0].group.ranks:"),
    ({"group": 'ranks = ["spark-1", "spark-2"]\n'}, "dist_port"),
    ({"group": 'ranks = ["spark-1", "spark-2"]\ndist_port = 1\nrank = 5\n'},
     "n.toml: engines[0].group.rank: 5 is not a rank of ranks (0-1)"),
    ({"group": 'ranks = ["spark-1", "spark-2"]\ndist_port = 1\nrestart = "some"\n'},
     "engines[0].group.restart"),
    ({"group": 'ranks = ["spark-1", "spark-2"]\ndist_port = 1\n'
               'restart_backoff = {initial_s = 400}\n'},
     "n.toml: engines[0].group.restart_backoff: initial_s is above max_s"),
])
def test_a_group_that_cannot_run_is_one_line(tmp_path: Path, monkeypatch, kw, expected) -> None:
    monkeypatch.delenv(RANK_ENV, raising=False)
    assert expected in error(tmp_path, **kw)


@given(st.text(max_size=8))
def test_any_rank_variable_is_a_rank_or_one_line(tmp_path_factory, text: str) -> None:
    tmp_path = tmp_path_factory.mktemp("c")
    import os
    old = os.environ.get(RANK_ENV)
    try:
        if "\0" in text:
            return
        os.environ[RANK_ENV] = text
        try:
            g = settings(tmp_path).engines[0].group
        except ConfigError as exc:
            assert "\n" not in str(exc) and RANK_ENV in str(exc)
        else:
            assert g is not None and 0 <= g.rank < 3
            assert g.rank == (int(text) if text.strip() else 1)
    finally:
        if old is None:
            os.environ.pop(RANK_ENV, None)
        else:
            os.environ[RANK_ENV] = old


@pytest.mark.parametrize(("kind", "order", "rank_ready"), [
    ("sglang", "together", "probe"), ("vllm", "head_first", "process"),
    ("llamacpp", "ranks_first", "listen")])
def test_builtin_roles(kind: str, order: str, rank_ready: str) -> None:
    m = load_manifest(kind)
    assert m.group is not None
    assert (m.group.start_order, m.group.roles.rank.ready) == (order, rank_ready)


def test_role_templates_fill_the_groups_placeholders(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv(RANK_ENV, raising=False)
    spec = settings(tmp_path, node="spark-1", kind="llamacpp").engines[0]
    g = spec.group
    assert g is not None
    hosts = ["10.0.0.1", "10.0.0.2", "fd00::3"]
    head = role_values(g, g.head, {"model": "m", "host": "0.0.0.0", "port": 8080}, rank=0,
                       dist_host="10.0.0.1", rank_hosts=hosts)
    argv, _ = build_command(role_manifest(spec.manifest, g.head), None, head)
    assert argv[-2:] == ["--rpc", "10.0.0.2:50000,[fd00::3]:50000"]
    rank = role_values(g, g.member, {"host": "0.0.0.0"}, rank=2, dist_host="10.0.0.1",
                       rank_hosts=hosts)
    assert build_command(role_manifest(spec.manifest, g.member), None, rank)[0] == [
        "rpc-server", "-H", "0.0.0.0", "-p", "50000"]
    sg = settings(tmp_path, node="spark-3").engines[0]
    assert sg.group is not None
    values = role_values(sg.group, sg.group.member, {"model": "m", "host": "h", "port": 1},
                         rank=2, dist_host="10.0.0.1", rank_hosts=hosts)
    argv, _ = build_command(role_manifest(sg.manifest, sg.group.member), None, values)
    assert argv[-6:] == ["--nnodes", "3", "--node-rank", "2", "--dist-init-addr",
                         "10.0.0.1:50000"]


BASE = ('{"kind": "x", "display_name": "X", "default_port": 1, "probes": {'
        '"ready": {"path": "/r"}, "health": {"path": "/h"}}, "group": %s}')


@pytest.mark.parametrize(("group", "expected"), [
    ('{"roles": {"head": {"start": {"argv": ["a"]}}, "rank": {"start": {"argv": ["b"]}}}}',
     "m.json: group.roles.rank: ready = 'probe' needs a probe"),
    ('{"roles": {"head": {"start": {"argv": ["a"]}, "ready": "process"}, '
     '"rank": {"start": {"argv": ["b"]}, "ready": "process"}}}',
     "m.json: group.roles.head.ready: the head is ready by the engine's own probes"),
    ('{"roles": {"head": {"start": {}}, "rank": {"start": {"argv": ["b"]}, "ready": "process"}}}',
     "m.json: group.roles.head.start.argv: empty"),
    ('{"roles": {"head": {"start": {"argv": ["a"]}}, "rank": {"start": {"argv": ["b"]}, '
     '"probe": {"path": "/x", "cost": "queued"}}}}', "m.json: group.roles.rank.probe: a rank's"),
    ('{"start_order": "sideways", "roles": {}}', "m.json: "),
])
def test_bad_group_roles_in_a_manifest(group: str, expected: str) -> None:
    with pytest.raises(ManifestError) as info:
        decode_manifest((BASE % group).encode(), "m.json")
    assert expected in str(info.value) and "\n" not in str(info.value)


def test_a_groups_engine_may_be_kept_its_own_or_by_the_top_level(tmp_path: Path) -> None:
    """on_exit = keep on a group's engine (a rank's process outlives its nvpair: docs/
    groups.md) was a config error; its own on_exit wins over the top-level one."""
    own = settings(tmp_path, extra="managed = true\non_exit = 'keep'\n").engines[0]
    assert own.on_exit == "keep" and own.group is not None and own.group.rank == 1
    head = settings(tmp_path, node="spark-1", extra="managed = true\non_exit = 'keep'\n")
    assert head.engines[0].on_exit == "keep"  # (the head's process stops with nvpair anyway)
    text = "on_exit = 'keep'\n" + config(tmp_path)
    top = resolve(decode_config(text.encode(), "n.toml"), "n.toml", tmp_path).engines[0]
    assert top.on_exit == "keep"
    text = "on_exit = 'keep'\n" + config(tmp_path, extra="managed = true\non_exit = 'stop'\n")
    assert resolve(decode_config(text.encode(), "n.toml"), "n.toml",
                   tmp_path).engines[0].on_exit == "stop"
    assert settings(tmp_path).engines[0].on_exit == "stop"  # the default


def test_on_exit_of_a_group_that_nvpair_does_not_manage_is_still_refused(
        tmp_path: Path) -> None:
    message = error(tmp_path, extra="on_exit = 'keep'\n")
    assert "engines[0].on_exit: needs managed = true" in message, message


@pytest.mark.parametrize(("node", "change", "verdict", "fields"), [
    # the rank's command (tp is in SGLang's rank argv): a new epoch on every node
    ("spark-1", ("tp = 4", "tp = 8"), "restart", ("args",)),
    ("spark-2", ("tp = 4", "tp = 8"), "restart", ("args",)),
    # the head's own argument: the head restarts the group; a rank's process is the same
    ("spark-1", ("tp = 4", "tp = 4\nserved_name = 'x'"), "restart", ("args",)),
    ("spark-2", ("tp = 4", "tp = 4\nserved_name = 'x'"), "update", ("args",)),
    # an arg no template uses, a timing of the group: in place
    ("spark-2", ("tp = 4", "tp = 4\nunused = 1"), "update", ("args",)),
    ("spark-1", ("dist_port = 50000", "dist_port = 50000\nfence_after_s = 9"), "update",
     ("group",)),
    ("spark-2", ("dist_port = 50000", "dist_port = 50000\nrestart_backoff = {initial_s = 1}"),
     "update", ("group",)),
    # what every node runs: its ranks, its port
    ("spark-2", ("dist_port = 50000", "dist_port = 50001"), "restart", ("group",)),
    ("spark-1", ('"spark-3"]', '"spark-3", "spark-4"]'), "restart", ("group",)),
])
def test_a_reload_restarts_a_group_only_for_what_it_runs(
        tmp_path: Path, monkeypatch, node: str, change: tuple[str, str], verdict: str,
        fields: tuple[str, ...]) -> None:
    from nvpair.config.diff import EngineChange, diff
    monkeypatch.delenv(RANK_ENV, raising=False)
    old = settings(tmp_path, node=node)
    text = config(tmp_path, node=node).replace(*change)
    new = resolve(decode_config(text.encode(), "n.toml"), "n.toml", tmp_path)
    assert diff(old, new).engines == (EngineChange("big", verdict, fields),)
    assert diff(old, old).engines == (EngineChange("big", "unchanged"),)


def test_the_definition_is_what_every_node_runs_alike(tmp_path: Path, monkeypatch) -> None:
    """The head's and a rank's configs give the same definition (each node's own address
    left out); a change of the rank's command line gives another."""
    from nvpair.config.group import definition
    from nvpair.config.settings import placeholder_values
    monkeypatch.delenv(RANK_ENV, raising=False)

    def of(text: str) -> str:
        spec = resolve(decode_config(text.encode(), "n.toml"), "n.toml", tmp_path).engines[0]
        assert spec.group is not None
        return definition(spec.group, spec.manifest, placeholder_values(spec))

    base = config(tmp_path)
    head = of(base.replace('model = "m"', 'model = "m"\nhost = "10.0.0.1"')
              .replace('node = "spark-2"', 'node = "spark-1"'))
    assert of(base) == head == of(base.replace('node = "spark-2"', 'node = "spark-3"'))
    assert of(base.replace("tp = 4", "tp = 8")) != head
