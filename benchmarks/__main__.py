"""``python -m benchmarks [--quick]``: run every scenario once, write the results, print them.

* full (``nox -s bench``, ~17 min): writes ``benchmarks/results/latest.json`` and the
  results section of ``docs/benchmarks.md``;
* ``--quick`` (``nox -s bench -- --quick``, about 90 s, CI): shorter windows, K up to 256,
  10 x 2,000 models, fewer requests; writes ``benchmarks/results/quick.json`` and leaves the
  doc alone.

Targets are printed as met or not met; none of them fails the run (the exit status is
non-zero only when a scenario could not run at all).
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec

from benchmarks import (
    events,
    listing_cost,
    memwatch,
    metrics,
    models,
    output_flood,
    probe_cost,
    replay,
    report,
    scale,
    server_cost,
    soak,
    throughput,
)
from benchmarks.config import FULL, QUICK, BenchConfig
from benchmarks.procs import ROOT, machine
from benchmarks.targets import evaluate
from benchmarks.wrk import wrk_path

Scenario = Callable[[BenchConfig, Path], dict[str, Any]]
SCENARIOS: dict[str, Scenario] = {
    "replay": replay.run_nvpair,
    "baseline": replay.run_baseline,
    "scale": scale.run,
    "models": models.run,
    "probe_cost": probe_cost.run,
    "server_cost": server_cost.run,
    "listing_cost": listing_cost.run,
    "throughput": throughput.run,
    "soak": soak.run,
    "metrics": metrics.run,
    "events": events.run,
    "memwatch": memwatch.run,
    "output_flood": output_flood.run,
}


def git_commit() -> str:
    """The commit measured, with "+changes" when src/ differs from it (NVPAIR_BENCH_COMMIT
    says it for a tree that is not a git checkout, such as an exported commit)."""
    if os.environ.get("NVPAIR_BENCH_COMMIT"):
        return os.environ["NVPAIR_BENCH_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                              capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "src"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + (" +changes in src/" if dirty else "")


def save(out: Path, results: dict[str, Any]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(msgspec.json.format(msgspec.json.encode(results), indent=1) + b"\n")


def render(path: Path, doc: str) -> int:
    results = msgspec.json.decode(path.read_bytes())
    results["targets"] = evaluate(results)
    meta = results["meta"]
    meta["rendered"] = "targets re-evaluated by python -m benchmarks --render"
    save(path, results)
    ts = report.tables(results)
    sys.stdout.write(report.render_text(ts))
    full = not meta["quick"] and set(results["scenarios"]) == set(SCENARIOS)
    if doc == "yes" or (doc == "auto" and full):
        report.update_doc(ROOT / "docs" / "benchmarks.md", report.render_markdown(ts, meta))
        print("\nwrote docs/benchmarks.md (results section)")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="the CI run: about 90 s")
    p.add_argument("--only", default="", help=f"comma-separated subset of {', '.join(SCENARIOS)}")
    p.add_argument("--out", default=None, help="the JSON file (default: benchmarks/results/"
                   "latest.json, or quick.json with --quick)")
    p.add_argument("--doc", choices=("auto", "yes", "no"), default="auto",
                   help="update docs/benchmarks.md (auto: full runs of every scenario only)")
    p.add_argument("--keep", action="store_true", help="keep the work folder (configs, logs)")
    p.add_argument("--scale-ks", default="", metavar="K,K,...",
                   help="the scale scenario's engine counts (default: "
                   f"{','.join(map(str, FULL.scale_ks))}; "
                   f"--quick {','.join(map(str, QUICK.scale_ks))})")
    p.add_argument("--render", metavar="JSON", default=None,
                   help="run nothing: re-evaluate the targets of a results file, print it "
                   "and (a full run of every scenario) rewrite the doc's results section")
    args = p.parse_args(argv)
    if args.render:
        return render(Path(args.render), args.doc)
    cfg = QUICK if args.quick else FULL
    if args.scale_ks:
        try:
            ks = tuple(int(k) for k in args.scale_ks.split(","))
        except ValueError:
            p.error(f"--scale-ks {args.scale_ks!r}: engine counts separated by commas, as 8,256")
        if not ks or min(ks) < 1:
            p.error(f"--scale-ks {args.scale_ks!r}: every count must be >= 1")
        cfg = msgspec.structs.replace(cfg, scale_ks=ks)
    names = [n for n in args.only.split(",") if n] or list(SCENARIOS)
    unknown = set(names) - set(SCENARIOS)
    if unknown:
        p.error(f"unknown scenario(s): {', '.join(sorted(unknown))}")
    out = Path(args.out) if args.out else (
        ROOT / "benchmarks" / "results" / ("quick.json" if args.quick else "latest.json"))
    command = "python -m benchmarks" + (" --quick" if args.quick else "") + (
        f" --only {args.only}" if args.only else "") + (
        f" --scale-ks {args.scale_ks}" if args.scale_ks else "")
    workdir = Path(tempfile.mkdtemp(prefix="nvpair-bench-"))
    started = time.monotonic()
    meta: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": command,
        "quick": args.quick,
        "machine": machine(),
        "load_generator": wrk_path() or "python fallback (wrk not installed)",
        "json": str(out.relative_to(ROOT)) if out.is_relative_to(ROOT) else str(out),
        "nvpair_commit": git_commit(),
    }
    print(f"nvpair benchmarks ({'quick' if args.quick else 'full'}): {', '.join(names)}; "
          f"work folder {workdir}", flush=True)
    results: dict[str, Any] = {"meta": meta, "config": msgspec.structs.asdict(cfg),
                               "scenarios": {}, "timings_s": {}}
    failed = False
    for name in names:
        t0 = time.monotonic()
        print(f"-- {name} ...", flush=True)
        sub = workdir / name
        sub.mkdir()
        try:
            results["scenarios"][name] = SCENARIOS[name](cfg, sub)
        except Exception:
            failed = True
            results["scenarios"][name] = {"error": traceback.format_exc()}
            print(f"   {name} failed (logs in {sub}):\n{traceback.format_exc()}", flush=True)
        results["timings_s"][name] = round(time.monotonic() - t0, 1)
        print(f"   {name} took {results['timings_s'][name]:.0f} s", flush=True)
        save(out, results)  # what has run so far survives a later scenario that hangs
    meta["elapsed_s"] = round(time.monotonic() - started, 1)
    meta["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    results["targets"] = evaluate(results)
    save(out, results)
    ts = report.tables(results)
    sys.stdout.write(report.render_text(ts))
    write_doc = args.doc == "yes" or (args.doc == "auto" and not args.quick
                                      and not args.only and not args.out
                                      and not args.scale_ks)
    if write_doc:
        report.update_doc(ROOT / "docs" / "benchmarks.md", report.render_markdown(ts, meta))
        print("\nwrote docs/benchmarks.md (results section)")
    print(f"\nwrote {out} in {meta['elapsed_s']:.0f} s")
    if failed or args.keep:
        print(f"work folder kept: {workdir}")
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
