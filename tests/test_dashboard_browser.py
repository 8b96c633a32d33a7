"""The dashboard in a real headless Chromium (tests/cdp.py), against nvpair and simulators
over real sockets: what a person sees, how fast a change reaches the page, a restart of
nvpair, hostile names, the buttons, and that the page asks nothing of any other address.

Set ``NVPAIR_DASHBOARD_SHOT`` to a path to keep a screenshot there too (docs/img/ is made
that way); every run keeps one under ``artifacts/`` (gitignored) and in the test's tmp dir.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import httpx2
import pytest
import trio
from tests.cdp import Page, needs_chromium, open_browser
from tests.managed import fast_manifest, free_port, sim_command, wait_state

from nvpair import service
from nvpair.config.settings import load_settings
from nvpair.sim import SimOptions, serve_sim

pytestmark = needs_chromium

HOSTILE = "<img src=x onerror=alert(1)>"
ARTIFACTS = Path(__file__).resolve().parent.parent / "artifacts"
PROBES = """
[engines.probes.ready]
interval_s = 0.1
timeout_s = 0.1
[engines.probes.health]
interval_s = 0.3
timeout_s = 0.3
"""


def config(tmp: Path, sims: dict[str, int], managed_port: int | None, *, listen: str,
           token: str | None = None, managed_args: tuple[str, ...] = (),
           managed_toml: str = "") -> Path:
    text = f"listen = '{listen}'\nnode = 'test-node'\nlog_dir = '{tmp / 'logs'}'\n"
    if token is not None:
        (tmp / "token").write_text(token + "\n")
        text += f"token_file = '{tmp / 'token'}'\n"
    for name, port in sims.items():
        text += f"[[engines]]\nname = '{name}'\nkind = 'vllm'\nport = {port}\n{PROBES}"
    if managed_port is not None:
        manifest = fast_manifest(tmp, "vllm")
        text += (f"[[engines]]\nname = 'managed'\nkind = '{manifest}'\nport = {managed_port}\n"
                 f"model = 'sim-managed'\nmanaged = true\n"
                 f"command = {json.dumps(sim_command('vllm', *managed_args))}\n"
                 f"{managed_toml}{PROBES}")
    path = tmp / "nvpair.toml"
    path.write_text(text)
    return path


async def rows(page: Page) -> list[str]:
    return await page.evaluate(  # type: ignore[no-any-return]
        "[...document.querySelectorAll('#engines tbody tr')].map(r => r.dataset.engine)")


async def watch_state(page: Page, engine: str, state: str) -> None:
    """Record (in the page) the wall time at which ``engine``'s row first shows ``state``."""
    await page.evaluate(f"""(() => {{
        window.__seen = null;
        const look = () => {{
            const row = [...document.querySelectorAll('#engines tbody tr')]
                .find(r => r.dataset.engine === {json.dumps(engine)});
            const cell = row && row.querySelector('[data-state]');
            if (cell && cell.dataset.state === {json.dumps(state)} && !window.__seen)
                window.__seen = Date.now();
        }};
        new MutationObserver(look).observe(document, {{subtree: true, childList: true,
            characterData: true, attributes: true}});
    }})()""")


def keep_screenshot(source: Path, name: str) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    shutil.copy(source, ARTIFACTS / name)
    if target := os.environ.get("NVPAIR_DASHBOARD_SHOT"):
        shutil.copy(source, target)


