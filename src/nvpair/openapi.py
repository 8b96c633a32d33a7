"""nvpair's own HTTP API as an OpenAPI 3.1 document (``GET /openapi.json``, ``nvpair schema
api``), its bodies' schemas generated from msgspec types.

The answers' types are the wire shapes the handlers send: the ``/v1/models`` item is
``nvpair.state.listing``'s own ``_Item``, a router counter is
``nvpair.state.traffic.EngineTraffic``'s
doc, and the others are written here field for field from the handlers' dicts
(``nvpair.http.views``, ``nvpair.http.api``, ``nvpair.http.control``). The paths come from the same
names
the API routes by (``ROUTED_PATHS``, ``ENGINE_ACTIONS``, the mounts' paths), and
tests/test_openapi.py holds the document to the route table and to real answers, so it
cannot drift from what is served. Every operation lists each status it can answer; every
error is OpenAI's shape (``Error``).
"""

from __future__ import annotations

from typing import Any

import msgspec

from nvpair import __version__
from nvpair.http.api import ENGINE_ACTIONS, LOG_WAIT_MAX_S, RELOAD_PATH
from nvpair.http.dashboard import HistoryView
from nvpair.http.groups import ACTIONS as GROUP_ACTIONS
from nvpair.http.groups import PREFIX as GROUPS_PATH
from nvpair.peers.receiver import ADVERTS_PATH
from nvpair.peers.status import PEERS_PATH
from nvpair.router import ROUTED_PATHS
from nvpair.router.queueview import PATH as QUEUE_PATH
from nvpair.state.listing import _Item as ModelItem

UNSET = msgspec.UNSET
#: the optional parts of the API, each present when configured (``document(parts)``)
PARTS = frozenset({"router", "peers", "groups"})


class ErrorBody(msgspec.Struct):
    message: str
    type: str
    code: str | None
    param: None
    #: a routed request's id (its x-request-id), on the router's errors
    request_id: str | msgspec.UnsetType = UNSET


class Error(msgspec.Struct):
    """OpenAI's error shape, used by every error nvpair answers."""

    error: ErrorBody


class Health(msgspec.Struct):
    status: str
    node: str


class ModelList(msgspec.Struct):
    """``GET /v1/models``: OpenAI's list."""

    object: str
    data: list[ModelItem]


class ClusterModelList(msgspec.Struct):
    """``GET /v1/cluster/models``: this node's items and every listed peer's (a peer's
    ``nvpair`` object has ``node_url``, ``peer``, ``routable`` and ``age_s`` in place of
    ``checked_age_s``)."""

    object: str
    data: list[dict[str, Any]]


class Identity(msgspec.Struct):
    model: str | None
    version: str | None


class Probe(msgspec.Struct):
    path: str
    ok: bool | None
    http_status: int | None
    latency_ms: float | None
    age_s: float | None
    consecutive_failures: int
    requests: int
    failures: int
    timeouts: int
    latency_ms_max: float
    latency_ms_mean: float | None
    error: str | None
    #: ticks skipped because routed requests had just succeeded (passive health)
    passive: int


class Reloaded(msgspec.Struct):
    """``POST /v1/admin/reload``: what the reload changed (docs/lifecycle.md, "Reload"):
    per verdict, each engine's name and the fields that changed; the sections outside
    the engines that were applied; the log line."""

    added: dict[str, list[str]]
    restart: dict[str, list[str]]
    update: dict[str, list[str]]
    removed: dict[str, list[str]]
    unchanged: int
    sections: list[str]
    summary: str


class GroupHead(msgspec.Struct):
    name: str
    role: str
    rank: int
    epoch: int
    ranks_ready: int
    ranks: int


class EngineStatus(msgspec.Struct):
    """One engine's status object (docs/api.md, "The status object")."""

    name: str
    kind: str
    node: str
    url: str
    managed: bool
    state: str
    state_age_s: float | None
    models: list[str]
    models_stale: bool
    models_age_s: float | None
    models_left_out: int
    models_left_out_why: str | None
    aliases: list[str]
    identity: Identity | None
    pid: int | None
    checked_age_s: float | None
    probes: dict[str, Probe]
    restarts: int
    exit_code: int | None
    exited_at: float | None
    error: str | None
    admitting: bool
    queued: int
    queued_oldest_s: float | None
    activity: str | None
    kv_cache_usage: float | None
    group: GroupHead | None
    memory: dict[str, Any] | None
    version: int


