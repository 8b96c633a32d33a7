"""The OpenAI front door: route requests to the engine that serves the model.

Module map: ``traffic`` (in-flight counts and passive health, the router's own memory),
``select`` (which engines may take a request, from the snapshot), ``relay`` (the ASGI
handler that passes bytes through and ends the engine's work when the client goes).
"""

from nvpair.router.relay import ROUTED_PATHS, Router
from nvpair.router.traffic import Traffic

__all__ = ["ROUTED_PATHS", "Router", "Traffic"]
