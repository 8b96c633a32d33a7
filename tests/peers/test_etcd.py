"""The etcd backend with real nvpair processes and a real etcd on loopback (lease TTL 3 s).

* node lifecycle: everyone finds everyone; changes propagate (measured); a graceful leave
  is seen at once; a lease revoked behind a node's back is replaced before anyone drops
  the node; a frozen node goes stale at its lease's expiry and gone after the debounce,
  and comes back when thawed.
* etcd faults: etcd frozen for 2 x TTL (every lease expires at once when it thaws) drops
  nobody and the listing stays fast; etcd restarted: the watches resume.
"""

from __future__ import annotations

import base64
import signal
import statistics
from pathlib import Path
from typing import Any

import httpx2
import msgspec
import pytest
import trio
import trio.testing
from tests.managed import free_port
from tests.peers.cluster import (
    Cluster,
    Node,
    check_listing_latency,
    cpu_stall_us,
    first_seen,
    leave_seen,
    open_cluster,
    open_farm,
    poll_urls,
    polling,
    propagation,
    set_refusing,
    states,
)
from tests.peers.etcd_server import EtcdServer, open_etcd
from tests.peers.etcd_standin import GARBAGE, FakeEtcd

from nvpair import service
from nvpair.config.cluster import EtcdSettings
from nvpair.config.settings import load_settings
from nvpair.peers.advert import Advert, AdvertEngine, Advertiser, AdvertModel
from nvpair.peers.etcd import EtcdBackend
from nvpair.peers.table import PeerTable
from nvpair.state.snapshot import Board

TTL = 3
DEBOUNCE = TTL / 2  # the default min(5, TTL/2)
SLACK = 1.5
REPORT: dict[str, Any] = {}

pytestmark = [
    # cancelled watches abandon httpx2's nested stream generators (in the nvpair processes;
    # here only the warnings filter of this process is concerned)
    pytest.mark.filterwarnings("ignore:Async generator 'httpx2:ResourceWarning"),
]


async def start_nodes(c: Cluster, tmp: Path, etcd: EtcdServer, engines: list[Any],
                      count: int) -> list[Node]:
    extra = (f"backend = 'etcd'\netcd_url = '{etcd.url}'\netcd_lease_ttl_s = {TTL}\n"
             "etcd_prefix = 'nvpair/test/nodes/'\n")
    nodes = [c.add(Node(f"n{i}", "127.0.0.1", free_port(), tmp, engines[i]))
             for i in range(count)]
    for node in nodes:
        node.write_config(cluster=extra)
    await c.start(*nodes)
    for node in nodes:
        want = {o.name: "fresh" for o in nodes if o is not node}
        await c.wait(node, "/v1/peers", lambda d, w=want: states(d) == w and all(
            p["models"] for p in d["peers"]), within=20, what="all peers fresh")
    return nodes


async def record_states(c: Cluster, observers: list[Node], seen: dict[str, set[str]]) -> None:
    """Until cancelled: every state each observer shows for each peer (``seen[peer]``)."""
    async def watch(node: Node) -> None:
        while True:
            for name, state in states(await c.json(node, "/v1/peers")).items():
                seen.setdefault(name, set()).add(state)
            await trio.sleep(0.1)

    async with trio.open_nursery() as nursery:
        for node in observers:
            nursery.start_soon(watch, node)


async def test_etcd_node_lifecycle(tmp_path: Path) -> None:
    REPORT.clear()
    try:
        with trio.fail_after(90):
            async with open_etcd(tmp_path) as etcd, open_farm(4) as engines, \
                    open_cluster(tmp_path) as c:
                await _node_lifecycle(c, tmp_path, etcd, engines)
    finally:
        print("peers etcd lifecycle:", REPORT)


