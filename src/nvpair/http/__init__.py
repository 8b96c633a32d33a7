"""The API server: routes, views, control, events, metrics and the dashboard.

The modules:

* ``asgi``: small ASGI helpers: JSON answers, OpenAI-shaped errors, a capped body read,
  `Mount`.
* ``views``: what the API answers, computed from one snapshot (pure functions).
* ``sse``: `GET /v1/events`, the journal as server-sent events: pacing, heartbeat, dropping
  a client that stops reading.
* ``keys``: `Keyring`, the API's keys: who a token is, what its role may do by the kind of
  route, its limits and counts, and its token file read again when it changes.
* ``api``: `Api`, the ASGI app: `/healthz`, `/v1/models`, `/v1/engines`, auth, and the
  mounts.
* ``control``: the API's controller: lifecycle requests as 202/409, and the engines' logs.
* ``metrics``: `Metrics`, `GET /metrics` in Prometheus' text format, written from the
  snapshot and the counters, cached per second.
* ``groups``: `GroupsView`, `GET /v1/groups[/{name}]` from memory and `POST
  /v1/groups/{name}/stop|start|restart`, passed on to the head.
* ``server``: hypercorn's trio worker with connection hygiene, deadlines, a connection cap
  and one keep-alive timer task per connection (its deadline moved, not a task per idle
  spell).
* ``dashboard``: `Dashboard`, the web page at `/ui/` (static files with ETags and a CSP),
  and `HistoryView`, `GET /v1/history`.
"""
