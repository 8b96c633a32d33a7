"""GET /v1/groups from a group's status, the error in words, and a POST on a rank passed
on to the head (httpx2.MockTransport stands for the head)."""

from __future__ import annotations

import json
from typing import Any

import httpx2
import pytest
import trio

from nvpair.http.groups import GroupsView, doc, error_words
from nvpair.state.group import EpochRecord, Head, Member, Report
from nvpair.supervision.group import Status

RANKS = ("a", "b", "c")


def head_status(h: Head, **kw: Any) -> Status:
    members = (Member(1, "b", "ready", h.epoch), Member(2, "c", "stopped", h.epoch))
    return Status(name="g", node="a", rank=0, role="head", ranks=RANKS, head=h,
                  members=members, head_proc="ready",
                  detail=((0, 1.0, 10, None, None), (1, 2.0, 11, None, None),
                          (2, 3.0, None, "was killed by SIGKILL", -9)), **kw)


def test_the_error_says_what_ended_the_epoch_and_when_it_restarts() -> None:
    h = Head(epoch=8, state="restarting", since=100.0, reason="rank 2 (c) was killed by "
             "SIGKILL", next_start_at=140.0,
             history=(EpochRecord(7, 10.0, 100.0, "rank 2 (c) was killed by SIGKILL"),))
    s = head_status(h)
    assert error_words(s, 102.0) == ("rank 2 (c) was killed by SIGKILL at epoch 7; "
                                     "restarting in 38 s")
    d = doc(s, 102.0, "/logs")
    assert (d["state"], d["epoch"], d["ranks_ready"], d["restart_in_s"]) == (
        "restarting", 8, 1, 38.0)
    assert [r["state"] for r in d["ranks"]] == ["ready", "ready", "stopped"]
    assert d["ranks"][2] == {"rank": 2, "node": "c", "state": "stopped", "state_age_s": 3.0,
                             "pid": None, "exit_code": -9, "exit": "was killed by SIGKILL",
                             "memory_bytes": None}
    assert d["history"][0]["log_file"] == "/logs/g.e7.log"
    assert d["history"][0]["ended_at"] - d["history"][0]["started_at"] == pytest.approx(90)


def test_a_ready_group_has_no_error_and_a_fenced_rank_says_so() -> None:
    assert error_words(head_status(Head(epoch=3, state="ready")), 5.0) is None
    rank = Status(name="g", node="c", rank=2, role="rank", ranks=RANKS,
                  report=Report(name="g", rank=2, epoch=3, state="fenced"),
                  head_report=Report(name="g", rank=0, epoch=3, state="ready", ranks_ready=2))
    assert error_words(rank, 5.0) == "rank 2 (c) fenced itself: no word from the head"
    d = doc(rank, 5.0)
    assert (d["state"], d["epoch"], d["ranks_ready"]) == ("ready", 3, 2)


class Source:
    def __init__(self, status: Status) -> None:
        self.s = status
        self.asked: list[str] = []

    def names(self) -> list[str]:
        return ["g"]

    def status(self, name: str, now: float) -> Status | None:
        return self.s if name == "g" else None

    def request(self, name: str, action: str) -> str | None:
        self.asked.append(action)
        return None

    def head_url(self, name: str) -> str | None:
        return "http://head.example:14322"

    def hold(self, name: str, held: bool) -> str | None:
        self.asked.append(f"hold {held}")
        return "this node is the head" if self.s.rank == 0 else None


async def call(view: GroupsView, method: str, path: str) -> tuple[int, Any]:
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    path, _, query = path.partition("?")
    await view({"type": "http", "method": method, "path": path, "headers": [],
                "query_string": query.encode()}, receive, send)
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return sent[0]["status"], json.loads(body)


async def test_reads_and_requests_on_the_head() -> None:
    source = Source(head_status(Head(epoch=3, state="ready")))
    view = GroupsView(source, "a", "cluster-secret")
    status, body = await call(view, "GET", "/v1/groups")
    assert status == 200 and [g["name"] for g in body["groups"]] == ["g"]
    assert (await call(view, "GET", "/v1/groups/zz"))[0] == 404
    assert (await call(view, "POST", "/v1/groups/g"))[0] == 405
    assert (await call(view, "GET", "/v1/groups/g/restart"))[0] == 405
    assert (await call(view, "POST", "/v1/groups/g/explode"))[0] == 404
    status, body = await call(view, "POST", "/v1/groups/g/restart")
    assert status == 202 and body["node"] == "a" and source.asked == ["restart"]


async def test_a_post_on_a_rank_goes_to_the_head_with_the_cluster_token() -> None:
    seen: list[httpx2.Request] = []

    def head(request: httpx2.Request) -> httpx2.Response:
        seen.append(request)
        return httpx2.Response(202, json={"group": "g", "action": "stop", "node": "a"})

    rank = Status(name="g", node="c", rank=2, role="rank", ranks=RANKS)
    view = GroupsView(Source(rank), "c", "cluster-secret",
                      transport=lambda: httpx2.MockTransport(head))
    with trio.fail_after(5):
        status, body = await call(view, "POST", "/v1/groups/g/stop")
    assert status == 202 and body["node"] == "a"
    assert str(seen[0].url) == "http://head.example:14322/v1/groups/g/stop"
    assert seen[0].headers["authorization"] == "Bearer cluster-secret"
    assert seen[0].headers["x-nvpair-forwarded-by"] == "c"


async def test_a_wrong_method_names_the_right_one_in_allow() -> None:
    """RFC 9110 15.5.6: a 405 has Allow (the live OpenAPI test covers the other routes; a
    node there has no groups)."""
    view = GroupsView(Source(head_status(Head(epoch=3, state="ready"))), "a", "cluster-secret")
    for method, path, allowed in (("POST", "/v1/groups", b"GET"),
                                  ("POST", "/v1/groups/g", b"GET"),
                                  ("GET", "/v1/groups/g/restart", b"POST")):
        sent: list[dict[str, Any]] = []

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message: dict[str, Any], sent: list[dict[str, Any]] = sent) -> None:
            sent.append(message)

        await view({"type": "http", "method": method, "path": path, "headers": []},
                   receive, send)
        assert sent[0]["status"] == 405
        assert (b"allow", allowed) in sent[0]["headers"], (method, path)


async def test_here_is_a_ranks_own_stop_or_start_never_passed_on() -> None:
    """``?here=1`` (what nvpair stop-engines asks of a rank's nvpair): the rank holds its
    own process stopped, or runs again; the head refuses it, and restart is the group's."""
    def head(request: httpx2.Request) -> httpx2.Response:
        raise AssertionError(f"passed on to the head: {request.url}")

    source = Source(Status(name="g", node="c", rank=2, role="rank", ranks=RANKS))
    view = GroupsView(source, "c", "cluster-secret",
                      transport=lambda: httpx2.MockTransport(head))
    status, body = await call(view, "POST", "/v1/groups/g/stop?here=1")
    assert status == 202 and body["here"] is True and body["node"] == "c"
    status, body = await call(view, "POST", "/v1/groups/g/start?here=1")
    assert status == 202 and source.asked == ["hold True", "hold False"]
    status, body = await call(view, "POST", "/v1/groups/g/restart?here=1")
    assert status == 400 and "restart is the group's" in body["error"]["message"]
    on_head = Source(head_status(Head(epoch=3, state="ready")))
    status, body = await call(GroupsView(on_head, "a", "t"), "POST", "/v1/groups/g/stop?here=1")
    assert status == 409 and body["error"]["message"] == "this node is the head"
    assert on_head.asked == ["hold True"]
