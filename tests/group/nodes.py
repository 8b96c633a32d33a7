"""Several real nvpair processes on loopback, one per node of a group, each on its own
address (127.0.0.N), with the simulators as the group's engine (a manifest of their own).

Every wait polls an external process's HTTP under ``trio.fail_after`` (there is no event
to wait on across processes); nothing sleeps to synchronise.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from tests.peers.cluster import USER_TOKEN, Cluster, Node
from tests.ports import free_port

SIM = [sys.executable, "-m", "nvpair.sim"]



def sim_manifest(path: Path, *, load_s: float = 0.3, rank_extra: tuple[str, ...] = (),
                 head_extra: tuple[str, ...] = (), on_loss: str = "hung") -> Path:
    """An SGLang-like group manifest whose roles are ``nvpair sim sglang`` processes: as
    SGLang's, the head hangs when a rank is lost (``on_loss``) and ranks ignore SIGTERM."""
    common = ["{model}", "--host", "{host}", "--port", "{port}", "--nnodes", "{nnodes}",
              "--node-rank", "{rank}", "--dist-init-addr", "{dist_addr}", "--no-control",
              "--load-s", str(load_s), "--warmup-s", "0", "--on-worker-loss", on_loss]
    rank_extra = ("--ignore-sigterm", *rank_extra)
    base = json.loads((Path(__file__).resolve().parents[2] / "engines" / "sglang.json")
                      .read_text())
    base["kind"] = "sglang"
    base["group"] = {"start_order": "together", "roles": {
        "head": {"start": {"argv": [*SIM, "sglang", "--model", *common, *head_extra]}},
        "rank": {"start": {"argv": [*SIM, "sglang", "--model", *common, *rank_extra]},
                 "ready": "probe", "stop_grace_s": 2,
                 "probe": {"path": "/ping", "interval_s": 0.5, "timeout_s": 0.5,
                           "failure_threshold": 2}}}}
    path.write_text(json.dumps(base))
    return path


def vllm_manifest(path: Path) -> Path:
    """A vLLM-like group manifest: the head first, then ``--headless`` ranks (no HTTP: a
    rank is ready when its process runs)."""
    base = json.loads((Path(__file__).resolve().parents[2] / "engines" / "vllm.json")
                      .read_text())
    common = ["{model}", "--nnodes", "{nnodes}", "--node-rank", "{rank}", "--master-addr",
              "{dist_host}", "--master-port", "{dist_port}", "--no-control", "--load-s", "0.3"]
    base["group"] = {"start_order": "head_first", "roles": {
        "head": {"start": {"argv": [*SIM, "vllm", "--host", "{host}", "--port", "{port}",
                                    "--model", *common]}},
        "rank": {"start": {"argv": [*SIM, "vllm", "--headless", "--model", *common]},
                 "ready": "process", "stop_grace_s": 2}}}
    path.write_text(json.dumps(base))
    return path


def start_time(pid: int) -> int:
    """A process's start time in clock ticks since boot (/proc/PID/stat)."""
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])


def rpc_manifest(path: Path, counts: Path, *, listen_after_s: float = 1.0) -> Path:
    """A llama.cpp-RPC-like group manifest: ``rpc-server`` stand-ins on the ranks (ranks
    first, watched by their listening socket), a head that connects to them, then serves."""
    base = json.loads((Path(__file__).resolve().parents[2] / "engines" / "llamacpp.json")
                      .read_text())
    rpc = [*SIM[:2], "nvpair.sim.rpc"]
    base["group"] = {"start_order": "ranks_first", "roles": {
        "head": {"start": {"argv": [
            *rpc, "head", "--rpc", "{rank_addrs}", "--", sys.executable, "-m", "nvpair.sim",
            "llamacpp", "--model", "{model}", "--host", "{host}", "--port", "{port}",
            "--no-control", "--load-s", "0.3"]}},
        "rank": {"start": {"argv": [
            *rpc, "serve", "-H", "{host}", "-p", "{dist_port}", "--listen-after-s",
            str(listen_after_s), "--count-file", f"{counts}/rank{{rank}}.count"]},
            "ready": "listen", "stop_grace_s": 2}}}
    path.write_text(json.dumps(base))
    return path


