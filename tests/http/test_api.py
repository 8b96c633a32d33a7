"""The API over a hand-built snapshot (ASGI in-process); browser checks also on a socket."""

from typing import Any
from urllib.parse import parse_qs

import httpx2
import msgspec
import pytest
import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st

from nvpair.base.logs import EngineLog, Lines
from nvpair.http.api import (
    LOG_PAGE_BYTES,
    Api,
    browser_refusal,
    local_host,
    log_query,
    read_log,
    split_authority,
)
from nvpair.state.snapshot import Board, EngineState, Model, ProbeStats


def board_with(*engines: EngineState) -> Board:
    return Board(engines)


def engine(name: str, state: str, models: tuple[str, ...] = (), **kw: object) -> EngineState:
    return EngineState(name=name, kind="vllm", url="http://127.0.0.1:8000", managed=False,
                       state=state, models=tuple(Model(id=m, created=5, owned_by="vllm")  # type: ignore[arg-type]
                                                 for m in models),
                       checked_at=trio.current_time(), **kw)  # type: ignore[arg-type]


def client(api: Api) -> httpx2.AsyncClient:
    return httpx2.AsyncClient(transport=httpx2.ASGITransport(app=api), base_url="http://127.0.0.1:14322")


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


class Logs:
    """A controller with one engine's log (``x``)."""

    def __init__(self, log: EngineLog) -> None:
        self.engine_log = log

    async def command(self, name: str, action: str) -> tuple[int, dict[str, object]]:
        raise AssertionError("no commands here")

    def log(self, name: str) -> EngineLog | None:
        return self.engine_log if name == "x" else None


async def test_a_large_log_read_comes_in_pages_of_at_most_4_mb() -> None:
    """Before: one answer of 32 MB (2,000 lines of 8,000 two-byte characters), encoded
    in one step. Now pages: every line once, in order, following ``next``."""
    log = EngineLog(None)
    for i in range(2000):
        log.write(f"{i:04d}" + "é" * 7996)
    api = Api(board_with(engine("x", "ready")), node="n", controller=Logs(log))
    got: list[str] = []
    pages = 0
    async with client(api) as c:
        r = await c.get("/v1/engines/x/logs?tail=100000")
        while True:
            assert r.status_code == 200
            assert len(r.content) <= LOG_PAGE_BYTES + 200
            doc = r.json()
            assert doc["first"] == len(got) and doc["missed"] == 0
            got += doc["lines"]
            pages += 1
            if not doc["more"]:
                break
            assert doc["next"] == len(got)
            r = await c.get(f"/v1/engines/x/logs?after={doc['next']}")
        assert doc["next"] == 2000
        assert got == log.tail(2000).lines
        assert pages >= 8  # 32 MB in pages of 4 MB at most
        # a follower at the end waits for the next line, as before
        r = await c.get("/v1/engines/x/logs?after=2000")
        assert r.json() == {"engine": "x", "lines": [], "first": 2000, "next": 2000,
                            "missed": 0, "more": False}


class Recorder:
    """A lifecycle controller that only records what it was asked."""

    def __init__(self) -> None:
        self.commands: list[tuple[str, str]] = []

    async def command(self, name: str, action: str) -> tuple[int, dict[str, object]]:
        self.commands.append((name, action))
        return 202, {"name": name, "operation": action}

    def log(self, name: str) -> None:
        return None


@pytest.mark.parametrize("headers", [
    {"Origin": "https://evil.example"},
    {"Host": "evil.example:14322"},  # DNS rebinding: evil.example now resolves to 127.0.0.1
    {"Host": "127.0.0.1.nip.io:14322"},
    {"Host": "127.0.0.1:notaport"},
    {"Origin": "null"},  # a sandboxed frame or a file:// page
    {"Origin": "http://127.0.0.1.evil.example"},
    {"Origin": "http://localhost.evil.example:14322"},
    {"Host": "localhost..:14322"},
    {"Host": "evil.example.:14322"},
    {"Origin": "ftp://127.0.0.1"},
    {"Sec-Fetch-Site": "cross-site"},
])
async def test_without_a_token_a_cross_site_stop_stops_nothing(headers) -> None:
    recorder = Recorder()
    api = Api(board_with(engine("x", "ready", ("m",))), node="n", controller=recorder)
    async with client(api) as c:
        r = await c.post("/v1/engines/x/stop", headers=headers)
        read = await c.get("/v1/engines", headers=headers)
        health = await c.get("/healthz", headers=headers)
    assert r.status_code == 403, r.text
    error = r.json()["error"]
    assert error["type"] == "permission_error"
    assert error["code"] in ("forbidden_host", "forbidden_origin")
    assert "token_file" in error["message"]
    assert recorder.commands == []
    assert read.status_code == 403  # nor can a rebound page read the engines
    assert health.status_code == 200