async def _node_lifecycle(c: Cluster, tmp: Path, etcd: EtcdServer, engines: list[Any]) -> None:
    started = trio.current_time()
    nodes = await start_nodes(c, tmp, etcd, engines, 4)
    REPORT["converged_s"] = round(trio.current_time() - started, 2)
    n0, n1, n2, n3 = nodes

    delays: list[float] = []
    for refuse in (True, False) * 2:
        await set_refusing(c.client, engines[0], "127.0.0.1", refuse)
        await c.wait(n0, "/v1/models", lambda d, r=refuse: (r == (d["data"] == [])) and
                     all(m["nvpair"]["state"] == "ready" for m in d["data"]), within=10)
        delays += await propagation(c, n0, nodes[1:])
    REPORT["propagation_ms"] = {"median": round(1000 * statistics.median(delays), 1),
                                "max": round(1000 * max(delays), 1)}
    assert statistics.median(delays) < 0.2 and max(delays) < 1.5, REPORT

    REPORT["leave_seen_s"] = round(await leave_seen(c, n3, [n0, n1, n2]), 2)
    assert REPORT["leave_seen_s"] < 1.0, REPORT

    # A lease revoked behind n2's back: n2 sees its key deleted, takes a new lease and puts
    # its advert again before anyone's debounce drops it.
    old_lease = (await c.json(n2, "/v1/peers"))["etcd"]["lease"]
    seen: dict[str, set[str]] = {}
    async with trio.open_nursery() as nursery:
        nursery.start_soon(record_states, c, [n0, n1], seen)
        revoked = trio.current_time()
        r = await c.client.post(f"{etcd.url}/v3/lease/revoke", json={"ID": str(old_lease)})
        assert r.status_code == 200, r.text
        await c.wait(n2, "/v1/peers", lambda d: d["etcd"]["lease"] not in (None, old_lease),
                     within=5, what="a new lease")
        REPORT["re_registered_s"] = round(trio.current_time() - revoked, 2)
        for node in (n0, n1):
            await c.wait(node, "/v1/peers", lambda d: states(d)["n2"] == "fresh", within=5)
        nursery.cancel_scope.cancel()
    assert "gone" not in seen["n2"], seen
    # re-registered before peers would drop the deleted key (the debounce): never seen gone
    assert REPORT["re_registered_s"] < DEBOUNCE, REPORT

    # A key deleted behind n1's back while its lease lives on (`etcdctl del`): n1 puts
    # it again at once (a keepalive alone would leave it missing until the next change).
    seen = {}
    async with trio.open_nursery() as nursery:
        nursery.start_soon(record_states, c, [n0, n2], seen)
        key = base64.b64encode(b"nvpair/test/nodes/n1").decode()
        r = await c.client.post(f"{etcd.url}/v3/kv/deleterange", json={"key": key})
        assert r.status_code == 200 and r.json().get("deleted") == "1", r.text
        deleted = trio.current_time()
        while True:  # etcd itself is the witness: the key is back
            r = await c.client.post(f"{etcd.url}/v3/kv/range", json={"key": key})
            if r.json().get("kvs"):
                break
            assert trio.current_time() - deleted < DEBOUNCE, "n1's key did not come back"
            await trio.sleep(0.05)  # an external process: nothing to wait on but it
        REPORT["key_back_s"] = round(trio.current_time() - deleted, 2)
        nursery.cancel_scope.cancel()
    assert "gone" not in seen["n1"], seen

    # A frozen node: its lease expires (TTL), the DELETE is debounced, then it is gone.
    c.send_signal(n2, signal.SIGSTOP)
    frozen = trio.current_time()
    seen_at = await first_seen(c, [n0, n1], ("n2",), within=TTL + DEBOUNCE + 2 * SLACK)
    for what, bound in (("stale", TTL), ("gone", TTL + DEBOUNCE)):
        took = max(at[what] for at in seen_at.values()) - frozen
        REPORT[f"frozen_{what}_after_s"] = round(took, 2)
        assert took < bound + SLACK, (what, REPORT)
    c.send_signal(n2, signal.SIGCONT)
    thawed = trio.current_time()
    for node in (n0, n1):
        await c.wait(node, "/v1/peers", lambda d: states(d)["n2"] == "fresh", within=5,
                     what="n2 back")
    REPORT["thawed_back_s"] = round(trio.current_time() - thawed, 2)


async def test_etcd_stall_and_restart(tmp_path: Path) -> None:
    REPORT.clear()
    try:
        with trio.fail_after(90):
            async with open_etcd(tmp_path) as etcd, open_farm(3) as engines, \
                    open_cluster(tmp_path) as c:
                await _etcd_faults(c, tmp_path, etcd, engines)
    finally:
        print("peers etcd faults:", REPORT)


