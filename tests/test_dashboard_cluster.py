"""The dashboard of a node with a real peer: two nvpair processes on loopback pushing adverts
to each other (tests/peers/cluster.py), each with a simulated engine, in a real headless
Chromium (tests/cdp.py). The page of one shows the other's model in the cluster's models and
the peer fresh, from the event stream; the peer killed, the page shows it stale, then gone,
and its model first stale, then no more listed.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import trio
from tests.cdp import needs_chromium, open_browser
from tests.managed import free_port
from tests.peers.cluster import Node, open_cluster, open_farm

pytestmark = needs_chromium

INTERVAL = 0.5  # adverts every 0.5 s: stale after 1.5 s (the ttl), gone after 3 s


def model_row(model: str) -> str:
    """A JavaScript expression: the cells' texts of ``model``'s row in the models table."""
    return (f"([...document.querySelectorAll('#models tbody tr')].map(r => [...r.cells]"
            f".map(c => c.textContent)).find(c => c[0] === {json.dumps(model)}) || null)")


async def test_a_real_peer_in_the_page_fresh_then_stale_then_gone(tmp_path: Path) -> None:
    with trio.fail_after(60):
        async with open_farm(2) as farm, open_cluster(tmp_path) as c:
            a = c.add(Node("a", "127.0.0.1", free_port(), tmp_path, farm[0]))
            b = c.add(Node("b", "127.0.0.1", free_port(), tmp_path, farm[1]))
            a.write_config(peers=[("b", b.url)], interval=INTERVAL, token_file=c.token_file)
            b.write_config(peers=[("a", a.url)], interval=INTERVAL, token_file=c.token_file)
            await c.start(a, b)
            await c.wait(a, "/v1/peers", lambda d: any(
                p["node"] == "b" and p["state"] == "fresh" for p in d["peers"]),
                within=15, what="b fresh at a")
            async with open_browser() as browser:
                page = await browser.new_page()
                await page.goto(f"{a.url}/ui/")
                await page.wait_for("document.querySelector('#link').textContent === 'live'")
                # the peer in the header, its model in the cluster's models beside a's own
                await page.wait_for("document.querySelector('#peers').textContent === "
                                    "'1 fresh'", within=10)
                await page.wait_for(model_row(farm[1].model), within=10)
                theirs = await page.evaluate(model_row(farm[1].model))
                assert theirs[1:4] == ["b", "e", "ready"], theirs
                await page.wait_for(model_row(farm[0].model))
                ours = await page.evaluate(model_row(farm[0].model))
                assert ours[1:4] == ["a", "e", "ready"], ours

                # b killed (no goodbye): stale after its ttl, then gone, as the events say
                c.send_signal(b, signal.SIGKILL)
                killed_at = trio.current_time()
                await page.wait_for("document.querySelector('#peers').textContent === "
                                    "'1 stale'", within=5)
                stale_s = trio.current_time() - killed_at
                await page.wait_for(model_row(farm[1].model) + "?.[3] === 'stale'", within=3)
                assert (await page.evaluate(model_row(farm[1].model)))[1] == "b"
                await page.wait_for("document.querySelector('#peers').textContent === "
                                    "'1 gone'", within=5)
                gone_s = trio.current_time() - killed_at
                await page.wait_for(model_row(farm[1].model) + " === null", within=3)
                assert (await page.evaluate(model_row(farm[0].model)))[1:4] == ["a", "e", "ready"]
                # the adverts' ttl is 3 intervals; gone after twice that (a poll of slack)
                assert 0.5 <= stale_s <= 3 * INTERVAL + 1.5, stale_s
                assert stale_s < gone_s <= 6 * INTERVAL + 1.5, gone_s
                assert page.exceptions == [] and page.console_errors == []
                assert all(u.startswith(a.url + "/") for u in page.requests), page.requests
