"""The reload's diff: running settings against new ones (nvpair.config.diff)."""

from pathlib import Path

import msgspec
from hypothesis import given
from hypothesis import strategies as st

from nvpair.config.diff import IDENTITY, REFUSED, EngineChange, diff
from nvpair.config.settings import RouterConfig, decode_config, resolve

BASE = """
listen = "127.0.0.1:14322"
node = "n1"
state_dir = "/tmp/nvpair-diff-state"

[[engines]]
name = "small"
kind = "llamacpp"
managed = true
model = "/models/gemma.gguf"
[engines.args]
ctx = 4096

[[engines]]
name = "big"
kind = "vllm"
model = "Qwen/Qwen3-8B"
port = 18000
"""


def settings(text: str = BASE):
    return resolve(decode_config(text.encode(), "nvpair.toml"), "nvpair.toml", Path("/"))


def with_engine(text: str, name: str, lines: list[str]) -> str:
    """``text`` with ``lines`` added to engine ``name``'s table (before its sub-tables)."""
    head = f'name = "{name}"\n'
    at = text.index(head) + len(head)
    return text[:at] + "".join(f"{line}\n" for line in lines) + text[at:]


def test_the_same_config_changes_nothing():
    d = diff(settings(), settings())
    assert [(e.name, e.verdict) for e in d.engines] == [("small", "unchanged"),
                                                        ("big", "unchanged")]
    assert d.empty and not d.refused and not d.sections
    assert d.summary() == "reload: 2 unchanged"


#: a config line for engine "small" (managed) and what it must be judged
SMALL_EDITS = [
    ('port = 18081', "restart", ("port",)),
    ('host = "127.0.0.2"', "restart", ("host",)),
    ('activation = "on_demand"', "restart", ("activation",)),
    ('command = ["/bin/llama-server", "-m", "{model}", "--port", "{port}"]', "restart",
     ("command",)),
    ('env = { CUDA_VISIBLE_DEVICES = "1" }', "restart", ("env",)),
    ('priority = 7', "update", ("priority",)),
    ('idle_unload_s = 60', "update", ("idle_unload_s",)),
    ('max_in_flight = 3', "update", ("max_in_flight",)),
    ('memory_bytes = 1000000', "update", ("memory_bytes",)),
    ('stop_grace_s = 3', "update", ("stop_grace_s",)),
    ('startup_budget_s = 33', "update", ("startup_budget_s",)),
    ('aliases = ["gemma"]', "update", ("aliases",)),
    ('kv_cache_probe_s = 5', "update", ("kv_cache_probe_s",)),
    ('probes.health.interval_s = 9', "update", ("probes",)),
]


@given(st.sampled_from(SMALL_EDITS), st.booleans())
def test_one_engine_edit_is_judged_by_what_it_changes(edit, other_too):
    line, verdict, fields = edit
    new = with_engine(BASE, "small", [line])
    if other_too:  # an edit of another engine leaves this one's verdict alone
        new = with_engine(new, "big", ["priority = 3"])
    d = diff(settings(), settings(new))
    small = d.engines[0]
    assert (small.name, small.verdict, small.fields) == ("small", verdict, fields)
    assert d.engines[1].verdict == ("update" if other_too else "unchanged")
    assert not d.refused


def test_an_argument_restarts_a_managed_engine_and_names_args():
    new = BASE.replace("ctx = 4096", "ctx_size = 8192")
    d = diff(settings(), settings(new))
    assert (d.engines[0].verdict, d.engines[0].fields) == ("restart", ("args",))
    assert d.summary() == "reload: 1 restarted (small: args), 1 unchanged"


def test_an_adopted_engine_restarts_only_for_its_identity():
    """An adopted engine has no command line: its args or model are nvpair's knowledge
    only (an update); its port is another engine (restart)."""
    d = diff(settings(), settings(with_engine(BASE, "big", ['args = { tp = 2 }'])))
    assert d.engines[1].verdict == "update"
    moved = BASE.replace("port = 18000", "port = 18001")
    d = diff(settings(), settings(moved))
    assert (d.engines[1].verdict, d.engines[1].fields) == ("restart", ("port",))
    assert set(d.engines[1].fields) <= set(IDENTITY)


def test_added_and_removed_in_one_summary():
    new = BASE.replace('name = "big"', 'name = "qwen"')
    d = diff(settings(), settings(new))
    assert [(e.name, e.verdict) for e in d.engines] == [
        ("small", "unchanged"), ("big", "removed"), ("qwen", "added")]
    assert d.summary() == "reload: 1 added (qwen), 1 removed (big), 1 unchanged"
    assert d.doc()["added"] == {"qwen": []} and d.doc()["unchanged"] == 1


