"""The OpenAI front door: route requests to the engine that serves the model.

Module map: ``select`` (which engines may take a request, from the snapshot), ``relay`` (the
ASGI handler that passes bytes through and ends the engine's work when the client goes),
``upstream`` (the pools), ``view`` (GET /v1/router). The router's memory of real requests,
``nvpair.traffic``, lives below both the router, which writes it, and the prober, which reads
it. Peers come in through the ``PeerRouter`` protocol (``router.peering``): the router imports
nothing of ``nvpair.peers``.
"""

from nvpair.router.relay import ROUTED_PATHS, Router
from nvpair.traffic import Traffic

__all__ = ["ROUTED_PATHS", "Router", "Traffic"]