@pytest.mark.parametrize("headers", [
    {},
    {"Host": "127.0.0.1:14322"},
    {"Host": "127.3.4.5"},
    {"Host": "localhost:14322"},
    {"Host": "LOCALHOST"},
    {"Host": "[::1]:14322"},
    {"Host": "mybox.lan:14322"},  # allowed_hosts
    {"Host": "mybox.lan.:14322"},  # the same name, fully qualified
    {"Host": "localhost."},
    {"Host": "127.0.0.1.:14322"},
    {"Origin": "http://mybox.lan.:3000"},
    {"Origin": "http://127.0.0.1:3000"},
    {"Origin": "http://localhost:8080"},
    {"Origin": "http://[::1]:8080"},
    {"Origin": "http://MyBox.lan:3000"},
    {"Sec-Fetch-Site": "same-origin"},
])
async def test_without_a_token_this_machines_names_are_served(headers) -> None:
    recorder = Recorder()
    api = Api(board_with(engine("x", "ready", ("m",))), node="n", controller=recorder,
              allowed_hosts=["MyBox.lan"])
    async with client(api) as c:
        r = await c.post("/v1/engines/x/stop", headers=headers)
    assert r.status_code == 202, r.text
    assert recorder.commands == [("x", "stop")]


async def test_with_a_token_host_and_origin_are_not_checked() -> None:
    """A page cannot send the token cross-site (nvpair answers no CORS preflight) and does
    not know it: the token alone decides, whatever the name the client used."""
    recorder = Recorder()
    api = Api(board_with(engine("x", "ready", ("m",))), node="n", controller=recorder,
              token="s3cret")
    foreign = {"Host": "gpu7.example:14322", "Origin": "https://ui.example"}
    async with client(api) as c:
        denied = await c.post("/v1/engines/x/stop", headers=foreign)
        ok = await c.post("/v1/engines/x/stop",
                          headers={**foreign, "Authorization": "Bearer s3cret"})
    assert denied.status_code == 401
    assert ok.status_code == 202 and recorder.commands == [("x", "stop")]


@pytest.mark.parametrize(("value", "status"), [
    ("Bearer s3cret", 200), ("bearer s3cret", 200), ("BEARER s3cret", 200),
    ("Bearer  s3cret", 200),
    ("Bearer S3CRET", 401), ("Basic s3cret", 401), ("Bearers3cret", 401), ("s3cret", 401),
    ("Bearer s3cret ", 401), ("Bearer", 401),
])
async def test_the_bearer_scheme_is_matched_in_any_case_the_token_exactly(value,
                                                                          status) -> None:
    api = Api(board_with(engine("a", "ready", ("m",))), node="n", token="s3cret")
    async with client(api) as c:
        r = await c.get("/v1/models", headers={"Authorization": value})
    assert r.status_code == status, r.text


class Cluster:
    version = 1

    def models(self, now: float) -> list[dict[str, object]]:
        return [{"id": "peer-model", "object": "model", "nvpair": {"node": "b"}}]


@pytest.mark.parametrize(("query", "cluster"), [
    ("scope=cluster", True), ("a=1&scope=cluster", True), ("scope=local", False),
    ("notscope=cluster", False), ("x=scope%3Dcluster", False), ("scope=clusters", False),
    ("", False),
])
async def test_scope_cluster_is_a_query_parameter(query, cluster) -> None:
    api = Api(board_with(engine("a", "ready", ("m",))), node="n", cluster=Cluster())
    async with client(api) as c:
        ids = [m["id"] for m in (await c.get(f"/v1/models?{query}")).json()["data"]]
    assert ids == (["m", "peer-model"] if cluster else ["m"])


