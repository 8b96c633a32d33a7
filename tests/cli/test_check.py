"""``nvpair check`` on the nodes of a multi-node group: what each node runs (Groups.local),
so a rank shows its part of the group, not an engine it would probe itself."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nvpair.cli import check
from nvpair.config.group import RANK_ENV
from nvpair.config.settings import Settings, decode_config, load_settings, resolve


def settings(tmp_path: Path, node: str, kind: str = "sglang") -> Settings:
    (tmp_path / "token").write_text("secret\n")
    text = (f'node = "{node}"\n[cluster]\ntoken_file = "token"\n[[peers]]\n'
            'url = "http://127.0.0.1:1"\n[[engines]]\nname = "big"\n'
            f'kind = "{kind}"\nmodel = "m"\nmanaged = true\n[engines.group]\n'
            'ranks = ["n0", "n1", "n2"]\ndist_port = 50000\n'
            '[[engines]]\nname = "solo"\nkind = "vllm"\nport = 8001\n')
    return resolve(decode_config(text.encode(), "n.toml"), "n.toml", tmp_path)


def test_a_rank_shows_its_part_of_the_group_not_an_engine(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(RANK_ENV, raising=False)
    assert check.run(settings(tmp_path, "n1"), as_json=False) == 0
    out = capsys.readouterr().out
    assert "group big: this node is rank 1 (of 3: n0, n1, n2), run for the head n0" in out
    assert ("no engine of its own here; its process is ready by GET /ping every 5s "
            "(about 720 requests per hour once ready)") in out
    engines = [line.split()[0] for line in out.splitlines()
               if line.startswith(("big ", "solo "))]
    assert "big" not in engines and "solo" in engines  # never probed here as an engine
    assert "big:" not in out.replace("group big:", "")  # no probe rate of its own
    assert check.run(settings(tmp_path, "n1"), as_json=True) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [e["name"] for e in doc["engines"]] == ["solo"]
    assert doc["groups"] == [{"name": "big", "role": "rank", "rank": 1, "head": "n0",
                              "ranks": ["n0", "n1", "n2"], "start_order": "together",
                              "ready": "probe", "probe": {
                                  "method": "GET", "path": "/ping", "interval_s": 5.0,
                                  "timeout_s": 2.0, "per_hour": 720}}]


def test_the_head_shows_its_engine_as_the_groups(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(RANK_ENV, raising=False)
    assert check.run(settings(tmp_path, "n0"), as_json=False) == 0
    out = capsys.readouterr().out
    assert "group big: this node is its head (rank 0 of 3: n0, n1, n2)" in out
    row = next(line for line in out.splitlines() if line.startswith("big "))
    assert "head of group big" in row
    doc = check.report(settings(tmp_path, "n0"))
    engines = doc["engines"]
    assert isinstance(engines, list)
    assert [(e["name"], e["managed"], e["group"]) for e in engines] == [
        ("big", False, "big"), ("solo", False, None)]


def test_an_rpc_rank_is_watched_by_its_socket(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(RANK_ENV, "2")
    assert check.run(settings(tmp_path, "n0", kind="llamacpp"), as_json=False) == 0
    out = capsys.readouterr().out
    assert "this node is rank 2 (of 3: n0, n1, n2), run for the head n0" in out
    assert "ready when its socket listens (read from /proc, never connected to)" in out


def test_a_key_in_an_engines_command_line_is_warned_of_in_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "key").write_text("k\n")
    text = "".join(
        f"[[engines]]\nname = '{name}'\nkind = '{kind}'\nport = {port}\nmodel = 'm'\n"
        f"managed = true\napi_key_file = 'key'\n{extra}"
        for name, kind, port, extra in [
            ("sg", "sglang", 8001, ""), ("ll", "llamacpp", 8002, ""), ("vl", "vllm", 8003, ""),
            ("own", "llamacpp", 8004, "command = ['srv', '--port', '{port}', '--key', "
                                      "'{api_key}']\n")])
    given = resolve(decode_config(text.encode(), "n.toml"), "n.toml", tmp_path)
    check.run(given, as_json=False)  # (exit 2 here: the engines' programs are not on PATH)
    keys = [line for line in capsys.readouterr().err.splitlines() if "API key" in line]
    assert keys == [
        "warning: engine sg: its API key is on the engine's command line (the sglang manifest "
        "passes {api_key} as an argument; SGLang takes its key no other way), where any "
        "local user can read it (ps, /proc/PID/cmdline)",
        "warning: engine own: its API key is on the engine's command line (its command has "
        "{api_key}), where any local user can read it (ps, /proc/PID/cmdline)"]
    check.run(given, as_json=True)
    found = json.loads(capsys.readouterr().out)["findings"]
    assert [f"{f['level']}: {f['text']}" for f in found if "API key" in f["text"]] == keys


def test_check_shows_the_keys_names_roles_and_limits_never_their_tokens(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for name in ("admin", "batch"):
        (tmp_path / name).write_text(f"tok-{name}-secret\n")
        (tmp_path / name).chmod(0o600)
    text = ('token_file = "admin"\n[[keys]]\nname = "batch"\ntoken_file = "batch"\n'
            'role = "user"\npriority = -1\nmax_in_flight = 2\nrequests_per_minute = 600\n'
            'models = ["qwen*", "gemma3-270m"]\n')
    s = resolve(decode_config(text.encode(), "n.toml"), "n.toml", tmp_path)
    assert check.run(s, as_json=False) == 0
    out = capsys.readouterr().out
    assert "bearer token required: 2 keys" in out
    rows = [line.split() for line in out.splitlines() if line.startswith(("token_file ", "batch "))]
    assert rows[0][:5] == ["token_file", "admin", "0", "-", "-"]
    assert rows[1][:7] == ["batch", "user", "-1", "2", "600", "qwen*,", "gemma3-270m"]
    assert check.run(s, as_json=True) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["token"] is True
    assert doc["keys"][1] == {"name": "batch", "role": "user", "priority": -1,
                              "token_file": str(tmp_path / "batch"), "max_in_flight": 2,
                              "requests_per_minute": 600, "models": ["qwen*", "gemma3-270m"]}
    assert "secret" not in out + json.dumps(doc)


def test_check_says_which_engines_outlive_nvpair(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "nvpair.toml"
    config.write_text("on_exit = 'keep'\n"
                      "[[engines]]\nname = 'kept'\nkind = 'vllm'\nport = 9001\nmodel = 'm'\n"
                      "managed = true\ncommand = ['x']\n"
                      "[[engines]]\nname = 'stopped'\nkind = 'vllm'\nport = 9002\nmodel = 'm'\n"
                      "managed = true\ncommand = ['x']\non_exit = 'stop'\n")
    loaded = load_settings(str(config))
    check.run(loaded, as_json=False)
    rows = [line for line in capsys.readouterr().out.splitlines() if "http://" in line]
    assert "managed, kept on exit" in next(r for r in rows if r.startswith("kept "))
    assert "kept on exit" not in next(r for r in rows if r.startswith("stopped "))
    assert [e["on_exit"] for e in check.report(loaded)["engines"]] == [  # type: ignore[union-attr]
        "keep", "stop"]
