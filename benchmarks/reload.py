"""A reload of a node of 1,024 engines with one engine changed (docs/lifecycle.md, "Reload").

``python -m benchmarks.reload [--quick]``

K simulated SGLang engines (K = 1,024; 128 with ``--quick``) run in farm processes
(``python -m nvpair.sim farm --control``: each engine with a control port, so its requests
are counted on the simulator's side), and one more is spare. One ``nvpair serve`` adopts
the K. Their health, identity and model-list probes run every 600 s, so once every engine
is ready and listed the node sends no request for minutes: any request an engine gets
during the reload is one the reload made. Then the config is edited so that ``e0000``
points at the spare engine (its port changed: a restart, for an adopted engine a new
adoption) and ``POST /v1/admin/reload`` is timed:

* ``apply_s``: the reload's answer (read, check, diff and apply; the runners of the
  changed engine swap in a task of their own);
* ``changed_ready_s``: from the request until ``e0000`` is ``ready`` on its new port;
* ``loop_lag``: nvpair's longest loop stall in those seconds (its loop-lag probe,
  ``NVPAIR_LOOP_LAG_FILE``: the longest gap between ticks of a 5 ms timer);
* ``unchanged_requests``: requests the K - 1 unchanged engines received from just before
  the reload until after it (target: 0), and ``unchanged_pids_kept``: nvpair's status of
  each still the same (state since, probe counters);
* ``reads_worst_ms``: the slowest of ``GET /v1/engines/e0001`` asked back to back during it.

Writes ``benchmarks/results/reload.json`` (``reload-quick.json`` with ``--quick``).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.procs import ROOT, Procs, get_json, machine, request, start_nvpair
from benchmarks.scale import loop_lag, start_farms

#: long enough that nothing is probed during the measure (a probe is due every 600 s)
QUIET = ("[engines.probes.health]\ninterval_s = 600\ntimeout_s = 2\n"
         "[engines.probes.identity]\ninterval_s = 600\n"
         "[engines.probes.models]\ninterval_s = 600\n")


def say(text: str) -> None:
    print(f"reload: {text}", file=sys.stderr, flush=True)


def config(engines: list[dict[str, Any]]) -> str:
    return "".join(f"[[engines]]\nname = 'e{i:04d}'\nkind = 'sglang'\nport = {e['port']}\n"
                   f"model = '{e['model']}'\n{QUIET}" for i, e in enumerate(engines))


def counts(engines: list[dict[str, Any]]) -> list[int]:
    """Each engine's requests so far, as its simulator counts them."""
    return [get_json(f"http://127.0.0.1:{e['control']}/__sim/stats")["total"]["count"]
            for e in engines]


def engines_doc(url: str) -> dict[str, dict[str, Any]]:
    doc = json.loads(request("GET", f"{url}/v1/engines", timeout=30)[1])
    return {e["name"]: e for e in doc["engines"]}


def settled(url: str, k: int, within: float) -> float:
    """Seconds until every engine is ready with its model listed."""
    began = time.monotonic()
    while time.monotonic() - began < within:
        doc = engines_doc(url)
        if sum(1 for e in doc.values() if e["state"] == "ready" and e["models"]) == k:
            return time.monotonic() - began
        time.sleep(0.2)
    raise RuntimeError(f"not every engine was ready and listed within {within:g} s")


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """nvpair's status of an engine untouched: its state, pid, since and probe counts."""
    def key(e: dict[str, Any]) -> tuple[Any, ...]:
        return (e["state"], e["pid"], e["restarts"],
                tuple((n, p["requests"]) for n, p in sorted(e["probes"].items())))
    return key(a) == key(b)


def run(quick: bool) -> dict[str, Any]:
    k = 128 if quick else 1024
    with tempfile.TemporaryDirectory(prefix="nvpair-reload-") as tmp, Procs(Path(tmp)) as procs:
        farm = start_farms(procs, "reload", "sglang", k + 1, 256, bad_every=0, control=True)
        engines, spare = farm[:k], farm[k]
        lag = Path(tmp) / "looplag-reload.jsonl"
        _proc, url, api_s = start_nvpair(procs, "nvpair-reload", config(engines), loop_lag=lag)
        say(f"nvpair answers after {api_s:.1f} s; waiting for {k} engines")
        settled_s = settled(url, k, 300)
        say(f"{k} engines ready and listed after {settled_s:.1f} s; reloading")
        before = counts(engines[1:])
        status_before = engines_doc(url)
        cfg = Path(tmp) / "nvpair-reload.toml"
        cfg.write_text(cfg.read_text().replace(
            f"port = {engines[0]['port']}\nmodel = '{engines[0]['model']}'\n",
            f"port = {spare['port']}\nmodel = '{spare['model']}'\n", 1))
        reads: list[float] = []
        stop = threading.Event()

        def read() -> None:  # a client reading an unchanged engine's status meanwhile
            while not stop.is_set():
                t0 = time.monotonic()
                request("GET", f"{url}/v1/engines/e0001")
                reads.append(time.monotonic() - t0)

        reader = threading.Thread(target=read)
        reader.start()
        wall = time.time()
        t0 = time.monotonic()
        status, body = request("POST", f"{url}/v1/admin/reload", {}, timeout=60)
        apply_s = time.monotonic() - t0
        answer = json.loads(body)
        while time.monotonic() - t0 < 120:
            e = engines_doc(url)["e0000"]
            if e["state"] == "ready" and str(spare["port"]) in e["url"]:
                break
            time.sleep(0.01)
        else:
            raise RuntimeError(f"e0000 was not ready on its new port within 120 s: {e}")
        ready_s = time.monotonic() - t0
        stop.set()
        reader.join()
        until = time.time()
        after = counts(engines[1:])
        status_after = engines_doc(url)
        extra = sum(b - a for a, b in zip(before, after, strict=True))
        kept = sum(1 for name in status_before if name != "e0000"
                   and same(status_before[name], status_after[name]))
        time.sleep(1.5)  # the loop-lag probe writes a line a second: the last one
        return {
            "machine": machine(), "engines": k, "api_answered_s": round(api_s, 3),
            "settled_s": round(settled_s, 3), "status": status,
            "summary": answer.get("summary"), "apply_s": round(apply_s, 4),
            "changed_ready_s": round(ready_s, 4), "loop_lag": loop_lag(lag, wall, until),
            "unchanged_requests": extra, "unchanged_untouched": kept,
            "unchanged": k - 1, "reads": len(reads),
            "reads_worst_ms": round(max(reads) * 1000, 2) if reads else None,
            "targets": {"unchanged engines get no request": extra == 0,
                        "every unchanged engine untouched": kept == k - 1}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="128 engines, not 1,024")
    args = parser.parse_args()
    result = run(args.quick)
    out = ROOT / "benchmarks" / "results" / ("reload-quick.json" if args.quick
                                               else "reload.json")
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "machine"}, indent=1))
    for target, met in result["targets"].items():
        print(f"{target}: {'met' if met else 'NOT met'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
