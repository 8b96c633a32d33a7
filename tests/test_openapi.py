"""The API's OpenAPI document: valid OpenAPI 3.1, every route the API dispatches in it, and
a live node's answers to every documented operation matching what it documents."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx2
import jsonschema
import pytest
import trio
from openapi_spec_validator import validate
from tests.managed import wait_state
from tests.ports import free_port

from nvpair import service
from nvpair.config.settings import load_settings
from nvpair.http.api import ENGINE_ACTIONS, FIXED_ROUTES, RELOAD_PATH, WAKE
from nvpair.http.dashboard import Dashboard, HistoryView
from nvpair.http.groups import ACTIONS as GROUP_ACTIONS
from nvpair.http.groups import PREFIX as GROUPS
from nvpair.openapi import PARTS, document, document_json
from nvpair.peers.receiver import ADVERTS_PATH
from nvpair.peers.status import PEERS_PATH
from nvpair.router import ROUTED_PATHS
from nvpair.router.queueview import PATH as QUEUE_PATH
from nvpair.sim import SimOptions, serve_sim


@pytest.mark.parametrize("parts", [PARTS, frozenset()])
def test_the_document_is_valid_openapi_3_1(parts: frozenset[str]) -> None:
    doc = document(parts, engines=("a", "b"), models=("m",))
    assert doc["openapi"] == "3.1.0"
    validate(doc)  # raises on any error of the OpenAPI 3.1 schema or its references


def dispatched() -> dict[str, str]:
    """Every route of the API's route table (``nvpair.http.api`` and the mounts), as a
    documented path -> its method."""
    routes = {path: "get" for path in FIXED_ROUTES}
    routes["/v1/engines/{name}"] = "get"
    routes.update({f"/v1/engines/{{name}}/{a}": "get" if a == "logs" else "post"
                   for a in ENGINE_ACTIONS})
    routes["/v1/models/{model}"] = "get"
    routes["/v1/models/{model}" + WAKE] = "post"
    routes[RELOAD_PATH] = "post"
    routes.update({path: "post" for path in ROUTED_PATHS})
    routes.update({"/v1/router": "get", QUEUE_PATH: "get", HistoryView.path: "get",
                   Dashboard.prefix: "get", PEERS_PATH: "get", ADVERTS_PATH: "post", GROUPS: "get",
                   GROUPS + "/{name}": "get"})
    routes.update({f"{GROUPS}/{{name}}/{a}": "post" for a in GROUP_ACTIONS})
    return routes


def test_every_route_the_api_dispatches_is_in_the_document() -> None:
    paths = document()["paths"]
    missing = {path: method for path, method in dispatched().items()
               if method not in paths.get(path, {})}
    assert not missing
    extra = set(paths) - set(dispatched())
    assert not extra, f"documented but not dispatched: {extra}"


def test_an_optional_part_not_configured_is_not_documented() -> None:
    paths = document(frozenset())["paths"]
    assert not set(paths) & {*ROUTED_PATHS, PEERS_PATH, ADVERTS_PATH, GROUPS}
    assert "/v1/engines/{name}/stop" in paths


def test_every_status_has_a_description_and_errors_have_openais_shape() -> None:
    for path, item in document()["paths"].items():
        for method, op in item.items():
            answers = op["responses"]
            assert "500" in answers, (path, method)
            for code, answer in answers.items():
                assert answer["description"], (path, method, code)
            if "401" in answers:
                assert answers["401"]["content"]["application/json"]["schema"] == {
                    "$ref": "#/components/schemas/Error"}


def response_schema(doc: dict[str, Any], op: dict[str, Any], status: int,
                    content_type: str) -> dict[str, Any] | None:
    """The documented schema of ``status`` (exact, else ``4XX``); None: no body documented.
    Fails when the status or the content type is not documented."""
    answers = op["responses"]
    answer = answers.get(str(status)) or answers.get(f"{str(status)[0]}XX")
    assert answer is not None, f"status {status} not documented"
    content = answer.get("content")
    if content is None:
        return None
    media = content_type.partition(";")[0].strip()
    assert media in content, f"{status} as {media}: documented {list(content)}"
    schema = content[media].get("schema", {})
    return {**schema, "components": doc["components"]}


async def test_a_live_nodes_answers_match_the_document(nursery, tmp_path: Path) -> None:
    """A node with the router, peers (one peer, down) and a token, over a simulator:
    /openapi.json needs no token; each documented operation, asked as a client would
    (valid, then with an unknown engine or model, then without the token), answers a
    documented status with a body its schema accepts."""
    sim = await nursery.start(serve_sim, SimOptions(kind="vllm", model="m1"))
    (tmp_path / "token").write_text("user-token")
    (tmp_path / "cluster").write_text("cluster-token")
    (tmp_path / "nvpair.toml").write_text(
        "listen = '127.0.0.1:0'\nnode = 'n1'\ntoken_file = 'token'\n"
        f"log_dir = '{tmp_path / 'logs'}'\n"
        "[cluster]\ntoken_file = 'cluster'\n"
        f"[[peers]]\nurl = 'http://127.0.0.1:{free_port()}'\n"
        f"[[engines]]\nname = 'e1'\nkind = 'vllm'\nport = {sim.port}\nmodel = 'm1'\n")
    with trio.fail_after(60):
        running = await nursery.start(service.run, load_settings(str(tmp_path / "nvpair.toml")))
        await wait_state(running.board, "e1", "ready", where=lambda e: bool(e.models))
        async with httpx2.AsyncClient(base_url=running.url) as anon, \
                httpx2.AsyncClient(base_url=running.url,
                                   headers={"authorization": "Bearer user-token"}) as client:
            r = await anon.get("/openapi.json")
            assert r.status_code == 200
            doc = r.json()
            assert (await anon.post("/openapi.json")).status_code == 405
            validate(doc)
            assert doc == json.loads(document_json(frozenset({"router", "peers"}), ("e1",),
                                                   ("m1",)))
            # the stop and drain last: they change the engine the others are asked about
            order = sorted(doc["paths"].items(),
                           key=lambda item: item[0].endswith(("/stop", "/drain")))
            checked = 0
            for path, item in order:
                if path == "/v1/events":  # a stream without end (tests/test_sse.py)
                    continue
                for method, op in item.items():
                    for name, model, who in (("e1", "m1", client), ("nope", "nope", client),
                                             ("e1", "m1", anon)):
                        if who is anon and op.get("security") == []:
                            continue
                        url = path.replace("{name}", name).replace("{model}", model)
                        kw: dict[str, Any] = {}
                        if method == "post":
                            kw["json"] = {"model": model, "input": "hi",
                                          "messages": [{"role": "user", "content": "hi"}],
                                          "max_tokens": 2}
                        r = await who.request(method.upper(), url, **kw)
                        where = f"{method.upper()} {url} -> {r.status_code}: {r.text[:200]}"
                        if who is anon:
                            assert r.status_code == 401, where
                        schema = response_schema(doc, op, r.status_code,
                                                 r.headers.get("content-type", ""))
                        if schema is not None and "json" in r.headers.get("content-type", ""):
                            try:
                                jsonschema.validate(r.json(), schema)
                            except jsonschema.ValidationError as exc:
                                pytest.fail(f"{where}\n{exc.message} at {list(exc.path)}")
                        checked += 1
            assert checked >= 3 * 20
            # a method the path does not take: 405, and Allow names what it takes (RFC
            # 9110, 15.5.6: a 405 must have it). /healthz answers any method, on purpose:
            # health checkers differ (HAProxy's default check is an OPTIONS).
            for path, item in doc["paths"].items():
                if path == "/healthz":
                    continue
                url = path.replace("{name}", "e1").replace("{model}", "m1")
                r = await client.request("DELETE", url)
                assert r.status_code == 405, (url, r.status_code)
                allowed = {m.strip() for m in r.headers.get("allow", "").split(",")}
                assert {m.upper() for m in item} <= allowed, (url, r.headers)
