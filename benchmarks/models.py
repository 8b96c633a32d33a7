"""Scenario 4 (models): a few engines with very many models, 10 Ollama-like engines with
10,000 models each (100,000 models) in the full run.

The engines run in one farm process (``python -m nvpair.sim farm --kind ollama
--models-per-engine N``), nvpair adopts them with the default Ollama manifest, and the
orchestrator polls ``/v1/models`` every 200 ms from nvpair's start until every model of
every engine is listed. Then the same measurement as the scale scenario
(:func:`benchmarks.scale.measure`): nvpair and a floor answering the same bytes under 8
back-to-back clients with ``/healthz`` beside them, nvpair idle, its RSS and its loop lag.
The idle CPU's window is ``models_idle_s`` (120 s): it holds one re-reading of every list
(every 108 s for an unchanged 3.5 MB list), so it reads the long-run average.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from benchmarks.config import BenchConfig
from benchmarks.procs import Procs, engine_toml, request, start_nvpair
from benchmarks.scale import loop_lag, measure, start_farms, states


def listed(url: str, models: set[str], spawned: float, within: float = 120.0
           ) -> dict[str, Any]:
    latencies = []
    seen = 0
    while time.monotonic() - spawned < within:
        t0 = time.monotonic()
        try:
            status, body = request("GET", f"{url}/v1/models", timeout=30)
        except OSError:
            time.sleep(0.2)
            continue
        now = time.monotonic()
        latencies.append(now - t0)
        ids = {m["id"] for m in json.loads(body)["data"]} if status == 200 else set()
        seen = len(ids & models)
        if seen == len(models):
            return {"all_listed_s": round(now - spawned, 3), "reads_during_startup":
                    len(latencies), "read_max_ms": round(max(latencies) * 1000, 1)}
        time.sleep(0.2)
    return {"all_listed_s": None, "listed_at_the_end": seen,
            "reads_during_startup": len(latencies)}


def run(cfg: BenchConfig, workdir: Path) -> dict[str, Any]:
    n, per = cfg.models_engines, cfg.models_per_engine
    with Procs(workdir) as procs:
        engines = start_farms(procs, "models", "ollama", n, n, bad_every=0,
                              models_per_engine=per)
        body = "".join(engine_toml(f"e{e['index']:03d}", "ollama", e["port"])
                       for e in engines)
        models = {f"m-{e['index']:03d}-{j:05d}" for e in engines for j in range(per)}
        lag = workdir / "looplag-models.jsonl"
        started_at = time.time()
        spawned = time.monotonic()
        manager, url, api_after = start_nvpair(procs, "nvpair-models", body, loop_lag=lag)
        listing = listed(url, models, spawned)
        listing["api_answered_s"] = round(api_after, 3)
        listed_at = time.time()
        out: dict[str, Any] = {"engines": n, "models_per_engine": per, "models": len(models),
                               "first_listing": listing}
        out.update(measure(cfg, procs, manager, url, "e000", lag, "models", workdir,
                           spawned, idle_s=cfg.models_idle_s))
        listing["loop_lag"] = loop_lag(lag, started_at, listed_at)
        out["states_at_end"] = states(url)
        return out
