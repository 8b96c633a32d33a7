"""``nvpair check`` as the gate before ``serve``: each mistake the new-user trial made
(newuser-3.md, goal 6) that ``serve`` fails on is an ``error:`` line and exit 2 here, run as a
person runs it (a real subprocess, a real PATH, real files, a real listening socket)."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

from tests.ports import free_port


def check(tmp_path: Path, text: str, *args: str,
          path: str | None = None) -> subprocess.CompletedProcess[str]:
    config = tmp_path / "c.toml"
    config.write_text(text)
    env = {**os.environ, "NO_COLOR": "1"}
    if path is not None:
        env["PATH"] = path
    return subprocess.run([sys.executable, "-m", "nvpair", "check", "--config", str(config),
                           *args], capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=60)


def program(where: Path, name: str) -> Path:
    """An executable ``name`` in ``where`` (what the engine's command would find)."""
    where.mkdir(exist_ok=True)
    exe = where / name
    exe.write_text("#!/bin/sh\nexit 0\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return exe


def errors(r: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in r.stderr.splitlines() if line.startswith("error: ")]


def managed_sim(name: str, port: int) -> str:
    return (f"[[engines]]\nname = '{name}'\nkind = 'vllm'\nmanaged = true\nmodel = 'm'\n"
            f"port = {port}\ncommand = {json.dumps([sys.executable, '-m', 'nvpair.sim'])}\n")


def test_two_managed_engines_on_one_port_fail_the_check(tmp_path: Path) -> None:
    port = free_port()
    r = check(tmp_path, f"listen = '127.0.0.1:{free_port()}'\n" + managed_sim("a", port)
              + managed_sim("b", port))
    assert r.returncode == 2, r.stderr
    assert errors(r) == [f"error: {tmp_path / 'c.toml'}: engines[1] (b): managed on "
                         f"127.0.0.1:{port} like engine 'a': two processes cannot listen on "
                         "one port; give each its own `port`"]
    assert "probed twice" not in r.stderr


def test_two_adopted_engines_on_one_port_are_a_warning_with_its_prefix(tmp_path: Path) -> None:
    r = check(tmp_path, "[[engines]]\nname = 'a'\nkind = 'vllm'\n"
                        "[[engines]]\nname = 'b'\nkind = 'openai'\n")
    assert r.returncode == 0, r.stderr
    assert [line for line in r.stderr.splitlines() if "probed twice" in line] == [
        f"warning: {tmp_path / 'c.toml'}: engines[1]: 127.0.0.1:8000 is engine 'a' already: "
        "one engine, probed twice"]


def test_an_engine_on_nvpairs_own_listen_port_fails_the_check(tmp_path: Path) -> None:
    port = free_port()
    r = check(tmp_path, f"listen = '127.0.0.1:{port}'\n" + managed_sim("small", port))
    assert r.returncode == 2, r.stderr
    assert errors(r) == [f"error: {tmp_path / 'c.toml'}: engines[0] (small): would start on "
                         f"port {port}, nvpair's own listen address (127.0.0.1:{port}); give "
                         "the engine or `listen` another port"]


def test_a_program_not_on_path_and_a_missing_model_fail_the_check(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    text = (f"listen = '127.0.0.1:{free_port()}'\n[[engines]]\nname = 'small'\n"
            f"kind = 'llamacpp'\nmanaged = true\nport = {free_port()}\n"
            "model = 'models/gemma.gguf'\n")
    r = check(tmp_path, text, path=str(bin_dir))
    assert r.returncode == 2
    source = tmp_path / "c.toml"
    assert errors(r) == [
        f"error: {source}: engines[0] (small): 'llama-server' is not on the PATH it will be "
        f"started with ({bin_dir}); install it, give its full path in `command`, or set "
        "PATH (under systemd: Environment=PATH=...)",
        f"error: {source}: engines[0] (small): model models/gemma.gguf does not exist (seen "
        f"from {tmp_path}, the directory the engine starts in)"]
    program(bin_dir, "llama-server")  # on the PATH now; the model is still missing
    r = check(tmp_path, text, path=str(bin_dir))
    assert r.returncode == 2 and len(errors(r)) == 1 and "does not exist" in errors(r)[0]
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "gemma.gguf").write_bytes(b"GGUF")
    r = check(tmp_path, text, path=str(bin_dir))
    assert r.returncode == 0 and errors(r) == [], r.stderr


def test_the_engines_own_path_is_the_one_looked_in(tmp_path: Path) -> None:
    """An engine's ``env.PATH`` is the PATH its program is found on (so is it at spawn)."""
    bin_dir = tmp_path / "opt"
    program(bin_dir, "vllm")
    text = (f"listen = '127.0.0.1:{free_port()}'\n[[engines]]\nname = 'v'\nkind = 'vllm'\n"
            f"managed = true\nmodel = 'Qwen/Qwen3-8B'\nport = {free_port()}\n")
    r = check(tmp_path, text, path="/nonexistent")
    assert r.returncode == 2 and "'vllm' is not on the PATH" in r.stderr
    r = check(tmp_path, text + f"env = {{PATH = '{bin_dir}'}}\n", path="/nonexistent")
    assert r.returncode == 0, r.stderr  # and a hub name is not taken for a missing file


def test_a_port_something_listens_on_now_is_a_warning(tmp_path: Path) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        r = check(tmp_path, f"listen = '127.0.0.1:{free_port()}'\n" + managed_sim("a", port))
    assert r.returncode == 0, r.stderr
    assert [line for line in r.stderr.splitlines() if line.startswith("warning: ")] == [
        f"warning: {tmp_path / 'c.toml'}: engines[0] (a): 127.0.0.1:{port} has a listener now: "
        "nvpair will not start the engine while it does (an engine left running? another "
        "program?)"]


def test_show_commands_prints_the_argv_and_environment_with_secrets_masked(
        tmp_path: Path) -> None:
    (tmp_path / "key").write_text("sk-very-secret\n")
    bin_dir = tmp_path / "bin"
    program(bin_dir, "llama-server")
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    text = (f"listen = '127.0.0.1:{free_port()}'\n[[engines]]\nname = 'small'\n"
            f"kind = 'llamacpp'\nmanaged = true\nport = 28123\nmodel = '{tmp_path}/m.gguf'\n"
            "api_key_file = 'key'\nactivation = 'on_demand'\npriority = 5\n"
            "memory_bytes = '80 MiB'\nidle_unload_s = 600\n"
            "env = {HF_TOKEN = 'hf-secret', CUDA_VISIBLE_DEVICES = '0'}\n"
            "[activation]\nmemory_budget_bytes = '90GB'\n")
    r = check(tmp_path, text, "--show-commands", path=str(bin_dir))
    assert r.returncode == 0, r.stderr
    assert (f"  small: llama-server -m {tmp_path}/m.gguf --host 127.0.0.1 --port 28123 "
            f"--api-key-file {tmp_path}/key\n         env: CUDA_VISIBLE_DEVICES=0, HF_TOKEN=***\n"
            ) in r.stdout  # (the key reaches llama-server by file, never in its argv)
    assert "secret" not in r.stdout + r.stderr
    assert ("on demand: started by a request, memory budget 90.0 GB (90,000,000,000 bytes), "
            "queue 64 requests per key and model for up to 300 s (a level of priority every "
            "10 s waited)\n  small: priority 5, footprint "
            "84 MB (83,886,080 bytes), unloaded after 600 s idle\n") in r.stdout
    assert "small   llamacpp  managed, on demand" in r.stdout
    r = check(tmp_path, text, "--json", path=str(bin_dir))
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    (engine,) = doc["engines"]
    assert engine["command"]["argv"] == ["llama-server", "-m", f"{tmp_path}/m.gguf", "--host",
                                         "127.0.0.1", "--port", "28123", "--api-key-file",
                                         f"{tmp_path}/key"]
    assert engine["command"]["env"] == {"CUDA_VISIBLE_DEVICES": "0", "HF_TOKEN": "***"}
    assert (engine["activation"], engine["priority"], engine["memory_bytes"],
            engine["idle_unload_s"]) == ("on_demand", 5, 80 * 2**20, 600.0)
    assert doc["memory_budget_bytes"] == 90 * 10**9 and doc["findings"] == []
    assert "secret" not in r.stdout


def test_json_carries_the_findings_and_the_exit_code(tmp_path: Path) -> None:
    port = free_port()
    r = check(tmp_path, f"listen = '127.0.0.1:{port}'\n" + managed_sim("a", port), "--json")
    assert r.returncode == 2
    assert [f["level"] for f in json.loads(r.stdout)["findings"]] == ["error"]


def test_a_kind_spelt_another_way_is_suggested_not_read_as_a_path(tmp_path: Path) -> None:
    for kind, meant in (("llama.cpp", "llamacpp"), ("vLLM", "vllm"),
                        ("llama-server", "llamacpp"), ("SGLang", "sglang")):
        r = check(tmp_path, f"[[engines]]\nname = 'a'\nkind = '{kind}'\n")
        assert r.returncode == 2
        assert r.stderr.strip() == (
            f"nvpair: error: {tmp_path / 'c.toml'}: engines[0].kind: unknown engine kind "
            f"'{kind}': did you mean '{meant}'? (built-in: llamacpp, ollama, openai, sglang, "
            "tgi, vllm; a manifest of your own is a path to a .json file)")
        assert "cannot read manifest" not in r.stderr


def test_nvpair_unit_for_a_config_that_does_not_exist_says_so(tmp_path: Path) -> None:
    missing = tmp_path / "nvpair.toml"
    r = subprocess.run([sys.executable, "-m", "nvpair", "unit", "--config", str(missing)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and f"--config {missing}" in r.stdout
    assert r.stderr == (f"nvpair: warning: {missing} does not exist yet; write it, then run "
                        f"`nvpair check --config {missing} --show-commands` as the unit's "
                        "user\n")


async def test_serve_logs_what_check_finds_as_it_starts(tmp_path: Path) -> None:
    import trio

    port = free_port()
    config = tmp_path / "c.toml"
    config.write_text(f"listen = '127.0.0.1:{port}'\nstate_dir = '{tmp_path / 'state'}'\n"
                      "[[engines]]\nname = 'small'\nkind = 'vllm'\nmanaged = true\n"
                      f"model = 'm'\nport = {port}\ncommand = ['/nonexistent/engine']\n")
    proc = await trio.lowlevel.open_process(
        [sys.executable, "-m", "nvpair", "serve", "--config", str(config)],
        stderr=subprocess.PIPE, env={**os.environ, "NO_COLOR": "1"})
    said = b""
    try:
        assert proc.stderr is not None
        with trio.fail_after(20):
            while b"nvpair listening on" not in said:
                chunk = await proc.stderr.receive_some()
                assert chunk, said
                said += chunk
    finally:
        proc.terminate()
        with trio.move_on_after(10, shield=True):
            await proc.wait()
    text = said.decode()
    assert (f"ERROR nvpair.check: {config}: engines[0] (small): would start on port {port}, "
            f"nvpair's own listen address (127.0.0.1:{port})") in text
    assert (f"ERROR nvpair.check: {config}: engines[0] (small): /nonexistent/engine does not "
            "exist (the program of its command)") in text