async def test_a_model_is_retrieved_by_id() -> None:
    board = board_with(engine("a", "ready", ("org/model-7b",), aliases=("fast",)),
                       engine("b", "down", ("gone",)))
    async with client(Api(board, node="n")) as c:
        listing = {m["id"]: m for m in (await c.get("/v1/models")).json()["data"]}
        one = await c.get("/v1/models/org/model-7b")
        alias = await c.get("/v1/models/fast")
        missing = await c.get("/v1/models/nope")
        down = await c.get("/v1/models/gone")
        post = await c.post("/v1/models/fast")
    def timeless(item: dict[str, Any]) -> dict[str, Any]:
        return {**item, "nvpair": {**item["nvpair"], "checked_age_s": None}}

    assert one.status_code == 200
    assert timeless(one.json()) == timeless(listing["org/model-7b"])
    assert alias.json()["nvpair"]["alias_of"] == "org/model-7b"
    for r in (missing, down):
        assert r.status_code == 404
        assert r.json()["error"]["code"] == "model_not_found"
        assert r.json()["error"]["type"] == "not_found_error"
    assert post.status_code == 405


async def test_the_openai_client_retrieves_a_model(nursery) -> None:
    """``client.models.retrieve`` over a real socket (hypercorn) answers the listed item."""
    import openai
    from hypercorn.config import Config
    from hypercorn.trio import serve

    api = Api(board_with(engine("a", "ready", ("m1",))), node="n")
    config = Config()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = config.errorlog = None
    with trio.fail_after(20):
        binds = await nursery.start(lambda task_status: serve(api, config,  # type: ignore[arg-type]
                                                              task_status=task_status))
        client_ = openai.OpenAI(base_url=f"{binds[0]}/v1", api_key="unused", max_retries=0)
        model = await trio.to_thread.run_sync(client_.models.retrieve, "m1")
        with pytest.raises(openai.NotFoundError):
            await trio.to_thread.run_sync(client_.models.retrieve, "m2")
    assert model.id == "m1" and model.owned_by == "vllm"


def scope_with(**headers: bytes) -> dict[str, object]:
    return {"headers": [(k.replace("_", "-").encode(), v) for k, v in headers.items()]}


@given(st.binary(max_size=80), st.binary(max_size=80))
def test_any_host_or_origin_is_judged_without_an_error(host: bytes, origin: bytes) -> None:
    refusal = browser_refusal(scope_with(host=host, origin=origin), frozenset())
    if refusal is None:  # served: both name this machine
        name = split_authority(host.decode("latin-1"))
        assert name is not None and local_host(name, frozenset())
        assert b"://" in origin
    else:
        code, message = refusal
        assert code in ("forbidden_host", "forbidden_origin") and "\n" not in message


@given(st.from_regex(r"[a-z][a-z0-9-]{0,20}(\.[a-z][a-z0-9-]{0,10}){1,3}", fullmatch=True),
       st.one_of(st.none(), st.integers(0, 65535)))
def test_a_dns_name_other_than_localhost_is_refused(name: str, port: int | None) -> None:
    authority = name if port is None else f"{name}:{port}"
    assert browser_refusal(scope_with(host=authority.encode()), frozenset()) is not None
    origin = f"http://{authority}".encode()
    assert browser_refusal(scope_with(origin=origin), frozenset()) is not None
    assert browser_refusal(scope_with(host=authority.encode()), frozenset({name})) is None


async def test_a_cross_site_stop_over_the_network_stops_nothing(nursery, tmp_path) -> None:
    """The whole service on a real socket, tokenless (the default): a web page's POST (an
    Origin of its own) or a rebound name (a Host of its own) leaves the engine listed; a
    local program's is served."""
    from tests.managed import wait_state
    from tests.router.script_engine import ScriptEngine

    from nvpair import service
    from nvpair.config.settings import load_settings

    eng = ScriptEngine("m")
    await nursery.start(eng.serve)
    (tmp_path / "nvpair.toml").write_text(
        "listen = '127.0.0.1:0'\n"
        f"[[engines]]\nname = 'x'\nkind = 'openai'\nport = {eng.port}\n")
    with trio.fail_after(20):
        running = await nursery.start(service.run, load_settings(str(tmp_path / "nvpair.toml")))
        await wait_state(running.board, "x", "ready")
        port = running.url.rsplit(":", 1)[1]
        async with httpx2.AsyncClient(base_url=running.url) as c:
            for headers in ({"Origin": "https://evil.example"},
                            {"Host": f"evil.example:{port}"},
                            {"Origin": "null", "Content-Type": "text/plain"}):
                r = await c.post("/v1/engines/x/stop", headers=headers)
                assert r.status_code == 403, r.text
                assert r.json()["error"]["type"] == "permission_error"
            assert running.board.current.engine("x").state == "ready"
            r = await c.post("/v1/engines/x/stop", headers={"Host": f"localhost:{port}"})
            assert r.status_code == 202, r.text
        await wait_state(running.board, "x", "stopped")


