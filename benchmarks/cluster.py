"""Scenario 8 (issue 8): N nvpair nodes sharing their model lists on loopback.

N real nvpair processes (tests/peers/cluster.py starts them), each adopting one simulated
vLLM engine (tests/peers/simfarm.py, one child process for all of them), peers broker
``push`` (every node lists every other in ``[[peers]]``) and, when etcd is installed,
``etcd`` (one real etcd on loopback). For each cluster:

* **converged**: from the first process start until every node lists every peer fresh;
* **steady**: a quiet window; per node, the advert bytes out and in per minute (the
  counters of ``GET /v1/peers``: push advert bodies sent and received, without HTTP
  headers (~270 B more per push, docs/peers.md); etcd: its gateway's counters) and CPU
  (``/proc/<pid>/stat``);
* **listing**: a poller process (tests/peers/pollers.py) reads
  ``GET /v1/models?scope=cluster`` round the nodes, with ``/healthz`` as the machine's
  baseline; p50 / p99 / max;
* **propagation**: node 0's engine refuses connections, then accepts again (the
  simulator's fault control; the node's probes notice within ~0.5 s). Two times: the
  advert's change on node 0 to its arrival on each other node (from the nodes' own
  ``changed_age_s``, so our polling does not count), and end to end, the fault to the
  moment the last other node's cluster listing reflects it (polled every 50 ms);
* **failure detection**: node N-1 gets SIGSTOP; seconds until the others mark it stale,
  then gone (from the observers' ``state_age_s``). It gets SIGCONT before the cluster
  stops.

``--quick``: N = 4, push at ``interval_s = 1`` (TTL 3 s: stale at 3 s, gone at 6 s
without news), etcd lease TTL 3 s, short windows. Full: N = 4 and 8 at the default
``interval_s = 5`` (TTL 15 s), etcd (N = 4) at its default lease TTL of 10 s.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import trio
from tests.peers.cluster import (
    LISTING,
    Cluster,
    Engine,
    Node,
    cpu_seconds,
    cpu_stall_us,
    first_seen,
    open_cluster,
    open_farm,
    percentile,
    poll_urls,
    polling,
    propagation,
    set_refusing,
    states,
)
from tests.ports import free_port

RESULTS = Path(__file__).resolve().parent / "results"


class Plan:
    def __init__(self, quick: bool) -> None:
        self.quick = quick
        self.sizes = (4,) if quick else (4, 8)
        self.interval = 1.0 if quick else 5.0
        self.etcd_ttl = 3 if quick else 10
        self.steady_s = 6.0 if quick else 30.0
        self.listing_s = 4.0 if quick else 15.0
        self.changes = 2 if quick else 6


def _ms(values: Sequence[float]) -> dict[str, Any]:
    if not values:
        return {"p50": None, "p99": None, "max": None, "n": 0}
    return {"p50": round(1000 * statistics.median(values), 1),
            "p99": round(1000 * percentile(values, 0.99), 1),
            "max": round(1000 * max(values), 1), "n": len(values)}


def _bytes(doc: dict[str, Any]) -> tuple[int, int]:
    """(out, in) advert bytes from a ``GET /v1/peers`` answer."""
    etcd = doc.get("etcd")
    if etcd:
        return int(etcd["bytes_sent"]), int(etcd["bytes_received"])
    out = sum(int(p["outbound"]["bytes_sent"]) for p in doc["peers"] if p.get("outbound"))
    got = sum(int(p["bytes_received"]) for p in doc["peers"])
    return out, got


async def _start(c: Cluster, tmp: Path, engines: list[Engine], n: int, backend: str,
                 plan: Plan, etcd_url: str = "") -> tuple[list[Node], float]:
    nodes = [c.add(Node(f"n{i}", "127.0.0.1", free_port(), tmp, engines[i])) for i in range(n)]
    for node in nodes:
        if backend == "push":
            node.write_config(peers=[(o.name, o.url) for o in nodes if o is not node],
                              interval=plan.interval, token_file=c.token_file)
        else:
            node.write_config(cluster=f"backend = 'etcd'\netcd_url = '{etcd_url}'\n"
                              f"etcd_lease_ttl_s = {plan.etcd_ttl}\n"
                              "etcd_prefix = 'nvpair/bench/nodes/'\n")
    started = trio.current_time()
    await c.start(*nodes, within=60)
    for node in nodes:
        want = {o.name: "fresh" for o in nodes if o is not node}
        await c.wait(node, "/v1/peers", lambda d, w=want: states(d) == w and all(
            p["models"] for p in d["peers"]), within=30 + 2 * plan.interval,
            what="all peers fresh")
    return nodes, trio.current_time() - started


async def _steady(c: Cluster, nodes: list[Node], seconds: float) -> dict[str, Any]:
    before = {n.name: _bytes(await c.json(n, "/v1/peers")) for n in nodes}
    cpu0 = {n.name: cpu_seconds(n.pid) for n in nodes}
    t0 = trio.current_time()
    await trio.sleep(seconds)
    window = trio.current_time() - t0
    cpu = [(cpu_seconds(n.pid) - cpu0[n.name]) / window for n in nodes]
    outs, ins = [], []
    for n in nodes:
        out, got = _bytes(await c.json(n, "/v1/peers"))
        outs.append((out - before[n.name][0]) * 60 / window)
        ins.append((got - before[n.name][1]) * 60 / window)
    return {"window_s": round(window, 1),
            "bytes_out_per_node_per_min": round(statistics.median(outs)),
            "bytes_in_per_node_per_min": round(statistics.median(ins)),
            "cpu_pct_per_node": {"median": round(100 * statistics.median(cpu), 2),
                                 "max": round(100 * max(cpu), 2)}}


async def _listing(nodes: list[Node], seconds: float) -> dict[str, Any]:
    stall0, t0 = cpu_stall_us(), trio.current_time()
    async with polling(poll_urls(nodes, listing=2 * len(nodes), baseline=2)) as polled:
        await trio.sleep(seconds)
    pressure = (cpu_stall_us() - stall0) / 1e4 / (trio.current_time() - t0)
    result = polled[0]
    return {"listing_ms": _ms(result.of(LISTING)), "healthz_ms": _ms(result.of("/healthz")),
            "errors": result.errors, "cpu_pressure_pct": round(pressure, 1)}


def _lists(doc: dict[str, Any], model: str) -> bool:
    return any(m["id"] == model for m in doc["data"])


async def _watch_listing(c: Cluster, node: Node, model: str, listed: bool,
                         done: list[float]) -> None:
    """Poll ``node``'s cluster listing until it lists ``model`` (or not); note the time."""
    while True:
        if _lists(await c.json(node, LISTING), model) == listed:
            done.append(trio.current_time())
            return
        await trio.sleep(0.05)


