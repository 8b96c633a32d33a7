"""Scenario 4: requests per second with 16 connections, nvpair against the server's floor.

nvpair adopts 8 quick simulated engines (one farm process). Once every engine is listed,
the bodies nvpair answers on ``/v1/models`` and ``/v1/engines`` are saved and served
unchanged by two floor processes on the same hypercorn trio worker and settings
(:mod:`benchmarks.floor`): a bare ASGI callable, and a QuartTrio app. The load generator
(:mod:`benchmarks.wrk`) runs in its own process; servers and paths are interleaved and
repeated, and the median of the repetitions is kept.
"""

from __future__ import annotations

import importlib.util
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.config import BenchConfig
from benchmarks.procs import (
    PY,
    CpuMeter,
    Procs,
    engine_toml,
    free_port,
    request,
    start_nvpair,
    wait_http,
)
from benchmarks.wrk import run_load, wrk_path

PATHS = ("/v1/models", "/v1/engines")


def quart_available() -> tuple[bool, str]:
    if importlib.util.find_spec("quart_trio") is not None:
        return True, "quart-trio was already installed"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "quart-trio"],
                          capture_output=True, text=True, check=False, timeout=300)
    if proc.returncode == 0:
        return True, "quart-trio installed by the bench run (pip install quart-trio)"
    return False, f"quart-trio could not be installed: {proc.stderr.strip()[-200:]}"


def wait_all_listed(url: str, count: int, within: float = 60.0) -> None:
    start = time.monotonic()
    while time.monotonic() - start < within:
        status, body = request("GET", f"{url}/v1/models")
        if status == 200 and len(json.loads(body)["data"]) >= count:
            return
        time.sleep(0.1)
    raise RuntimeError(f"{url}: not all {count} models listed within {within:g} s")


def run(cfg: BenchConfig, workdir: Path) -> dict[str, Any]:
    with Procs(workdir) as procs:
        engines = start_farms_all_quick(procs, 8)
        body = "".join(engine_toml(f"e{e['index']:03d}", "sglang", e["port"], e["model"])
                       for e in engines)
        nv, nv_url, _ = start_nvpair(procs, "nvpair-throughput", body)
        wait_all_listed(nv_url, len(engines))
        routes = []
        sizes = {}
        for path in PATHS:
            status, data = request("GET", f"{nv_url}{path}")
            assert status == 200
            file = workdir / f"body{path.replace('/', '_')}.json"
            file.write_bytes(data)
            routes += ["--route", f"{path}={file}"]
            sizes[path] = len(data)
        servers = {"nvpair": nv_url}
        pids = {"nvpair": nv.pid}
        ok, quart_note = quart_available()
        frameworks = ["asgi", "quart"] if ok else ["asgi"]
        for fw in frameworks:
            port = free_port()
            proc = procs.start(f"floor-{fw}", [PY, "-m", "benchmarks.floor", "--framework", fw,
                                               "--listen", f"127.0.0.1:{port}", *routes])
            url = f"http://127.0.0.1:{port}"
            wait_http(f"{url}/healthz", proc)
            servers[f"floor_{fw}"] = url
            pids[f"floor_{fw}"] = proc.pid
        # the floors answer the very bytes nvpair answered
        for name, url in servers.items():
            for path in PATHS:
                status, data = request("GET", f"{url}{path}")
                assert status == 200 and (name == "nvpair" or data == (
                    workdir / f"body{path.replace('/', '_')}.json").read_bytes()), (name, path)
        samples: dict[str, dict[str, list[dict[str, Any]]]] = {
            s: {p: [] for p in PATHS} for s in servers}
        for _ in range(cfg.throughput_reps):
            for path in PATHS:
                for name, url in servers.items():
                    if cfg.throughput_warmup_s > 0:
                        run_load(f"{url}{path}", cfg.throughput_connections,
                                 cfg.throughput_warmup_s)
                    meter = CpuMeter(pids[name])
                    sample = run_load(f"{url}{path}", cfg.throughput_connections,
                                      cfg.throughput_s)
                    cpu = meter.read()["cpu_s"]
                    sample["server_cpu_us_per_request"] = (
                        round(cpu * 1e6 / sample["requests"], 1) if sample["requests"] else None)
                    samples[name][path].append(sample)
    table: dict[str, Any] = {}
    for name, by_path in samples.items():
        table[name] = {}
        for path, runs in by_path.items():
            table[name][path] = {
                "rps": round(statistics.median(r["rps"] for r in runs), 1),
                "rps_runs": [r["rps"] for r in runs],
                "p50_ms": statistics.median(r["p50_ms"] or 0 for r in runs),
                "p99_ms": statistics.median(r["p99_ms"] or 0 for r in runs),
                "errors": sum(r["errors"] for r in runs),
                "server_cpu_us_per_request": statistics.median(
                    r["server_cpu_us_per_request"] or 0 for r in runs),
            }
    ratios: dict[str, Any] = {}
    for path in PATHS:
        floor = table["floor_asgi"][path]["rps"]
        cpu_floor = table["floor_asgi"][path]["server_cpu_us_per_request"]
        ratios[path] = {
            "nvpair_over_floor": round(table["nvpair"][path]["rps"] / floor, 3) if floor else None,
            # the same ratio from CPU time per request (floor / nvpair): far less sensitive
            # to other load on the machine than requests per second
            "nvpair_over_floor_by_cpu": round(
                cpu_floor / table["nvpair"][path]["server_cpu_us_per_request"], 3)
            if cpu_floor else None,
        }
        if "floor_quart" in table:
            ratios[path]["quart_over_floor"] = round(
                table["floor_quart"][path]["rps"] / floor, 3) if floor else None
            ratios[path]["quart_over_floor_by_cpu"] = round(
                cpu_floor / table["floor_quart"][path]["server_cpu_us_per_request"], 3
            ) if cpu_floor else None
            q = table["floor_quart"][path]["rps"]
            ratios[path]["nvpair_over_quart"] = round(
                table["nvpair"][path]["rps"] / q, 3) if q else None
    return {
        "load_generator": "wrk -t1 -c16 (Debian wrk)" if wrk_path() else
        "python fallback (benchmarks.wrk, 2 processes): wrk is not installed",
        "connections": cfg.throughput_connections,
        "window_s": cfg.throughput_s,
        "repetitions": cfg.throughput_reps,
        "engines": len(engines),
        "body_bytes": sizes,
        "quart": quart_note,
        "servers": table,
        "ratios": ratios,
    }


def start_farms_all_quick(procs: Procs, k: int) -> list[dict[str, Any]]:
    farm = procs.start(f"farm-throughput-{k}", [
        PY, "-m", "nvpair.sim", "farm", "--kind", "sglang", "--count", str(k)],
        stdout=subprocess.PIPE)
    assert farm.popen.stdout is not None
    line = farm.popen.stdout.readline()
    if not line:
        raise RuntimeError(f"{farm.name} exited:\n{farm.tail()}")
    engines: list[dict[str, Any]] = json.loads(line)
    return engines

