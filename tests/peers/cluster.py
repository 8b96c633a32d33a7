"""Real nvpair processes for the peers tests: configs, start and stop, reads, sockets.

Every wait here polls an external process's HTTP under ``trio.fail_after`` (there is no
event to wait on across processes); nothing sleeps to synchronise.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, BinaryIO

import httpx2
import msgspec
import trio

REPO = Path(__file__).resolve().parents[2]
TOKEN = "peers-test-cluster-token"
#: the API (user) token of nodes that listen off loopback; the test client always sends it.
USER_TOKEN = "peers-test-user-token"
AUTH = {"authorization": f"Bearer {USER_TOKEN}"}
POLL_S = 0.05


class Engine(msgspec.Struct, frozen=True):
    port: int
    control: int
    model: str


class Node:
    """One nvpair process (not started until ``Cluster.start``)."""

    def __init__(self, name: str, host: str, port: int, tmp: Path, engine: Engine | None,
                 netns: str | None = None) -> None:
        self.name, self.host, self.port, self.engine, self.netns = name, host, port, engine, netns
        self.dir = tmp / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.config = self.dir / "nvpair.toml"
        self.log = self.dir / "nvpair.log"
        self.proc: trio.Process | None = None
        self._log_file: BinaryIO | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def write_config(self, *, peers: Sequence[tuple[str, str]] = (), interval: float = 1.0,
                     token_file: Path | None = None, cluster: str = "",
                     engine_host: str = "127.0.0.1") -> None:
        lines = [f"listen = '{self.host}:{self.port}'", f"node = '{self.name}'",
                 f"log_dir = '{self.dir / 'logs'}'"]
        if not self.host.startswith("127."):
            (self.dir / "user-token").write_text(USER_TOKEN)
            lines.append(f"token_file = '{self.dir / 'user-token'}'")
        if self.engine is not None:
            lines += ["[[engines]]", "name = 'e'", "kind = 'vllm'", f"host = '{engine_host}'",
                      f"port = {self.engine.port}",
                      "[engines.probes.ready]", "interval_s = 0.5", "timeout_s = 0.5",
                      "[engines.probes.health]", "interval_s = 1", "timeout_s = 1"]
        for name, url in peers:
            lines += ["[[peers]]", f"url = '{url}'", f"name = '{name}'"]
        lines += ["[cluster]", f"interval_s = {interval}"]
        if token_file is not None:
            lines.append(f"token_file = '{token_file}'")
        self.config.write_text("\n".join(lines) + "\n" + cluster)


def states(doc: dict[str, Any]) -> dict[str, str]:
    """node -> state, from a ``GET /v1/peers`` answer."""
    return {p["node"]: p["state"] for p in doc["peers"]}


def summary(doc: Any) -> str:
    """A short account of an answer for failure messages (peers: state, models, error)."""
    if isinstance(doc, dict) and "peers" in doc:
        rows = [(p["node"], p["state"], p["age_s"], p["models"],
                 p["outbound"] and p["outbound"]["last_error"]) for p in doc["peers"]]
        return f"peers {rows}; etcd {doc.get('etcd')}"
    return msgspec.json.encode(doc).decode()[:3000]


def cpu_stall_us() -> int:
    """Microseconds some runnable task waited for a CPU (/proc/pressure/cpu; 0 without PSI).
    A busy box, not nvpair, is what makes listing latencies high: the tests report both."""
    try:
        some = Path("/proc/pressure/cpu").read_text().splitlines()[0]
    except OSError:
        return 0
    return int(some.rsplit("total=", 1)[1])


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _port(address: str) -> int:
    port = address.rsplit(":", 1)[1]
    return int(port) if port.isdigit() else -1


class Sock(msgspec.Struct, frozen=True):
    state: str
    local: str
    peer: str
    pid: int | None
    info: str = ""

    @property
    def peer_port(self) -> int:
        return _port(self.peer)

    @property
    def local_port(self) -> int:
        return _port(self.local)

    def counter(self, name: str) -> int:
        for part in self.info.split():
            if part.startswith(name + ":"):
                return int(part.split(":", 1)[1])
        return 0


async def sockets(netns: str | None = None) -> list[Sock]:
    """Every TCP socket (``ss -Htanpi``), with its owning pid and its byte counters."""
    cmd = ["ss", "-Htanpi"]
    if netns is not None:
        cmd = ["ip", "netns", "exec", netns, *cmd]
    result = await trio.run_process(cmd, capture_stdout=True)
    out: list[Sock] = []
    for line in result.stdout.decode().splitlines():
        if not line[:1].isalpha():  # the -i details of the socket above
            if out:
                last = out[-1]
                out[-1] = msgspec.structs.replace(last, info=last.info + " " + line.strip())
            continue
        parts = line.split()
        pid = None
        if "pid=" in line:
            pid = int(line.split("pid=", 1)[1].split(",", 1)[0])
        out.append(Sock(state=parts[0], local=parts[3], peer=parts[4], pid=pid))
    return out


class Cluster:
    def __init__(self, tmp: Path, client: httpx2.AsyncClient) -> None:
        self.tmp = tmp
        self.client = client
        self.nodes: dict[str, Node] = {}
        self.token_file = tmp / "cluster-token"
        self.token_file.write_text(TOKEN + "\n")

    def add(self, node: Node) -> Node:
        self.nodes[node.name] = node
        return node

    async def start(self, *nodes: Node, within: float = 30.0) -> None:
        for node in nodes:
            cmd = [sys.executable, "-m", "nvpair", "serve", "--config", str(node.config)]
            if node.netns is not None:
                cmd = ["ip", "netns", "exec", node.netns, *cmd]
            node._log_file = node.log.open("ab")
            node.proc = await trio.lowlevel.open_process(
                cmd, stdout=node._log_file, stderr=subprocess.STDOUT, cwd=str(REPO))
        with trio.fail_after(within):
            for node in nodes:
                while True:
                    try:
                        r = await self.client.get(node.url + "/healthz")
                    except httpx2.TransportError:
                        r = None
                    if r is not None and r.status_code == 200:
                        break
                    assert node.proc is not None and node.proc.returncode is None, \
                        f"{node.name} exited: {node.log.read_text()[-2000:]}"
                    await trio.sleep(POLL_S)

    def send_signal(self, node: Node, signum: int) -> None:
        assert node.proc is not None
        os.kill(node.proc.pid, signum)

    async def stop(self, node: Node, signum: int = signal.SIGTERM) -> int:
        assert node.proc is not None
        self.send_signal(node, signum)
        with trio.fail_after(15):
            return await node.proc.wait()

    async def json(self, node: Node, path: str) -> Any:
        r = await self.client.get(node.url + path, headers=AUTH)
        assert r.status_code == 200, (node.name, path, r.status_code, r.text)
        return r.json()

    async def wait(self, node: Node, path: str, predicate: Callable[[Any], bool], *,
                   within: float, what: str = "") -> Any:
        """Poll ``node``'s ``path`` until ``predicate(doc)``; the doc. Fails with the last."""
        doc = None
        try:
            with trio.fail_after(within):
                while True:
                    doc = await self.json(node, path)
                    if predicate(doc):
                        return doc
                    await trio.sleep(POLL_S)
        except trio.TooSlowError:
            raise AssertionError(f"{node.name}: {what or path} not within {within} s; last "
                                 f"{summary(doc)}") from None

    async def close(self) -> None:
        procs = [n for n in self.nodes.values() if n.proc is not None]
        for node in procs:
            assert node.proc is not None
            if node.proc.returncode is None:
                os.kill(node.proc.pid, signal.SIGCONT)
                node.proc.terminate()
        with trio.move_on_after(10, shield=True):
            for node in procs:
                assert node.proc is not None
                await node.proc.wait()
        for node in procs:
            assert node.proc is not None
            if node.proc.returncode is None:
                node.proc.kill()
                with trio.move_on_after(5, shield=True):
                    await node.proc.wait()
            if node._log_file is not None:
                node._log_file.close()