class Engines(msgspec.Struct):
    """``GET /v1/engines``; ``seq`` and ``boot_id`` say where a long-poll waits from."""

    node: str
    version: int
    memory: dict[str, Any] | None
    engines: list[EngineStatus]
    seq: int | msgspec.UnsetType = UNSET
    boot_id: str | msgspec.UnsetType = UNSET


class Operation(EngineStatus):
    """The 202 of an engine request: the status and the operation under way (``note``:
    for an adopted engine, what the request means for it)."""

    operation: str
    note: str | msgspec.UnsetType = UNSET


class ModelOperation(Operation, kw_only=True):
    """The 202 of a model's wake: the status of the engine that serves it, the operation
    (``awake``, ``waking`` or ``loading``) and the model."""

    model: str


class Logs(msgspec.Struct):
    engine: str
    lines: list[str]
    first: int
    next: int
    missed: int


class RouterEngine(msgspec.Struct):
    in_flight: int
    requests: int
    failures: int
    consecutive_failures: int
    client_gone: int
    rejected: int
    last_ok_age_s: float | None
    suspect: bool
    last_error: str | None


class RouterKey(msgspec.Struct):
    """A key's counters (``nvpair.http.keys.Key.doc``; never its token)."""

    role: str
    priority: int
    max_in_flight: int | None
    requests_per_minute: int | None
    models: list[str] | None
    in_flight: int
    requests: int
    rejected: dict[str, int]
    queued: int
    queue_wait_s: float
    refused: bool


class QueueWaiter(msgspec.Struct):
    position: int
    key: str | None
    priority: int
    level: int
    age_s: float
    request_id: str | None


class QueueEngineKey(msgspec.Struct):
    depth: int
    priority: int
    oldest_wait_s: float


class QueueEngine(msgspec.Struct):
    model: str | None
    depth: int
    oldest_wait_s: float | None
    activating: bool
    blocked: str | None
    keys: dict[str, QueueEngineKey]
    waiting: list[QueueWaiter]
    more: int


class QueueKey(msgspec.Struct):
    depth: int
    oldest_wait_s: float
    engines: dict[str, int]


class Queue(msgspec.Struct):
    """``GET /v1/queue``: per on-demand engine, its waiting requests in the order they go
    (position, key, priority and the level ageing lifted it to, age; no bodies), and per
    key (``(no key)``: requests without one) over every engine (docs/on-demand.md)."""

    engines: dict[str, QueueEngine]
    keys: dict[str, QueueKey]


class RouterCounters(msgspec.Struct):
    """``GET /v1/router``: per engine (or ``peer NODE``), and per key when the API has
    keys (docs/keys.md)."""

    engines: dict[str, RouterEngine]
    keys: dict[str, RouterKey] | msgspec.UnsetType = UNSET


class HistoryEngine(msgspec.Struct):
    first_age_s: float | None
    latency_ms: list[float | None]
    latency_ms_max: list[float | None]
    memory_bytes: list[int | None]


class History(msgspec.Struct):
    """``GET /v1/history``: the dashboard's charts."""

    node: str
    version: str
    uptime_s: float
    routes: dict[str, bool]
    step_s: float
    engines: dict[str, HistoryEngine]


class Peers(msgspec.Struct):
    """``GET /v1/peers``: this node's advert, the broker's state and the peer table
    (docs/peers.md)."""

    node: str
    backend: str
    url: str
    broker: dict[str, Any]


class Groups(msgspec.Struct):
    """``GET /v1/groups``: this node's multi-node groups (docs/groups.md)."""

    node: str
    groups: list[dict[str, Any]]


class Group(msgspec.Struct):
    """``GET /v1/groups/{name}``: one group as this node knows it."""

    name: str


TYPES: tuple[Any, ...] = (Error, Health, ModelList, ClusterModelList, Engines, EngineStatus,
                          Operation, ModelOperation, Logs, RouterCounters, Queue, History,
                          Peers, Groups, Group, Reloaded)

