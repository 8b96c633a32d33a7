"""``GET /v1/router``: what real traffic has shown, per engine (the router's own counters)."""

from __future__ import annotations

import trio

from nvpair.http.asgi import Receive, Scope, Send, send_json, send_wrong_method
from nvpair.state.traffic import Traffic


class TrafficView:
    def __init__(self, traffic: Traffic) -> None:
        self.traffic = traffic

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["method"] != "GET":
            await send_wrong_method(send, "GET", "/v1/router")
            return
        await send_json(send, 200, {"engines": self.traffic.doc(trio.current_time())})
