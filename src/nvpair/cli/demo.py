"""``nvpair demo``: nvpair with simulated engines, managed as child processes, on loopback."""

from __future__ import annotations

import logging
import socket
import sys
import tempfile
from pathlib import Path

import msgspec
import trio

from nvpair import service
from nvpair.cli.progress import print_transitions
from nvpair.cli.serve import os_error
from nvpair.config.settings import Config, resolve

#: (name, kind, model, extra simulator flags)
DEMO_ENGINES: tuple[tuple[str, str, str, list[str]], ...] = (
    ("sglang", "sglang", "deepseek-ai/DeepSeek-V4.1-Flash", ["--health-tick-s", "1.0"]),
    ("vllm", "vllm", "Qwen/Qwen3-8B", []),
    ("llamacpp", "llamacpp", "gemma3-270m", []),
    ("ollama", "ollama", "llama3.2:latest", ["--models", "llama3.2:latest,qwen3:0.6b"]),
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def demo_config(listen: str, log_dir: Path) -> Config:
    engines = []
    for name, kind, model, extra in DEMO_ENGINES:
        command = [sys.executable, "-m", "nvpair.sim", kind, "--model", "{model}",
                   "--host", "{host}", "--port", "{port}", "--no-control", *extra]
        engines.append({"name": name, "kind": kind, "model": model, "port": _free_port(),
                        "managed": True, "command": command})
    return msgspec.convert({"listen": listen, "node": "demo", "log_dir": str(log_dir),
                            "engines": engines}, Config)


def run_demo(listen: str) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    with tempfile.TemporaryDirectory(prefix="nvpair-demo-") as tmp:
        settings = resolve(demo_config(listen, Path(tmp)), "(demo)", Path(tmp))

        def announce(url: str) -> None:
            print(f"""nvpair demo: 4 simulated engines (SGLang, vLLM, llama.cpp, Ollama), each a
child process managed by nvpair; they load for a couple of seconds.

  dashboard: {url}/ui/  (open it in a browser)
  models:   curl {url}/v1/models
  engines:  curl {url}/v1/engines      (or: nvpair status --url {url})
  logs:     curl {url}/v1/engines/vllm/logs?tail=20
  restart:  curl -X POST {url}/v1/engines/vllm/restart

SGLang's /health generates for 1 s in this demo, like the real one; nvpair never calls
it (see probes in {url}/v1/engines/sglang). Ctrl-C stops nvpair and every engine.""",
                  flush=True)

        try:
            trio.run(lambda: service.main(settings, announce=announce,
                                                   watch=print_transitions))
        except Exception as exc:  # a bind error comes wrapped in the nurseries' groups
            error = os_error(exc)
            if error is None:
                raise
            print(f"nvpair: error: cannot listen on {listen}: {error.strerror or error}",
                  file=sys.stderr)
            return 1
    print("nvpair demo: stopped; no engine left running.")
    return 0
