"""The API's controller: a runner's domain results (Accepted, Busy) as 202 and 409, over
the API in-process (ASGI), with runners that are not running (a request only records what
is wanted)."""

from __future__ import annotations

import httpx2
import trio
from tests.fakes import engine_spec

from nvpair.http.api import Api
from nvpair.http.control import ADOPTED_NOTE, Control
from nvpair.http.views import engine_status
from nvpair.state.snapshot import Board
from nvpair.state.transitions import initial_state
from nvpair.supervision.lifecycle import EngineRunner


def _setup(**spec_kw: object) -> tuple[Api, Control]:
    spec = engine_spec("vllm", name="e", **spec_kw)
    board = Board((initial_state(spec),))
    control = Control({"e": EngineRunner(spec, board, None, None)}, board, "node-1")
    return Api(board, node="node-1", controller=control), control


def _client(api: Api) -> httpx2.AsyncClient:
    return httpx2.AsyncClient(transport=httpx2.ASGITransport(app=api),
                              base_url="http://127.0.0.1:14322")


async def test_accepted_is_202_with_the_engines_status_and_the_operation() -> None:
    api, _ = _setup(managed=True, model="m", command=["srv"])
    async with _client(api) as c:
        r = await c.post("/v1/engines/e/stop")
        status = await c.get("/v1/engines/e")
    assert r.status_code == 202
    doc = r.json()
    assert doc.pop("operation") == "stopping"
    assert doc["node"] == "node-1" and doc["name"] == "e" and "note" not in doc
    expected = status.json()
    for age in ("since_age_s", "checked_age_s", "state_age_s"):  # read a moment apart
        doc.pop(age, None)
        expected.pop(age, None)
    assert doc == expected  # the same status object as GET /v1/engines/e


async def test_busy_is_409_engine_busy_with_the_reason() -> None:
    api, _ = _setup(managed=True, model="m", command=["srv"])
    async with _client(api) as c:
        assert (await c.post("/v1/engines/e/stop")).status_code == 202
        start = await c.post("/v1/engines/e/start")  # while the stop is in progress
        restart = await c.post("/v1/engines/e/restart")
        again = await c.post("/v1/engines/e/stop")  # a repeat is accepted
    for r in (start, restart):
        assert r.status_code == 409
        assert r.json() == {"error": {
            "message": "engine e is stopping; start it once it has stopped",
            "type": "conflict_error", "code": "engine_busy", "param": None}}
    assert again.status_code == 202 and again.json()["operation"] == "stopping"


async def test_an_adopted_engine_says_it_is_never_signalled() -> None:
    api, control = _setup(managed=False)
    async with _client(api) as c:
        r = await c.post("/v1/engines/e/restart")
        logs = await c.get("/v1/engines/e/logs")
    assert r.status_code == 202 and r.json()["note"] == ADOPTED_NOTE
    assert r.json()["operation"] == "restarting"
    assert logs.status_code == 404 and control.log("e") is None  # no process, no log


async def test_a_repeat_with_nothing_to_do_names_the_action(autojump_clock) -> None:
    """Start while it runs: accepted, nothing to do; the answer says the action (on the
    autojump clock: the state's age is the same millisecond in the answer as here)."""
    _, control = _setup(managed=True, model="m", command=["srv"])
    status, doc = await control.command("e", "start")
    snap = control.board.current
    e = snap.engine("e")
    assert e is not None
    assert status == 202 and doc == {**engine_status(e, snap, trio.current_time(), "node-1"),
                                     "operation": "start"}
    assert control.log("e") is control.runners["e"].log is not None
    assert control.log("nope") is None
