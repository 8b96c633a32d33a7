"""How long and how big each scenario runs: the full run and ``--quick`` (CI, about 90 s)."""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec


class BenchConfig(msgspec.Struct, frozen=True):
    quick: bool
    #: scenario 1: the back-to-back clients, and the window of each N (s)
    clients: tuple[int, ...] = (1, 8, 32)
    replay_window_s: float = 60.0
    replay_timeout_s: float = 30.0
    #: scenario 2: the baseline's N and window (s); each N gets a fresh baseline process
    baseline_clients: tuple[int, ...] = (1, 8, 32)
    baseline_window_s: float = 60.0
    #: scenario 3
    scale_ks: tuple[int, ...] = (1, 8, 64, 256, 1024)
    scale_load_clients: int = 8
    scale_load_s: float = 10.0
    scale_idle_s: float = 20.0
    #: RSS is read this long after nvpair's start (or at once when later): it grows for
    #: the first minute (the allocator's arenas fill), so a reading at another age is not
    #: comparable
    scale_rss_age_s: float = 75.0
    sims_per_process: int = 256
    #: scenario "models": Ollama-like engines and the models each serves (same windows)
    models_engines: int = 10
    models_per_engine: int = 10_000
    #: its idle CPU's window: long enough to hold one reading of every list. An unchanged
    #: list of 3.5 MB is read again every 108 s (nvpair.probing.sweep.UNCHANGED_BYTES_PER_S), all
    #: ten in one batch (about 65 ms of CPU): a 20 s window held that batch or not, and
    #: read either the base alone or five times the lists' share (0.33 % against 1.05 %)
    models_idle_s: float = 120.0
    #: scenario "listing_cost": the SGLang-like board's engines, and rebuilds timed
    listing_engines: int = 1024
    listing_rebuilds: int = 200
    #: scenario 4
    throughput_s: float = 6.0
    throughput_warmup_s: float = 2.0
    throughput_reps: int = 3
    throughput_connections: int = 16
    #: scenario 5
    soak_status_calls: int = 100_000
    soak_timeouts: int = 10_000
    soak_engines: int = 10
    soak_probe_s: float = 0.1
    #: requests on a new connection each (connection churn)
    soak_churn: int = 10_000
    #: the longest wait for nvpair's API sockets to leave CLOSE-WAIT before a reading
    #: (hypercorn's trio worker closes them when the keep-alive timer fires: up to 5 s)
    soak_settle_s: float = 8.0


FULL = BenchConfig(quick=False)
QUICK = BenchConfig(
    quick=True,
    clients=(1, 32),
    replay_window_s=5.0,
    replay_timeout_s=5.0,
    baseline_clients=(1, 32),
    baseline_window_s=5.0,
    scale_ks=(8, 256),
    listing_engines=256,
    listing_rebuilds=20,
    models_per_engine=2_000,
    models_idle_s=3.0,
    scale_load_s=2.0,
    scale_idle_s=3.0,
    scale_rss_age_s=0.0,
    throughput_s=2.0,
    throughput_warmup_s=0.0,
    throughput_reps=1,
    soak_status_calls=5_000,
    soak_timeouts=1_000,
    soak_probe_s=0.05,
    soak_churn=1_000,
)


def run_alone(prog: str, run: Callable[[BenchConfig, Path], dict[str, Any]],
              argv: Sequence[str] | None = None) -> int:
    """``python -m benchmarks.<scenario> [--quick]``: one scenario run by itself, in a
    scratch folder, its results printed as JSON."""
    parser = argparse.ArgumentParser(prog=prog)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        result = run(QUICK if args.quick else FULL, Path(tmp))
    print(msgspec.json.format(msgspec.json.encode(result), indent=1).decode())
    return 0
