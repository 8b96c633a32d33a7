"""Scenario 3: K simulated engines, a quarter of them hung or slow (up to K = 1,024).

For each K: the simulators run in ``ceil(K / sims_per_process)`` farm processes
(``python -m nvpair.sim farm``, :mod:`nvpair.sim.farm`), nvpair adopts all K with the default
SGLang manifest, and the orchestrator polls ``/v1/models`` every 20 ms from nvpair's start
until every quick engine's model is listed, then every slow one's (the time to the first
full listing, counted from the process start and from the moment its API first answered).

Then, side by side in the same window (:func:`measure`): ``scale_load_clients`` back-to-back
clients go round nvpair and a floor server (:mod:`benchmarks.floor`) answering the very
bytes nvpair answered at that moment, alternating ``/v1/models`` and an engine's status,
while a sequential ``GET /healthz`` every 50 ms from another process reads each server's
own latency; then
nothing reads: 10 s of loop lag, then ``scale_idle_s`` of nvpair's CPU while it only probes
(the loop-lag probe paused, its own wake-ups not counted), and the RSS is read at a fixed age
(``scale_rss_age_s`` after nvpair's start; it grows for the first minute).
nvpair runs its loop-lag probe (``NVPAIR_LOOP_LAG_FILE``): the longest gap between ticks of
a 5 ms timer, for the start, the load and the idle windows.
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
    Proc,
    Procs,
    engine_toml,
    fd_count,
    memory_kb,
    request,
    start_nvpair,
)
from benchmarks.replay import start_floor
from nvpair.runtime.looplag import PAUSE_SUFFIX

HEALTHZ_EVERY_S = 0.05
#: the idle window's loop lag is read for this long before its CPU (see ``measure``)
IDLE_LAG_S = 10.0


def start_farms(procs: Procs, tag: str, kind: str, k: int, per: int, *,
                bad_every: int = 4, models_per_engine: int = 1,
                control: bool = False) -> list[dict[str, Any]]:
    """``k`` simulated engines in ``ceil(k / per)`` farm processes; their descriptions
    (``control``: each engine with a control port, for its request counts)."""
    farms = []
    for i in range(math.ceil(k / per)):
        first, count = i * per, min(per, k - i * per)
        farms.append(procs.start(f"farm-{tag}-{i}", [
            PY, "-m", "nvpair.sim", "farm", "--kind", kind, "--first", str(first),
            "--count", str(count), "--bad-every", str(bad_every),
            "--models-per-engine", str(models_per_engine),
            *(["--control"] if control else [])], stdout=subprocess.PIPE))
    engines: list[dict[str, Any]] = []
    for farm in farms:
        assert farm.popen.stdout is not None
        line = farm.popen.stdout.readline()
        if not line:
            raise RuntimeError(f"{farm.name} exited:\n{farm.tail()}")
        engines += json.loads(line)
    return engines


def first_listing(url: str, quick: set[str], slow: set[str], spawned: float,
                  wait_slow: bool, within: float = 60.0, every: float = 0.02
                  ) -> dict[str, Any]:
    port = int(url.rsplit(":", 1)[1])
    latencies: list[float] = []
    listed_at = None
    slow_at = None
    while time.monotonic() - spawned < within:
        t0 = time.monotonic()
        try:
            status, body = request("GET", f"http://127.0.0.1:{port}/v1/models", timeout=10)
        except OSError:
            time.sleep(every)
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
        time.sleep(every)
    ordered = sorted(latencies)
    return {
        "all_quick_listed_s": None if listed_at is None else round(listed_at, 3),
        "all_slow_listed_s": None if slow_at is None else round(slow_at, 3),
        "reads_during_startup": len(ordered),
        "read_p50_ms": round((quantile(ordered, 0.5) or 0) * 1000, 3),
        "read_max_ms": round(ordered[-1] * 1000, 3) if ordered else None,
    }


def loop_lag(path: Path, since: float, until: float) -> dict[str, Any]:
    """The longest gap between the probe's 5 ms ticks in the seconds reported within
    [since, until] (unix times; each line covers the second before its ``t``)."""
    lines = []
    if path.exists():
        for text in path.read_text().splitlines():
            try:
                lines.append(json.loads(text))
            except ValueError:  # a line being written
                continue
    inside = [ln for ln in lines if since < ln["t"] <= until + 1.0]
    if not inside:
        return {"max_ms": None, "seconds": 0}
    worst = sorted(ln["max_ms"] for ln in inside)
    step = max(inside, key=lambda ln: ln.get("step_ms", 0))
    gap = max(inside, key=lambda ln: ln["max_ms"])
    return {"max_ms": worst[-1], "p99_ms": quantile(worst, 0.99), "seconds": len(inside),
            # the CPU the loop's thread spent in the longest gap (a gap long by the clock
            # that took little CPU was the process waiting for a core: the machine)
            "max_cpu_ms": gap.get("max_cpu_ms"),
            "over_20ms_seconds": sum(1 for w in worst if w > 20),
            # the longest single task step, and whose (the probe's Trio instrument)
            "step_ms": step.get("step_ms"), "step_task": step.get("step_task"),
            # the longest garbage collection (a pause inside whichever step allocated)
            "gc_ms": max((ln.get("gc_ms", 0) for ln in inside), default=None),
            "gc_gen": max(inside, key=lambda ln: ln.get("gc_ms", 0)).get("gc_gen")}


def measure(cfg: BenchConfig, procs: Procs, manager: Proc, url: str, status_engine: str,
            lag: Path, tag: str, workdir: Path, spawned: float,
            idle_s: float | None = None) -> dict[str, Any]:
    """nvpair and the floor under the same load, then nvpair idle: the second half of a
    scale run (see the module's docstring). ``spawned``: nvpair's start (monotonic);
    ``idle_s``: the idle CPU's window (``cfg.scale_idle_s`` by default)."""
    floor_lag = workdir / f"looplag-floor-{tag}.jsonl"
    floor, floor_url = start_floor(procs, url, workdir,
                                   ("/v1/models", f"/v1/engines/{status_engine}"),
                                   name=f"floor-{tag}", loop_lag=floor_lag)
    body_bytes = len(request("GET", f"{floor_url}/v1/models", timeout=30)[1])
    meter, floor_meter = CpuMeter(manager.pid), CpuMeter(floor.pid)
    load_from = time.time()
    both = ["--target", f"nvpair={url}#{status_engine}",
            "--target", f"floor={floor_url}#{status_engine}"]
    poller = procs.start(f"pollers-{tag}", [
        PY, "-m", "benchmarks.pollers", *both, "--clients", str(cfg.scale_load_clients),
        "--poll", "", "--duration", str(cfg.scale_load_s), "--timeout", "10"],
        stdout=subprocess.PIPE)
    # /healthz from a process of its own: read beside the clients, it measured the clients'
    # own loop (a 21 MB body parsed there held it 86 ms for nvpair and the floor alike)
    healthz = procs.start(f"healthz-{tag}", [
        PY, "-m", "benchmarks.pollers", *both, "--clients", "0", "--poll", "",
        "--healthz", str(HEALTHZ_EVERY_S), "--duration", str(cfg.scale_load_s),
        "--timeout", "10"], stdout=subprocess.PIPE)
    out, _ = poller.popen.communicate(timeout=cfg.scale_load_s + 120)
    hz_out, _ = healthz.popen.communicate(timeout=cfg.scale_load_s + 120)
    procs.items.remove(poller)
    procs.items.remove(healthz)
    load_until = time.time()
    targets = json.loads(out.strip().splitlines()[-1])["targets"]
    for label, series in json.loads(hz_out.strip().splitlines()[-1])["targets"].items():
        targets[label]["healthz"] = series["healthz"]
    load_cpu, floor_cpu = meter.read(), floor_meter.read()
    procs.items.remove(floor)
    floor.stop()
    time.sleep(0.5)  # let the load's connections close
    # idle: first the loop lag, then the CPU with the loop-lag probe paused (its own 200
    # wake-ups a second are about 2 % of a core: at 10 engines, 0.2 % per engine)
    idle_from = time.time()
    time.sleep(min(IDLE_LAG_S, cfg.scale_idle_s))
    idle_until = time.time()
    pause = Path(str(lag) + PAUSE_SUFFIX)
    pause.touch()
    time.sleep(1.5)  # (the probe notices at its next report)
    idle = CpuMeter(manager.pid)
    idle_end = time.monotonic() + (cfg.scale_idle_s if idle_s is None else idle_s)
    rss_at = spawned + cfg.scale_rss_age_s

    def rss() -> tuple[float, dict[str, int]]:  # (at its age: it grows the first minute)
        time.sleep(max(0.0, rss_at - time.monotonic()))
        return time.monotonic() - spawned, memory_kb(manager.pid)

    early = rss() if rss_at < idle_end else None  # (read within a long idle window)
    time.sleep(max(0.0, idle_end - time.monotonic()))
    idle_cpu = idle.read()
    pause.unlink()
    rss_age_s, mem = early or rss()
    nv, fl = targets["nvpair"], targets["floor"]
    ratio = {q: (round(nv["models"][q] / fl["models"][q], 3)
                 if nv["models"][q] and fl["models"][q] else None)
             for q in ("p50_ms", "p99_ms", "max_ms")}
    return {
        "load": {"clients": cfg.scale_load_clients, "models": nv["models"],
                 "status": nv["status"], "healthz": nv["healthz"],
                 "cpu_pct": load_cpu["cpu_pct"], "body_bytes": body_bytes},
        "floor": {"models": fl["models"], "status": fl["status"], "healthz": fl["healthz"],
                  "cpu_pct": floor_cpu["cpu_pct"]},
        "models_over_floor": ratio,
        "loop_lag": {"load": loop_lag(lag, load_from, load_until),
                     "idle": loop_lag(lag, idle_from, idle_until),
                     "floor_load": loop_lag(floor_lag, load_from, load_until)},
        "idle_cpu_pct": idle_cpu["cpu_pct"],
        "idle_window_s": idle_cpu["wall_s"],
        "rss_mb": round(mem["VmRSS"] / 1024, 2),
        "rss_age_s": round(rss_age_s, 1),
        "peak_rss_mb": round(mem["VmHWM"] / 1024, 2),
        "fds": fd_count(manager.pid),
    }


def states(url: str) -> dict[str, int]:
    doc = json.loads(request("GET", f"{url}/v1/engines", timeout=30)[1])
    out: dict[str, int] = {}
    for e in doc["engines"]:
        out[e["state"]] = out.get(e["state"], 0) + 1
    return out


def run_one(cfg: BenchConfig, workdir: Path, k: int) -> dict[str, Any]:
    with Procs(workdir) as procs:
        engines = start_farms(procs, f"k{k}", "sglang", k, cfg.sims_per_process)
        body = "".join(engine_toml(f"e{e['index']:03d}", "sglang", e["port"], e["model"])
                       for e in engines)
        quick = {e["model"] for e in engines if e["behaviour"] == "quick"}
        slow = {e["model"] for e in engines if e["behaviour"] == "slow"}
        lag = workdir / f"looplag-k{k}.jsonl"
        started_at = time.time()
        spawned = time.monotonic()
        manager, url, api_after = start_nvpair(procs, f"nvpair-k{k}", body, loop_lag=lag)
        listing = first_listing(url, quick, slow, spawned, wait_slow=not cfg.quick or k >= 256)
        if listing["all_quick_listed_s"] is not None:
            listing["all_quick_listed_after_api_s"] = round(
                listing["all_quick_listed_s"] - api_after, 3)
        listing["api_answered_s"] = round(api_after, 3)
        listed_at = time.time()
        out = {
            "k": k,
            "behaviours": {b: sum(1 for e in engines if e["behaviour"] == b)
                           for b in ("quick", "hung", "slow")},
            "sim_processes": math.ceil(k / cfg.sims_per_process),
            "first_listing": listing,
        }
        out.update(measure(cfg, procs, manager, url, "e000", lag, f"k{k}", workdir,
                           spawned))
        listing["loop_lag"] = loop_lag(lag, started_at, listed_at)  # its lines came later
        out["states_at_end"] = states(url)
        return out


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