async def test_a_large_model_list_is_sent_in_pieces_with_the_same_bytes(autojump_clock) -> None:
    from tests.listing_oracle import models_doc

    from nvpair.http.asgi import encoder
    big = tuple(f"org/model-{i:05d}-" + "x" * 60 for i in range(3000))  # > 256 KiB
    board = board_with(engine("a", "ready", ("m1",)), engine("big", "ready", big),
                       engine("c", "stale", ("m1", "m2")))
    api = Api(board, node="n1")
    chunks = await api.models_chunks(False)
    assert len(chunks) == 3 and len(chunks[1]) > 256 * 1024  # the big part is not copied
    want = encoder.encode(models_doc(board.current, trio.current_time(), "n1"))
    async with client(api) as c:
        r = await c.get("/v1/models")
    assert r.content == want and r.headers["content-length"] == str(len(want))


@given(st.lists(st.sampled_from([b"", b"{}", b'{"a":1}', b"big"]), max_size=8))
def test_chunked_models_are_the_list_and_large_parts_are_pieces_of_their_own(
        kinds: list[bytes]) -> None:
    """However small and large parts mix, the pieces joined are the whole list (commas
    only between items), and every large part is sent as it is, not copied."""
    from nvpair.http import api
    big = b'{"x":"' + b"y" * api.CHUNK_BYTES + b'"}'
    parts = [big if k == b"big" else k for k in kinds]
    chunks = api._chunked(parts)
    assert b"".join(chunks) == b'{"object":"list","data":[' + b",".join(parts) + b"]}"
    assert sum(1 for c in chunks if c is big) == kinds.count(b"big")


async def test_a_reader_never_waits_for_another_readers_models_build() -> None:
    """A reader whose /v1/models build is held (here before its first step) holds no one
    else: a second reader of the same version and bucket builds its own and answers."""
    board = board_with(*(engine(f"e{i}", "ready", (f"m{i}",)) for i in range(5)))
    api = Api(board, node="n1")
    real, release, held = api._models.parts_stepwise, trio.Event(), []

    async def first_held(*args: Any, **kw: Any) -> list[bytes]:
        if not held:
            held.append(True)
            await release.wait()
        return await real(*args, **kw)

    api._models.parts_stepwise = first_held  # type: ignore[method-assign]
    got: list[tuple[bytes, ...]] = []

    async def read() -> None:
        got.append(await api.models_chunks(False))

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(read)
            await trio.testing.wait_all_tasks_blocked()  # (the first build is held)
            second = await api.models_chunks(False)
            assert not got  # (answered while the first is still held)
            release.set()
    assert len(got) == 1 and got[0] == second and b'"m4"' in b"".join(second)


async def test_at_a_buckets_turn_a_reader_answers_the_listing_another_reader_rebuilds(
        autojump_clock) -> None:
    """While one reader builds the next age bucket of a listing, another reader of the same
    listing answers the body it has at once (its ages one bucket older), never waiting and
    not building the same bytes again; a reader of a listing that changed builds its own."""
    from nvpair.http.api import AGE_RESOLUTION_S

    board = board_with(*(engine(f"e{i}", "ready", (f"m{i}",)) for i in range(5)))
    api = Api(board, node="n1")
    real, release, builds = api._models.parts_stepwise, trio.Event(), []

    async def counted(*args: Any, **kw: Any) -> list[bytes]:
        builds.append(trio.current_time())
        if len(builds) == 2:  # (the build of the next bucket is held)
            await release.wait()
        return await real(*args, **kw)

    api._models.parts_stepwise = counted  # type: ignore[method-assign]
    first = await api.models_chunks(False)
    await trio.sleep(AGE_RESOLUTION_S)  # (the bucket turns)
    got: list[tuple[bytes, ...]] = []

    async def read() -> None:
        got.append(await api.models_chunks(False))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(read)
        await trio.testing.wait_all_tasks_blocked()  # (the next bucket's build is held)
        start = trio.current_time()
        assert await api.models_chunks(False) is first  # (at once, and no third build)
        assert trio.current_time() == start and len(builds) == 2
        board.update("e4", lambda e: msgspec.structs.replace(e, state="down"))
        changed = await api.models_chunks(False)  # (a new listing: built, not the old body)
        assert len(builds) == 3 and b'"m4"' not in b"".join(changed)
        release.set()
    assert len(got) == 1  # (the held build answered too; the newer listing stays cached)
    assert b"".join(await api.models_chunks(False)) == b"".join(changed)


