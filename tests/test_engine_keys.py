"""An engine's API key reaches it by its environment or a file, never its argv, which any
local user reads in ``/proc/PID/cmdline``: managed simulators started from the built-in
manifests' own key surfaces (llama.cpp ``--api-key-file``, vLLM ``VLLM_API_KEY``)."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import trio
from tests.managed import FAST_PROBES, fast_manifest, free_port, sim_command, wait_state
from tests.test_serve_signals import serving

from nvpair import service
from nvpair.config.settings import load_settings

KEY = "sekrit-engine-key-123"


def keyed_config(tmp: Path, kind: str) -> Path:
    """One managed engine of ``kind`` whose manifest is the built-in one (its optional
    fragments and environment) with a simulator in place of the engine's binary."""
    manifest = fast_manifest(tmp, kind)
    doc = json.loads(manifest.read_text())
    doc["start"]["argv"] = sim_command(kind, "--load-s", "0.2")
    manifest.write_text(json.dumps(doc))
    (tmp / "key").write_text(KEY + "\n")
    path = tmp / "nvpair.toml"
    path.write_text(f"listen = '127.0.0.1:0'\nlog_dir = '{tmp / 'logs'}'\n"
                    f"state_dir = '{tmp / 'state'}'\n[[engines]]\nname = 'e'\n"
                    f"kind = '{manifest}'\nport = {free_port()}\nmodel = 'm'\nmanaged = true\n"
                    "api_key_file = 'key'\n" + FAST_PROBES)
    return path


def proc_file(pid: int, name: str) -> list[bytes]:
    """``/proc/PID/<name>``'s NUL-separated strings (argv, environ)."""
    return Path(f"/proc/{pid}/{name}").read_bytes().split(b"\0")


@pytest.mark.parametrize("kind", ["llamacpp", "vllm"])
async def test_a_managed_engines_key_is_not_in_its_command_line(
        nursery, tmp_path: Path, kind: str) -> None:
    settings = load_settings(str(keyed_config(tmp_path, kind)))
    with trio.fail_after(30):
        running = await nursery.start(service.run, settings)
        # listed: its /v1/models answered nvpair's key, so the engine has that key
        e = await wait_state(running.board, "e", "ready", where=lambda e: bool(e.models))
    assert e.pid is not None
    cmdline = proc_file(e.pid, "cmdline")
    assert not any(KEY.encode() in arg for arg in cmdline), cmdline
    environ = proc_file(e.pid, "environ")  # mode 0400: its own user's only
    if kind == "llamacpp":
        at = cmdline.index(b"--api-key-file")
        assert cmdline[at + 1] == str(tmp_path / "key").encode()
        assert not any(KEY.encode() in var for var in environ)
    else:
        assert f"VLLM_API_KEY={KEY}".encode() in environ


async def test_serve_warns_of_a_key_in_argv_as_check_does(tmp_path: Path) -> None:
    """SGLang takes its key only as --api-key: ``nvpair serve`` says so in its log."""
    (tmp_path / "key").write_text(KEY + "\n")
    command = sim_command("sglang", "--api-key", "{api_key}")
    config = tmp_path / "nvpair.toml"
    config.write_text(f"listen = '127.0.0.1:0'\nlog_dir = '{tmp_path / 'logs'}'\n"
                      f"state_dir = '{tmp_path / 'state'}'\n[[engines]]\nname = 'sg'\n"
                      f"kind = 'sglang'\nport = {free_port()}\nmodel = 'm'\nmanaged = true\n"
                      f"api_key_file = 'key'\ncommand = {json.dumps(command)}\n")
    with trio.fail_after(30):
        async with serving(config) as serve:
            line = await serve.saw("WARNING nvpair.check: engine sg: its API key is on the "
                                   "engine's command line (its command has {api_key})")
            serve.proc.send_signal(signal.SIGTERM)
            assert await serve.proc.wait() == 0
    assert KEY not in line