async def test_dashboard_live_safe_and_its_buttons(nursery, tmp_path) -> None:
    quick = await nursery.start(serve_sim, SimOptions(kind="vllm", model="Qwen/Qwen3-8B"))
    hostile = await nursery.start(serve_sim, SimOptions(kind="vllm", model=HOSTILE))
    settings = load_settings(str(config(tmp_path, {"quick": quick.port, "hostile": hostile.port},
                                        free_port(), listen="127.0.0.1:0")))
    with trio.fail_after(40):
        running = await nursery.start(service.run, settings)
        for name in ("quick", "hostile", "managed"):
            await wait_state(running.board, name, "ready", where=lambda e: bool(e.models))
        async with open_browser() as browser:
            page = await browser.new_page()
            started = time.monotonic()
            await page.goto(f"{running.url}/")  # the root redirects a browser to ui/
            await page.wait_for("document.querySelectorAll('#engines tbody tr').length === 3 && "
                                "document.querySelector('#link').textContent === 'live'")
            first_render = time.monotonic() - started
            assert await page.evaluate("location.pathname") == "/ui/"
            assert sorted(await rows(page)) == ["hostile", "managed", "quick"]

            # the hostile model name is text: in the engines and the models tables, no <img>
            await page.wait_for(f"[...document.querySelectorAll('#models td')].some("
                                f"td => td.textContent === {json.dumps(HOSTILE)})")
            cell = await page.evaluate("[...document.querySelectorAll('#engines tr')].find("
                                       "r => r.dataset.engine === 'hostile')"
                                       ".querySelector('.models').textContent")
            assert cell == HOSTILE
            assert await page.evaluate("document.querySelectorAll('img').length") == 0

            # buttons for the managed engine only
            buttons = await page.evaluate("Object.fromEntries([...document.querySelectorAll("
                                          "'#engines tbody tr')].map(r => [r.dataset.engine, "
                                          "[...r.querySelectorAll('td.actions button')]"
                                          ".map(b => b.textContent)]))")
            assert buttons == {"quick": [], "hostile": [],
                               "managed": ["start", "stop", "restart"]}

            # a simulator's state flip (fault injection on its control port) reaches the
            # page within 250 ms of the snapshot's change
            await watch_state(page, "quick", "stale")
            async with httpx2.AsyncClient() as client:
                r = await client.post(f"{quick.control_url}/__sim/fault",
                                      json={"mode": "error", "status": 500,
                                            "paths": ["/health"]})
                assert r.status_code == 200, r.text
            await wait_state(running.board, "quick", "stale", "unhealthy")
            changed_ms = time.time() * 1000
            seen_ms = await page.wait_for("window.__seen", within=2)
            flip_ms = seen_ms - changed_ms
            ARTIFACTS.mkdir(exist_ok=True)
            await trio.Path(ARTIFACTS / "dashboard-timings.json").write_text(json.dumps(
                {"first_render_s": round(first_render, 3), "flip_ms": round(flip_ms, 1)}))
            assert flip_ms <= 250, flip_ms

            # the drawer: the managed engine's log, its probes, a chart
            await page.evaluate("[...document.querySelectorAll('#engines tr')].find("
                                "r => r.dataset.engine === 'managed')"
                                ".querySelector('button.name').click()")
            await page.wait_for("document.querySelector('#drawer-log').textContent.length > 0 "
                                "&& document.querySelectorAll('#drawer-probes tbody tr').length"
                                " > 0 && document.querySelector('#drawer-chart svg')")
            shot = tmp_path / "dashboard.png"
            await page.evaluate("document.querySelector('#drawer-close').click()")
            await page.screenshot(str(shot))
            keep_screenshot(shot, "dashboard.png")

            # stop, asked for confirmation first; the page then shows `stopped`
            await watch_state(page, "managed", "stopped")
            await page.evaluate("[...document.querySelectorAll('#engines tr')].find("
                                "r => r.dataset.engine === 'managed')"
                                ".querySelector('button.act-stop').click()")
            assert await page.wait_for("document.querySelector('button.confirm')"
                                       "?.textContent") == "yes, stop"
            assert running.board.current.engine("managed").state != "stopped"  # type: ignore[union-attr]
            await page.evaluate("document.querySelector('button.confirm').click()")
            await wait_state(running.board, "managed", "stopped")
            await page.wait_for("window.__seen")

            assert first_render <= 1.0, first_render
            assert page.exceptions == []
            assert page.console_errors == []
            origin = running.url + "/"
            assert page.requests and all(u.startswith(origin) for u in page.requests), \
                [u for u in page.requests if not u.startswith(origin)]
        running.stop()


