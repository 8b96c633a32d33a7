"""Engines on demand: what the on-demand path adds (docs/on-demand.md).

``python -m benchmarks.on_demand [--quick]``

One ``nvpair serve`` manages two vLLM simulators: ``hot`` (``activation = "always"``, the
router as it was) and ``od`` (``activation = "on_demand"``, loading for ``--load-s``):

* **warm**: once ``od`` runs, rounds of sequential non-streaming requests go to each model
  in turn (one keep-alive connection each); the headline is the p50 of ``od`` minus the
  p50 of ``hot`` (target: within 1 ms);
* **cold**: ``od`` is drained to ``cold``, then one streaming request for its model is
  timed from the request to the first byte of the answer's body. Against it: the engine's
  own start, the same simulator started alone and timed from spawn to its first 200 on
  ``/health``, plus its warm time to first byte. The difference is what nvpair adds
  (target: at most 100 ms). nvpair sees an engine ready by its ready probe, which ticks
  every 0.25 s at most while requests wait (the manifest's 2 s otherwise): measured twice,
  with the manifest's own probes (``od``, the headline) and with the ready probe at 50 ms
  (``od_fast``).

* **alternation**: two on-demand simulators (loading for ``ALT_LOAD_S``) with memory for
  one, four clients (each its own key, closed loop), two on each model, so the requests
  nvpair sees alternate between the models. Run twice in the same process, each with its
  own nvpair: first come first served (``swap_batch = 0``, the default) and swap batching
  (``swap_batch = 8``, ``max_swap_wait_s = 30``): swaps per minute, total time, p50/p99 of
  the queue wait per key (``x-nvpair-queue-ms``), the longest wait, failures (must be 0).
* **swap** (issue 33 §4): three on-demand vLLM simulators (``a``, ``b``, ``c``, 100 MB
  each, declared) and a memory budget for one (150 MB); streaming requests alternate
  a, b, c, a, b, c, ... so every request is a swap. Run twice, one nvpair after the other:
  ``sleep = true`` (the eviction tiers: a victim sleeps at level 1, a request for it wakes
  it) and without (stop/start). The simulators load in ``SWAP_LOAD_S`` (3 s) and wake in
  ``SWAP_WAKE_S`` (0.3 s), the ratio vLLM's own sleep blog reports for small models (a
  reload in seconds, a wake in 0.1 to 0.4 s). Per mode: total time, the p50 and p99 time
  to first byte of the swaps after the first round (each engine's first start is a cold
  start in both modes), the swaps by tier (read from each victim's ``activity``), and the
  requests that failed (target: 0). Against the tiers: the engine's wake alone (one
  simulator put to sleep and woken by calling it directly, to the first byte of a request);
  nvpair's share of a swap is the difference of the p50s (target: within 50 ms), and
  holds the victim's drained sleep as well as the wake.

Writes ``benchmarks/results/on-demand.json`` (``on-demand-quick.json`` with ``--quick``).
``--only alternation`` or ``--only swap`` runs that scenario alone
(``on-demand-<scenario>[-quick].json``).
"""

from __future__ import annotations

import argparse
import http.client
import json
import re
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.procs import PY, ROOT, Procs, free_port, get_json, machine, request, start_nvpair
from nvpair.state.transitions import AWAITED_READY_INTERVAL_S

LOAD_S = 2.0
#: the swap scenario's engines: a load as a small model's reload, a wake as vLLM's level 1
SWAP_LOAD_S = 3.0
SWAP_WAKE_S = 0.3
SWAP_MB = 100


def sim_argv(port: int, model: str, load_s: float) -> list[str]:
    return [PY, "-m", "nvpair.sim", "vllm", "--port", str(port), "--model", model,
            "--load-s", str(load_s), "--warmup-s", "0", "--token-rate", "5000",
            "--no-control", "--log-level", "WARNING"]


def own_start(procs: Procs, load_s: float) -> float:
    """The simulator alone: spawn to its first 200 on /health, in seconds."""
    port = free_port()
    started = time.monotonic()
    proc = procs.start(f"alone-{port}", sim_argv(port, "m-alone", load_s))
    try:
        while True:
            try:
                if request("GET", f"http://127.0.0.1:{port}/health", timeout=1.0)[0] == 200:
                    return time.monotonic() - started
            except OSError:
                pass
            if not proc.alive():
                raise RuntimeError(f"the simulator exited:\n{proc.tail()}")
            time.sleep(0.005)
    finally:
        proc.stop()