#: component names of types whose class names are private in their modules
_RENAMED = {"_Item": "ModelItem", "_Nvpair": "ModelNvpair"}
_READ_ERRORS = (401, 403)  # every route behind the token (403: a key's role, or no token
# and a browser's request)


def _ref(t: Any) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{t.__name__}"}


def _json(t: Any) -> dict[str, Any]:
    return {"content": {"application/json": {"schema": _ref(t)}}}


def _answers(ok: dict[int | str, tuple[str, dict[str, Any]]], errors: tuple[int, ...],
             auth: bool = True, engine: tuple[int, ...] = ()) -> dict[str, Any]:
    """The responses: ``ok``'s, then the errors in OpenAI's shape; those in ``engine``
    may also be the engine's own answer, passed through as it came (any JSON)."""
    out: dict[str, Any] = {str(code): {"description": words, **body}
                           for code, (words, body) in ok.items()}
    for code in sorted({*errors, *(_READ_ERRORS if auth else ()), 500}):
        out[str(code)] = {"description": _ERROR_WORDS[code], **_json(Error)}
        if code in engine:
            out[str(code)] = {
                "description": _ERROR_WORDS[code] + "; or the engine's own answer",
                "content": {"application/json": {"schema": {}}}}
    return out


_ERROR_WORDS = {
    400: "a bad query or body (what is wrong, in one line)",
    401: "a missing or wrong bearer token",
    403: "the key's role does not allow this kind of route (docs/keys.md); or, without "
         "keys, a request that may come from a web page (docs/api.md)",
    404: "no such engine, model, group or file",
    405: "another method than the one this path takes",
    408: "the body did not arrive in time",
    409: "conflicts with the operation in progress",
    413: "a body over the cap",
    415: "the body is not sent as application/json",
    429: "over the key's max_in_flight or requests_per_minute (rate_limit_exceeded, "
         "Retry-After), or the on-demand engine's queue is full",
    500: "a bug in nvpair: the reason is in its log",
    502: "the engine failed before answering",
    503: "no engine can take it now (Retry-After), or no lifecycle controller",
    504: "the engine sent nothing within first_byte_timeout_s",
}


def _param(name: str, where: str, schema: dict[str, Any], words: str) -> dict[str, Any]:
    return {"name": name, "in": where, "required": where == "path", "schema": schema,
            "description": words}


def _whole(low: int, high: int) -> dict[str, Any]:
    return {"type": "integer", "minimum": low, "maximum": high}


_TEXT = {"schema": {"type": "string"}}


