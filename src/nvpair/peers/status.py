"""``GET /v1/peers``: the peer table with states, ages, last errors, bytes and pushes.

Served from memory like every other read (the user token applies, as for /v1/engines).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import trio

from nvpair.http.asgi import Receive, Scope, Send, send_json, send_wrong_method

PEERS_PATH = "/v1/peers"


class Status:
    def __init__(self, doc: Callable[[float], dict[str, Any]]) -> None:
        self.doc = doc

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["method"] != "GET":
            await send_wrong_method(send, "GET", PEERS_PATH)
            return
        await send_json(send, 200, self.doc(trio.current_time()))
