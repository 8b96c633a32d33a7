"""Scenario 5: a soak of status calls and probe timeouts against a hung simulator.

One SGLang simulator that accepts connections and never answers (``--fault hang`` on every
path). nvpair adopts it ``soak_engines`` times (engines ``h00``...), with a readiness probe
of ``soak_probe_s`` interval and timeout, so every probe is a timeout whose connection
nvpair must close. While those time out, the load generator makes ``soak_status_calls``
status calls (``GET /v1/engines/h00``, 16 keep-alive connections), and then ``soak_churn``
more, each on a new connection that the client closes after the answer (connection churn:
the peak of fds and CLOSE-WAIT during it, and how long CLOSE-WAIT takes to clear).

Before (after a warm-up, once no API socket is left in CLOSE-WAIT), after the status calls
and timeouts, and after the churn too (likewise):
nvpair's RSS, open fds and TCP sockets (``ss -tanp``), and the simulator's.
The probes keep timing out during both readings, so each reading is the median of five
samples taken 0.2 s apart, and sockets are counted apart from the other fds.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

from benchmarks.config import BenchConfig
from benchmarks.procs import (
    PY,
    Procs,
    engine_toml,
    fd_count,
    get_json,
    memory_kb,
    sockets,
    start_nvpair,
    start_sim,
    tcp_states,
)
from benchmarks.wrk import run_load


def timeouts(url: str) -> int:
    doc = get_json(f"{url}/v1/engines", timeout=10)
    return sum(p.get("timeouts", 0) for e in doc["engines"] for p in e["probes"].values())


def fd_kinds(pid: int) -> tuple[int, int]:
    """(sockets, everything else) among the open fds of ``pid``."""
    socks = other = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:"):
            socks += 1
        else:
            other += 1
    return socks, other


def reading(pid: int, sim_pid: int, sim_port: int, api_port: int) -> dict[str, Any]:
    """nvpair's RSS, fds and sockets; the simulator's fds and CLOSE-WAIT.

    The probes keep timing out while this reads (each engine opens and closes a connection
    to the simulator many times a second), so the socket count moves between readings by up
    to one per engine; the fds that are not sockets, the API's connections and CLOSE-WAIT
    must come back exactly."""
    samples = []
    for _ in range(5):
        mine = sockets(pid)
        socks, other = fd_kinds(pid)
        samples.append({
            "rss_kb": memory_kb(pid)["VmRSS"],
            "fds": socks + other,
            "fds_not_sockets": other,
            "sockets": socks,
            "probe_sockets": sum(1 for _, _, peer in mine if peer.endswith(f":{sim_port}")),
            "api_connections": sum(1 for st, local, _ in mine
                                   if st != "LISTEN" and local.endswith(f":{api_port}")),
            "close_wait": sum(1 for st, _, _ in mine if st == "CLOSE-WAIT"),
            "sim_close_wait": tcp_states(sim_pid)[sim_pid].get("CLOSE-WAIT", 0),
            "sim_fds": fd_count(sim_pid),
        })
        time.sleep(0.2)
    return {k: statistics.median(s[k] for s in samples) for k in samples[0]} | {
        "rss_mb": round(statistics.median(s["rss_kb"] for s in samples) / 1024, 2)}


def settle(pid: int, api_port: int, limit_s: float) -> float:
    """Wait until nvpair holds no connection on its API port (at most ``limit_s``, at least
    0.5 s); how long that took. Hypercorn's trio worker closes a connection whose client has
    gone only when its idle timer fires (keep-alive, 5 s), so this can take that long."""
    started = time.monotonic()
    time.sleep(0.5)
    while time.monotonic() - started < limit_s:
        if not any(st != "LISTEN" and local.endswith(f":{api_port}")
                   for st, local, _ in sockets(pid)):
            break
        time.sleep(0.25)
    return round(time.monotonic() - started, 2)


def churn(procs: Procs, url: str, pid: int, api_port: int, requests: int) -> dict[str, Any]:
    """``requests`` status calls, each on a new connection the client closes after the
    answer (two processes, 4 clients each): peak fds and CLOSE-WAIT during, and how long
    until CLOSE-WAIT was gone again."""
    gens = [procs.start(f"churn-{i}", [PY, "-m", "benchmarks.wrk", "--url", url,
                                       "--connections", "4", "--fresh",
                                       "--limit", str(requests // 2)], stdout=subprocess.PIPE)
            for i in range(2)]
    started = time.monotonic()
    peak_fds = peak_cw = 0
    while any(g.alive() for g in gens) and time.monotonic() - started < 900:
        mine = sockets(pid)
        peak_cw = max(peak_cw, sum(1 for st, local, _ in mine
                                   if st == "CLOSE-WAIT" and local.endswith(f":{api_port}")))
        peak_fds = max(peak_fds, fd_count(pid))
        time.sleep(0.25)
    took = time.monotonic() - started
    done = 0
    errors = 0
    for g in gens:
        out, _ = g.popen.communicate(timeout=60)
        doc = json.loads(out.strip().splitlines()[-1])
        done += doc["requests"]
        errors += doc["errors"]
        procs.items.remove(g)
    cleared = settle(pid, api_port, 15.0)
    return {"requests": done, "errors": errors, "rate_per_s": round(done / took, 1),
            "peak_fds": peak_fds, "peak_close_wait": peak_cw,
            "close_wait_cleared_after_s": cleared}


def run(cfg: BenchConfig, workdir: Path) -> dict[str, Any]:
    with Procs(workdir) as procs:
        sim, port, _ = start_sim(procs, "soak-sim", "sglang", "--fault", "hang",
                                 model="hung-model")
        p = cfg.soak_probe_s
        probes = (f"[engines.probes.ready]\ninterval_s = {p}\ntimeout_s = {p}\n"
                  f"[engines.probes.health]\ninterval_s = {p}\ntimeout_s = {p}\n")
        body = "".join(engine_toml(f"h{i:02d}", "sglang", port, "hung-model", probes)
                       for i in range(cfg.soak_engines))
        manager, url, _ = start_nvpair(procs, "nvpair-soak", body)
        status_url = f"{url}/v1/engines/h00"
        # warm-up: some status calls and some timeouts, then let idle connections expire
        run_load(status_url, 16, 60, limit=cfg.soak_status_calls // 20)
        deadline = time.monotonic() + 60
        while timeouts(url) < cfg.soak_timeouts // 20 and time.monotonic() < deadline:
            time.sleep(0.5)
        api_port = int(url.rsplit(":", 1)[1])
        settle(manager.pid, api_port, cfg.soak_settle_s)
        before = reading(manager.pid, sim.pid, port, api_port)
        t_before = timeouts(url)
        started = time.monotonic()
        load = run_load(status_url, 16, 3600, limit=cfg.soak_status_calls)
        status_done_s = time.monotonic() - started
        deadline = time.monotonic() + 600
        while timeouts(url) - t_before < cfg.soak_timeouts and time.monotonic() < deadline:
            time.sleep(0.5)
        probe_done_s = time.monotonic() - started
        settle(manager.pid, api_port, cfg.soak_settle_s)
        mid = reading(manager.pid, sim.pid, port, api_port)
        churned = churn(procs, status_url, manager.pid, api_port, cfg.soak_churn)
        t_after = timeouts(url)
        settled = settle(manager.pid, api_port, cfg.soak_settle_s)
        after = reading(manager.pid, sim.pid, port, api_port)
        peak = memory_kb(manager.pid)["VmHWM"]
    growth = round(after["rss_mb"] - before["rss_mb"], 2)
    growth_keep_alive = round(mid["rss_mb"] - before["rss_mb"], 2)
    return {
        "engines": cfg.soak_engines,
        "probe_interval_and_timeout_s": p,
        "status_calls": load["requests"],
        "status_errors": load["errors"],
        "status_rps": load["rps"],
        "status_calls_took_s": round(status_done_s, 1),
        "probe_timeouts": t_after - t_before,
        "probe_timeouts_took_s": round(probe_done_s, 1),
        "connection_churn": churned,
        "settled_after_s": settled,
        "before": before,
        "after_status_calls": mid,
        "after": after,
        "rss_growth_mb": growth,
        "rss_growth_before_churn_mb": growth_keep_alive,
        "peak_rss_mb": round(peak / 1024, 2),
        "fds_delta": after["fds"] - before["fds"],
        "close_wait_delta": after["close_wait"] - before["close_wait"],
    }

