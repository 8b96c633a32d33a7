"""The test helper that hands out ports: workers never share one, the kernel never picks one."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from tests import ports


def _blocks(monkeypatch: pytest.MonkeyPatch) -> list[range]:
    blocks = []
    for worker in ("", *(f"gw{n}" for n in range(8))):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        blocks.append(ports._block())
    return blocks


def test_workers_blocks_are_disjoint_and_below_the_ephemeral_range(monkeypatch) -> None:
    blocks = _blocks(monkeypatch)
    taken = [p for b in blocks for p in b]
    assert len(taken) == len(set(taken)) == 9 * ports.BLOCK
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    assert max(taken) < low, f"the kernel hands out ports from {low}: move the blocks lower"


def test_a_port_held_by_anyone_is_skipped() -> None:
    block = ports._block()
    first = ports.free_port()
    after = first + 1 if first + 1 in block else block.start  # the next one in the block
    with socket.socket() as held:
        held.bind(("127.0.0.1", after))
        second = ports.free_port()
    assert second not in (first, after) and {first, second} <= set(block)
