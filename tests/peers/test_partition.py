"""A one-way partition that really blocks one direction at the network layer.

Node A runs in its own network namespace, joined to the root namespace by a veth pair;
B and C listen on the root side. An nftables rule in A's namespace drops every packet A
sends to B's port, so A can no longer push to B, while B's connections to A (whose
packets go to B's ephemeral ports) still work. A then shows B as one-way (B's adverts
arrive, A's pushes do not get through); B shows A stale, then gone; C sees both fresh.
Removing the rule heals it.

Needs root, iproute2 and nftables (CI: apt-get install -y nftables); skipped otherwise.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio
from tests.managed import free_port
from tests.peers.cluster import Node, open_cluster, open_farm, states

INTERVAL = 1.0
TTL = 3 * INTERVAL
SLACK = 1.5

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("nft") is None,
    reason="needs root, iproute2 and nftables for a network namespace (apt-get install -y "
           "nftables)")


async def sh(*cmd: str) -> None:
    await trio.run_process(list(cmd), stdout=subprocess.DEVNULL)


@asynccontextmanager
async def namespace() -> AsyncIterator[tuple[str, str, str]]:
    """A network namespace linked to the root one: (name, root-side IP, namespace IP)."""
    tag = f"{os.getpid() % 10000}{random.randrange(100)}"
    # a subnet no other namespace here holds (tests run two at a time: pytest -n 2)
    held = (await trio.run_process(["ip", "-4", "-o", "addr", "show"],
                                   capture_stdout=True)).stdout.decode()
    name, subnet = f"nvp{tag}", random.choice(
        [f"10.231.{i}" for i in range(256) if f" 10.231.{i}." not in held])
    root_ip, ns_ip = f"{subnet}.1", f"{subnet}.2"
    await sh("ip", "netns", "add", name)
    try:
        await sh("ip", "link", "add", f"nvr{tag}", "type", "veth", "peer", "name", f"nvn{tag}",
                 "netns", name)
        await sh("ip", "addr", "add", f"{root_ip}/30", "dev", f"nvr{tag}")
        await sh("ip", "link", "set", f"nvr{tag}", "up")
        await sh("ip", "-n", name, "addr", "add", f"{ns_ip}/30", "dev", f"nvn{tag}")
        await sh("ip", "-n", name, "link", "set", f"nvn{tag}", "up")
        await sh("ip", "-n", name, "link", "set", "lo", "up")
        yield name, root_ip, ns_ip
    finally:
        with trio.move_on_after(10, shield=True):
            await sh("ip", "netns", "del", name)  # the veth pair goes with it


async def block(ns: str, ip: str, port: int) -> None:
    """Drop every packet that ``ns`` sends to ``ip:port``."""
    await sh("ip", "netns", "exec", ns, "nft", "add", "table", "inet", "nvpair_partition")
    await sh("ip", "netns", "exec", ns, "nft", "add", "chain", "inet", "nvpair_partition", "out",
             "{ type filter hook output priority 0; }")
    await sh("ip", "netns", "exec", ns, "nft", "add", "rule", "inet", "nvpair_partition", "out",
             "ip", "daddr", ip, "tcp", "dport", str(port), "drop")


async def unblock(ns: str) -> None:
    await sh("ip", "netns", "exec", ns, "nft", "delete", "table", "inet", "nvpair_partition")


async def test_one_way_partition(tmp_path: Path) -> None:
    with trio.fail_after(60):
        async with namespace() as (ns, root_ip, ns_ip), open_farm(3, root_ip) as engines, \
                open_cluster(tmp_path) as c:
            a = c.add(Node("a", ns_ip, free_port(), tmp_path, engines[0], netns=ns))
            b = c.add(Node("b", root_ip, free_port(), tmp_path, engines[1]))
            cc = c.add(Node("c", root_ip, free_port(), tmp_path, engines[2]))
            nodes = [a, b, cc]
            for node in nodes:
                node.write_config(peers=[(o.name, o.url) for o in nodes if o is not node],
                                  interval=INTERVAL, token_file=c.token_file,
                                  engine_host=root_ip)
            await c.start(*nodes)
            for node in nodes:
                want = {o.name: "fresh" for o in nodes if o is not node}
                await c.wait(node, "/v1/peers", lambda d, w=want: states(d) == w, within=20,
                             what="all fresh")

            await block(ns, root_ip, b.port)
            blocked = trio.current_time()
            doc = await c.wait(a, "/v1/peers", lambda d: states(d)["b"] == "one-way",
                               within=TTL + 2 * SLACK, what="b one-way")
            one_way_after = trio.current_time() - blocked
            outbound = next(p for p in doc["peers"] if p["node"] == "b")["outbound"]
            assert outbound["consecutive_failures"] >= 1 and outbound["last_error"]
            listed = {m["nvpair"]["node"]: m["nvpair"] for m in
                      (await c.json(a, "/v1/cluster/models"))["data"]}
            assert listed["b"]["peer"] == "one-way" and listed["b"]["routable"] is False
            await c.wait(b, "/v1/peers", lambda d: states(d)["a"] == "stale",
                         within=TTL + SLACK, what="a stale")
            stale_after = trio.current_time() - blocked
            await c.wait(b, "/v1/peers", lambda d: states(d)["a"] == "gone",
                         within=2 * TTL + SLACK, what="a gone")
            gone_after = trio.current_time() - blocked
            doc = await c.json(b, "/v1/peers")
            assert next(p for p in doc["peers"] if p["node"] == "a")["outbound"][
                "consecutive_failures"] == 0  # b still reaches a
            assert states(await c.json(cc, "/v1/peers")) == {"a": "fresh", "b": "fresh"}
            assert states(doc)["c"] == "fresh"
            assert one_way_after < TTL + SLACK + 2.0  # + one push timeout
            assert stale_after < TTL + SLACK and gone_after < 2 * TTL + SLACK

            await unblock(ns)
            for node in (a, b):
                await c.wait(node, "/v1/peers", lambda d: set(states(d).values()) == {"fresh"},
                             within=4 * INTERVAL + 2 + SLACK, what="healed")
    print("peers one-way partition:", {"one_way_after_s": round(one_way_after, 2),
                                       "stale_after_s": round(stale_after, 2),
                                       "gone_after_s": round(gone_after, 2)})