def first_byte(url: str, model: str) -> float:
    """One streaming request: seconds from sending it to the first byte of the body."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    body = json.dumps({"model": model, "stream": True, "max_tokens": 4,
                       "messages": [{"role": "user", "content": "hi"}]})
    try:
        started = time.monotonic()
        conn.request("POST", "/v1/chat/completions", body=body,
                     headers={"content-type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            raise RuntimeError(f"{model}: {response.status} {response.read()[:200]!r}")
        response.read1(1)
        took = time.monotonic() - started
        response.read()
        return took
    finally:
        conn.close()


def latencies(url: str, model: str, count: int) -> list[float]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    body = json.dumps({"model": model, "max_tokens": 2,
                       "messages": [{"role": "user", "content": "hi"}]})
    out = []
    try:
        for _ in range(count):
            started = time.monotonic()
            conn.request("POST", "/v1/chat/completions", body=body,
                         headers={"content-type": "application/json"})
            response = conn.getresponse()
            response.read()
            if response.status != 200:
                raise RuntimeError(f"{model}: {response.status}")
            out.append(time.monotonic() - started)
    finally:
        conn.close()
    return out


def wait_state(url: str, name: str, state: str, within: float = 60.0) -> None:
    deadline = time.monotonic() + within
    doc: dict[str, Any] = {}
    while time.monotonic() < deadline:
        doc = get_json(f"{url}/v1/engines/{name}")
        if doc["state"] == state:
            return
        time.sleep(0.02)
    raise RuntimeError(f"engine {name} never became {state}: {doc.get('state')}, "
                       f"{doc.get('error')}")


def swap_argv(port: int, model: str) -> list[str]:
    return [PY, "-m", "nvpair.sim", "vllm", "--port", str(port), "--model", model,
            "--load-s", str(SWAP_LOAD_S), "--wake-s", str(SWAP_WAKE_S), "--warmup-s", "0",
            "--token-rate", "5000", "--enable-sleep-mode", "--no-control",
            "--log-level", "WARNING"]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def swap_mode(procs: Procs, sleep: bool, requests: int) -> dict[str, Any]:
    """One nvpair, three on-demand engines with room for one, ``requests`` alternating
    streaming requests: what each cost, and how each victim was evicted."""
    names = ("a", "b", "c")
    engines = ""
    for name in names:
        port = free_port()
        engines += (f"[[engines]]\nname = '{name}'\nkind = 'vllm'\nport = {port}\n"
                    f"model = 'm-{name}'\nmanaged = true\nactivation = 'on_demand'\n"
                    f"memory_bytes = {SWAP_MB * 10**6}\nsleep = {str(sleep).lower()}\n"
                    f"command = {json.dumps(swap_argv(port, f'm-{name}'))}\n")
    top = (f"[activation]\nmemory_budget_bytes = {SWAP_MB * 3 // 2 * 10**6}\n"
           "[memory]\ninterval_s = 3600\nwindow_h = 24\n")  # (the declared sizes hold)
    proc, url, _took = start_nvpair(procs, f"nvpair-{'tiers' if sleep else 'stops'}",
                                    engines, top=top)
    try:
        first_round: list[float] = []
        swaps: list[float] = []
        tiers: dict[str, int] = {}
        failed = 0
        started = time.monotonic()
        for i in range(requests):
            name = names[i % len(names)]
            try:
                took = first_byte(url, f"m-{name}")
            except (RuntimeError, OSError) as exc:
                failed += 1
                print(f"swap {i} ({name}) failed: {exc}")
                continue
            (first_round if i < len(names) else swaps).append(took)
            if i:  # the engine asked before this one was the victim: how it went
                victim = names[(i - 1) % len(names)]
                activity = get_json(f"{url}/v1/engines/{victim}").get("activity") or ""
                tier = activity.split("(", 1)[1].split(")", 1)[0] if (
                    activity.startswith(f"evicted {victim} (")) else "none"
                tiers[tier] = tiers.get(tier, 0) + 1
        total = time.monotonic() - started
    finally:
        proc.stop()
    return {"requests": requests, "failed": failed, "total_s": round(total, 2),
            "first_round_first_byte_s": [round(x, 3) for x in first_round],
            "swaps": len(swaps), "swap_first_byte_s": [round(x, 3) for x in swaps],
            "swap_first_byte_p50_s": round(statistics.median(swaps), 3),
            "swap_first_byte_p99_s": round(percentile(swaps, 0.99), 3),
            "swaps_by_tier": tiers}


def direct_wakes(procs: Procs, rounds: int) -> list[float]:
    """The engine's wake alone: one simulator put to sleep (level 1) and woken by calling it
    directly, timed from ``POST /wake_up`` to the first byte of a streaming request's body
    (what a swap through nvpair is measured against)."""
    port = free_port()
    proc = procs.start(f"wake-alone-{port}", swap_argv(port, "m-alone"),
                       extra_env={"VLLM_SERVER_DEV_MODE": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if request("GET", f"{url}/health", timeout=1.0)[0] == 200:
                    break
            except OSError:
                pass
            if not proc.alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the simulator did not start:\n{proc.tail()}")
            time.sleep(0.01)
        first_byte(url, "m-alone")
        out = []
        for _ in range(rounds):
            if request("POST", f"{url}/sleep?level=1&mode=wait")[0] != 200:
                raise RuntimeError("the simulator did not sleep")
            started = time.monotonic()
            if request("POST", f"{url}/wake_up", timeout=10)[0] != 200:
                raise RuntimeError("the simulator did not wake")
            out.append(time.monotonic() - started + first_byte(url, "m-alone"))
        return out
    finally:
        proc.stop()


def run_swap(quick: bool) -> dict[str, Any]:
    requests = 7 if quick else 30
    with tempfile.TemporaryDirectory(prefix="nvpair-bench-swap-") as tmp, \
            Procs(Path(tmp)) as procs:
        tiers = swap_mode(procs, True, requests)
        stops = swap_mode(procs, False, requests)
        alone = direct_wakes(procs, 4 if quick else 15)
    share = tiers["swap_first_byte_p50_s"] - statistics.median(alone)
    return {"load_s": SWAP_LOAD_S, "wake_s": SWAP_WAKE_S, "engine_mb": SWAP_MB,
            "budget_mb": SWAP_MB * 3 // 2, "sleep_tiers": tiers, "stop_start": stops,
            "p50_speedup": round(stops["swap_first_byte_p50_s"]
                                 / tiers["swap_first_byte_p50_s"], 1),
            "engine_wake_alone_first_byte_s": [round(x, 3) for x in alone],
            "nvpair_share_of_a_swap_ms": round(share * 1000, 1)}


def run(quick: bool) -> dict[str, Any]:
    rounds, per_round, colds = (3, 100, 2) if quick else (6, 300, 4)
    fast_probes = ("[engines.probes.ready]\ninterval_s = 0.05\ntimeout_s = 0.05\n"
                   "[engines.probes.health]\ninterval_s = 1\ntimeout_s = 1\n")
    with tempfile.TemporaryDirectory(prefix="nvpair-bench-od-") as tmp, Procs(Path(tmp)) as procs:
        alone = [own_start(procs, LOAD_S) for _ in range(colds)]
        engines = ""
        for name, activation, load, probes in (
                ("hot", "always", 0.0, fast_probes), ("od", "on_demand", LOAD_S, ""),
                ("od_fast", "on_demand", LOAD_S, fast_probes)):
            port = free_port()
            engines += (f"[[engines]]\nname = '{name}'\nkind = 'vllm'\nport = {port}\n"
                        f"model = 'm-{name}'\nmanaged = true\nactivation = '{activation}'\n"
                        f"command = {json.dumps(sim_argv(port, f'm-{name}', load))}\n"
                        + probes)
        _proc, url, _took = start_nvpair(procs, "nvpair", engines)
        wait_state(url, "hot", "ready")
        first_byte(url, "m-hot")
        warm_od: list[float] = []
        cold: dict[str, list[float]] = {"od": [], "od_fast": []}
        for _ in range(colds):
            for name, times in cold.items():
                wait_state(url, name, "cold")
                times.append(first_byte(url, f"m-{name}"))
                warm_od.append(first_byte(url, f"m-{name}"))  # the engine's own, warm
                request("POST", f"{url}/v1/engines/{name}/drain")
        wait_state(url, "od", "cold")
        first_byte(url, "m-od")
        hot: list[float] = []
        od: list[float] = []
        for _ in range(rounds):
            hot += latencies(url, "m-hot", per_round)
            od += latencies(url, "m-od", per_round)
    own = statistics.median(alone) + statistics.median(warm_od)
    overhead = statistics.median(cold["od"]) - own
    overhead_fast = statistics.median(cold["od_fast"]) - own
    p50_hot, p50_od = statistics.median(hot), statistics.median(od)
    result = {
        "machine": machine(),
        "quick": quick,
        "load_s": LOAD_S,
        "warm": {"requests_each": len(hot), "p50_ms_always": round(p50_hot * 1000, 3),
                 "p50_ms_on_demand": round(p50_od * 1000, 3),
                 "added_p50_ms": round((p50_od - p50_hot) * 1000, 3)},
        "cold": {"runs": colds, "first_byte_s": [round(x, 3) for x in cold["od"]],
                 "engine_alone_start_s": [round(x, 3) for x in alone],
                 "engine_warm_first_byte_ms": round(statistics.median(warm_od) * 1000, 2),
                 "overhead_ms": round(overhead * 1000, 1),
                 "ready_probe": ("the manifest's (2 s; "
                                 f"{AWAITED_READY_INTERVAL_S} s while requests wait)"),
                 "fast": {"ready_probe": "0.05 s",
                          "first_byte_s": [round(x, 3) for x in cold["od_fast"]],
                          "overhead_ms": round(overhead_fast * 1000, 1)}},
    }
    result["targets"] = {
        "warm p50 within 1 ms of always": abs(p50_od - p50_hot) <= 0.001,
        "cold overhead <= 100 ms": overhead <= 0.100,
    }
    return result


#: the alternation's simulators load for this long (a small model from the page cache)
ALT_LOAD_S = 1.0
#: the alternation's answers: this many tokens at this rate (0.16 s on the engine)
ALT_TOKENS, ALT_RATE = 8, 50
#: the swap-batching policy the alternation measures against first come first served
ALT_POLICY = "swap_batch = 8\nmax_swap_wait_s = 30\n"


def _activations(url: str, token: str) -> int:
    """On-demand starts requests waited for (``nvpair_router_activation_seconds_count``)."""
    status, body = _get(url, "/metrics", token)
    m = re.search(rb"^nvpair_router_activation_seconds_count (\d+)", body, re.M)
    if status != 200 or m is None:
        raise RuntimeError(f"/metrics: {status} {body[:200]!r}")
    return int(m[1])


def _get(url: str, path: str, token: str) -> tuple[int, bytes]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        conn.request("GET", path, headers={"authorization": f"Bearer {token}"})
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def _client(url: str, token: str, model: str, count: int,
            waits: list[float], failures: list[str]) -> None:
    """``count`` requests one after the other on one connection; each one's queue wait."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    body = json.dumps({"model": model, "max_tokens": ALT_TOKENS,
                       "messages": [{"role": "user", "content": "hi"}]})
    try:
        for _ in range(count):
            conn.request("POST", "/v1/chat/completions", body=body,
                         headers={"content-type": "application/json",
                                  "authorization": f"Bearer {token}"})
            r = conn.getresponse()
            r.read()
            if r.status != 200:
                failures.append(f"{model}: {r.status}")
                continue
            waits.append(float(r.getheader("x-nvpair-queue-ms") or 0) / 1000)
    except OSError as exc:
        failures.append(f"{model}: {exc}")
    finally:
        conn.close()


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def alternation_once(procs: Procs, policy: str, name: str, per_client: int) -> dict[str, Any]:
    """One nvpair with ``policy`` ([activation] lines); the four clients; what it did."""
    keys, top = ["c1", "c2", "c3", "c4"], "token_file = 'admin'\n"
    for key in ["admin", *keys]:
        (procs.workdir / key).write_text(f"token-{key}\n")
        (procs.workdir / key).chmod(0o600)
        if key != "admin":
            top += f"[[keys]]\nname = '{key}'\ntoken_file = '{key}'\nrole = 'user'\n"
    top = top.replace("token_file = 'admin'", f"token_file = '{procs.workdir / 'admin'}'")
    top = re.sub(r"token_file = '(c\d)'", lambda m: f"token_file = '{procs.workdir / m[1]}'", top)
    # The planner plans with memory_bytes: the memory watch reads once, at start (the
    # engines cold), and not again within the run (a simulator's real footprint, 20 MB,
    # would let both fit).
    engines = (f"[activation]\nmemory_budget_bytes = 10_000_000_000\n{policy}\n"
               "[memory]\ninterval_s = 600\n")
    for model in ("qwen", "gemma"):
        port = free_port()
        argv = [PY, "-m", "nvpair.sim", "vllm", "--port", str(port), "--model", model,
                "--load-s", str(ALT_LOAD_S), "--warmup-s", "0", "--token-rate",
                str(ALT_RATE), "--no-control", "--log-level", "WARNING"]
        engines += (f"[[engines]]\nname = '{model}'\nkind = 'vllm'\nport = {port}\n"
                    f"model = '{model}'\nmanaged = true\nactivation = 'on_demand'\n"
                    f"memory_bytes = 6_000_000_000\ncommand = {json.dumps(argv)}\n"
                    "[engines.probes.ready]\ninterval_s = 0.05\ntimeout_s = 0.05\n")
    proc, url, _ = start_nvpair(procs, name, engines, top=top)
    waits: dict[str, list[float]] = {k: [] for k in keys}
    failures: list[str] = []
    before = _activations(url, "token-admin")
    threads = [threading.Thread(target=_client, args=(
        url, f"token-{k}", "qwen" if i % 2 == 0 else "gemma", per_client, waits[k], failures))
        for i, k in enumerate(keys)]
    started = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    took = time.monotonic() - started
    swaps = _activations(url, "token-admin") - before - 1  # (the first start is no swap)
    proc.stop()
    every = [w for ws in waits.values() for w in ws]
    return {"policy": policy.strip().replace("\n", ", ") or "first come first served",
            "requests": len(every), "failures": len(failures),
            "failed": failures[:5], "total_s": round(took, 2), "swaps": swaps,
            "swaps_per_min": round(swaps / took * 60, 1),
            "longest_wait_s": round(max(every, default=0.0), 3),
            "wait_s_per_key": {k: {"p50": round(_pct(ws, 0.5), 3),
                                   "p99": round(_pct(ws, 0.99), 3)}
                               for k, ws in waits.items()}}