def _paths(parts: frozenset[str], engines: tuple[str, ...], models: tuple[str, ...]
           ) -> dict[str, Any]:
    engine_name = _param("name", "path", {"type": "string"}, "an engine's name")
    if engines:  # this node's (a client, or a fuzzer, may start from these)
        engine_name["examples"] = {name: {"value": name} for name in engines}
    model: dict[str, Any] = {"type": "string"}
    if models:  # the ids and aliases the config names (the engines may list more)
        model["examples"] = list(models)
    paths: dict[str, Any] = {
        "/healthz": {"get": {"summary": "nvpair's own liveness (no token needed)",
                             "security": [], "responses": _answers(
                                 {200: ("alive", _json(Health))}, (), auth=False)}},
        "/openapi.json": {"get": {"summary": "this document (no token needed)", "security": [],
                                  "responses": _answers({200: ("OpenAPI 3.1", {
                                      "content": {"application/json": {
                                          "schema": {"type": "object"}}}})}, (),
                                      auth=False)}},
        "/metrics": {"get": {"summary": "Prometheus metrics", "responses": _answers(
            {200: ("the text exposition", {"content": {"text/plain": _TEXT}})}, ())}},
        "/v1/models": {"get": {
            "summary": "OpenAI's list of models (ready, stale and cold engines')",
            "parameters": [_param("scope", "query", {"type": "string",
                                                     "examples": ["cluster", "local"]},
                                  "cluster: the peers' models too; any other value: this "
                                  "node's only")],
            "responses": _answers({200: ("the list", {"content": {"application/json": {
                "schema": {"anyOf": [_ref(ModelList), _ref(ClusterModelList)]}}}})}, ())}},
        "/v1/cluster/models": {"get": {
            "summary": "this node's models and every listed peer's",
            "responses": _answers({200: ("the list", _json(ClusterModelList))}, ())}},
        "/v1/models/{model}": {"get": {
            "summary": "OpenAI's retrieve-model (an id may hold slashes)",
            "parameters": [_param("model", "path", model, "a model id or alias")],
            "responses": _answers({200: ("the item /v1/models lists", {"content": {
                "application/json": {"schema": {"type": "object"}}}})}, (404,))}},
        "/v1/models/{model}/wake": {"post": {
            "summary": "wake what serves the model: its sleeping engine, or a multi-model "
                       "engine's load of it; a second wake joins the first (docs/sleep.md)",
            "parameters": [_param("model", "path", model, "a model id or alias")],
            "responses": _answers({202: ("accepted: the engine's status, the operation "
                                         "and the model", _json(ModelOperation))},
                                  (404, 409, 503))}},
        "/v1/engines": {"get": {
            "summary": "every engine's status; with after and wait_s, a long-poll",
            "parameters": [
                _param("after", "query", _whole(0, 2**62), "answer once seq moved past it"),
                _param("wait_s", "query", _whole(0, LOG_WAIT_MAX_S),
                       "how long to wait for that (seconds)")],
            "responses": _answers({200: ("the engines", _json(Engines))}, (400,))}},
        "/v1/events": {"get": {
            "summary": "server-sent events: a snapshot, then one event per change",
            "parameters": [
                _param("types", "query", {"type": "string"},
                       "a comma-separated choice of engine, models, peer, group, reload"),
                _param("engine", "query", {"type": "string"}, "only this engine's events")],
            "responses": _answers({200: ("the stream", {"content": {
                "text/event-stream": _TEXT}})}, (400, 404, 503))}},
        "/v1/engines/{name}": {"get": {
            "summary": "one engine's status", "parameters": [engine_name],
            "responses": _answers({200: ("the status", _json(EngineStatus))}, (404,))}},
        "/v1/engines/{name}/logs": {"get": {
            "summary": "a managed engine's output, by line number",
            "parameters": [
                engine_name,
                _param("tail", "query", _whole(1, 100_000), "the last N lines (default 100)"),
                _param("after", "query", _whole(0, 2**62), "the lines numbered N and on"),
                _param("wait_s", "query", _whole(0, LOG_WAIT_MAX_S),
                       "with after: wait up to S seconds for a line")],
            "responses": _answers({200: ("the lines", _json(Logs))}, (400, 404))}},
        "/v1/router": {"get": {"summary": "the router's per-engine counters",
                               "responses": _answers({200: ("the counters",
                                                            _json(RouterCounters))}, ())}},
        QUEUE_PATH: {"get": {
            "summary": "who waits for which on-demand engine, in the order they go",
            "responses": _answers({200: ("the queues", _json(Queue))}, ())}},
        HistoryView.path: {"get": {
            "summary": "the dashboard's charts",
            "parameters": [_param("engine", "query", {"type": "string"}, "one engine"),
                           _param("points", "query", _whole(1, 360), "how many buckets")],
            "responses": _answers({200: ("the series", _json(History))}, (400,))}},
        "/ui/": {"get": {"summary": "the dashboard (its files need no token)", "security": [],
                         "responses": _answers({200: ("the page", {"content": {
                             "text/html": _TEXT}})}, (403, 404), auth=False)}},
    }
    paths[RELOAD_PATH] = {"post": {
        "summary": "read the config again and apply what changed; only engines whose "
                   "process changed restart (an admin's; docs/lifecycle.md)",
        "responses": _answers({200: ("applied: what changed", _json(Reloaded))}, (400,))}}
    for action in sorted(ENGINE_ACTIONS - {"logs"}):
        paths[f"/v1/engines/{{name}}/{action}"] = {"post": {
            "summary": f"ask for {action} (docs/"
                       f"{'sleep' if action in ('wake', 'sleep') else 'lifecycle'}.md)",
            "parameters": [engine_name],
            "responses": _answers({202: ("accepted: the status and the operation",
                                         _json(Operation))}, (404, 409, 503))}}
    if "router" in parts:
        for path in sorted(ROUTED_PATHS):
            paths[path] = {"post": {
                "summary": "OpenAI's API, routed to an engine serving the model "
                           "(the body passes through untouched; docs/router.md)",
                "requestBody": {"required": True, "content": {"application/json": {
                    "schema": {"type": "object", "required": ["model"], "properties": {
                        "model": {**model, "minLength": 1}},
                               "additionalProperties": True}}}},
                "responses": _answers(
                    {200: ("the engine's answer, as it sent it", {"content": {
                        "application/json": {"schema": {}},
                        "text/event-stream": _TEXT}}),
                      "4XX": ("the engine's own refusal, passed through as it came", {}),
                     "5XX": ("the engine's own failure, passed through as it came", {})},
                    (400, 404, 413, 415, 429, 502, 503, 504), engine=(400, 404, 413, 429))}}
    if "peers" in parts:
        paths[PEERS_PATH] = {"get": {"summary": "the peer table",
                                     "responses": _answers({200: ("the peers",
                                                                  _json(Peers))}, ())}}
        paths[ADVERTS_PATH] = {"post": {
            "summary": "a peer's advert (the cluster token, not the API token)",
            "security": [],
            "requestBody": {"required": True, "content": {"application/json": {
                "schema": {"type": "object"}}}},
            "responses": _answers({204: ("taken", {})}, (400, 401, 408, 409, 413),
                                  auth=False)}}
    if "groups" in parts:
        group = _param("name", "path", {"type": "string"}, "a group's name")
        paths[GROUPS_PATH] = {"get": {"summary": "this node's multi-node groups",
                                      "responses": _answers({200: ("the groups",
                                                                   _json(Groups))}, ())}}
        paths[GROUPS_PATH + "/{name}"] = {"get": {
            "summary": "one group", "parameters": [group],
            "responses": _answers({200: ("the group", _json(Group))}, (404,))}}
        for action in GROUP_ACTIONS:
            paths[f"{GROUPS_PATH}/{{name}}/{action}"] = {"post": {
                "summary": f"ask the group's head for {action}", "parameters": [group],
                "responses": _answers({202: ("accepted", {"content": {"application/json": {
                    "schema": {"type": "object"}}}})}, (404, 409, 502, 503, 504))}}
    return paths


