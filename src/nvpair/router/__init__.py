"""The OpenAI front door: route requests to the engine that serves the model.

The modules:

* ``evict``: which on-demand engines make room for another, and how (`plan`), pure: a tier
  per victim (sleep at level 1 within the host RAM, sleep at level 2, stop); idle ones
  first (a busy one only when they do not free enough), then by priority, then idle time
  over come-back time; pinned ones never.
* ``select``: which engines may take a request for a model, from the snapshot, never probed.
* ``relay``: the ASGI handler that passes a request to an engine and its answer back.
* ``request``: one routed request: its id (`Routed`, `valid_id`), times, answer, access line.
* ``upstream``: a connection pool per engine or peer, on httpcore2.
* ``models``: multi-model engines (llama-server in router mode): `ModelSlots`, nvpair's
  requests per model, and never a request that evicts a model with requests in flight.
* ``counters``: `GET /v1/router`, the router's own counters.
* ``peering``: what the router knows of peers: `PeerRouter`, the routes to a model.
* ``activation``: engines on demand: `Activator`, the single-flight start (or wake), the
  bounded queue per engine, evictions by tier and idle unloads.
* ``fairqueue``: `FairQueue`, the order of an engine's waiting requests: priority with
  ageing, round-robin across keys (pure).
* ``swaps``: swap batching, when a loaded engine may be evicted for another (`verdict`, pure).
* ``queueview``: `QueueView`, `GET /v1/queue`: who waits for which engine, in order.
* ``tracing``: a routed request's trace (`Tracer`, `RequestTrace`): its server span and the
  spans of its queue, activation, evictions, wake and upstream call or peer hop.

The router's memory of real requests, ``nvpair.state.traffic``, lives below both the router,
which writes it, and the prober, which reads it. Peers come in through the ``PeerRouter``
protocol (``peering``): the router imports nothing of ``nvpair.peers``.
"""

from nvpair.router.relay import ROUTED_PATHS, Router
from nvpair.state.traffic import Traffic

__all__ = ["ROUTED_PATHS", "Router", "Traffic"]
