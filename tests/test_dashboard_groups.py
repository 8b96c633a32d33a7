"""The dashboard of a real multi-node group: two nvpair processes on loopback (127.0.0.1 and
127.0.0.2, tests/group/nodes.py) running a simulated SGLang group, in a real headless
Chromium (tests/cdp.py). The head's page draws the group's rank grid from the event
stream's snapshot, and a rank killed -9 reaches the page as ``group`` events (a new epoch,
its reason), with no read of ``GET /v1/groups`` at all.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import trio
from tests.cdp import needs_chromium, open_browser
from tests.group.nodes import Group, sim_manifest
from tests.peers.cluster import open_cluster

from nvpair.base.changes import Changes
from nvpair.state.events import Journal
from nvpair.state.snapshot import Board

GRID = ("[...document.querySelectorAll('#groups .rank')].map(r => "
        "[r.dataset.rank, r.textContent])")
TITLE = "document.querySelector('#groups h3')?.textContent"


def without_memory(doc: dict[str, Any]) -> dict[str, Any]:
    return {**doc, "ranks": [{k: v for k, v in r.items() if k != "memory_bytes"}
                             for r in doc["ranks"]]}


@needs_chromium[0]
@needs_chromium[1]
async def test_the_page_draws_a_real_group_and_follows_its_epochs(tmp_path: Path) -> None:
    manifest = sim_manifest(tmp_path / "sim.json")
    with trio.fail_after(60):
        async with open_cluster(tmp_path) as cluster:
            group = Group(cluster, tmp_path, 2, manifest=manifest)
            await cluster.start(*group.nodes)
            doc = await group.wait(lambda d: d["state"] == "ready", within=30,
                                   what="the group ready")
            epoch = doc["epoch"]
            async with open_browser() as browser:
                page = await browser.new_page()
                await page.goto(f"{group.head.url}/ui/")
                await page.wait_for(f"{TITLE} === 'g ready epoch {epoch} · 1/1 ranks ready'")
                assert await page.evaluate(GRID) == [["0", "rank 0 · n0 ready"],
                                                     ["1", "rank 1 · n1 ready"]]
                # a ready group is quiet: its loop steps every second, and sends nothing
                # while nothing changes (its ages are not in its events) but its processes'
                # memory, read every 5 s, when it moves
                events = "view.events.filter(e => e.type === 'group').map(e => e.doc)"
                before = len(await page.evaluate(events))
                start = without_memory(await page.evaluate("view.groups.get('g')"))
                await trio.sleep(3)  # a window of steps with nothing to tell
                during = (await page.evaluate(events))[before:]
                assert len(during) <= 2 and all(
                    without_memory(d) == start for d in during), during
                # rank 1's process killed: the group's events bring the next epoch
                os.kill(doc["ranks"][1]["pid"], signal.SIGKILL)
                killed_at = trio.current_time()
                await page.wait_for(f"{TITLE}?.startsWith('g ') && !{TITLE}.includes("
                                    f"'epoch {epoch} ')", within=5)
                changed_s = trio.current_time() - killed_at
                history = await page.wait_for(
                    f"document.querySelector('#groups ol')?.textContent.includes("
                    f"'epoch {epoch}: rank 1 (n1) was killed by SIGKILL')", within=5)
                assert history
                await page.wait_for(f"{TITLE} === 'g ready epoch {epoch + 1} · 1/1 ranks "
                                    "ready'", within=20)
                assert await page.evaluate(
                    "view.events.filter(e => e.type === 'group').length") >= 2
                assert not [u for u in page.requests if "/v1/groups" in u], page.requests
                assert page.exceptions == [] and page.console_errors == []
                assert changed_s < 2.0, changed_s


class FakeGroups:
    """A GroupSource (nvpair.state.events) whose documents the test sets."""

    def __init__(self, docs: dict[str, dict[str, Any]]) -> None:
        self.docs = docs
        self.steps = Changes()

    @property
    def version(self) -> int:
        return self.steps.version

    async def wait_changed(self, since: int) -> int:
        return await self.steps.wait_changed(since)

    def contents(self, now: float) -> dict[str, dict[str, Any]]:
        return self.docs


def group_doc(state: str, epoch: int, age: float) -> dict[str, Any]:
    return {"name": "g", "state": state, "epoch": epoch, "state_age_s": age,
            "restart_in_s": None, "ranks": [{"rank": 0, "state": state, "state_age_s": age}],
            "history": [{"epoch": epoch, "started_at": 1e9 + age, "ended_at": None,
                         "reason": None}]}


async def test_group_events_are_changes_of_content_not_of_ages(autojump_clock) -> None:
    source = FakeGroups({"g": group_doc("forming", 1, 0.0)})
    journal = Journal(Board(()), node="n", groups=source)
    async with trio.open_nursery() as nursery:
        await nursery.start(journal.run)
        stream, missed = journal.subscribe()
        assert missed is None
        snapshot = json.loads(journal.snapshot(stream))
        assert snapshot["groups"] == [{"name": "g", "state": "forming", "epoch": 1,
                                       "ranks": [{"rank": 0, "state": "forming"}],
                                       "history": [{"epoch": 1, "reason": None}]}]
        # steps where only ages and times move send nothing
        for age in (1.0, 2.0, 3.0):
            source.docs = {"g": group_doc("forming", 1, age)}
            source.steps.bump()
            await trio.sleep(1)
        assert stream.take() == [] and journal.seq == 0
        source.docs = {"g": group_doc("ready", 1, 4.0)}
        source.steps.bump()
        await trio.sleep(1)
        events = stream.take()
        assert [(e.type, e.key, json.loads(e.data)["state"]) for e in events] == [
            ("group", "group:g", "ready")]
        assert b"event: group\n" in events[0].wire
        # a stream that asks for engines only gets no groups, in its snapshot either
        engines_only, _ = journal.subscribe(frozenset({"engine"}))
        assert "groups" not in json.loads(journal.snapshot(engines_only))
        source.docs = {"g": group_doc("down", 2, 5.0)}
        source.steps.bump()
        await trio.sleep(1)
        assert engines_only.take() == [] and len(stream.take()) == 1
        nursery.cancel_scope.cancel()


def test_a_journal_without_groups_says_none_in_its_snapshot() -> None:
    journal = Journal(Board(()), node="n")
    stream, _ = journal.subscribe()
    assert "groups" not in json.loads(journal.snapshot(stream))