async def _etcd_faults(c: Cluster, tmp: Path, etcd: EtcdServer, engines: list[Any]) -> None:
    nodes = await start_nodes(c, tmp, etcd, engines, 3)
    seen: dict[str, set[str]] = {}
    urls = poll_urls(nodes, listing=6)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(record_states, c, nodes, seen)
        stall0, t0 = cpu_stall_us(), trio.current_time()
        async with polling(urls) as polled:
            await _stall(c, etcd, nodes)
        REPORT["cpu_pressure_pct"] = round(
            (cpu_stall_us() - stall0) / 1e4 / (trio.current_time() - t0), 1)
        await _restart(c, etcd, engines, nodes)
        nursery.cancel_scope.cancel()
    assert "gone" not in set().union(*seen.values()), seen
    check_listing_latency(polled[0], REPORT["cpu_pressure_pct"], REPORT)


async def _stall(c: Cluster, etcd: EtcdServer, nodes: list[Node]) -> None:
    """etcd frozen for 2 x TTL: every node notices and keeps serving its table (stale after
    TTL); nobody is dropped when every lease expires at once on the thaw."""
    etcd.freeze()
    frozen = trio.current_time()
    for node in nodes:
        await c.wait(node, "/v1/peers", lambda d: d["etcd"]["state"] == "unreachable",
                     within=TTL, what="etcd unreachable")
    for node in nodes:
        await c.wait(node, "/v1/peers", lambda d: set(states(d).values()) == {"stale"},
                     within=TTL + SLACK, what="peers stale while etcd is frozen")
    listing = await c.json(nodes[0], "/v1/cluster/models")
    assert {m["nvpair"]["node"] for m in listing["data"]} == {"n0", "n1", "n2"}
    assert all(m["nvpair"]["stale"] for m in listing["data"] if m["nvpair"]["node"] != "n0")
    await trio.sleep_until(frozen + 2 * TTL)  # the fault lasts 2 x TTL
    etcd.thaw()
    thawed = trio.current_time()
    for node in nodes:
        await c.wait(node, "/v1/peers", lambda d: d["etcd"]["state"] == "ok" and set(
            states(d).values()) == {"fresh"}, within=TTL + SLACK, what="back after thaw")
    REPORT["stall_recovered_s"] = round(trio.current_time() - thawed, 2)


async def _restart(c: Cluster, etcd: EtcdServer, engines: list[Any], nodes: list[Node]) -> None:
    """etcd restarted with its data: the watches end and resume from a fresh range."""
    await etcd.stop()
    await etcd.start()
    restarted = trio.current_time()
    for node in nodes:
        await c.wait(node, "/v1/peers", lambda d: d["etcd"]["state"] == "ok" and set(
            states(d).values()) == {"fresh"}, within=TTL + 2 * SLACK, what="back after restart")
    REPORT["restart_recovered_s"] = round(trio.current_time() - restarted, 2)
    delays = []
    for refuse in (True, False):  # the watches work again
        await set_refusing(c.client, engines[0], "127.0.0.1", refuse)
        await c.wait(nodes[0], "/v1/models", lambda d, r=refuse: (r == (d["data"] == []))
                     and all(m["nvpair"]["state"] == "ready" for m in d["data"]), within=10)
        delays += await propagation(c, nodes[0], nodes[1:])
    REPORT["propagation_after_restart_ms"] = round(1000 * max(delays), 1)
    assert max(delays) < 1.5, REPORT


async def test_etcd_unreachable_from_the_start_serves_an_empty_table(tmp_path: Path) -> None:
    """No etcd at all: the node runs, lists its own models and says why peers are missing."""
    closed_port = free_port()  # nothing listens here
    with trio.fail_after(30):
        async with open_cluster(tmp_path) as c:
            (node,) = [c.add(Node("solo", "127.0.0.1", free_port(), tmp_path, None))]
            node.write_config(cluster=f"backend = 'etcd'\netcd_url = "
                                      f"'http://127.0.0.1:{closed_port}'\n")
            await c.start(node)
            doc = await c.wait(node, "/v1/peers",
                               lambda d: d["etcd"]["state"] == "unreachable", within=10)
            assert doc["peers"] == [] and "ConnectError" in doc["etcd"]["last_error"]
            r = await c.client.get(node.url + "/v1/models?scope=cluster")
            assert r.status_code == 200 and r.json()["data"] == []


