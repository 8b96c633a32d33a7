"""Scenario "probe_cost": the CPU nvpair spends on one probe, each way a probe can go.

A simulated vLLM engine (its own process) answers ``GET /health`` (cheap, empty body);
nvpair's ``probes.request`` asks it over and over in this process,
and the process's CPU time per probe is read (``resource.getrusage``). The ways, one after
another in the same run, twice, interleaved (this machine is shared; ratios are what count):

* ``pooled_kept``: a probe every 2 s, within the keep-alive: httpcore2's pool reuses
  one connection;
* ``pooled_closed``: a probe every 5 s through the pool, asking the engine to close the
  connection after answering (what every such probe did before nvpair.probing.oneshot);
* ``one_shot``: the same probe on a connection of its own (``nvpair.probing.oneshot``: a plain
  non-blocking socket, the request's bytes made once, the answer read by
  ``nvpair.probing.answer``), what probes further apart than ``probes.KEEPALIVE_S`` do now.

``python -m benchmarks.probe_cost [--quick]`` runs it alone and prints the numbers.
"""

from __future__ import annotations

import resource
import sys
from pathlib import Path
from typing import Any

import trio

from benchmarks.config import BenchConfig, run_alone
from benchmarks.procs import Procs, start_sim

WAYS = ("pooled_kept", "pooled_closed", "one_shot")


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def _measure(port: int, n: int, rounds: int) -> dict[str, Any]:
    from nvpair.config.manifest import ProbeSpec
    from nvpair.probing import probes

    url = f"http://127.0.0.1:{port}"
    specs = {"pooled_kept": ProbeSpec(path="/health", interval_s=2.0),
             "pooled_closed": ProbeSpec(path="/health", interval_s=5.0),
             "one_shot": ProbeSpec(path="/health", interval_s=5.0)}
    runs: dict[str, list[float]] = {way: [] for way in WAYS}
    for _ in range(rounds):
        for way in WAYS:
            async with probes.ProbeClient(url, timeout_s=5.0) as client:
                if way == "pooled_closed":
                    client.target = None  # (every probe through the pool, as before)
                spec = specs[way]
                for _ in range(n // 10):  # warm: connections, caches
                    await probes.request(client, spec, "/health", api_key=None)
                started = _cpu_s()
                for _ in range(n):
                    await probes.request(client, spec, "/health", api_key=None)
                runs[way].append((_cpu_s() - started) / n * 1e6)
    best = {way: round(min(us), 1) for way, us in runs.items()}
    return {"probes_per_run": n, "rounds": rounds,
            "cpu_us_per_probe": best,
            "runs_us": {way: [round(x, 1) for x in us] for way, us in runs.items()},
            "one_shot_over_pooled_closed": round(best["one_shot"] / best["pooled_closed"], 3),
            "one_shot_over_pooled_kept": round(best["one_shot"] / best["pooled_kept"], 3)}


def run(cfg: BenchConfig, workdir: Path) -> dict[str, Any]:
    """The scenario (``workdir``: where the simulator's log goes)."""
    n = 300 if cfg.quick else 3000
    with Procs(workdir) as procs:
        _, port, _ = start_sim(procs, "probe-cost-vllm", "vllm")
        return trio.run(_measure, port, n, 2)


def main(argv: list[str] | None = None) -> int:
    return run_alone("python -m benchmarks.probe_cost", run, argv)


if __name__ == "__main__":
    sys.exit(main())