async def _propagation(c: Cluster, nodes: list[Node], engine: Engine, changes: int
                       ) -> dict[str, Any]:
    source, others = nodes[0], nodes[1:]
    advert: list[float] = []
    e2e: list[float] = []
    for i in range(changes):
        refuse = i % 2 == 0
        t0 = trio.current_time()
        await set_refusing(c.client, engine, "127.0.0.1", refuse)
        done: list[float] = []
        with trio.fail_after(15):
            async with trio.open_nursery() as nursery:
                for node in others:
                    nursery.start_soon(_watch_listing, c, node, engine.model, not refuse,
                                       done)
        e2e.append(max(done) - t0)
        advert += await propagation(c, source, others)
    return {"advert_ms": _ms(advert), "end_to_end_ms": _ms(e2e)}


async def _failure(c: Cluster, nodes: list[Node], within: float) -> dict[str, Any]:
    victim, observers = nodes[-1], nodes[:-1]
    stopped = trio.current_time()
    c.send_signal(victim, signal.SIGSTOP)
    try:
        seen = await first_seen(c, observers, (victim.name,), within=within)
    finally:
        c.send_signal(victim, signal.SIGCONT)
    stale = [m["stale"] - stopped for m in seen.values()]
    gone = [m["gone"] - stopped for m in seen.values()]
    return {"stale_s": {"median": round(statistics.median(stale), 2),
                        "max": round(max(stale), 2)},
            "gone_s": {"median": round(statistics.median(gone), 2),
                       "max": round(max(gone), 2)}}


