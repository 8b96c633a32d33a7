"""A sleeping model's wake, with the real llama-server (issue 33, docs/sleep.md).

``python -m benchmarks.wake_real [--quick] [--rounds N]``

llama-server (the build ``scripts/llama_server.py`` caches, gemma-3-270m) started with
``--sleep-idle-seconds 1`` and adopted by one ``nvpair serve`` (no ``sleep = true``: it is
seen asleep by its ``/props``). Each round, once the server sleeps and nvpair lists it
``sleeping``, one streaming chat is timed from sending it to the first byte of its body:

* **direct**: sent to the sleeping llama-server itself (the engine's wake alone);
* **through nvpair**: sent to nvpair, which routes it to the sleeping server (which wakes
  for it by itself).

The two alternate, so the machine's drift falls on both alike; nvpair's share of a wake is
the median through nvpair minus the median direct (target: within 50 ms), and, less
exposed to a round's drift, the median of each round's difference. A wake of this model
varies by a second or more on a loaded machine, far more than nvpair's part, so the same
is measured on the awake engine too (``awake``: the cold-start engine once it runs, five
first bytes direct and five through nvpair each round, interleaved): nvpair does no more
for a request to a sleeping llama-server than for an awake one (it sends it as it is; the
server wakes for it), so that difference is nvpair's share without the wake's noise. Against both: a
**cold start**, the same model as an on-demand engine nvpair manages (drained to ``cold``
each round), timed the same way from the request to its first byte.

Writes ``benchmarks/results/wake-real.json`` (``wake-real-quick.json`` with ``--quick``).
Needs the cached llama-server (``python scripts/llama_server.py provide``): without it, it
says so and exits 2.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.on_demand import first_byte, wait_state
from benchmarks.procs import (
    PY,
    ROOT,
    Procs,
    free_port,
    get_json,
    machine,
    request,
    start_nvpair,
    wait_http,
)

IDLE_S = 1
#: the real server looks at its idle time about once a second: asleep within a few
ASLEEP_WITHIN_S = 30.0
MODEL = "gemma"
#: first bytes of the awake engine per round, each way
AWAKE_PAIRS = 5
#: one compute thread, a small context: llama.cpp's threads spin-wait for each other, and
#: on a shared 2-core machine two of them made short generations 50 times slower
SERVER_FLAGS = ("-c", "1024", "-t", "1", "-np", "1")


def assets() -> tuple[str, str] | None:
    """The cached llama-server binary and model, or None when there are none."""
    done = subprocess.run([PY, str(ROOT / "scripts" / "llama_server.py"), "paths", "--json"],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        return None
    paths = json.loads(done.stdout)
    return str(paths["llama_server"]), str(paths["model"])


def is_sleeping(url: str) -> bool:
    value = get_json(f"{url}/props")["is_sleeping"]
    assert isinstance(value, bool)
    return value


def until(what: str, check: Any, within: float = ASLEEP_WITHIN_S) -> None:
    """Poll ``check()`` (an outside process's state: nothing to wait on but time)."""
    deadline = time.monotonic() + within
    while not check():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not happen within {within:g} s")
        time.sleep(0.05)


def run(quick: bool, rounds: int | None) -> dict[str, Any]:
    found = assets()
    if found is None:
        raise SystemExit("no cached llama-server: run `python scripts/llama_server.py "
                         "provide` (or `nox -s integration`) first")
    binary, model = found
    rounds = rounds or (3 if quick else 7)
    with tempfile.TemporaryDirectory(prefix="nvpair-bench-wake-") as tmp, \
            Procs(Path(tmp)) as procs:
        port, cold_port = free_port(), free_port()
        server = procs.start("llama-server", [
            binary, "-m", model, "--alias", MODEL, "--host", "127.0.0.1", "--port", str(port),
            "--sleep-idle-seconds", str(IDLE_S), *SERVER_FLAGS])
        direct = f"http://127.0.0.1:{port}"
        wait_http(f"{direct}/health", server, within=120)
        cold_argv = [binary, "-m", model, "--alias", f"{MODEL}-cold", "--host", "127.0.0.1",
                     "--port", str(cold_port), *SERVER_FLAGS]
        engines = (f"[[engines]]\nname = 'g'\nkind = 'llamacpp'\nport = {port}\n"
                   f"model = '{MODEL}'\n"
                   "[engines.probes.health]\ninterval_s = 0.5\ntimeout_s = 0.5\n"
                   f"[[engines]]\nname = 'cold'\nkind = 'llamacpp'\nport = {cold_port}\n"
                   f"model = '{MODEL}-cold'\nmanaged = true\nactivation = 'on_demand'\n"
                   f"command = {json.dumps(cold_argv)}\n")
        _proc, url, _took = start_nvpair(procs, "nvpair", engines)
        first_byte(direct, MODEL)  # (the first generation after a load is a warm-up)
        times: dict[str, list[float]] = {"direct": [], "nvpair": [], "cold_start": [],
                                         "awake_direct": [], "awake_nvpair": []}
        cold_direct = f"http://127.0.0.1:{cold_port}"
        for _ in range(rounds):
            for way, target in (("direct", direct), ("nvpair", url)):
                until("llama-server's sleep", lambda: is_sleeping(direct))
                wait_state(url, "g", "sleeping", within=ASLEEP_WITHIN_S)
                times[way].append(first_byte(target, MODEL))
            wait_state(url, "cold", "cold", within=60)
            times["cold_start"].append(first_byte(url, f"{MODEL}-cold"))
            for _ in range(AWAKE_PAIRS):
                times["awake_direct"].append(first_byte(cold_direct, f"{MODEL}-cold"))
                times["awake_nvpair"].append(first_byte(url, f"{MODEL}-cold"))
            request("POST", f"{url}/v1/engines/cold/drain")
    medians = {way: statistics.median(took) for way, took in times.items()}
    share = medians["nvpair"] - medians["direct"]
    paired = statistics.median(b - a for a, b in zip(times["direct"], times["nvpair"],
                                                     strict=True))
    awake = statistics.median(b - a for a, b in zip(times["awake_direct"],
                                                    times["awake_nvpair"], strict=True))
    result: dict[str, Any] = {
        "machine": machine(),
        "quick": quick,
        "rounds": rounds,
        "sleep_idle_seconds": IDLE_S,
        "first_byte_s": {way: [round(x, 4) for x in took] for way, took in times.items()},
        "median_ms": {way: round(m * 1000, 1) for way, m in medians.items()},
        "nvpair_share_of_a_wake_ms": round(share * 1000, 1),
        "nvpair_share_paired_median_ms": round(paired * 1000, 1),
        "nvpair_share_awake_paired_median_ms": round(awake * 1000, 2),
        "wake_vs_cold_start": round(medians["cold_start"] / medians["nvpair"], 2),
    }
    result["targets"] = {"nvpair's share of a wake <= 50 ms": share <= 0.050,
                         "nvpair's share, awake and paired, <= 50 ms": awake <= 0.050}
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, help="rounds (default 7; 3 with --quick)")
    args = parser.parse_args()
    result = run(args.quick, args.rounds)
    out = ROOT / "benchmarks" / "results" / ("wake-real-quick.json" if args.quick
                                               else "wake-real.json")
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in (
        "median_ms", "nvpair_share_of_a_wake_ms", "nvpair_share_paired_median_ms",
        "nvpair_share_awake_paired_median_ms", "wake_vs_cold_start", "targets")}, indent=1))
    for target, met in result["targets"].items():
        print(f"{target}: {'met' if met else 'NOT met'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
