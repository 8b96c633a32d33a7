"""Scenarios 1 and 2: the report replayed against nvpair, and against the design that failed.

One SGLang simulator whose ``/health`` generates for 1.0 s (``slow``) and one whose
``/health`` takes 1 ms (``fast``), each adopted by its own manager process. Each manager
gets the report's pollers: two at 5 s, one at 10 s, a status poll at 1/s (a poll that has
not answered by its next tick is given up, as the desktop's was), plus N back-to-back
clients on ``/v1/models`` and the engine's status. The slow and the fast stack run in the
same window, so the machine's noise falls on both and their ratio is the headline: for
nvpair each back-to-back client goes round the two stacks in turn (same load, interleaved
moments); for the baseline each stack has its own poller process. As a control, the nvpair
round also includes a floor server (:mod:`benchmarks.floor`: hypercorn's trio worker
answering nvpair's bytes with nothing behind it), so a latency tail that the machine causes
shows on the floor too.

nvpair adopts with the default SGLang manifest. The baseline
(:mod:`benchmarks.baseline`) runs the same pollers against the same kind of simulators; a
fresh baseline process per N, so the work queued by one window does not spill into the next.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

from benchmarks.config import BenchConfig
from benchmarks.procs import (
    PY,
    CpuMeter,
    Proc,
    Procs,
    engine_toml,
    free_port,
    get_json,
    memory_kb,
    request,
    sim_reset,
    sim_stats,
    start_nvpair,
    start_sim,
    wait_http,
)

MODEL = "deepseek-v4.1-flash"
HEALTH_TICK = {"slow": 1.0, "fast": 0.001}
POLLERS = "5,5,10,1"
#: paths that run a generation on SGLang
GENERATING = ("/health", "/health_generate")


class Stack:
    """One simulator and the manager that adopted it."""

    def __init__(self, health: str, sim: Proc, control: str, manager: Proc, url: str) -> None:
        self.health = health
        self.sim = sim
        self.control = control
        self.manager = manager
        self.url = url


def start_sims(procs: Procs, prefix: str) -> dict[str, tuple[Proc, int, str]]:
    return {h: start_sim(procs, f"{prefix}-sim-{h}", "sglang", "--health-tick-s", str(tick),
                         model=MODEL)
            for h, tick in HEALTH_TICK.items()}


def wait_listed(url: str, engine: str, within: float = 30.0) -> None:
    start = time.monotonic()
    while time.monotonic() - start < within:
        doc = get_json(f"{url}/v1/engines/{engine}")
        if doc["state"] == "ready" and doc["models"]:
            return
        time.sleep(0.1)
    raise RuntimeError(f"{url}: engine {engine} was not ready and listed within {within:g} s")


def window(procs: Procs, stacks: list[Stack], clients: int, seconds: float, timeout: float,
           tag: str, interleave: bool, floor: Proc | None = None, floor_url: str = ""
           ) -> dict[str, Any]:
    """Run the pollers against every stack at once for ``seconds``; measure each.

    ``interleave``: one poller process whose back-to-back clients go round the stacks in
    turn (the fairest comparison: the same load at interleaved moments, never both at once
    for one client). Otherwise one poller process per stack, running side by side (for the
    baseline, where a client stuck for seconds on one stack must not starve the other).
    ``floor``: a floor server (fixed bytes) added to the interleaved round, as a control:
    the latency the machine and the server stack give with nothing behind them."""
    groups = [stacks] if interleave else [[s] for s in stacks]
    meters = {}
    if floor is not None:
        meters["floor"] = CpuMeter(floor.pid)
    for s in stacks:
        sim_reset(s.control)
        meters[s.health] = CpuMeter(s.manager.pid)
    started = time.monotonic()
    pollers = []
    for group in groups:
        argv = [PY, "-m", "benchmarks.pollers", "--clients", str(clients), "--poll", POLLERS,
                "--duration", str(seconds), "--timeout", str(timeout)]
        for s in group:
            argv += ["--target", f"{s.health}={s.url}#head"]
        if floor is not None and len(group) > 1:
            argv += ["--target", f"floor={floor_url}#head"]
        labels = "-".join(s.health for s in group)
        pollers.append(procs.start(f"pollers-{tag}-{labels}-n{clients}", argv,
                                   stdout=subprocess.PIPE))
    loads: dict[str, Any] = {}
    client_cpu = 0.0
    for poller in pollers:
        stdout, _ = poller.popen.communicate(timeout=seconds + 120)
        doc = json.loads(stdout.strip().splitlines()[-1])
        loads |= doc["targets"]
        client_cpu += doc["cpu_s"]
        procs.items.remove(poller)
    out: dict[str, Any] = {}
    for s in stacks:
        cpu = meters[s.health].read()
        stats = sim_stats(s.control)
        elapsed = time.monotonic() - started
        mem = memory_kb(s.manager.pid)
        per_hour = {path: round(v["count"] * 3600 / elapsed)
                    for path, v in stats["paths"].items() if v["count"]}
        out[s.health] = {
            "clients": clients,
            "window_s": round(elapsed, 2),
            "latency": loads[s.health],
            "engine_requests": {p: v["count"] for p, v in stats["paths"].items()},
            "engine_requests_per_hour": per_hour,
            "engine_requests_per_hour_total": sum(per_hour.values()),
            "generating_requests": sum(stats["paths"].get(p, {}).get("count", 0)
                                       for p in GENERATING),
            "manager_cpu_pct": cpu["cpu_pct"],
            "manager_rss_mb": round(mem["VmRSS"] / 1024, 2),
            "manager_peak_rss_mb": round(mem["VmHWM"] / 1024, 2),
        }
    if floor is not None:
        out["floor"] = {"latency": loads["floor"],
                        "manager_cpu_pct": meters["floor"].read()["cpu_pct"]}
    # the load generators' own CPU (all of them, for both stacks), as a share of one core
    out["clients_cpu_pct"] = round(100 * client_cpu / max(seconds, 0.1), 1)
    return out


def ratios(slow: dict[str, Any], fast: dict[str, Any]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for series in ("models", "status_all"):
        for q in ("p50_ms", "p99_ms", "max_ms"):
            a, b = slow["latency"][series][q], fast["latency"][series][q]
            out[f"{series}_{q}"] = round(a / b, 3) if a is not None and b else None
    return out


def start_floor(procs: Procs, url: str, workdir: Path,
                paths: tuple[str, ...] = ("/v1/models", "/v1/engines/head"),
                name: str = "floor", loop_lag: Path | None = None) -> tuple[Proc, str]:
    """The bare hypercorn-trio floor answering the bytes ``url`` answers right now
    (``loop_lag``: where its loop-lag probe writes)."""
    routes = []
    for path in paths:
        status, body = request("GET", f"{url}{path}", timeout=30)
        assert status == 200, (path, status)
        file = workdir / f"{name}{path.replace('/', '_')}.json"
        file.write_bytes(body)
        routes += ["--route", f"{path}={file}"]
    port = free_port()
    proc = procs.start(name, [PY, "-m", "benchmarks.floor", "--listen",
                              f"127.0.0.1:{port}", *routes],
                       extra_env=None if loop_lag is None else {"NVPAIR_LOOP_LAG_FILE":
                                                                str(loop_lag)})
    floor_url = f"http://127.0.0.1:{port}"
    wait_http(f"{floor_url}/healthz", proc)
    return proc, floor_url


def run_nvpair(cfg: BenchConfig, workdir: Path) -> dict[str, Any]:
    result: dict[str, Any] = {"by_clients": {}}
    with Procs(workdir) as procs:
        sims = start_sims(procs, "replay")
        stacks = []
        for health, (sim, port, control) in sims.items():
            manager, url, _ = start_nvpair(procs, f"nvpair-{health}",
                                           engine_toml("head", "sglang", port, MODEL))
            stacks.append(Stack(health, sim, control, manager, url))
        for s in stacks:
            wait_listed(s.url, "head")
        floor, floor_url = start_floor(procs, stacks[0].url, workdir)
        for n in cfg.clients:
            w = window(procs, stacks, n, cfg.replay_window_s, cfg.replay_timeout_s, "nvpair",
                       interleave=True, floor=floor, floor_url=floor_url)
            w["ratio_slow_fast"] = ratios(w["slow"], w["fast"])
            result["by_clients"][str(n)] = w
    return result


def run_baseline(cfg: BenchConfig, workdir: Path) -> dict[str, Any]:
    result: dict[str, Any] = {"by_clients": {}}
    with Procs(workdir) as procs:
        sims = start_sims(procs, "baseline")
        for n in cfg.baseline_clients:
            stacks = []
            for health, (sim, port, control) in sims.items():
                listen = free_port()
                manager = procs.start(f"baseline-{health}-n{n}", [
                    PY, "-m", "benchmarks.baseline", "--listen", f"127.0.0.1:{listen}",
                    "--engine", f"head=http://127.0.0.1:{port}"])
                url = f"http://127.0.0.1:{listen}"
                wait_http(f"{url}/healthz", manager)
                stacks.append(Stack(health, sim, control, manager, url))
            # no time limit of its own: the pollers' window caps the run (the baseline is
            # stopped right after it, with whatever work is still queued)
            w = window(procs, stacks, n, cfg.baseline_window_s, cfg.baseline_window_s,
                       "baseline", interleave=False)
            w["ratio_slow_fast"] = ratios(w["slow"], w["fast"])
            for s in stacks:  # the work still queued behind the lock when the window closed
                w[s.health]["backlog"] = get_json(f"{s.url}/debug/backlog")["head"]
            result["by_clients"][str(n)] = w
            for s in stacks:
                procs.items.remove(s.manager)
                s.manager.stop()
    return result
