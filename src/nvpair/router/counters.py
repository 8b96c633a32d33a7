"""``GET /v1/router``: what real traffic has shown, per engine (the router's own counters),
and per key when the API has keys (nvpair.http.keys)."""

from __future__ import annotations

from typing import Any

import trio

from nvpair.http.asgi import Receive, Scope, Send, send_json, send_wrong_method
from nvpair.http.keys import Keyring
from nvpair.state.traffic import Traffic


class TrafficView:
    def __init__(self, traffic: Traffic, keys: Keyring | None = None) -> None:
        self.traffic = traffic
        self.keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["method"] != "GET":
            await send_wrong_method(send, "GET", "/v1/router")
            return
        doc: dict[str, Any] = {"engines": self.traffic.doc(trio.current_time())}
        if self.keys is not None and self.keys.on:
            doc["keys"] = self.keys.doc()
        await send_json(send, 200, doc)
