"""The API over a hand-built snapshot (ASGI in-process); real-socket tests are in test_service."""

from urllib.parse import parse_qs

import httpx2
import msgspec
import pytest
import trio
import trio.testing

from nvpair.api import Api, log_query, read_log
from nvpair.logs import EngineLog, Lines
from nvpair.snapshot import Board, EngineState, Model, ProbeStats


def board_with(*engines: EngineState) -> Board:
    return Board(engines)


def engine(name: str, state: str, models: tuple[str, ...] = (), **kw: object) -> EngineState:
    return EngineState(name=name, kind="vllm", url="http://127.0.0.1:8000", managed=False,
                       state=state, models=tuple(Model(id=m, created=5, owned_by="vllm")  # type: ignore[arg-type]
                                                 for m in models),
                       checked_at=trio.current_time(), **kw)  # type: ignore[arg-type]


def client(api: Api) -> httpx2.AsyncClient:
    return httpx2.AsyncClient(transport=httpx2.ASGITransport(app=api), base_url="http://nvpair")


async def test_models_lists_ready_and_stale_engines_only() -> None:
    board = board_with(engine("a", "ready", ("m1",)), engine("b", "stale", ("m2",)),
                       engine("c", "unhealthy", ("m3",)), engine("d", "down", ("m4",)),
                       engine("e", "ready", ("m1",)))
    async with client(Api(board, node="n1")) as c:
        r = await c.get("/v1/models")
    assert r.status_code == 200
    doc = r.json()
    assert doc["object"] == "list"
    by_id = {m["id"]: m for m in doc["data"]}
    assert set(by_id) == {"m1", "m2"}
    assert by_id["m1"]["object"] == "model" and by_id["m1"]["created"] == 5
    assert by_id["m1"]["nvpair"]["engines"] == ["a", "e"]
    m2 = dict(by_id["m2"]["nvpair"])
    age = m2.pop("checked_age_s")
    assert isinstance(age, float | int) and age >= 0, age
    assert m2 == {"engine": "b", "engines": ["b"], "kind": "vllm", "node": "n1",
                  "state": "stale", "stale": True, "alias_of": None}


async def test_aliases_are_listed() -> None:
    board = board_with(engine("a", "ready", ("org/model-7b",), aliases=("fast",)))
    async with client(Api(board, node="n")) as c:
        data = (await c.get("/v1/models")).json()["data"]
    assert [(m["id"], m["nvpair"]["alias_of"]) for m in data] == [
        ("org/model-7b", None), ("fast", "org/model-7b")]


async def test_engine_status_shape() -> None:
    e = engine("a", "ready", ("m1",), pid=42,
               probes=(("health", ProbeStats(path="/health", ok=True, http_status=200,
                                             latency_ms=1.5, requests=3)),))
    async with client(Api(board_with(e), node="n")) as c:
        doc = (await c.get("/v1/engines/a")).json()
        listing = (await c.get("/v1/engines")).json()
        missing = await c.get("/v1/engines/nope")
    for key in ("name", "kind", "url", "managed", "state", "models", "pid", "checked_age_s",
                "probes", "restarts", "error", "version"):
        assert key in doc
    assert doc["pid"] == 42 and doc["models"] == ["m1"]
    assert doc["probes"]["health"]["requests"] == 3
    assert listing["engines"][0]["name"] == "a"
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "engine_not_found"


async def test_errors_are_openai_shaped_and_4xx() -> None:
    async with client(Api(board_with(engine("x", "ready", ("m",))), node="n")) as c:
        r404 = await c.get("/v2/nothing")
        r405 = await c.post("/v1/models")
        bad_tail = await c.get("/v1/engines/x/logs?tail=abc")
        no_engine = await c.get("/v1/engines/y/logs?tail=5")
        post_logs = await c.post("/v1/engines/x/logs")
    assert r404.status_code == 404 and set(r404.json()["error"]) >= {"message", "type", "code"}
    assert r405.status_code == 405
    assert bad_tail.status_code == 400 and "tail" in bad_tail.json()["error"]["message"]
    assert no_engine.status_code == 404
    assert post_logs.status_code == 405


async def test_token_required_everywhere_but_healthz() -> None:
    api = Api(board_with(engine("a", "ready", ("m",))), node="n", token="s3cret")
    async with client(api) as c:
        assert (await c.get("/healthz")).status_code == 200
        r = await c.get("/v1/models")
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        bad = await c.get("/v1/models", headers={"Authorization": "Bearer nope"})
        assert bad.status_code == 401
        ok = await c.get("/v1/models", headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200


async def test_answers_are_encoded_once_per_version(autojump_clock) -> None:
    board = board_with(engine("a", "ready", ("m",)))
    api = Api(board, node="n")
    first = api.cached("models", lambda s, n: {"v": s.version})
    assert api.cached("models", lambda s, n: pytest.fail("re-encoded")) is first
    board.update("a", lambda e: msgspec.structs.replace(e, restarts=1))
    assert msgspec.json.decode(api.cached("models", lambda s, n: {"v": s.version})) == {"v": 2}


async def test_a_log_read_waits_for_the_next_line_up_to_wait_s(autojump_clock) -> None:
    log = EngineLog(None)
    log.write("first")
    got: list[Lines] = []

    async def read(query: str) -> None:
        got.append(await read_log(log, log_query(parse_qs(query))))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(read, "after=1&wait_s=30")
        await trio.testing.wait_all_tasks_blocked()
        start = trio.current_time()
        log.write("second")
    assert got == [Lines(["second"], 1, 2, 0)] and trio.current_time() == start
    start = trio.current_time()
    assert await read_log(log, log_query(parse_qs("after=2&wait_s=7"))) == Lines([], 2, 2, 0)
    assert trio.current_time() - start == 7  # nothing came: empty after wait_s, not sooner
    both = Lines(["first", "second"], 0, 2, 0)
    assert await read_log(log, log_query(parse_qs("after=0"))) == both
    assert await read_log(log, log_query({})) == both  # tail=100 when nothing is asked


@pytest.mark.parametrize(("query", "message"), [
    ("tail=0", "tail: expected a whole number 1-100000, got '0'"),
    ("after=-1", "after: expected a whole number 0-4611686018427387904, got '-1'"),
    ("after=0&wait_s=31", "wait_s: expected a whole number 0-30, got '31'"),
    ("after=0&tail=5", "tail and after: give one of them"),
    ("after=9", "line 9 is not in this log (it has 0-0)"),
])
async def test_bad_log_queries_say_what_is_wrong(query: str, message: str) -> None:
    with pytest.raises(ValueError) as info:
        await read_log(EngineLog(None), log_query(parse_qs(query)))
    assert str(info.value) == message
