"""What open dashboard tabs cost nvpair: its CPU with 0, 1 and 4 tabs of the page open.

    python -m tests.dashboard_cost [--window-s 60]

Starts ``nvpair demo`` (four managed simulators), waits until every engine is ready, then
reads nvpair's own CPU time (``/proc/PID/stat``: utime + stime, its children not
included) over a window with no tab, with one tab, and with four tabs of a headless
Chromium (tests/cdp.py) on ``/ui/``, and counts the requests the tabs made. Prints one
JSON line per phase. Needs /usr/bin/chromium.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path
from urllib.parse import urlsplit

import httpx2
import trio
from tests.cdp import Page, open_browser
from tests.managed import free_port
from tests.peers.cluster import cpu_seconds

REPO = Path(__file__).resolve().parent.parent


async def wait_ready(client: httpx2.AsyncClient, url: str) -> None:
    with trio.fail_after(60):
        while True:
            try:
                doc = (await client.get(url + "/v1/engines")).json()
                if doc["engines"] and all(e["state"] in ("ready", "stale")
                                          for e in doc["engines"]):
                    return
            except (httpx2.TransportError, ValueError):
                pass
            await trio.sleep(0.2)  # another process: nothing to wait on but its answers


async def phase(pid: int, pages: list[Page], window_s: float) -> dict[str, float]:
    before_cpu, seen = cpu_seconds(pid), [len(p.requests) for p in pages]
    started = trio.current_time()
    await trio.sleep(window_s)
    wall = trio.current_time() - started
    cpu = cpu_seconds(pid) - before_cpu
    paths = Counter(urlsplit(u).path for p, n in zip(pages, seen, strict=True)
                    for u in p.requests[n:])
    return {"tabs": len(pages), "window_s": round(wall, 1), "cpu_s": round(cpu, 3),
            "cpu_percent": round(100 * cpu / wall, 2),
            "requests_per_min": round(60 * sum(paths.values()) / wall, 1),
            "per_tab_per_min": {k: round(60 * v / wall / max(len(pages), 1), 1)
                                for k, v in sorted(paths.items())}}


async def main(window_s: float) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = await trio.lowlevel.open_process(
        [sys.executable, "-m", "nvpair", "demo", "--listen", f"127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=str(REPO))
    try:
        async with httpx2.AsyncClient(timeout=5, trust_env=False) as client:
            await wait_ready(client, url)
        await trio.sleep(5)  # past the start's probes
        print(json.dumps(await phase(proc.pid, [], window_s)), flush=True)
        async with open_browser() as browser:
            pages: list[Page] = []
            for want in (1, 4):
                while len(pages) < want:
                    page = await browser.new_page()
                    await page.goto(url + "/ui/")
                    await page.wait_for("document.querySelector('#link').textContent "
                                        "=== 'live'", within=10)
                    pages.append(page)
                await trio.sleep(2)  # the first reads of the new tabs, out of the window
                print(json.dumps(await phase(proc.pid, pages, window_s)), flush=True)
    finally:
        os.kill(proc.pid, signal.SIGINT)
        with trio.move_on_after(20, shield=True):
            await proc.wait()
        if proc.returncode is None:
            proc.kill()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--window-s", type=float, default=60.0)
    trio.run(main, parser.parse_args().window_s)
