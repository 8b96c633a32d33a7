"""``python -m nvpair.sim`` as a real process: the banner, SIGTERM, crashes and children."""

from __future__ import annotations

import re
import signal
import subprocess
import sys

import httpx2
import pytest
import trio
from tests.managed import alive

from nvpair.sim.cli import build_parser, options_from_args

BANNER = re.compile(
    r"sim (?P<kind>\w+) listening on 127\.0\.0\.1:(?P<port>\d+)"
    r" control 127\.0\.0\.1:(?P<control>\d+)"
)


async def _banner(proc: trio.Process) -> re.Match[str]:
    assert proc.stdout is not None
    text = b""
    while True:
        chunk = await proc.stdout.receive_some(4096)
        assert chunk, f"simulator exited early: {text!r}"
        text += chunk
        if b"\n" in text:
            break
    match = BANNER.match(text.decode().splitlines()[0])
    assert match, text
    return match


async def _spawn(*args: str) -> trio.Process:
    return await trio.lowlevel.open_process(
        [sys.executable, "-m", "nvpair.sim", *args, "--port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )


async def test_sigterm_exits_cleanly_after_the_engine_shutdown():
    with trio.fail_after(20):
        proc = await _spawn("sglang", "--load-s", "0", "--warmup-s", "0", "--stop-s", "0.3",
                            "--health-tick-s", "0.1", "--spawn-children", "2")
        try:
            match = await _banner(proc)
            assert match["kind"] == "sglang"
            async with httpx2.AsyncClient(timeout=5) as client:
                control = f"http://127.0.0.1:{match['control']}"
                stats = (await client.get(f"{control}/__sim/wait?phase=ready")).json()
                assert stats["phase"] == "ready" and stats["listening"]
                children = stats["engine"]["child_pids"]
                assert len(children) == 2 and all(alive(pid) for pid in children)
                health = await client.get(f"http://127.0.0.1:{match['port']}/health")
                assert health.status_code == 200
                proc.send_signal(signal.SIGTERM)
                assert await proc.wait() == 0
            assert not any(alive(pid) for pid in children)
            assert proc.stderr is not None
            errors = (await proc.stderr.receive_some(65536)).decode()
            assert "Traceback" not in errors and "SIGTERM received" in errors
        finally:
            proc.kill()


async def test_crash_fault_exits_with_its_code():
    with trio.fail_after(20):
        proc = await _spawn("vllm", "--load-s", "0", "--fault", "crash", "--fault-seconds",
                            "0.2", "--fault-exit-code", "7")
        try:
            await _banner(proc)
            assert await proc.wait() == 7
        finally:
            proc.kill()


async def test_sigint_exits_cleanly_while_loading():
    with trio.fail_after(20):
        proc = await _spawn("tgi", "--load-s", "60")
        try:
            await _banner(proc)
            proc.send_signal(signal.SIGINT)
            assert await proc.wait() == 0
            assert proc.stderr is not None
            assert b"Traceback" not in await proc.stderr.receive_some(65536)
        finally:
            proc.kill()


def test_cli_defaults_and_engine_flags(monkeypatch):
    monkeypatch.setenv("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "0")
    monkeypatch.setenv("SGLANG_HEALTH_CHECK_TIMEOUT", "5")
    args = build_parser().parse_args([
        "sglang", "--model-path", "m", "--served-model-name", "s", "--skip-server-warmup",
        "--fault", "slow", "--fault-paths", "/health,/ping", "--fault-seconds", "2",
    ])
    options = options_from_args(args)
    assert (options.port, options.load_s, options.warmup_s) == (30000, 2.0, 0.0)
    assert (options.model, options.served) == ("m", "s")
    assert options.health_generation is False and options.health_timeout_s == 5.0
    assert options.fault is not None and options.fault.paths == ("/health", "/ping")
    assert options.hard_exit is True

    monkeypatch.setenv("OLLAMA_HOST", "127.0.0.1:12345")
    ollama = options_from_args(build_parser().parse_args(["ollama", "--models", "a,b"]))
    assert ollama.port == 12345 and ollama.models == ("a", "b")
    vllm = options_from_args(build_parser().parse_args([
        "vllm", "--headless", "--nnodes", "2", "--node-rank", "1", "--master-port", "29501"]))
    assert vllm.dist_init_addr == "127.0.0.1:29501" and vllm.headless


def test_cli_takes_llama_server_flags():
    """The llama.cpp simulator runs from llama-server's own argv (the manifest's template)."""
    argv = ["llamacpp", "-m", "/m/g.gguf", "--host", "127.0.0.1", "--port", "0", "--alias",
            "g", "-c", "2048", "-ngl", "99", "-np", "2", "-t", "4", "--api-key", "k1,k2",
            "--metrics", "--no-slots", "--embeddings", "--pooling", "mean", "--no-webui",
            "--kv-unified"]
    options = options_from_args(build_parser().parse_args(argv))
    assert (options.model, options.served, options.context_length) == ("/m/g.gguf", "g", 2048)
    assert (options.np, options.kv_unified, options.api_key) == (2, True, "k1,k2")
    assert options.metrics and options.no_slots and options.embeddings
    assert options.pooling == "mean" and options.webui is False
    auto = options_from_args(build_parser().parse_args(["llamacpp", "-np", "-1"]))
    assert (auto.np, auto.kv_unified, auto.webui, auto.idle_timeout_s) == (None, None, True, None)


def test_keys_reach_each_kind_by_its_engines_own_surfaces(monkeypatch, tmp_path):
    """llama-server: --api-key-file, each non-empty line a key as it is; vLLM: VLLM_API_KEY
    (--api-key wins); no other kind reads either (engine-surfaces.md)."""
    keys = tmp_path / "keys"
    keys.write_bytes(b"k1\n\nk 2\n")
    parse = build_parser().parse_args
    llama = options_from_args(parse(["llamacpp", "--api-key-file", str(keys)]))
    assert llama.api_key == "k1,k 2"
    both = options_from_args(parse(["llamacpp", "--api-key", "k0", "--api-key-file", str(keys)]))
    assert both.api_key == "k0,k1,k 2"
    with pytest.raises(ValueError, match="failed to open file '/nonexistent'"):
        options_from_args(parse(["llamacpp", "--api-key-file", "/nonexistent"]))
    for kind in ("vllm", "sglang"):
        with pytest.raises(ValueError, match="llama-server takes a key file"):
            options_from_args(parse([kind, "--api-key-file", str(keys)]))
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    assert options_from_args(parse(["vllm"])).api_key == "from-env"
    assert options_from_args(parse(["vllm", "--api-key", "given"])).api_key == "given"
    for kind in ("llamacpp", "sglang", "tgi", "ollama"):
        assert options_from_args(parse([kind])).api_key is None, kind