@asynccontextmanager
async def open_cluster(tmp: Path) -> AsyncIterator[Cluster]:
    limits = httpx2.Limits(max_connections=64, max_keepalive_connections=64)
    async with httpx2.AsyncClient(timeout=5, limits=limits, trust_env=False) as client:
        cluster = Cluster(tmp, client)
        try:
            yield cluster
        finally:
            with trio.move_on_after(30, shield=True):
                await cluster.close()


@asynccontextmanager
async def open_farm(count: int, host: str = "127.0.0.1") -> AsyncIterator[list[Engine]]:
    """``count`` simulated vLLM engines in one child process (tests/peers/simfarm.py)."""
    proc = await trio.lowlevel.open_process(
        [sys.executable, "-m", "tests.peers.simfarm", "--host", host, "--count", str(count)],
        stdout=subprocess.PIPE, cwd=str(REPO))
    try:
        line = b""
        with trio.fail_after(30):
            assert proc.stdout is not None
            while not line.endswith(b"\n"):
                chunk = await proc.stdout.receive_some(65536)
                assert chunk, "the sim farm exited"
                line += chunk
        yield msgspec.json.decode(line, type=list[Engine])
    finally:
        proc.kill()
        with trio.move_on_after(5, shield=True):
            await proc.wait()


async def set_refusing(client: httpx2.AsyncClient, engine: Engine, host: str,
                       refuse: bool) -> None:
    """Make a simulated engine refuse connections (its node lists the model no more)."""
    url = f"http://{host}:{engine.control}/__sim/fault"
    r = await (client.post(url, json={"mode": "refuse"}) if refuse else client.delete(url))
    assert r.status_code == 200, r.text