@pytest.mark.alone  # (a bound of the retry + 1 s: not beside another worker)
async def test_dashboard_reconnects_after_nvpair_restarts(nursery, tmp_path) -> None:
    sim = await nursery.start(serve_sim, SimOptions(kind="vllm", model="m"))
    port = free_port()
    settings = load_settings(str(config(tmp_path, {"one": sim.port}, None,
                                        listen=f"127.0.0.1:{port}")))
    with trio.fail_after(40):
        async with open_browser() as browser:
            page = await browser.new_page()
            async with trio.open_nursery() as first:
                running = await first.start(service.run, settings)
                await wait_state(running.board, "one", "ready")
                await page.goto(f"{running.url}/ui/")
                await page.wait_for("document.querySelector('#link').textContent === 'live'"
                                    " && document.querySelectorAll('#engines tbody tr')"
                                    ".length === 1")
                boot = await page.evaluate("view.lastId.split('.')[0]")
                # the retry the page waits with: the first stream's (each stream draws its
                # own, 1-3 s; the next nvpair's new stream would tell another)
                retry_s = await page.evaluate("view.retryMs") / 1000
                running.stop()  # nvpair says bye; the page shows it is reconnecting
                await page.wait_for("document.querySelector('#link').textContent"
                                    ".startsWith('nvpair stopped') || document.querySelector("
                                    "'#link').textContent === 'reconnecting…'")
            # the first nvpair has ended; a new one on the same port
            async with trio.open_nursery() as second:
                again = await second.start(service.run, settings)
                back_at = trio.current_time()
                assert again.url == running.url
                await page.wait_for("document.querySelector('#link').textContent === "
                                    "'live'", within=5)
                assert trio.current_time() - back_at <= retry_s + 1.0
                assert await page.evaluate("view.lastId.split('.')[0]") != boot
                assert await rows(page) == ["one"]  # no duplicate rows
                await wait_state(again.board, "one", "ready")
                await page.wait_for("document.querySelector('#engines [data-state]')"
                                    ".dataset.state === 'ready'")
                assert await rows(page) == ["one"]
                assert page.exceptions == []
                # only refused connections while nvpair was away, nothing else
                assert [e for e in page.console_errors
                        if not e.startswith("network:")] == [], page.console_errors
                again.stop()


async def test_dashboard_asks_for_the_token_once_and_keeps_it_in_the_tab(
        nursery, tmp_path) -> None:
    sim = await nursery.start(serve_sim, SimOptions(kind="vllm", model="m"))
    settings = load_settings(str(config(tmp_path, {"one": sim.port}, None,
                                        listen="127.0.0.1:0", token="s3cret-token")))
    with trio.fail_after(40):
        running = await nursery.start(service.run, settings)
        async with open_browser() as browser:
            page = await browser.new_page()
            await page.goto(f"{running.url}/ui/")
            await page.wait_for("!document.querySelector('#login').hidden")
            await page.evaluate_and_load("document.querySelector('#token').value = "
                                         "'s3cret-token'; "
                                         "document.querySelector('#login button').click()")
            await page.wait_for("document.querySelector('#link').textContent === 'live' && "
                                "document.querySelectorAll('#engines tbody tr').length === 1",
                                within=5)
            assert await page.evaluate("sessionStorage.getItem('nvpair-token')") == "s3cret-token"
            assert await page.evaluate("localStorage.length") == 0
            assert await page.evaluate("document.cookie") == ""
            assert await page.evaluate("document.querySelector('#login').hidden") is True
        running.stop()