def alternation(quick: bool) -> dict[str, Any]:
    """First come first served against swap batching, in the same run."""
    per_client = 6 if quick else 30
    with tempfile.TemporaryDirectory(prefix="nvpair-bench-alt-") as tmp, \
            Procs(Path(tmp)) as procs:
        fifo = alternation_once(procs, "", "nvpair-fifo", per_client)
        batched = alternation_once(procs, ALT_POLICY, "nvpair-batch", per_client)
    return {"load_s": ALT_LOAD_S, "clients": 4, "requests_per_client": per_client,
            "answer_s": ALT_TOKENS / ALT_RATE, "fifo": fifo, "swap_batching": batched,
            "swaps_cut": round(fifo["swaps"] / max(batched["swaps"], 1), 2),
            "time_cut": round(fifo["total_s"] / batched["total_s"], 2)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", choices=("alternation", "swap"), default=None,
                        help="run one scenario alone (results in on-demand-<name>*.json)")
    args = parser.parse_args()
    if args.only is not None:
        result: dict[str, Any] = {"machine": machine(), "quick": args.quick, "targets": {}}
    else:
        result = run(args.quick)
    if args.only in (None, "alternation"):
        result["alternation"] = alt = alternation(args.quick)
        result["targets"]["alternation: no failures"] = (
            alt["fifo"]["failures"] == alt["swap_batching"]["failures"] == 0)
        result["targets"]["alternation: swap batching cuts swaps 2x or more"] = (
            alt["swaps_cut"] >= 2)
    if args.only in (None, "swap"):
        result["swap"] = swap = run_swap(args.quick)
        result["targets"].update({
            "swap: no request failed": swap["sleep_tiers"]["failed"] == 0
            and swap["stop_start"]["failed"] == 0,
            "swap: every victim slept with tiers": set(swap["sleep_tiers"]["swaps_by_tier"])
            == {"sleep at level 1"},
            "swap: p50 first byte with tiers below stop/start": swap["p50_speedup"] > 1,
            "swap: nvpair's share of a swap within 50 ms":
                swap["nvpair_share_of_a_swap_ms"] <= 50,
        })
    stem = "on-demand" + (f"-{args.only}" if args.only else "") + ("-quick" if args.quick else "")
    out = ROOT / "benchmarks" / "results" / f"{stem}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("warm", "cold", "alternation", "swap", "targets")
                      if k in result}, indent=1))
    for target, met in result["targets"].items():
        print(f"{target}: {'met' if met else 'NOT met'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