# -- the backend against a stand-in that answers garbage (unit: MockTransport, autojump) --

PREFIX = "nvpair/t/nodes/"


def peer_advert(node: str = "peer", url: str = "http://127.0.0.1:9") -> bytes:
    return msgspec.json.encode(Advert(
        node=node, boot_id="b1", seq=1, ttl_s=TTL, url=url,
        engines=(AdvertEngine(name="e", kind="vllm", state="ready", models=("far",)),),
        models=(AdvertModel(id="far", engine="e", engines=("e",), kind="vllm"),)))


async def until(predicate: Any, within: float = 30.0) -> None:
    """Poll ``predicate`` on the autojump clock (the backend's state has no event)."""
    with trio.fail_after(within):
        while not predicate():  # noqa: ASYNC110
            await trio.sleep(0.01)


@pytest.mark.parametrize("kind", GARBAGE)
async def test_garbage_from_etcd_is_a_failed_backend_with_backoff_not_a_crash(
        kind: str, autojump_clock: trio.testing.MockClock) -> None:
    """Each kind of garbage: the backend says ``failed`` with the reason, retries with
    backoff (a handful of requests per second at most), keeps the table (stale, then gone:
    news only while the watch works), and is ok again once etcd answers properly. Before,
    run() raised DecodeError/TypeError/binascii.Error into the service's nursery."""
    etcd = FakeEtcd(ttl=TTL)
    etcd.kv[(PREFIX + "peer").encode()] = peer_advert()
    advertiser = Advertiser(Board(()), "me", ttl_s=TTL, url="http://127.0.0.1:1")
    table = PeerTable("me", gone_factor=3.0, min_ttl=TTL)
    settings = EtcdSettings(url="http://etcd", prefix=PREFIX, lease_ttl_s=TTL,
                            debounce_s=DEBOUNCE)
    backend = EtcdBackend(settings, advertiser, table, transport=etcd.transport())
    now = trio.current_time
    async with trio.open_nursery() as nursery:
        await nursery.start(backend.run)
        await until(lambda: backend.state == "ok" and table.states(now()) == {"peer": "fresh"})
        etcd.set_garbage(kind)
        before = len(etcd.requests)
        await until(lambda: backend.state == "failed")
        failed_at = now()
        reason = backend.doc(now())["last_error"]
        assert reason and "\n" not in reason and "internal error" not in reason, reason
        await trio.sleep(TTL + 0.5)
        assert table.states(now()) == {"peer": "stale"}  # still listed, flagged
        await trio.sleep(30)
        assert backend.state == "failed" and backend.counts["failures"] >= 3
        spent = now() - failed_at
        assert len(etcd.requests) - before < 6 * spent, (len(etcd.requests) - before, spent)
        assert table.states(now()) == {"peer": "gone"}
        etcd.set_garbage(None)
        await until(lambda: backend.state == "ok" and table.states(now()) == {"peer": "fresh"})
        nursery.cancel_scope.cancel()


async def test_a_value_with_a_bad_url_is_skipped_and_counted_not_listed(
        autojump_clock: trio.testing.MockClock) -> None:
    """A node's key whose advert has an unusable URL is left out (one log line, counted in
    ``rejected``); the other nodes are listed."""
    etcd = FakeEtcd(ttl=TTL)
    etcd.kv[(PREFIX + "good").encode()] = peer_advert("good")
    etcd.kv[(PREFIX + "port").encode()] = peer_advert("port").replace(
        b"http://127.0.0.1:9", b"http://peer:99999")
    etcd.kv[(PREFIX + "v6").encode()] = peer_advert("v6").replace(
        b"http://127.0.0.1:9", b"http://[::1")
    advertiser = Advertiser(Board(()), "me", ttl_s=TTL, url="http://127.0.0.1:1")
    table = PeerTable("me", gone_factor=3.0, min_ttl=TTL)
    settings = EtcdSettings(url="http://etcd", prefix=PREFIX, lease_ttl_s=TTL,
                            debounce_s=DEBOUNCE)
    backend = EtcdBackend(settings, advertiser, table, transport=etcd.transport())
    async with trio.open_nursery() as nursery:
        await nursery.start(backend.run)
        await until(lambda: backend.state == "ok" and "good" in table.entries)
        assert set(table.entries) == {"good"}
        assert backend.doc(trio.current_time())["rejected"] == {"schema": 2}
        nursery.cancel_scope.cancel()