def document(parts: frozenset[str] = PARTS, engines: tuple[str, ...] = (),
             models: tuple[str, ...] = ()) -> dict[str, Any]:
    """The OpenAPI 3.1 document of the API with ``parts`` (of ``PARTS``) configured;
    ``engines`` and ``models``: the node's engine names and configured model ids, given as
    examples of ``{name}`` and of a routed request's ``model``."""
    _, schemas = msgspec.json.schema_components(
        TYPES, ref_template="#/components/schemas/{name}")
    # nvpair.state.listing's wire types are private there; here they get public names
    text = msgspec.json.encode(schemas)
    for private, public in _RENAMED.items():
        text = text.replace(b'"%s"' % private.encode(), b'"%s"' % public.encode())
        text = text.replace(b'/%s"' % private.encode(), b'/%s"' % public.encode())
    schemas = msgspec.json.decode(text)
    return {
        "openapi": "3.1.0",
        "info": {"title": "nvpair", "version": __version__,
                 "description": "nvpair's HTTP API (docs/api.md). Every route but /healthz, "
                                "/openapi.json and the dashboard's files needs "
                                "Authorization: Bearer <token> when token_file or [[keys]] "
                                "are set; a key's role decides which routes it may use "
                                "(docs/keys.md)."},
        "paths": _paths(parts, engines, models),
        "components": {"schemas": schemas, "securitySchemes": {
            "bearer": {"type": "http", "scheme": "bearer"}}},
        "security": [{"bearer": []}],
    }


def document_json(parts: frozenset[str] = PARTS, engines: tuple[str, ...] = (),
                  models: tuple[str, ...] = ()) -> bytes:
    return msgspec.json.format(msgspec.json.encode(document(parts, engines, models)),
                               indent=2)