class Pollers(msgspec.Struct):
    latencies: dict[str, list[float]]
    errors: int

    def of(self, path: str) -> list[float]:
        """Every latency of the URLs that end with ``path``."""
        return [x for url, xs in self.latencies.items() if url.endswith(path) for x in xs]


@asynccontextmanager
async def polling(urls: list[str], every: float = 0.05) -> AsyncIterator[list[Pollers]]:
    """Poll ``urls`` from another process (tests/peers/pollers.py) for the duration of the
    block; the result (one item) is there after the block."""
    proc = await trio.lowlevel.open_process(
        [sys.executable, "-m", "tests.peers.pollers", "--every", str(every), *urls],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=str(REPO))
    result: list[Pollers] = []
    try:
        yield result
    finally:
        assert proc.stdin is not None and proc.stdout is not None
        with trio.move_on_after(10, shield=True):
            await proc.stdin.aclose()
            out = b""
            while chunk := await proc.stdout.receive_some(1 << 20):
                out += chunk
            await proc.wait()
            result.append(msgspec.json.decode(out, type=Pollers))
        if proc.returncode is None:
            proc.kill()


async def timed_json(c: Cluster, node: Node, path: str) -> tuple[float, Any]:
    """The answer and the moment it describes (the middle of the request), on our clock."""
    before = trio.current_time()
    doc = await c.json(node, path)
    return (before + trio.current_time()) / 2, doc


def peer(doc: dict[str, Any], name: str) -> dict[str, Any]:
    return next(p for p in doc["peers"] if p["node"] == name)


async def propagation(c: Cluster, source: Node, others: list[Node]) -> list[float]:
    """Seconds from ``source``'s advert change to its arrival at each other node."""
    at, own = await timed_json(c, source, "/v1/peers")
    changed = at - own["changed_age_s"]
    seq = own["seq"]
    delays = []
    for node in others:
        doc = await c.wait(node, "/v1/peers", lambda d: peer(d, source.name)["seq"] >= seq,
                           within=5, what=f"{source.name}'s seq {seq}")
        at = trio.current_time()
        delays.append(at - peer(doc, source.name)["changed_age_s"] - changed)
    return delays


