"""Start and stop a real llama.cpp ``llama-server``, or nvpair's llama.cpp simulator with the
same flags, as a process under trio (shared by conftest and capture).

The binary and model come from ``scripts/llama_server.py`` (its ``paths --json`` subcommand), or
from the env vars ``NVPAIR_LLAMA_SERVER`` and ``NVPAIR_LLAMA_MODEL`` if both are set. The
simulator is ``python -m nvpair.sim llamacpp`` given llama-server's own flags (it accepts them),
plus its load time and a control port.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Literal

import httpx2
import trio
from tests.ports import free_port

REPO_ROOT = Path(__file__).resolve().parents[2]
PROVIDE_SCRIPT = REPO_ROOT / "scripts" / "llama_server.py"

DEFAULT_ALIAS = "gemma3-270m"
DEFAULT_CTX = 1024
DEFAULT_PARALLEL = 2
#: One compute thread. llama.cpp's threads spin-wait for each other at every step; on a shared
#: 2-core machine two of them were seen to make 10 short generations take 52 s instead of 1 s.
DEFAULT_THREADS = 1
READY_TIMEOUT_S = 120.0
STOP_GRACE_S = 10.0
POLL_INTERVAL_S = 0.02  # readiness poll of an external process only
#: the model path the simulator reports (it reads no file).
SIM_MODEL = "/models/gemma-3-270m-q4_k_m.gguf"
#: the simulator's load time when the test wants to see it loading (ended by finish_loading).
SIM_LONG_LOAD_S = 120.0

Variant = Literal["real", "sim"]


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



@dataclass(frozen=True)
class Probe:
    """One readiness observation: seconds since spawn, and ``refused``/``timeout`` or a status."""

    t: float
    outcome: str | int
    body: str = ""


@dataclass
class LlamaServer:
    """A running llama-server (``variant`` "real") or llama.cpp simulator ("sim")."""

    base_url: str
    port: int
    alias: str
    api_key: str | None
    #: a trio process, or a plain one for a server shared by the whole session
    process: trio.Process | subprocess.Popen[bytes]
    log_path: Path
    argv: list[str]
    started_at: float
    probes: list[Probe] = field(default_factory=list)
    variant: Variant = "real"
    #: the simulator's control port URL (None for the real server).
    control_url: str | None = None

    async def finish_loading(self) -> None:
        """The simulator: end its (long) load now. The real server loads on its own."""
        if self.control_url is None:
            await trio.lowlevel.checkpoint()
            return
        async with httpx2.AsyncClient(base_url=self.control_url, timeout=10.0) as control:
            resp = await control.post("/__sim/phase", json={"phase": "ready"})
            assert resp.status_code == 200, resp.text

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
    threads: int = DEFAULT_THREADS,
    parallel: int | None = DEFAULT_PARALLEL,
    metrics: bool = True,
    api_key: str | None = None,
    extra: Sequence[str] = (),
) -> list[str]:
    """llama-server's argv; ``parallel=None`` leaves ``-np`` out (auto: 4 slots, unified KV)."""
    argv = [
        str(assets.binary),
        "-m", str(assets.model),
        "--host", "127.0.0.1",
        "--port", str(port),
        "-c", str(ctx),
        "-t", str(threads),
        "--alias", alias,
        "--no-webui",  # this build has no web UI anyway; the simulator has one unless told
    ]  # fmt: skip
    if parallel is not None:
        argv += ["-np", str(parallel)]
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
    parallel: int | None = DEFAULT_PARALLEL,
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


def sim_argv(port: int, *, load_s: float, control: bool = True, **kwargs: Any) -> list[str]:
    """The simulator's argv: llama-server's (``server_argv``) run by ``python -m nvpair.sim
    llamacpp``, plus its load time and, with ``control``, a control port it picks."""
    assets = LlamaAssets(Path(sys.executable), Path(SIM_MODEL))
    argv = server_argv(assets, port, **kwargs)
    argv[1:1] = ["-m", "nvpair.sim", "llamacpp"]  # after the interpreter
    argv += ["--load-s", str(load_s)]
    argv += ["--control-port", "0"] if control else ["--no-control"]
    return argv