async def test_a_node_whose_etcd_answers_garbage_keeps_serving(nursery, tmp_path: Path) -> None:
    """Real sockets: nvpair (in-process) against an etcd stand-in that answers a 200 HTML
    page, then bad base64 in the watch. ``/v1/peers`` says ``failed`` with the reason while
    ``/v1/models`` and ``/healthz`` answer and the peer goes stale; once etcd answers
    properly the backend is ok and the peer fresh again. Before, the first HTML answer
    raised DecodeError through the broker into the API's nursery: the node went down."""
    etcd = FakeEtcd(ttl=2)
    etcd.kv[(PREFIX + "peer").encode()] = peer_advert()
    url = await nursery.start(etcd.serve)
    (tmp_path / "nvpair.toml").write_text(
        f"listen = '127.0.0.1:0'\nnode = 'me'\n[cluster]\nbackend = 'etcd'\n"
        f"etcd_url = '{url}'\netcd_lease_ttl_s = 2\netcd_prefix = '{PREFIX}'\n")
    running = await nursery.start(service.run, load_settings(str(tmp_path / "nvpair.toml")))
    with trio.fail_after(30):
        async with httpx2.AsyncClient(base_url=str(running.url), trust_env=False,
                                      timeout=2) as client:
            async def peers_until(predicate: Any) -> dict[str, Any]:
                while True:  # polling the API, as a user would
                    doc: dict[str, Any] = (await client.get("/v1/peers")).json()
                    if predicate(doc):
                        return doc
                    await trio.sleep(0.05)

            await peers_until(lambda d: d["etcd"]["state"] == "ok" and states(d) == {
                "peer": "fresh"})
            for kind, words in (("html", "is not JSON: <html>"), ("base64", "not base64")):
                etcd.set_garbage(kind)
                doc = await peers_until(lambda d, w=words: d["etcd"]["state"] == "failed"
                                        and w in d["etcd"]["last_error"])
                doc = await peers_until(lambda d: states(d) == {"peer": "stale"})
                assert doc["etcd"]["state"] == "failed"  # still: the table kept, stale
                for path in ("/v1/models", "/healthz", "/v1/models?scope=cluster"):
                    r = await client.get(path)
                    assert r.status_code == 200, (path, r.text)
                cluster = (await client.get("/v1/models?scope=cluster")).json()["data"]
                assert [m["nvpair"]["peer"] for m in cluster] == ["stale"]
                etcd.set_garbage(None)
                await peers_until(lambda d: d["etcd"]["state"] == "ok" and states(d) == {
                    "peer": "fresh"})


async def test_a_backend_run_again_keeps_its_key(autojump_clock: trio.testing.MockClock) -> None:
    """The broker runs the backend again after a failure of its run: the second run renews
    this node's lease and keeps its key. Before, the first run's end closed both clients
    for good: the watcher made a new one after its first failure, but the owner's loop
    retried the closed client forever ('renewing the lease: RuntimeError: Cannot send a
    request, as the client has been closed'), so the node's key expired."""
    etcd = FakeEtcd(ttl=TTL)
    advertiser = Advertiser(Board(()), "me", ttl_s=TTL, url="http://127.0.0.1:1")
    table = PeerTable("me", gone_factor=3.0, min_ttl=TTL)
    settings = EtcdSettings(url="http://etcd", prefix=PREFIX, lease_ttl_s=TTL,
                            debounce_s=DEBOUNCE)
    backend = EtcdBackend(settings, advertiser, table, transport=etcd.transport())
    for _ in range(2):
        async with trio.open_nursery() as nursery:
            await nursery.start(backend.run)
            await until(lambda: backend.state == "ok")
            keepalives = backend.counts["keepalives"]
            await trio.sleep(3 * TTL)
            assert backend.counts["keepalives"] > keepalives
            assert backend.state == "ok" and backend.counts["failures"] == 0, backend.doc(
                trio.current_time())["last_error"]
            nursery.cancel_scope.cancel()