class Group:
    """``count`` nodes n0..n{count-1} (n0 the head) of one group named ``g``."""

    def __init__(self, cluster: Cluster, tmp: Path, count: int, *, manifest: Path,
                 group_extra: str = "",
                 hosts: list[tuple[str, str | None]] | None = None,
                 etcd_url: str | None = None, grace_s: float = 2,
                 top: dict[int, str] | None = None) -> None:
        """``hosts``: each node's address and network namespace (default 127.0.0.N);
        ``etcd_url``: the etcd backend instead of push; ``grace_s``: rank_lost_grace_s;
        ``top``: lines at the top of node N's config (``on_exit = 'keep'``)."""
        self.cluster = cluster
        self.port = free_port()  # each node's API, on its own address
        self.engine_port = free_port()
        self.dist_port = free_port()
        hosts = hosts or [(f"127.0.0.{i + 1}", None) for i in range(count)]
        self.nodes = [cluster.add(Node(f"n{i}", hosts[i][0], self.port, tmp, None,
                                       netns=hosts[i][1])) for i in range(count)]
        self.manifest, self.etcd_url, self.grace_s, self.top = manifest, etcd_url, grace_s, top
        self.write(group_extra=group_extra)

    def write(self, *, group: bool = True, group_extra: str = "", args: str = "",
              engines: str = "", nodes: list[Node] | None = None) -> None:
        """Write each node's config (``nodes``: only these): the group ``g`` unless
        ``group`` is false, ``args`` lines in its ``[engines.args]``, ``engines``: more
        ``[[engines]]`` tables before it (a reload's edit)."""
        for node in nodes or self.nodes:
            peers = [o for o in self.nodes if o is not node]
            lines = [(self.top or {}).get(self.nodes.index(node), "")]
            if not node.host.startswith("127."):  # off loopback: the API wants a token
                (node.dir / "user-token").write_text(USER_TOKEN)
                lines.append(f"token_file = '{node.dir / 'user-token'}'")
            lines += [f"listen = '{node.host}:{node.port}'", f"node = '{node.name}'",
                      f"log_dir = '{node.dir / 'logs'}'",
                      f"state_dir = '{node.dir / 'state'}'", engines]
            if group:
                lines += ["[[engines]]", "name = 'g'", f"kind = '{self.manifest}'",
                          "managed = true", "model = 'big-model'", f"host = '{node.host}'",
                          f"port = {self.engine_port}", "stop_grace_s = 3",
                          "[engines.args]", args,
                          "[engines.probes.ready]", "interval_s = 0.25", "timeout_s = 0.25",
                          "[engines.probes.health]", "interval_s = 1", "timeout_s = 1",
                          "[engines.group]",
                          f"ranks = [{', '.join(repr(n.name) for n in self.nodes)}]",
                          f"dist_port = {self.dist_port}",
                          f"rank_lost_grace_s = {self.grace_s}",
                          "restart_backoff = {initial_s = 0.5, max_s = 2}", group_extra]
            if self.etcd_url is not None:
                lines += ["[cluster]", "backend = 'etcd'", f"etcd_url = '{self.etcd_url}'",
                          "etcd_lease_ttl_s = 3", "etcd_prefix = 'nvpair/test/nodes/'"]
                node.config.write_text("\n".join(lines) + "\n")
                continue
            for other in peers:
                lines += ["[[peers]]", f"url = '{other.url}'", f"name = '{other.name}'"]
            lines += ["[cluster]", "interval_s = 1", f"token_file = '{self.cluster.token_file}'"]
            node.config.write_text("\n".join(lines) + "\n")

    @property
    def head(self) -> Node:
        return self.nodes[0]

    async def doc(self, node: Node | None = None) -> Any:
        return await self.cluster.json(node or self.head, "/v1/groups/g")

    async def wait(self, predicate: Any, *, within: float, what: str,
                   node: Node | None = None) -> Any:
        return await self.cluster.wait(node or self.head, "/v1/groups/g", predicate,
                                       within=within, what=what)


def epoch_of(pid: int) -> int | None:
    """The NVPAIR_GROUP_EPOCH in a process's environment (None: gone, not a group's, or
    another test's: every test has its own XDG_STATE_HOME (tests/conftest.py), which its
    nodes and their processes inherit, so tests running at once (pytest -n 2) see only
    their own, a process left behind by its nvpair included)."""
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    ours = "XDG_STATE_HOME=" + os.environ.get("XDG_STATE_HOME", "")
    if ours.encode() not in env:
        return None
    for item in env:
        if item.startswith(b"NVPAIR_GROUP_EPOCH="):
            return int(item.split(b"=", 1)[1])
    return None


def group_processes() -> dict[int, int]:
    """pid -> epoch of every live process with NVPAIR_GROUP_EPOCH in its environment that
    this user may read (the test's own: nvpair's children)."""
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            epoch = epoch_of(int(entry))
            if epoch is not None:
                try:
                    state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
                except OSError:
                    continue
                if state != "Z":
                    out[int(entry)] = epoch
    return out