class SharedServers:
    """Ready servers with the default flags, one per variant, shared by every test of the
    session that only reads (started on first use, stopped at the end of the session).

    Plain processes, not trio ones, since each test runs its own trio loop; readiness is
    polled under ``trio.fail_after`` in a short ``trio.run``.
    """

    def __init__(self, log_dir: Path) -> None:
        self._log_dir = log_dir
        self._servers: dict[Variant, LlamaServer] = {}

    def get(self, variant: Variant, assets: LlamaAssets | None) -> LlamaServer:
        if variant not in self._servers:
            self._servers[variant] = self._start(variant, assets)
        server = self._servers[variant]
        if server.process.poll() is not None:
            raise ServerStartError(f"the shared {variant} server exited "
                                   f"({server.process.returncode}):\n{server.log_tail()}")
        return server

    def _start(self, variant: Variant, assets: LlamaAssets | None) -> LlamaServer:
        error: Exception | None = None
        for attempt in range(3):  # a free port can be taken between probe and bind: retry
            port = free_port()
            if variant == "real":
                assert assets is not None
                argv = server_argv(assets, port)
            else:
                argv = sim_argv(port, load_s=0.0, control=False)
            log_path = self._log_dir / f"shared-{variant}-{port}.log"
            with _open_log(log_path) as log_file:
                started_at = time.monotonic()
                proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log_file,
                                        stderr=subprocess.STDOUT, cwd=str(REPO_ROOT))
            server = LlamaServer(
                base_url=f"http://127.0.0.1:{port}", port=port, alias=DEFAULT_ALIAS,
                api_key=None, process=proc, log_path=log_path, argv=argv,
                started_at=started_at, variant=variant,
            )
            try:
                trio.run(wait_until_ready, server, READY_TIMEOUT_S)
                return server
            except ServerStartError as exc:
                _stop_popen(proc)
                error = exc
                if attempt == 2 or "bind" not in server.log_tail().lower():
                    break
        raise error or ServerStartError("could not start the shared server")

    def close(self) -> None:
        for server in self._servers.values():
            assert isinstance(server.process, subprocess.Popen)
            _stop_popen(server.process)
        self._servers.clear()


def _stop_popen(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM, up to ``STOP_GRACE_S``, then SIGKILL; always reap."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
    proc.wait()


async def _read_line(stream: trio.abc.ReceiveStream, within: float) -> bytes:
    data = b""
    with trio.fail_after(within):
        while not data.endswith(b"\n"):
            chunk = await stream.receive_some(256)
            if not chunk:
                break
            data += chunk
    return data


@asynccontextmanager
async def run_llamacpp_sim(
    log_dir: Path,
    *,
    wait_ready: bool = True,
    ready_timeout: float = 30.0,
    alias: str = DEFAULT_ALIAS,
    ctx: int = DEFAULT_CTX,
    parallel: int | None = DEFAULT_PARALLEL,
    metrics: bool = True,
    api_key: str | None = None,
    extra: Sequence[str] = (),
    name: str = "llamacpp-sim",
    load_s: float | None = None,
) -> AsyncIterator[LlamaServer]:
    """Run ``python -m nvpair.sim llamacpp`` with llama-server's flags (same argv as
    :func:`run_llama_server` but for the program), on a port it picks; yield once ``/health``
    is 200 (or at once). Without ``wait_ready`` it loads for ``SIM_LONG_LOAD_S`` unless
    ``load_s`` says otherwise; :meth:`LlamaServer.finish_loading` ends that.
    """
    if load_s is None:
        load_s = 0.0 if wait_ready else SIM_LONG_LOAD_S
    argv = sim_argv(0, load_s=load_s, alias=alias, ctx=ctx, parallel=parallel,
                    metrics=metrics, api_key=api_key, extra=extra)
    log_path = log_dir / f"{name}.log"
    with _open_log(log_path) as log_file:
        started_at = time.monotonic()
        proc = await trio.lowlevel.open_process(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log_file,
            cwd=str(REPO_ROOT),
        )
    try:
        assert proc.stdout is not None
        banner = (await _read_line(proc.stdout, 30.0)).decode()
        # "sim llamacpp listening on 127.0.0.1:PORT control 127.0.0.1:CPORT"
        words = banner.split()
        if len(words) < 7 or words[2:4] != ["listening", "on"] or words[5] != "control":
            log_tail = log_path.read_text(errors="replace")[-2000:]
            raise ServerStartError(f"simulator banner {banner!r}; log:\n{log_tail}")
        port = int(words[4].rpartition(":")[2])
        server = LlamaServer(
            base_url=f"http://127.0.0.1:{port}", port=port, alias=alias, api_key=api_key,
            process=proc, log_path=log_path, argv=argv, started_at=started_at,
            variant="sim", control_url=f"http://{words[6]}",
        )
        if wait_ready:
            await wait_until_ready(server, ready_timeout)
        yield server
    finally:
        with trio.move_on_after(STOP_GRACE_S + 5, shield=True):
            await stop_process(proc)
            if proc.stdout is not None:
                await proc.stdout.aclose()