async def first_seen(c: Cluster, observers: list[Node], names: tuple[str, ...], *,
                     within: float) -> dict[tuple[str, str], dict[str, float]]:
    """Poll every observer at once until each shows each of ``names`` gone.

    For each (observer, name): when the observer's states ``stale`` and ``gone`` began, on
    our clock, from the ``state_age_s`` the observer reports (so a slow poll on a busy box
    does not count), and when we first saw each (``seen_stale``, ``seen_gone``).
    """
    seen: dict[tuple[str, str], dict[str, float]] = {}

    async def watch(node: Node) -> None:
        while True:
            at, doc = await timed_json(c, node, "/v1/peers")
            for name in names:
                mark = seen.setdefault((node.name, name), {})
                p = peer(doc, name)
                if p["state"] in ("stale", "gone") and "stale" not in mark:
                    mark["seen_stale"] = at
                    mark["stale"] = at - p["state_age_s"] if p["state"] == "stale" else at
                if p["state"] == "gone" and "gone" not in mark:
                    mark["seen_gone"] = at
                    mark["gone"] = at - p["state_age_s"]
            if all("gone" in seen.get((node.name, n), {}) for n in names):
                return
            await trio.sleep(0.2)

    try:
        with trio.fail_after(within):
            async with trio.open_nursery() as nursery:
                for node in observers:
                    nursery.start_soon(watch, node)
    except trio.TooSlowError:
        raise AssertionError(f"not all gone within {within} s: {seen}") from None
    return seen


async def leave_seen(c: Cluster, leaving: Node, observers: Sequence[Node]) -> float:
    """SIGTERM ``leaving``; seconds until the last observer marked it left (from the
    observers' own ``state_age_s``, so our polling does not count)."""
    signalled = trio.current_time()
    c.send_signal(leaving, signal.SIGTERM)
    seen = []
    for node in observers:
        await c.wait(node, "/v1/peers", lambda d: states(d)[leaving.name] == "left", within=5,
                     what=f"{leaving.name} left")
        at, doc = await timed_json(c, node, "/v1/peers")
        seen.append(at - peer(doc, leaving.name)["state_age_s"] - signalled)
    assert leaving.proc is not None
    with trio.fail_after(15):
        await leaving.proc.wait()
    return max(seen)


#: CPU pressure (% of the time some task waited for a CPU) above which the box, not nvpair,
#: sets listing latencies: other jobs on a shared 2-core box.


LISTING = "/v1/models?scope=cluster"
BASELINE = "/healthz"


def poll_urls(nodes: Sequence[Node], listing: int = 8, baseline: int = 2) -> list[str]:
    """Pollers of the cluster listing and, as a baseline, of /healthz (no work at all)."""
    return ([f"{nodes[i % len(nodes)].url}{LISTING}" for i in range(listing)]
            + [f"{nodes[i % len(nodes)].url}{BASELINE}" for i in range(baseline)])


def check_listing_latency(polled: Pollers, pressure_pct: float,
                          report: dict[str, Any]) -> None:
    """The cluster listing's p99 is under 50 ms, or, when the machine itself is slow (its
    /healthz, which does nothing, polled from the same nodes at the same moments, is slow
    too), at most twice /healthz's p99. A listing that waited on a peer would take a push
    timeout (2 s) or more either way."""
    listing, baseline = polled.of(LISTING), polled.of(BASELINE)
    p99, base99 = percentile(listing, 0.99), percentile(baseline, 0.99)
    report["listing_ms"] = {"p50": round(1000 * percentile(listing, 0.5), 1),
                            "p99": round(1000 * p99, 1), "max": round(1000 * max(listing), 1),
                            "reads": len(listing), "healthz_p99": round(1000 * base99, 1),
                            "cpu_pressure_pct": round(pressure_pct, 1)}
    assert polled.errors == 0, report
    if p99 >= 0.050:
        print(f"note: listing p99 {1000 * p99:.0f} ms on a busy box (CPU pressure "
              f"{pressure_pct:.0f} %): held to /healthz's {1000 * base99:.0f} ms")
    assert p99 < max(0.050, 2 * base99), report


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