async def scenario(tmp: Path, engines: list[Engine], n: int, backend: str, plan: Plan,
                   etcd_url: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {"backend": backend, "nodes": n}
    if backend == "push":
        out["interval_s"] = plan.interval
        out["ttl_s"] = 3 * plan.interval
    else:
        out["lease_ttl_s"] = plan.etcd_ttl
    async with open_cluster(tmp) as c:
        nodes, converged = await _start(c, tmp, engines, n, backend, plan, etcd_url)
        out["converged_s"] = round(converged, 2)
        out["steady"] = await _steady(c, nodes, plan.steady_s)
        out["listing"] = await _listing(nodes, plan.listing_s)
        out["propagation"] = await _propagation(c, nodes, engines[0], plan.changes)
        # push: gone at 2 x TTL without news; etcd: TTL + debounce (up to a whole TTL)
        bound = 6 * plan.interval if backend == "push" else 2 * plan.etcd_ttl
        out["failure"] = await _failure(c, nodes, within=bound + 15)
    return out


async def run(plan: Plan, tmp: Path) -> dict[str, Any]:
    results: list[dict[str, Any]] = []
    async with open_farm(max(plan.sizes)) as engines:
        for n in plan.sizes:
            t0 = trio.current_time()
            try:
                r = await scenario(tmp / f"push-{n}", engines, n, "push", plan)
            except AssertionError as e:
                r = {"backend": "push", "nodes": n, "error": str(e)[:2000]}
            r["wall_s"] = round(trio.current_time() - t0, 1)
            results.append(r)
            print(f"  push N={n}: {r['wall_s']} s", file=sys.stderr)
        # (an even number of changes leaves node 0's engine accepting again)
        results.append(await _etcd(plan, tmp, engines))
    return {"quick": plan.quick, "scenarios": results}


async def _etcd(plan: Plan, tmp: Path, engines: list[Engine]) -> dict[str, Any]:
    n = 4
    try:
        from tests.peers.etcd_server import ETCD, open_etcd
    except ImportError as e:  # tests/peers/etcd_server.py needs pytest
        return {"backend": "etcd", "nodes": n, "skipped": f"cannot import: {e}"}
    if ETCD is None:
        return {"backend": "etcd", "nodes": n, "skipped": "etcd is not installed"}
    t0 = trio.current_time()
    try:
        async with open_etcd(tmp / "etcd") as etcd:
            r = await scenario(tmp / "etcd-4", engines, n, "etcd", plan, etcd.url)
    except AssertionError as e:
        r = {"backend": "etcd", "nodes": n, "error": str(e)[:2000]}
    r["wall_s"] = round(trio.current_time() - t0, 1)
    print(f"  etcd N={n}: {r['wall_s']} s", file=sys.stderr)
    return r


def _cell(d: dict[str, Any] | None, *keys: str) -> str:
    for k in keys:
        if not isinstance(d, dict) or d.get(k) is None:
            return "-"
        d = d[k]
    return f"{d:,}" if isinstance(d, int) else str(d)


def table(doc: dict[str, Any]) -> str:
    header = ("backend", "N", "converge s", "listing p50/p99 ms", "healthz p99 ms",
              "advert ms p50/max", "e2e ms p50/max", "stale s med/max", "gone s med/max",
              "B/node/min out/in", "CPU %/node med/max")
    rows = [header]
    notes = []
    for r in doc["scenarios"]:
        if "skipped" in r or "error" in r:
            notes.append(f"{r['backend']} N={r['nodes']}: {r.get('skipped') or r['error']}")
            continue
        lst, prop, fail, st = r["listing"], r["propagation"], r["failure"], r["steady"]
        rows.append((
            r["backend"], str(r["nodes"]), _cell(r, "converged_s"),
            f"{_cell(lst, 'listing_ms', 'p50')} / {_cell(lst, 'listing_ms', 'p99')}",
            _cell(lst, "healthz_ms", "p99"),
            f"{_cell(prop, 'advert_ms', 'p50')} / {_cell(prop, 'advert_ms', 'max')}",
            f"{_cell(prop, 'end_to_end_ms', 'p50')} / {_cell(prop, 'end_to_end_ms', 'max')}",
            f"{_cell(fail, 'stale_s', 'median')} / {_cell(fail, 'stale_s', 'max')}",
            f"{_cell(fail, 'gone_s', 'median')} / {_cell(fail, 'gone_s', 'max')}",
            f"{_cell(st, 'bytes_out_per_node_per_min')} / "
            f"{_cell(st, 'bytes_in_per_node_per_min')}",
            f"{_cell(st, 'cpu_pct_per_node', 'median')} / "
            f"{_cell(st, 'cpu_pct_per_node', 'max')}"))
        if lst["errors"] or lst["cpu_pressure_pct"] > 20:
            notes.append(f"{r['backend']} N={r['nodes']}: listing errors {lst['errors']}, "
                         f"CPU pressure {lst['cpu_pressure_pct']} %")
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines + notes)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--quick", action="store_true",
                    help="N = 4 only, interval 1 s, short windows (under a minute)")
    args = ap.parse_args(argv)
    plan = Plan(args.quick)
    with tempfile.TemporaryDirectory(prefix="nvpair-bench-cluster-") as tmp:
        for name in [f"push-{n}" for n in plan.sizes] + ["etcd", "etcd-4"]:
            (Path(tmp) / name).mkdir()
        doc = trio.run(run, plan, Path(tmp))
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / ("cluster-quick.json" if args.quick else "cluster.json")
    path.write_text(json.dumps(doc, indent=2) + "\n")
    print(table(doc))
    print(f"written: {path}")
    return 1 if any("error" in r for r in doc["scenarios"]) else 0


if __name__ == "__main__":
    raise SystemExit(main())
