"""The API's keys: roles by the kind of route, model patterns, limits (under the autojump
clock), and token files read again when they change (real files, real clock)."""

import fnmatch
import logging
import os
from pathlib import Path

import httpx2
import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st
from tests.http.test_api import Recorder, board_with, client, engine

from nvpair.config.keys import KeySpec
from nvpair.http.api import Api
from nvpair.http.keys import Key, Keyring, route_kind

ADMIN = KeySpec(name="ops", path="", role="admin", token="t-ops")
USER = KeySpec(name="batch", path="", role="user", token="t-batch", models=("qwen*",))
READER = KeySpec(name="grafana", path="", role="reader", token="t-grafana")


def bearer(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


def api(recorder: Recorder) -> Api:
    board = board_with(engine("q", "ready", ("qwen3-8b",)), engine("g", "ready", ("gemma3",)))
    return Api(board, node="n", controller=recorder, keys=Keyring([ADMIN, USER, READER]))


async def test_a_reader_reads_but_cannot_stop_an_engine_nor_list_models() -> None:
    recorder = Recorder()
    async with client(api(recorder)) as c:
        stop = await c.post("/v1/engines/q/stop", headers=bearer("t-grafana"))
        engines = await c.get("/v1/engines", headers=bearer("t-grafana"))
        models = await c.get("/v1/models", headers=bearer("t-grafana"))
    assert stop.status_code == 403, stop.text
    assert stop.json()["error"]["type"] == "permission_error"
    assert stop.json()["error"]["code"] == "forbidden_role"
    assert "'grafana' (role reader)" in stop.json()["error"]["message"]
    assert recorder.commands == []
    assert engines.status_code == 200
    assert models.status_code == 403


async def test_a_user_cannot_stop_an_engine_and_an_admin_can() -> None:
    recorder = Recorder()
    async with client(api(recorder)) as c:
        user = await c.post("/v1/engines/q/stop", headers=bearer("t-batch"))
        status = await c.get("/v1/engines", headers=bearer("t-batch"))
        assert recorder.commands == []
        admin = await c.post("/v1/engines/q/stop", headers=bearer("t-ops"))
    assert user.status_code == 403 and status.status_code == 403
    assert admin.status_code == 202 and recorder.commands == [("q", "stop")]


async def test_a_control_route_added_later_needs_an_admin_without_more_code() -> None:
    """The role goes by the kind of route: any method but GET on a path that is not the
    router's is control, so a route this API does not know yet is refused to a reader and
    a user before it is looked up (an admin gets its 404)."""
    async with client(api(Recorder())) as c:
        for token in ("t-grafana", "t-batch"):
            r = await c.post("/v1/engines/q/hibernate", headers=bearer(token))
            assert r.status_code == 403, (token, r.text)
        assert (await c.post("/v1/engines/q/hibernate", headers=bearer("t-ops"))).status_code == 404


@pytest.mark.parametrize(("method", "path", "routed", "kind"), [
    ("GET", "/v1/engines", False, "read"), ("GET", "/metrics", False, "read"),
    ("GET", "/v1/events", False, "read"), ("HEAD", "/v1/history", False, "read"),
    ("GET", "/v1/models", False, "use"), ("GET", "/v1/cluster/models", False, "use"),
    ("GET", "/v1/models/org/x", False, "use"), ("POST", "/v1/chat/completions", True, "use"),
    ("POST", "/v1/engines/x/stop", False, "control"), ("POST", "/v1/groups/g/stop", False,
                                                       "control"),
    ("POST", "/v1/engines/x/wake", False, "control"), ("DELETE", "/v1/engines", False,
                                                       "control"),
    ("POST", "/v1/models/org/x/wake", False, "control"),  # (a model's wake: an admin's)
    ("GET", "/v1/models/org/wake", False, "use"),  # (retrieves the model org/wake)
])
def test_route_kinds(method: str, path: str, routed: bool, kind: str) -> None:
    assert route_kind(method, path, routed) == kind


async def test_model_patterns_hide_other_models_from_the_keys_list() -> None:
    async with client(api(Recorder())) as c:
        mine = await c.get("/v1/models", headers=bearer("t-batch"))
        cluster = await c.get("/v1/models?scope=cluster", headers=bearer("t-batch"))
        every = await c.get("/v1/models", headers=bearer("t-ops"))
        hidden = await c.get("/v1/models/gemma3", headers=bearer("t-batch"))
        shown = await c.get("/v1/models/qwen3-8b", headers=bearer("t-batch"))
    assert [m["id"] for m in mine.json()["data"]] == ["qwen3-8b"]
    assert [m["id"] for m in cluster.json()["data"]] == ["qwen3-8b"]
    assert {m["id"] for m in every.json()["data"]} == {"qwen3-8b", "gemma3"}
    assert mine.json()["data"][0] == every.json()["data"][0]  # the same item, as listed
    assert hidden.status_code == 404 and hidden.json()["error"]["code"] == "model_not_found"
    assert shown.status_code == 200 and shown.json()["id"] == "qwen3-8b"


@pytest.mark.parametrize("headers", [{}, bearer("t-nope"), bearer("t-ops "),
                                     {"authorization": "Basic t-ops"}])
async def test_a_wrong_or_missing_token_is_401(headers: dict[str, str]) -> None:
    async with client(api(Recorder())) as c:
        r = await c.get("/v1/engines", headers=headers)
    assert r.status_code == 401
    assert r.headers["www-authenticate"] == "Bearer"
    assert r.json()["error"]["code"] == "invalid_api_key"


async def test_requests_per_minute_refuses_at_the_limit_and_not_before(autojump_clock) -> None:
    key = Key(KeySpec(name="k", path="", role="user", token="t", requests_per_minute=600))
    for _ in range(600):  # a full bucket: the whole minute's requests at once
        assert key.admit("m", trio.current_time()) is None
        key.release()
    refusal = key.admit("m", trio.current_time())
    assert refusal is not None and refusal.status == 429
    assert refusal.code == "rate_limit_exceeded"
    assert refusal.headers == [(b"retry-after", b"1")]  # one comes back every 0.1 s
    await trio.sleep(0.09)
    assert key.admit("m", trio.current_time()) is not None  # not yet
    await trio.sleep(0.02)
    assert key.admit("m", trio.current_time()) is None
    key.release()
    await trio.sleep(3600)  # full again, never above it
    assert all(key.admit("m", trio.current_time()) is None for _ in range(600))
    assert key.admit("m", trio.current_time()) is not None
    assert key.rejected == {"rate": 3} and key.requests == 1201


async def test_a_slow_rate_says_when_to_come_back(autojump_clock) -> None:
    key = Key(KeySpec(name="k", path="", role="user", token="t", requests_per_minute=2))
    assert key.admit("m", trio.current_time()) is None
    assert key.admit("m", trio.current_time()) is None
    refusal = key.admit("m", trio.current_time())
    assert refusal is not None and refusal.headers == [(b"retry-after", b"30")]
    await trio.sleep(29.9)
    assert key.admit("m", trio.current_time()) is not None
    await trio.sleep(0.2)
    assert key.admit("m", trio.current_time()) is None


def test_max_in_flight_refuses_at_the_limit_and_not_before() -> None:
    key = Key(KeySpec(name="k", path="", role="user", token="t", max_in_flight=2,
                      models=("qwen*",)))
    assert key.admit("qwen-a", 0.0) is None
    assert key.admit("qwen-b", 0.0) is None
    refusal = key.admit("qwen-a", 0.0)
    assert refusal is not None and (refusal.status, refusal.code) == (429,
                                                                      "rate_limit_exceeded")
    assert refusal.headers == [(b"retry-after", b"1")]
    other = key.admit("gemma", 0.0)  # outside its patterns: 404, whatever its limits
    assert other is not None and other.status == 404
    key.release()
    assert key.admit("qwen-a", 0.0) is None
    assert key.in_flight == 2 and key.rejected == {"in_flight": 1, "model": 1}


@given(globs=st.lists(st.text(alphabet="ab*?[]!-.", min_size=1, max_size=6), min_size=1,
                      max_size=3),
       model=st.text(alphabet="ab-.[]!", max_size=8))
def test_patterns_match_as_fnmatch_does(globs: list[str], model: str) -> None:
    key = Key(KeySpec(name="k", path="", role="user", token="t", models=tuple(globs)))
    assert key.sees(model) == any(fnmatch.fnmatchcase(model, g) for g in globs)
    assert key.sees(model) == key.sees(model)  # (the memo answers the same)


def token_file(tmp: Path, name: str, token: str) -> Path:
    path = tmp / name
    path.write_text(token + "\n")
    path.chmod(0o600)
    return path


async def until(keys: Keyring, token: bytes, name: str | None) -> None:
    """Wait until ``token`` is key ``name``'s (None: no key's). A file edited in place is
    empty for a moment, which a look may catch: a change of its own, then this one."""
    def found() -> str | None:
        key = keys.identify(token)
        return None if key is None else key.name

    with trio.fail_after(10):
        while found() != name:
            await keys.changes.wait_changed(keys.changes.version)


async def test_a_token_is_rotated_by_editing_its_file(nursery, tmp_path: Path,
                                                      caplog) -> None:
    a = token_file(tmp_path, "a", "old-a")
    b = token_file(tmp_path, "b", "tok-b")
    keys = Keyring([KeySpec(name="a", path=str(a), role="user", token="old-a"),
                    KeySpec(name="b", path=str(b), role="reader", token="tok-b")])
    caplog.set_level(logging.INFO, "nvpair.keys")
    await nursery.start(keys.watch)
    assert keys.identify(b"old-a") is keys.by_name["a"]
    a.write_text("new-a\n")  # edited in place
    await until(keys, b"new-a", "a")
    assert keys.identify(b"old-a") is None
    assert keys.identify(b"tok-b") is keys.by_name["b"]
    fresh = token_file(tmp_path, "a.tmp", "newer-a")
    os.replace(fresh, a)  # replaced, as an editor or a secrets agent does
    await until(keys, b"newer-a", "a")
    a.unlink()  # removed: the key is refused until the file is back
    await until(keys, b"newer-a", None)
    assert keys.by_name["a"].doc()["refused"]
    token_file(tmp_path, "a", "tok-b")  # back, but with b's token: both refused
    await until(keys, b"tok-b", None)
    a.write_text("final-a\n")
    await until(keys, b"final-a", "a")
    assert keys.identify(b"tok-b") is keys.by_name["b"]
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "key 'a': its token_file changed" in logged
    assert "refused until its token_file can be read" in logged
    assert "holds another key's token: both are refused" in logged
    for token in ("old-a", "new-a", "newer-a", "final-a", "tok-b"):
        assert token not in logged


async def test_the_old_token_file_is_one_admin_key() -> None:
    recorder = Recorder()
    board = board_with(engine("q", "ready", ("m",)))
    async with client(Api(board, node="n", controller=recorder, token="s3cret")) as c:
        r = await c.post("/v1/engines/q/stop", headers=bearer("s3cret"))
        models = await c.get("/v1/models", headers=bearer("s3cret"))
    assert r.status_code == 202 and recorder.commands == [("q", "stop")]
    assert models.status_code == 200


async def test_a_keys_counters_are_in_the_router_view() -> None:
    from nvpair.router.counters import TrafficView
    from nvpair.state.traffic import Traffic

    keys = Keyring([ADMIN, USER])
    keys.by_name["batch"].admit("gemma", 0.0)
    view = TrafficView(Traffic(), keys)
    async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=view),
                                  base_url="http://x") as c:
        doc = (await c.get("/v1/router")).json()
    assert doc["keys"]["batch"]["rejected"] == {"model": 1}
    assert doc["keys"]["batch"]["models"] == ["qwen*"] and doc["keys"]["ops"]["role"] == "admin"
    assert "t-batch" not in str(doc)
