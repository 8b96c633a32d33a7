"""Start and stop a real llama.cpp ``llama-server`` under trio (shared by conftest and capture).

The binary and model come from ``scripts/llama_server.py`` (its ``paths --json`` subcommand), or
from the env vars ``NVPAIR_LLAMA_SERVER`` and ``NVPAIR_LLAMA_MODEL`` if both are set.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import httpx2
import trio

REPO_ROOT = Path(__file__).resolve().parents[2]
PROVIDE_SCRIPT = REPO_ROOT / "scripts" / "llama_server.py"

DEFAULT_ALIAS = "gemma3-270m"
DEFAULT_CTX = 1024
DEFAULT_PARALLEL = 2
READY_TIMEOUT_S = 120.0
STOP_GRACE_S = 10.0
POLL_INTERVAL_S = 0.02  # readiness poll of an external process only


@dataclass(frozen=True)
class LlamaAssets:
    binary: Path
    model: Path


def find_assets() -> tuple[LlamaAssets | None, str]:
    """Return the cached binary and model, or ``None`` and the reason they are not available."""
    env_bin = os.environ.get("NVPAIR_LLAMA_SERVER")
    env_model = os.environ.get("NVPAIR_LLAMA_MODEL")
    if env_bin and env_model:
        assets = LlamaAssets(Path(env_bin), Path(env_model))
        missing = [str(p) for p in (assets.binary, assets.model) if not p.is_file()]
        if missing:
            return None, f"NVPAIR_LLAMA_SERVER/NVPAIR_LLAMA_MODEL point to missing files: {missing}"
        return assets, ""
    proc = subprocess.run(
        [sys.executable, str(PROVIDE_SCRIPT), "paths", "--json"],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        detail = proc.stderr.strip().splitlines()[-1:] or [f"exit code {proc.returncode}"]
        return None, (
            "no cached llama-server/model (run `python scripts/llama_server.py provide` "
            f"or `nox -s integration`): {detail[0]}"
        )
    data = json.loads(proc.stdout)
    return LlamaAssets(Path(data["llama_server"]), Path(data["model"])), ""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class Probe:
    """One readiness observation: seconds since spawn, and ``refused``/``timeout`` or a status."""

    t: float
    outcome: str | int
    body: str = ""


@dataclass
class LlamaServer:
    base_url: str
    port: int
    alias: str
    api_key: str | None
    process: trio.Process
    log_path: Path
    argv: list[str]
    started_at: float
    probes: list[Probe] = field(default_factory=list)

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "<no log>"
        return "\n".join(text.splitlines()[-lines:])

    def client(self, *, api_key: str | None = None, timeout: float = 30.0) -> httpx2.AsyncClient:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        return httpx2.AsyncClient(base_url=self.base_url, headers=headers, timeout=timeout)

    def first_probe(self, outcome: str | int) -> Probe | None:
        return next((p for p in self.probes if p.outcome == outcome), None)


class ServerStartError(RuntimeError):
    pass


ServerFactory = Callable[..., AbstractAsyncContextManager[LlamaServer]]


def server_argv(
    assets: LlamaAssets,
    port: int,
    *,
    alias: str = DEFAULT_ALIAS,
    ctx: int = DEFAULT_CTX,
    threads: int = 2,
    parallel: int = DEFAULT_PARALLEL,
    metrics: bool = True,
    api_key: str | None = None,
    extra: Sequence[str] = (),
) -> list[str]:
    argv = [
        str(assets.binary),
        "-m", str(assets.model),
        "--host", "127.0.0.1",
        "--port", str(port),
        "-c", str(ctx),
        "-t", str(threads),
        "-np", str(parallel),
        "--alias", alias,
    ]  # fmt: skip
    if metrics:
        argv.append("--metrics")
    if api_key:
        argv += ["--api-key", api_key]
    argv += list(extra)
    return argv


async def stop_process(proc: trio.Process, grace: float = STOP_GRACE_S) -> None:
    """SIGTERM, wait up to ``grace`` seconds, then SIGKILL; always reap. Shielded."""
    with trio.CancelScope(shield=True):
        if proc.returncode is None:
            with suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            with trio.move_on_after(grace):
                await proc.wait()
            if proc.returncode is None:
                proc.kill()
        await proc.wait()


async def wait_until_ready(server: LlamaServer, within: float = READY_TIMEOUT_S) -> None:
    """Poll ``/health`` until 200, recording every change of outcome in ``server.probes``."""
    last: str | int | None = None
    try:
        with trio.fail_after(within):
            async with httpx2.AsyncClient(base_url=server.base_url, timeout=5.0) as client:
                while True:
                    if server.process.poll() is not None:
                        raise ServerStartError(
                            f"llama-server exited with code {server.process.returncode} "
                            f"before it was ready; log tail:\n{server.log_tail()}"
                        )
                    t = time.monotonic() - server.started_at
                    body = ""
                    try:
                        resp = await client.get("/health")
                    except httpx2.ConnectError:
                        outcome: str | int = "refused"
                    except httpx2.TimeoutException:
                        outcome = "timeout"
                    else:
                        outcome, body = resp.status_code, resp.text
                    if outcome != last:
                        server.probes.append(Probe(round(t, 3), outcome, body))
                        last = outcome
                    if outcome == 200:
                        return
                    await trio.sleep(POLL_INTERVAL_S)
    except trio.TooSlowError:
        raise ServerStartError(
            f"llama-server not ready after {within} s (probes {server.probes}); "
            f"log tail:\n{server.log_tail()}"
        ) from None


def _open_log(path: Path) -> BinaryIO:
    path.parent.mkdir(parents=True, exist_ok=True)
    return open(path, "wb")  # closed by the caller's with-block


@asynccontextmanager
async def run_llama_server(
    assets: LlamaAssets,
    log_dir: Path,
    *,
    wait_ready: bool = True,
    ready_timeout: float = READY_TIMEOUT_S,
    alias: str = DEFAULT_ALIAS,
    ctx: int = DEFAULT_CTX,
    parallel: int = DEFAULT_PARALLEL,
    metrics: bool = True,
    api_key: str | None = None,
    extra: Sequence[str] = (),
    name: str = "llama-server",
) -> AsyncIterator[LlamaServer]:
    """Run llama-server on a free port; yield once ``/health`` is 200 (or at once).

    Teardown: SIGTERM, up to 10 s grace, SIGKILL, reap; shielded from cancellation.
    """
    for attempt in range(3):  # a free port can be taken between probe and bind: retry
        port = free_port()
        argv = server_argv(
            assets, port, alias=alias, ctx=ctx, parallel=parallel, metrics=metrics,
            api_key=api_key, extra=extra,
        )  # fmt: skip
        log_path = log_dir / f"{name}-{port}.log"
        with _open_log(log_path) as log_file:
            started_at = time.monotonic()
            proc = await trio.lowlevel.open_process(
                argv, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT
            )
        server = LlamaServer(
            base_url=f"http://127.0.0.1:{port}",
            port=port,
            alias=alias,
            api_key=api_key,
            process=proc,
            log_path=log_path,
            argv=argv,
            started_at=started_at,
        )
        try:
            if wait_ready:
                try:
                    await wait_until_ready(server, ready_timeout)
                except ServerStartError:
                    if attempt < 2 and "bind" in server.log_tail().lower():
                        continue  # port race: stop this one (finally) and retry
                    raise
            yield server
            return
        finally:
            with trio.move_on_after(60, shield=True):  # stop_process bounds itself; belt and braces
                await stop_process(proc)
    raise ServerStartError("could not bind a free port after 3 attempts")