@given(st.sampled_from(["listen", "state_dir", "node"]))
def test_listen_state_dir_and_node_are_refused(section):
    edits = {"listen": ('listen = "127.0.0.1:14322"', 'listen = "127.0.0.1:14323"'),
             "state_dir": ('state_dir = "/tmp/nvpair-diff-state"',
                           'state_dir = "/tmp/elsewhere"'),
             "node": ('node = "n1"', 'node = "n2"')}
    d = diff(settings(), settings(BASE.replace(*edits[section])))
    assert d.refused == (REFUSED[section],)
    assert section not in d.sections


@given(st.builds(RouterConfig, cooldown_s=st.floats(0.5, 100), suspect_after=st.integers(1, 9)))
def test_a_global_section_is_named_and_no_engine_moves(router):
    old = settings()
    new = msgspec.structs.replace(old, router=router)
    d = diff(old, new)
    assert d.sections == (() if router == old.router else ("router",))
    assert all(e.verdict == "unchanged" for e in d.engines)


def test_an_argument_the_command_line_does_not_use_restarts_nothing():
    """The argv decides: an arg no placeholder takes changes no process."""
    one = BASE.replace("ctx = 4096", "ctx = 4096\nunused = 1")
    d = diff(settings(one), settings(one.replace("unused = 1", "unused = 2")))
    assert d.engines[0].verdict == "update"


#: another value for each field of an EngineSpec (of "small", managed llama.cpp)
OTHER = {"kind": "vllm", "host": "10.0.0.9", "port": 1234, "managed": False,
         "model": "/models/other.gguf", "command": ("llama-server", "-m", "{model}"),
         "api_key": "k2", "api_key_file": "/tmp/k2", "args": {"ctx": 1},
         "env": {"A": "1"}, "aliases": ("x",), "optional": True, "allow_generating": True,
         "startup_budget_s": 1.0, "stop_grace_s": 1.0, "pid_file": "/tmp/p",
         "cgroup": "/sys/fs/cgroup/x", "activation": "on_demand", "idle_unload_s": 5.0,
         "priority": 9, "memory_bytes": 7, "max_in_flight": 2, "kv_cache_probe_s": 9.0,
         "idle_sleep_s": 30, "sleep_level": 2, "on_exit": "keep", "pin": True,
         "sleep_flags": True}


@given(st.sampled_from(sorted(OTHER)))
def test_any_one_field_changed_is_never_unchanged_and_identity_restarts(field):
    old = settings()
    small = old.engines[0]
    changed = msgspec.structs.replace(small, **{field: OTHER[field]})
    d = diff(old, msgspec.structs.replace(old, engines=(changed, old.engines[1])))
    verdict = d.engines[0]
    assert verdict.verdict in ("restart", "update")
    assert field in verdict.fields or verdict.fields == ("manifest",)
    if field in IDENTITY:
        assert verdict.verdict == "restart"
    if field in ("priority", "idle_unload_s", "max_in_flight", "memory_bytes", "aliases",
                 "stop_grace_s", "startup_budget_s", "kv_cache_probe_s", "optional", "pin"):
        assert verdict.verdict == "update"
    if field == "on_exit":  # (a pipe or its own file: how the process was started)
        assert verdict == EngineChange("small", "restart", ("on_exit",))
    assert d.engines[1].verdict == "unchanged"


def test_every_engine_field_is_covered_by_the_property():
    """A field added to EngineSpec must be judged by the diff's tests too."""
    from nvpair.config.settings import EngineSpec
    assert set(EngineSpec.__struct_fields__) - set(OTHER) == {
        "name", "manifest", "probes", "group", "sleep"}


def test_every_setting_is_in_a_section():
    """A setting added to Settings must be named in a section (applied live or refused);
    until it is, a change of it is refused, never dropped without a word."""
    from nvpair.config.diff import SECTIONS
    from nvpair.config.settings import Settings
    named = {f for fields in SECTIONS.values() for f in fields}
    assert set(Settings.__struct_fields__) - named == {"source", "engines"}
    old = settings()
    d = diff(old, msgspec.structs.replace(old, sweep_deadline_s=9.0, source="other"))
    assert d.sections == ("sweep",) and not d.refused  # (the source is where, not what)
