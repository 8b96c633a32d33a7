"""``nvpair memory`` and the MEMORY column of ``nvpair status``, run as a person runs them
(real subprocesses against a running nvpair whose engine holds a known footprint)."""

from __future__ import annotations

import json
import os
import sys

import trio
from tests.managed import free_port, managed_config, sim_command, wait_state

from nvpair import service
from nvpair.cli.memory import duration, lines, size, slope
from nvpair.config.settings import load_settings

MEMORY = "[memory]\ninterval_s = 0.1\nwindow_h = 0.003\nhorizon_h = 1\n"


async def nvpair(*argv: str) -> str:
    r = await trio.run_process([sys.executable, "-m", "nvpair", *argv], capture_stdout=True,
                               capture_stderr=True, check=False,
                               env={**os.environ, "NO_COLOR": "1"})
    assert r.returncode == 0, r.stderr.decode()
    return r.stdout.decode()  # type: ignore[no-any-return]


async def test_memory_and_status_show_what_the_engine_holds(nursery, tmp_path) -> None:  # type: ignore[no-untyped-def]
    settings = managed_config(tmp_path, "e", free_port(),
                              sim_command("vllm", "--resident-mb", "200"))
    path = tmp_path / "nvpair.toml"
    path.write_text(path.read_text() + MEMORY)
    settings = load_settings(str(path))
    with trio.fail_after(30):
        running = await nursery.start(service.run, settings)
        await wait_state(running.board, "e", "ready")
        while running.board.current.engine("e").memory.rss_anon_bytes is None:  # type: ignore[union-attr]
            await running.board.wait_changed(running.board.current.version)
        out = await nvpair("memory", "--url", running.url)
        head, row, node = out.splitlines()[:3]
        assert head.split()[:3] == ["ENGINE", "HELD", "FLOOR"]
        assert row.split()[0] == "e" and row.split()[2] == "MB"
        assert 200 <= int(row.split()[1]) < 400  # the 200 MiB it holds, and Python's own
        assert "flat" in row and node.startswith("node: ") and "available" in node
        doc = json.loads(await nvpair("memory", "e", "--json", "--url", running.url))
        assert doc["engines"]["e"]["rss_anon_bytes"] >= 200 << 20 and doc["node"]["reserve_bytes"]
        status = await nvpair("status", "--url", running.url)
        assert "MEMORY" in status.splitlines()[0] and status.splitlines()[1].split()[-1] == "flat"
        running.stop()


def test_a_person_reads_sizes_slopes_and_durations() -> None:
    assert (size(8.7e9), size(812e6), size(None)) == ("8.7 GB", "812 MB", "-")
    assert (slope(0.39e9), slope(-2e6), slope(None)) == ("+0.39 GB/h", "-2 MB/h", "-")
    assert (duration(30), duration(1800), duration(22 * 3600), duration(None)) == (
        "30 s", "30 min", "22.0 h", "-")
    doc = {"engines": [{"name": "head", "memory": {
        "rss_anon_bytes": 22e9, "swap_bytes": 0, "floor_bytes": 21.5e9,
        "slope_bytes_per_h": 0.39e9, "exhaustion_s": 22 * 3600, "trend": "leaking",
        "error": None, "action": None, "why": "steady rise runs out within the horizon"}}],
        "memory": {"mem_available": 8.7e9, "reserve_bytes": 2.1e9, "headroom_bytes": 6.6e9,
                   "trend": "leaking", "slope_bytes_per_h": 0.39e9, "exhaustion_s": 61000,
                   "unified_memory": True, "psi_some_avg10": 0.0}}
    text = lines(doc, None)
    row = text.splitlines()[1]
    assert "22.0 GB" in row and "+0.39 GB/h" in row and "22.0 h" in row and "leaking" in row
    assert "unified memory" in text.splitlines()[-1]
