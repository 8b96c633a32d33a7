"""A plain OpenAI-compatible server (kind ``openai``): /v1/models and inference, with every
path behind the API key when one is set, and the port refused while loading.
"""

from __future__ import annotations

import time
from typing import Any

from nvpair.sim.engine import Engine, Router
from nvpair.sim.http import Reply, Request
from nvpair.sim.openai_api import ModelCardRoutes, OpenAIApi
from nvpair.sim.vllm import admit_served_name


class OpenAICompat(ModelCardRoutes, Engine):
    kind = "openai"

    def add_routes(self, router: Router) -> None:
        router.add("GET", "/v1/models", self.models)
        router.add("GET", "/v1/models/{model}", self.model)
        OpenAIApi(self).add_routes(router)

    async def unauthorized(self, reply: Reply) -> None:
        await reply.send_json(401, {"error": {
            "message": "Incorrect API key provided.", "type": "invalid_request_error",
            "param": None, "code": "invalid_api_key",
        }})

    async def error(self, reply: Reply, status: int, message: str) -> None:
        await reply.send_json(status, {"error": {
            "message": message, "type": "invalid_request_error" if status < 500 else "server_error",
            "param": None, "code": None,
        }})

    async def admit(self, request: Request, reply: Reply, model: object) -> str | None:
        return await admit_served_name(self, reply, model)

    def _card(self) -> dict[str, Any]:
        return {"id": self.served_model, "object": "model", "created": int(time.time()),
                "owned_by": "organization-owner"}

