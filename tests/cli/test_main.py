"""The command line as a person runs it: a real subprocess, exit codes and output."""

import json
import socket
import subprocess
import sys
from pathlib import Path


def nvpair(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "nvpair", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=60, env={"PATH": "/usr/bin:/bin", "NO_COLOR": "1"})


def test_version(tmp_path: Path) -> None:
    r = nvpair("--version", cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.startswith("nvpair ")


def test_bad_config_is_one_line_and_exit_2(tmp_path: Path) -> None:
    (tmp_path / "nvpair.toml").write_text("[[engines]]\nname = 'a'\nkind = 'vllm'\nport = 'x'\n")
    r = nvpair("check", cwd=tmp_path)
    assert r.returncode == 2
    assert r.stderr == "nvpair: error: nvpair.toml: engines[0].port: expected int, got str\n"
    assert "Traceback" not in r.stderr


def test_check_prints_engines_and_probe_rates(tmp_path: Path) -> None:
    (tmp_path / "nvpair.toml").write_text("[[engines]]\nname = 'head'\nkind = 'sglang'\n")
    r = nvpair("check", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "head" in r.stdout and "GET /ping" in r.stdout
    assert "about 840 probe requests per hour" in r.stdout


def test_check_json(tmp_path: Path) -> None:
    (tmp_path / "nvpair.toml").write_text("[[engines]]\nname = 'head'\nkind = 'sglang'\n")
    r = nvpair("check", "--json", cwd=tmp_path)
    doc = json.loads(r.stdout)
    assert doc["engines"][0]["probes"]["health"]["per_hour"] == 720
    assert doc["engines"][0]["probes_per_hour"] == 840


def test_schema_is_json_schema(tmp_path: Path) -> None:
    for what in ("config", "manifest"):
        r = nvpair("schema", what, cwd=tmp_path)
        doc = json.loads(r.stdout)
        assert doc["$schema"].startswith("https://json-schema.org/")
        assert doc["$defs"]


def test_schema_api_is_the_openapi_document(tmp_path: Path) -> None:
    from nvpair.openapi import document

    r = nvpair("schema", "api", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == json.loads(json.dumps(document()))


def test_serve_refuses_public_listen_without_token(tmp_path: Path) -> None:
    r = nvpair("serve", "--listen", "0.0.0.0:14322", cwd=tmp_path)
    assert r.returncode == 2
    assert "--listen: 0.0.0.0 is not a loopback address; set token_file" in r.stderr


def test_serve_on_a_busy_port_is_one_line_and_exit_1(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = nvpair("serve", "--listen", f"127.0.0.1:{port}", cwd=tmp_path)
    assert r.returncode == 1, r.stderr
    assert r.stderr.splitlines()[-1] == (
        f"nvpair: error: cannot listen on 127.0.0.1:{port}: Address already in use")
    assert "Traceback" not in r.stderr