async def test_peers_and_groups_render_as_text_where_present(nursery, tmp_path) -> None:
    """Peers and groups come from other nodes: what they report is text too. (This nvpair
    has neither, so the page's own renderers are given what a peer event and
    GET /v1/groups would say.)"""
    sim = await nursery.start(serve_sim, SimOptions(kind="vllm", model="m"))
    settings = load_settings(str(config(tmp_path, {"one": sim.port}, None,
                                        listen="127.0.0.1:0")))
    with trio.fail_after(40):
        running = await nursery.start(service.run, settings)
        async with open_browser() as browser:
            page = await browser.new_page()
            await page.goto(f"{running.url}/ui/")
            await page.wait_for("document.querySelector('#link').textContent === 'live'")
            assert await page.evaluate("document.querySelector('#groups-section').hidden")
            assert await page.evaluate("document.querySelector('#peers').textContent") == "none"
            await page.evaluate(f"""
                handle('peer', {{node: {json.dumps(HOSTILE)}, state: 'stale', models: []}});
                handle('peer', {{node: 'b', state: 'fresh', models: []}});
                renderGroups({{node: 'x', groups: [{{name: {json.dumps(HOSTILE)},
                    state: 'degraded', epoch: 3, error: {json.dumps(HOSTILE)},
                    ranks: [{{rank: 0, node: 'a', state: 'ready'}},
                            {{rank: 1, node: {json.dumps(HOSTILE)}, state: 'unknown'}}],
                    history: [{{epoch: 2, reason: {json.dumps(HOSTILE)}}}]}}]}})""")
            assert await page.evaluate(
                "document.querySelector('#peers').textContent") == "1 fresh, 1 stale"
            groups = await page.evaluate("document.querySelector('#groups').textContent")
            assert "epoch 3" in groups and "rank 1" in groups
            assert groups.count(HOSTILE) == 4  # name, rank's node, error, history
            assert not await page.evaluate("document.querySelector('#groups-section').hidden")
            assert await page.evaluate("document.querySelectorAll('img').length") == 0
            assert page.exceptions == [] and page.console_errors == []
        running.stop()


async def click(page: Page, engine: str, selector: str) -> None:
    await page.evaluate(f"[...document.querySelectorAll('#engines tr')].find("
                        f"r => r.dataset.engine === {json.dumps(engine)})"
                        f".querySelector({json.dumps(selector)}).click()")


async def test_a_refused_action_is_shown_in_words_and_cleared_by_the_next(
        nursery, tmp_path) -> None:
    """A start asked while the engine is stopping is refused (409 engine_busy): the page says
    why above the tables; the start asked again once it has stopped is taken and clears it."""
    settings = load_settings(str(config(
        tmp_path, {}, free_port(), listen="127.0.0.1:0", managed_args=("--ignore-sigterm",),
        managed_toml="stop_grace_s = 1.5\n")))  # its stop takes the grace, then SIGKILL
    with trio.fail_after(40):
        running = await nursery.start(service.run, settings)
        await wait_state(running.board, "managed", "ready")
        async with open_browser() as browser:
            page = await browser.new_page()
            await page.goto(f"{running.url}/ui/")
            await page.wait_for("document.querySelector('#link').textContent === 'live' && "
                                "document.querySelector('button.act-stop')")
            api = f"{running.url}/v1/engines/managed/"
            await click(page, "managed", "button.act-stop")
            await page.evaluate("document.querySelector('button.confirm').click()")
            assert await page.wait_response(api + "stop") == 202
            runner = running.runners["managed"]
            assert runner.operation == "stopping"
            await page.wait_for("document.querySelector('button.act-start')")
            seen = len(page.responses)
            await click(page, "managed", "button.act-start")
            await page.evaluate("document.querySelector('button.confirm').click()")
            assert await page.wait_response(api + "start", after=seen) == 409
            said = await page.wait_for("!document.querySelector('#notice').hidden && "
                                       "document.querySelector('#notice').textContent")
            assert said == "start managed: engine managed is stopping; start it once it has " \
                           "stopped", said
            assert runner.operation == "stopping"  # the refusal changed nothing
            await wait_state(running.board, "managed", "stopped")
            await page.wait_for("document.querySelector('#engines [data-state]')"
                                ".dataset.state === 'stopped'")
            assert await page.evaluate("document.querySelector('#notice').textContent") == said
            seen = len(page.responses)
            await click(page, "managed", "button.act-start")
            await page.evaluate("document.querySelector('button.confirm').click()")
            assert await page.wait_response(api + "start", after=seen) == 202
            await page.wait_for("document.querySelector('#notice').hidden")
            assert page.exceptions == []
            # the 409 is the one console error: Chromium logs every failed fetch
            assert all("409" in e for e in page.console_errors), page.console_errors
        running.stop()
