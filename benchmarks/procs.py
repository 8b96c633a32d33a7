"""Processes under test, and what /proc and ss say about them.

Everything measured runs as its own process (nvpair, simulators, the baseline, the floor
servers, the load generators); this module starts them, waits until they answer, reads their
CPU time, RSS, fds and CLOSE-WAIT sockets, and stops them (SIGTERM, then SIGKILL).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from tests.ports import free_port as free_port  # (one port helper for tests and benchmarks)

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
CLK_TCK = os.sysconf("SC_CLK_TCK")


def env() -> dict[str, str]:
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [e.get("PYTHONPATH")])])
    e.setdefault("PYTHONUNBUFFERED", "1")
    return e


class Proc:
    """A child process with a name; ``stop()`` is SIGTERM, a grace, then SIGKILL."""

    def __init__(self, name: str, argv: Sequence[str], log: Path | None = None,
                 stdout: int | None = subprocess.DEVNULL,
                 extra_env: dict[str, str] | None = None) -> None:
        self.name = name
        self.argv = list(argv)
        self.log = log
        err = open(log, "ab") if log else subprocess.DEVNULL  # noqa: SIM115
        try:
            self.popen = subprocess.Popen(self.argv, cwd=ROOT, env={**env(), **(extra_env or {})},
                                          stdout=stdout,
                                          stderr=err, stdin=subprocess.DEVNULL)
        finally:
            if log and not isinstance(err, int):
                err.close()
        self.pid = self.popen.pid
        self.started = time.monotonic()

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self, grace: float = 5.0) -> int | None:
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.popen.terminate()
            try:
                self.popen.wait(grace)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)
        if self.popen.stdout is not None:
            self.popen.stdout.close()
        return self.popen.returncode

    def tail(self, lines: int = 20) -> str:
        if self.log is None or not self.log.exists():
            return ""
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


class Procs:
    """Every process one scenario started; ``close()`` stops them in reverse order."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.items: list[Proc] = []

    def start(self, name: str, argv: Sequence[str], stdout: int | None = subprocess.DEVNULL,
              extra_env: dict[str, str] | None = None) -> Proc:
        proc = Proc(name, argv, self.workdir / f"{name}.log", stdout=stdout, extra_env=extra_env)
        self.items.append(proc)
        return proc

    def close(self) -> None:
        while self.items:
            self.items.pop().stop()

    def __enter__(self) -> Procs:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- HTTP, synchronous (the orchestrator's own requests: setup and checks) ----------------------


def request(method: str, url: str, body: object = None, timeout: float = 5.0
         ) -> tuple[int, bytes]:
    m = re.fullmatch(r"http://([^:/]+):(\d+)(/.*)", url)
    assert m, url
    conn = http.client.HTTPConnection(m[1], int(m[2]), timeout=timeout)
    try:
        data = None if body is None else json.dumps(body).encode()
        headers = {"content-type": "application/json"} if data is not None else {}
        conn.request(method, m[3], body=data, headers=headers)
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def get_json(url: str, timeout: float = 5.0) -> Any:
    status, body = request("GET", url, timeout=timeout)
    if status != 200:
        raise RuntimeError(f"GET {url}: {status} {body[:200]!r}")
    return json.loads(body)


def wait_http(url: str, proc: Proc, within: float = 30.0) -> float:
    """Wait until ``url`` answers 200; the time it took. Fails if ``proc`` dies."""
    start = time.monotonic()
    while time.monotonic() - start < within:
        if not proc.alive():
            raise RuntimeError(f"{proc.name} exited ({proc.popen.returncode}):\n{proc.tail()}")
        with contextlib.suppress(OSError, http.client.HTTPException):
            if request("GET", url, timeout=2.0)[0] == 200:
                return time.monotonic() - start
        time.sleep(0.05)
    raise RuntimeError(f"{proc.name}: {url} did not answer within {within:g} s:\n{proc.tail()}")


# -- what runs -----------------------------------------------------------------------------------


def start_sim(procs: Procs, name: str, kind: str = "sglang", *extra: str,
              model: str = "deepseek-v4.1-flash") -> tuple[Proc, int, str]:
    """One simulator process, ready. (proc, engine port, control URL)."""
    port, control = free_port(), free_port()
    proc = procs.start(name, [PY, "-m", "nvpair.sim", kind, "--port", str(port),
                              "--control-port", str(control), "--model", model,
                              "--load-s", "0", "--warmup-s", "0", "--log-level", "WARNING",
                              *extra])
    control_url = f"http://127.0.0.1:{control}"
    wait_http(f"{control_url}/__sim/stats", proc)
    get_json(f"{control_url}/__sim/wait?phase=ready", timeout=30)
    return proc, port, control_url


def engine_toml(name: str, kind: str, port: int, model: str | None = None,
                extra: str = "") -> str:
    text = f"[[engines]]\nname = '{name}'\nkind = '{kind}'\nport = {port}\n"
    if model:
        text += f"model = '{model}'\n"
    return text + extra + "\n"


def start_nvpair(procs: Procs, name: str, engines: str, *, top: str = "",
                 within: float = 60.0, loop_lag: Path | None = None) -> tuple[Proc, str, float]:
    """nvpair as a process (``python -m nvpair serve``). (proc, URL, seconds to answer).

    ``loop_lag``: where nvpair's loop-lag probe writes (``NVPAIR_LOOP_LAG_FILE``)."""
    port = free_port()
    cfg = procs.workdir / f"{name}.toml"
    cfg.write_text(f"listen = '127.0.0.1:{port}'\nnode = 'bench'\n"
                   f"log_dir = '{procs.workdir / 'logs'}'\n{top}\n{engines}")
    proc = procs.start(name, [PY, "-m", "nvpair", "serve", "--config", str(cfg)],
                       extra_env=None if loop_lag is None else {"NVPAIR_LOOP_LAG_FILE":
                                                                str(loop_lag)})
    url = f"http://127.0.0.1:{port}"
    took = wait_http(f"{url}/healthz", proc, within)
    return proc, url, took


def sim_stats(control_url: str) -> dict[str, Any]:
    doc: dict[str, Any] = get_json(f"{control_url}/__sim/stats")
    return doc


def sim_reset(control_url: str) -> None:
    request("POST", f"{control_url}/__sim/reset-stats", {})


def sim_fault(control_url: str, mode: str, paths: Sequence[str] = (),
              seconds: float | None = None) -> None:
    body: dict[str, Any] = {"mode": mode, "paths": list(paths)}
    if seconds is not None:
        body["seconds"] = seconds
    status, text = request("POST", f"{control_url}/__sim/fault", body)
    if status != 200:
        raise RuntimeError(f"fault {mode}: {status} {text[:200]!r}")


# -- /proc and ss ------------------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of ``pid`` (its threads included), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def memory_kb(pid: int) -> dict[str, int]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0])
    return out


def rss_mb(pid: int) -> float:
    return round(memory_kb(pid)["VmRSS"] / 1024, 2)


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def tcp_states(*pids: int) -> dict[int, dict[str, int]]:
    """TCP sockets owned by each of ``pids``, by state (one ``ss -tanp``)."""
    out: dict[int, dict[str, int]] = {pid: {} for pid in pids}
    try:
        text = subprocess.run(["ss", "-tanpH"], capture_output=True, text=True, check=True,
                              timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return out
    for line in text.splitlines():
        for pid in pids:
            if f"pid={pid}," in line:
                state = line.split()[0]
                out[pid][state] = out[pid].get(state, 0) + 1
    return out


def sockets(pid: int) -> list[tuple[str, str, str]]:
    """TCP sockets owned by ``pid``: (state, local address, peer address)."""
    try:
        text = subprocess.run(["ss", "-tanpH"], capture_output=True, text=True, check=True,
                              timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    out = []
    for line in text.splitlines():
        if f"pid={pid}," in line:
            f = line.split()
            out.append((f[0], f[3], f[4]))
    return out


class CpuMeter:
    """CPU used by a process between ``start`` and ``stop``, as a share of one core."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.t0 = time.monotonic()
        self.c0 = cpu_seconds(pid)

    def read(self) -> dict[str, float]:
        wall = time.monotonic() - self.t0
        cpu = cpu_seconds(self.pid) - self.c0
        return {"cpu_s": round(cpu, 3), "wall_s": round(wall, 3),
                "cpu_pct": round(100 * cpu / wall, 2) if wall > 0 else 0.0}


@contextlib.contextmanager
def workdir(base: Path) -> Iterator[Path]:
    base.mkdir(parents=True, exist_ok=True)
    yield base


def machine() -> dict[str, Any]:
    model = "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    load = os.getloadavg()
    mem = "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem = f"{int(line.split()[1]) / 1024 / 1024:.1f} GiB"
    return {"nproc": os.cpu_count(), "cpu_model": model, "memory": mem,
            "python": sys.version.split()[0], "platform": sys.platform,
            "loadavg_at_start": [round(x, 2) for x in load]}
