"""A small client of Chromium's DevTools protocol (CDP), over trio and trio-websocket.

Enough to drive the dashboard in a real headless browser: open a page, evaluate
JavaScript, wait for a condition in the page, take a screenshot, and record what the page
did that a test must check (exceptions, console errors, every request it sent).

    async with open_browser() as browser:
        page = await browser.new_page()
        await page.goto(url)
        await page.wait_for("document.querySelector('tr.engine') !== null")
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio
from trio_websocket import WebSocketConnection, open_websocket_url

from nvpair.base.changes import Changes

CHROMIUM = "/usr/bin/chromium"

#: tests that need the browser: ``pytestmark = needs_chromium``
needs_chromium = [
    pytest.mark.browser,
    pytest.mark.skipif(not os.access(CHROMIUM, os.X_OK),
                       reason=f"no {CHROMIUM}: install Debian's chromium (.ci/run does) "
                              "to run the dashboard's browser tests"),
]


class CdpError(Exception):
    """The browser answered a command with an error."""


class Browser:
    """One headless Chromium, one WebSocket to it; pages are sessions on that socket."""

    def __init__(self, ws: WebSocketConnection) -> None:
        self.ws = ws
        self._next_id = 0
        self._waiting: dict[int, tuple[trio.Event, list[dict[str, Any]]]] = {}
        self.pages: dict[str, Page] = {}

    async def run(self) -> None:
        """Read every message: answers go to their command, events to their page."""
        while True:
            message = json.loads(await self.ws.get_message())
            if "id" in message:
                waiter = self._waiting.pop(message["id"], None)
                if waiter is not None:
                    waiter[1].append(message)
                    waiter[0].set()
            elif (page := self.pages.get(message.get("sessionId", ""))) is not None:
                page.on_event(message["method"], message.get("params", {}))

    async def send(self, method: str, session: str | None = None, **params: Any) -> Any:
        self._next_id += 1
        ident = self._next_id
        done: tuple[trio.Event, list[dict[str, Any]]] = (trio.Event(), [])
        self._waiting[ident] = done
        message: dict[str, Any] = {"id": ident, "method": method, "params": params}
        if session is not None:
            message["sessionId"] = session
        await self.ws.send_message(json.dumps(message))
        with trio.fail_after(15):
            await done[0].wait()
        answer = done[1][0]
        if "error" in answer:
            raise CdpError(f"{method}: {answer['error']}")
        return answer.get("result", {})

    async def new_page(self, width: int = 1280, height: int = 860) -> Page:
        target = await self.send("Target.createTarget", url="about:blank")
        attached = await self.send("Target.attachToTarget", targetId=target["targetId"],
                                   flatten=True)
        page = Page(self, attached["sessionId"])
        self.pages[page.session] = page
        for domain in ("Page.enable", "Runtime.enable", "Log.enable", "Network.enable"):
            await page.send(domain)
        await page.send("Emulation.setDeviceMetricsOverride", width=width, height=height,
                        deviceScaleFactor=1, mobile=False)
        return page


class Page:
    """One tab. ``exceptions``, ``console_errors`` and ``requests`` record what it did."""

    def __init__(self, browser: Browser, session: str) -> None:
        self.browser = browser
        self.session = session
        self.exceptions: list[str] = []
        self.console_errors: list[str] = []
        #: every URL the page asked for (Network.requestWillBeSent), in order
        self.requests: list[str] = []
        #: every answer's URL and status (Network.responseReceived), in order
        self.responses: list[tuple[str, int]] = []
        self._responded = Changes()
        self._loaded = trio.Event()

    def on_event(self, method: str, params: dict[str, Any]) -> None:
        if method == "Runtime.exceptionThrown":
            details = params["exceptionDetails"]
            self.exceptions.append(details.get("exception", {}).get("description")
                                   or details.get("text", "?"))
        elif method == "Log.entryAdded" and params["entry"]["level"] == "error":
            entry = params["entry"]
            # source "network": a request that failed (refused while nvpair restarts)
            self.console_errors.append(
                f"{entry.get('source')}: {entry.get('url', '')}: {entry['text']}")
        elif method == "Runtime.consoleAPICalled" and params["type"] in ("error", "assert"):
            self.console_errors.append(" ".join(str(a.get("value", a.get("description")))
                                                for a in params["args"]))
        elif method == "Network.requestWillBeSent":
            self.requests.append(params["request"]["url"])
        elif method == "Network.responseReceived":
            self.responses.append((params["response"]["url"], params["response"]["status"]))
            self._responded.bump()
        elif method == "Page.loadEventFired":
            self._loaded.set()

    async def send(self, method: str, **params: Any) -> Any:
        return await self.browser.send(method, self.session, **params)

    async def wait_response(self, url: str, after: int = 0, within: float = 5.0) -> int:
        """The status of the first answer to ``url`` among ``responses[after:]``, waiting
        for it (each answer the page receives wakes this)."""
        with trio.fail_after(within):
            while True:
                for got, status in self.responses[after:]:
                    if got == url:
                        return status
                await self._responded.wait()

    async def goto(self, url: str) -> None:
        """Navigate and wait for the load event."""
        self._loaded = trio.Event()
        result = await self.send("Page.navigate", url=url)
        if result.get("errorText"):
            raise CdpError(f"navigate to {url}: {result['errorText']}")
        with trio.fail_after(10):
            await self._loaded.wait()

    async def evaluate_and_load(self, expression: str) -> None:
        """Evaluate ``expression``, which navigates (a reload, a form), and wait for the
        new document's load event."""
        self._loaded = trio.Event()
        await self.send("Runtime.evaluate", expression=expression)
        with trio.fail_after(10):
            await self._loaded.wait()

    async def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression (a promise is awaited)."""
        result = await self.send("Runtime.evaluate", expression=expression,
                                 awaitPromise=True, returnByValue=True)
        if "exceptionDetails" in result:
            details = result["exceptionDetails"]
            raise CdpError(details.get("exception", {}).get("description")
                           or details.get("text"))
        return result["result"].get("value")

    async def wait_for(self, condition: str, within: float = 5.0) -> Any:
        """Wait, in the page, until the expression ``condition`` is truthy, and return its
        value: checked at once and on every change of the document (a MutationObserver),
        so nothing polls from here. Fails after ``within`` seconds, naming the condition."""
        script = f"""new Promise((resolve) => {{
            const check = () => {{
                try {{ const v = ({condition}); return typeof v === 'object' && v ? true : v; }}
                catch (e) {{ return null; }}
            }};
            const first = check();
            if (first) {{ resolve(first); return; }}
            const timer = setTimeout(() => {{ observer.disconnect(); resolve(null); }},
                                     {int(within * 1000)});
            const observer = new MutationObserver(() => {{
                const value = check();
                if (value) {{ observer.disconnect(); clearTimeout(timer); resolve(value); }}
            }});
            observer.observe(document, {{subtree: true, childList: true,
                                         characterData: true, attributes: true}});
        }})"""
        with trio.fail_after(within + 5):
            value = await self.evaluate(script)
        if not value:
            raise AssertionError(f"not within {within} s in the page: {condition}")
        return value

    async def screenshot(self, path: str) -> None:
        shot = await self.send("Page.captureScreenshot", format="png")
        await trio.Path(path).write_bytes(base64.b64decode(shot["data"]))


@asynccontextmanager
async def open_browser() -> AsyncIterator[Browser]:
    """A headless Chromium with a throwaway profile, closed (and its profile removed) at
    the end of the block."""
    profile = tempfile.mkdtemp(prefix="nvpair-chromium-")
    argv = [CHROMIUM, "--headless=new", "--remote-debugging-port=0",
            f"--user-data-dir={profile}", "--no-first-run", "--no-default-browser-check",
            "--disable-gpu", "--disable-extensions", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", "--metrics-recording-only",
            "--no-sandbox", "about:blank"]
    proc = await trio.lowlevel.open_process(argv, stdout=subprocess.DEVNULL,
                                            stderr=subprocess.PIPE)
    try:
        assert proc.stderr is not None
        ws_url = await _devtools_url(proc.stderr)
        async with open_websocket_url(ws_url, max_message_size=64 * 2**20) as ws, \
                trio.open_nursery() as nursery:
            browser = Browser(ws)
            nursery.start_soon(browser.run)
            nursery.start_soon(_drain, proc.stderr)
            try:
                yield browser
            finally:
                nursery.cancel_scope.cancel()
    finally:
        proc.kill()
        with trio.move_on_after(5, shield=True):
            await proc.wait()
        shutil.rmtree(profile, ignore_errors=True)


async def _devtools_url(stderr: trio.abc.ReceiveStream) -> str:
    """The browser's WebSocket URL, from its ``DevTools listening on ws://...`` line."""
    seen = b""
    with trio.fail_after(20):
        while True:
            chunk = await stderr.receive_some(4096)
            if not chunk:
                raise RuntimeError(f"chromium exited: {seen.decode(errors='replace')[-500:]}")
            seen += chunk
            for line in seen.splitlines():
                if line.startswith(b"DevTools listening on "):
                    return line.removeprefix(b"DevTools listening on ").strip().decode()


async def _drain(stderr: trio.abc.ReceiveStream) -> None:
    while await stderr.receive_some(65536):
        pass
