"""Scenario 3: K simulated engines, a quarter of them hung or slow.

For each K: the simulators run in ``ceil(K / 64)`` farm processes (:mod:`benchmarks.simfarm`),
nvpair adopts all K with the default SGLang manifest, and the orchestrator polls
``/v1/models`` every 20 ms from nvpair's start until every quick engine's model is listed
(the time to the first full listing, counted from the process start and from the moment
its API first answered). Then ``scale_load_clients`` back-to-back clients read for
``scale_load_s`` (``/v1/models`` latency under load), then nothing reads for
``scale_idle_s`` (nvpair's CPU while it only probes), and the RSS is read.
"""

from __future__ import annotations

import itertools
import json
import math
import subprocess
import time
from pathlib import Path
from typing import Any

from benchmarks.config import BenchConfig
from benchmarks.pollers import quantile
from benchmarks.procs import (
    PY,
    CpuMeter,
    Procs,
    engine_toml,
    fd_count,
    memory_kb,
    request,
    start_nvpair,
)


def start_farms(procs: Procs, k: int, per: int) -> list[dict[str, Any]]:
    farms = []
    for i in range(math.ceil(k / per)):
        first, count = i * per, min(per, k - i * per)
        farms.append(procs.start(f"farm-k{k}-{i}", [
            PY, "-m", "benchmarks.simfarm", "--first", str(first), "--count", str(count),
            "--bad-every", "4"], stdout=subprocess.PIPE))
    engines: list[dict[str, Any]] = []
    for farm in farms:
        assert farm.popen.stdout is not None
        line = farm.popen.stdout.readline()
        if not line:
            raise RuntimeError(f"{farm.name} exited:\n{farm.tail()}")
        engines += json.loads(line)
    return engines


def first_listing(url: str, quick: set[str], slow: set[str], spawned: float,
                  wait_slow: bool, within: float = 60.0) -> dict[str, Any]:
    port = int(url.rsplit(":", 1)[1])
    latencies: list[float] = []
    listed_at = None
    slow_at = None
    while time.monotonic() - spawned < within:
        t0 = time.monotonic()
        try:
            status, body = request("GET", f"http://127.0.0.1:{port}/v1/models", timeout=10)
        except OSError:
            time.sleep(0.02)
            continue
        now = time.monotonic()
        latencies.append(now - t0)
        ids = {m["id"] for m in json.loads(body)["data"]} if status == 200 else set()
        if listed_at is None and quick <= ids:
            listed_at = now - spawned
        if slow_at is None and slow and slow <= ids:
            slow_at = now - spawned
        if listed_at is not None and (slow_at is not None or not slow or not wait_slow
                                      or now - spawned > listed_at + 8):
            break
        time.sleep(0.02)
    ordered = sorted(latencies)
    return {
        "all_quick_listed_s": None if listed_at is None else round(listed_at, 3),
        "all_slow_listed_s": None if slow_at is None else round(slow_at, 3),
        "reads_during_startup": len(ordered),
        "read_p50_ms": round((quantile(ordered, 0.5) or 0) * 1000, 3),
        "read_max_ms": round(ordered[-1] * 1000, 3) if ordered else None,
    }


def run_one(cfg: BenchConfig, workdir: Path, k: int) -> dict[str, Any]:
    with Procs(workdir) as procs:
        engines = start_farms(procs, k, cfg.sims_per_process)
        body = "".join(engine_toml(f"e{e['index']:03d}", "sglang", e["port"], e["model"])
                       for e in engines)
        quick = {e["model"] for e in engines if e["behaviour"] == "quick"}
        slow = {e["model"] for e in engines if e["behaviour"] == "slow"}
        spawned = time.monotonic()
        manager, url, api_after = start_nvpair(procs, f"nvpair-k{k}", body)
        listing = first_listing(url, quick, slow, spawned, wait_slow=not cfg.quick)
        if listing["all_quick_listed_s"] is not None:
            listing["all_quick_listed_after_api_s"] = round(
                listing["all_quick_listed_s"] - api_after, 3)
        listing["api_answered_s"] = round(api_after, 3)
        meter = CpuMeter(manager.pid)
        poller = procs.start(f"pollers-k{k}", [
            PY, "-m", "benchmarks.pollers", "--target", f"k={url}#e000",
            "--clients", str(cfg.scale_load_clients), "--poll", "",
            "--duration", str(cfg.scale_load_s), "--timeout", "10"], stdout=subprocess.PIPE)
        out, _ = poller.popen.communicate(timeout=cfg.scale_load_s + 120)
        procs.items.remove(poller)
        load = json.loads(out.strip().splitlines()[-1])["targets"]["k"]
        load_cpu = meter.read()
        time.sleep(0.5)  # let the load's connections close
        idle = CpuMeter(manager.pid)
        time.sleep(cfg.scale_idle_s)
        idle_cpu = idle.read()
        mem = memory_kb(manager.pid)
        doc = json.loads(request("GET", f"{url}/v1/engines", timeout=10)[1])
        states: dict[str, int] = {}
        for e in doc["engines"]:
            states[e["state"]] = states.get(e["state"], 0) + 1
        return {
            "k": k,
            "behaviours": {b: sum(1 for e in engines if e["behaviour"] == b)
                           for b in ("quick", "hung", "slow")},
            "sim_processes": math.ceil(k / cfg.sims_per_process),
            "first_listing": listing,
            "load": {"clients": cfg.scale_load_clients, "models": load["models"],
                     "status": load["status"], "cpu_pct": load_cpu["cpu_pct"]},
            "idle_cpu_pct": idle_cpu["cpu_pct"],
            "idle_window_s": idle_cpu["wall_s"],
            "rss_mb": round(mem["VmRSS"] / 1024, 2),
            "peak_rss_mb": round(mem["VmHWM"] / 1024, 2),
            "fds": fd_count(manager.pid),
            "states_at_end": states,
        }


def growth(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """How idle CPU and RSS grow with K: log-log slopes between successive K."""
    out: dict[str, Any] = {"idle_cpu_slopes": [], "rss_per_engine_kb": None}
    for a, b in itertools.pairwise(rows):
        ca, cb = a["idle_cpu_pct"], b["idle_cpu_pct"]
        slope = (math.log(cb / ca) / math.log(b["k"] / a["k"])) if ca > 0 and cb > 0 else None
        out["idle_cpu_slopes"].append({"from_k": a["k"], "to_k": b["k"],
                                       "slope": None if slope is None else round(slope, 3)})
    if len(rows) >= 2:
        first, last = rows[0], rows[-1]
        out["rss_per_engine_kb"] = round(
            (last["rss_mb"] - first["rss_mb"]) * 1024 / (last["k"] - first["k"]), 1)
        out["idle_cpu_per_engine_pct"] = {
            str(r["k"]): round(r["idle_cpu_pct"] / r["k"], 4) for r in rows}
    return out


def run(cfg: BenchConfig, workdir: Path) -> dict[str, Any]:
    rows = []
    for k in cfg.scale_ks:
        rows.append(run_one(cfg, workdir, k))
    return {"by_k": rows, "growth": growth(rows)}