async def test_a_reader_of_a_listing_another_reader_builds_answers_the_newest_body(
        autojump_clock) -> None:
    """The listing changed and one reader builds it: another reader of that listing does
    not build the same bytes beside it, nor wait; it answers the newest whole body there is
    (the listing one build ago) at once, and once the build is done, the new listing."""
    board = board_with(*(engine(f"e{i}", "ready", (f"m{i}",)) for i in range(5)))
    api = Api(board, node="n1")
    real, release, builds = api._models.parts_stepwise, trio.Event(), []

    async def counted(*args: Any, **kw: Any) -> list[bytes]:
        builds.append(trio.current_time())
        if len(builds) == 2:  # (the build of the changed listing is held)
            await release.wait()
        return await real(*args, **kw)

    api._models.parts_stepwise = counted  # type: ignore[method-assign]
    before = await api.models_chunks(False)
    board.update("e4", lambda e: msgspec.structs.replace(e, state="down"))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(api.models_chunks, False)
        await trio.testing.wait_all_tasks_blocked()  # (its build is held)
        start = trio.current_time()
        assert await api.models_chunks(False) is before  # (at once, and no third build)
        assert trio.current_time() == start and len(builds) == 2
        release.set()
    after = b"".join(await api.models_chunks(False))
    assert len(builds) == 2 and b'"m3"' in after and b'"m4"' not in after


async def test_a_models_answer_built_across_checkpoints_is_of_the_version_it_took(
        autojump_clock) -> None:
    """The listing moves (a big engine unlisted) while a /v1/models build waits at a
    checkpoint: that answer is the listing it started from, whole, byte for byte; the
    next answer is the new listing (the old build does not take the cache's place)."""
    from tests.listing_oracle import models_doc

    from nvpair.http.asgi import encoder
    from nvpair.state.listing import catalog
    big = tuple(f"org/model-{i:05d}-" + "x" * 60 for i in range(3000))  # > 256 KiB
    board = board_with(engine("a", "ready", big), engine("b", "ready", ("m1",)),
                       engine("c", "ready", tuple(f"c/{m}" for m in big)))
    api = Api(board, node="n1")
    before = encoder.encode(models_doc(board.current, trio.current_time(), "n1"))

    class Between(trio.abc.Instrument):
        """After the reader's first step (it ended at the checkpoint after "a")."""

        reader: trio.lowlevel.Task | None = None
        done = False

        def after_task_step(self, task: trio.lowlevel.Task) -> None:
            if task is self.reader and not self.done:
                self.done = True
                board.update("c", lambda e: msgspec.structs.replace(e, state="down"))
                catalog(board, trio.current_time())  # (the advertiser's look meanwhile)

    between = Between()
    between.reader = trio.lowlevel.current_task()
    trio.lowlevel.add_instrument(between)
    try:
        first = await api.models_chunks(False)
    finally:
        trio.lowlevel.remove_instrument(between)
    assert between.done and b"".join(first) == before
    after = encoder.encode(models_doc(board.current, trio.current_time(), "n1"))
    assert after != before and b"".join(await api.models_chunks(False)) == after


async def test_the_long_polls_seq_counts_every_change_its_answer_shows(autojump_clock) -> None:
    """A change on the board that the journal's task has not yet taken when the answer is
    made (the task is stepped by hand here, after it): the answer shows it, so its seq
    must count it, and a long-poll after that seq waits for the next change. Before, the
    answer carried the older seq, and the poll after it woke at once with nothing new (the
    flaky long-poll test's early wake, when the engine's models came in just before its
    first read)."""
    from nvpair.state.events import Journal

    board = board_with(engine("a", "ready", ("m",)))
    journal = Journal(board, node="n")
    api = Api(board, node="n", events=journal)
    async with client(api) as c:
        board.update("a", lambda e: msgspec.structs.replace(e, restarts=1))
        doc = (await c.get("/v1/engines")).json()
        assert doc["engines"][0]["restarts"] == 1
        journal.refresh(trio.current_time())  # the journal's task, late
        start = trio.current_time()
        again = (await c.get(f"/v1/engines?after={doc['seq']}&wait_s=5")).json()
        assert trio.current_time() - start == pytest.approx(5)
        assert again["seq"] == doc["seq"]
