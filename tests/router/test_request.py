"""A routed request's id, its log lines, its access line and the gauges and histograms it
moves, over real sockets: scripted engines that record the headers they get, and managed
simulators that take a while to load."""

from __future__ import annotations

import io
import json
import logging
import re
from collections.abc import Iterator

import httpx2
import msgspec
import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st
from tests.managed import sim_command
from tests.router.script_engine import JSON, SSE_HEAD, ScriptEngine
from tests.router.test_activation import on_demand, payload, queued
from tests.router.test_relay import CHAT, body, start

from nvpair import service
from nvpair.base.logformat import ACCESS
from nvpair.cli.serve import setup_logging
from nvpair.config.settings import load_settings
from nvpair.router.request import ID_MAX, valid_id

HEX32 = re.compile(r"[0-9a-f]{32}")
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@given(st.binary(max_size=200))
def test_an_id_is_kept_only_when_short_and_printable(raw: bytes) -> None:
    kept = valid_id(raw)
    fits = 0 < len(raw) <= ID_MAX and all(0x21 <= b <= 0x7E for b in raw)
    assert (kept is not None) == fits
    if kept is not None:
        assert kept.encode() == raw


@given(st.text(min_size=1, max_size=ID_MAX, alphabet=st.characters(
    min_codepoint=0x21, max_codepoint=0x7E)))
def test_every_printable_ascii_id_up_to_the_cap_is_kept(text: str) -> None:
    assert valid_id(text.encode()) == text


async def test_the_id_is_echoed_sent_to_the_engine_and_a_bad_one_replaced(
        nursery, tmp_path) -> None:
    eng = ScriptEngine("m")
    with trio.fail_after(30):
        running = await start(nursery, tmp_path, {"e": eng})
        async with httpx2.AsyncClient(headers=JSON, base_url=running.url) as client:
            given_id = await client.post(CHAT, content=body(), headers={
                "x-request-id": "client-7f3a", "traceparent": TRACEPARENT,
                "tracestate": "vendor=opaque"})
            made = await client.post(CHAT, content=body())
            bad = {}
            for name, value in (("long", "x" * (ID_MAX + 1)), ("space", "a b"),
                                ("latin1", "caf\xe9".encode("latin-1"))):
                bad[name] = await client.post(CHAT, content=body(),
                                              headers={"x-request-id": value})
            missing = await client.post(CHAT, content=body("nope"),
                                        headers={"x-request-id": "lost-1"})
    assert given_id.status_code == 200
    assert given_id.headers["x-request-id"] == "client-7f3a"
    assert eng.requests[0][2]["x-request-id"] == "client-7f3a"
    # W3C trace context passes through untouched, so the engine's spans join the trace
    assert eng.requests[0][2]["traceparent"] == TRACEPARENT
    assert eng.requests[0][2]["tracestate"] == "vendor=opaque"
    assert HEX32.fullmatch(made.headers["x-request-id"])
    assert eng.requests[1][2]["x-request-id"] == made.headers["x-request-id"]
    for i, (name, r) in enumerate(bad.items(), start=2):
        assert r.status_code == 200, name
        assert HEX32.fullmatch(r.headers["x-request-id"]), name
        assert eng.requests[i][2]["x-request-id"] == r.headers["x-request-id"], name
    # an answer nvpair makes itself names the id in its body too
    assert missing.status_code == 404
    assert missing.headers["x-request-id"] == "lost-1"
    assert missing.json()["error"]["request_id"] == "lost-1"
    assert missing.json()["error"]["code"] == "model_not_found"
    assert "x-nvpair-queue-ms" not in given_id.headers  # (it did not wait)


@pytest.fixture
def logging_restored() -> Iterator[None]:
    """``setup_logging`` changes the process's loggers: put them back afterwards."""
    root, access = logging.getLogger(), logging.getLogger(ACCESS)
    saved = (root.handlers[:], root.level, access.handlers[:], access.level, access.propagate)
    yield
    for handler in {*root.handlers, *access.handlers} - {*saved[0], *saved[2]}:
        handler.close()
    root.handlers[:], access.handlers[:] = saved[0], saved[2]
    root.setLevel(saved[1])
    access.setLevel(saved[3])
    access.propagate = saved[4]
    logging.getLogger("nvpair.router").setLevel(logging.NOTSET)


async def test_json_log_lines_parse_and_carry_the_id_and_the_access_fields(
        nursery, tmp_path, logging_restored) -> None:
    eng = ScriptEngine("m")
    eng.script = lambda path, raw: [(0.0, SSE_HEAD), (0.05, b"data: {}\n\n"),
                                    (0.0, b"data: [DONE]\n\n")]
    out = io.StringIO()
    with trio.fail_after(30):
        running = await start(nursery, tmp_path, {"e": eng},
                              top="log_format = 'json'\naccess_log = true")
        setup_logging(load_settings(str(tmp_path / "nvpair.toml")), out)
        logging.getLogger("nvpair.router").setLevel(logging.DEBUG)
        async with httpx2.AsyncClient(headers=JSON, base_url=running.url) as client:
            good = await client.post(CHAT, content=body(stream=True),
                                     headers={"x-request-id": "req-1"})
            bad = await client.post(CHAT, content=body(), headers={"x-request-id": "a b"})
    lines = [json.loads(line) for line in out.getvalue().splitlines()]  # every line parses
    assert lines, "nothing logged"
    fields = {"time", "level", "logger", "engine", "request_id", "key", "event", "message"}
    assert all(fields <= line.keys() for line in lines), lines
    access = [line for line in lines if line["event"] == "access"]
    assert [a["request_id"] for a in access] == ["req-1", bad.headers["x-request-id"]]
    first = access[0]
    assert (first["method"], first["path"], first["model"], first["engine"], first["status"]) \
        == ("POST", CHAT, "m", "e", 200)
    assert first["bytes"] == len(good.content) > 0
    assert first["queue_ms"] is None
    assert 40 <= first["first_byte_ms"] <= first["total_ms"] < 5000, first
    assert first["level"] == "info" and first["logger"] == ACCESS
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", first["time"])
    # a line logged while the request is handled carries its id (the bad one: the new id)
    replaced = [line for line in lines if "x-request-id was not kept" in line["message"]]
    assert [line["request_id"] for line in replaced] == [bad.headers["x-request-id"]]
    assert replaced[0]["level"] == "debug"


async def test_the_access_log_file_has_one_text_line_per_routed_request(
        nursery, tmp_path, logging_restored) -> None:
    eng = ScriptEngine("m")
    with trio.fail_after(30):
        running = await start(nursery, tmp_path, {"e": eng}, top="access_log = 'access.log'")
        setup_logging(load_settings(str(tmp_path / "nvpair.toml")), io.StringIO())
        async with httpx2.AsyncClient(headers=JSON, base_url=running.url) as client:
            ok = await client.post(CHAT, content=body(), headers={"x-request-id": "r-1"})
            await client.get("/v1/models")  # (not routed: no line)
            await client.post(CHAT, content=body("nope"), headers={"x-request-id": "r-2"})
    lines = (tmp_path / "access.log").read_text().splitlines()
    assert len(lines) == 2, lines
    pairs = [dict(p.split("=", 1) for p in line.split(" ")[3:]) for line in lines]
    assert lines[0].split(" ")[2] == "access"
    assert pairs[0]["request_id"] == "r-1" and pairs[1]["request_id"] == "r-2"
    assert (pairs[0]["method"], pairs[0]["path"], pairs[0]["model"], pairs[0]["status"],
            pairs[0]["queue_ms"], pairs[0]["bytes"]) == (
        "POST", CHAT, "m", "200", "-", str(len(ok.content)))
    assert int(pairs[0]["first_byte_ms"]) <= int(pairs[0]["total_ms"])
    assert (pairs[1]["model"], pairs[1]["status"], pairs[1]["engine"]) == ("nope", "404", "-")


def sample(text: str, name: str, **labels: str) -> float | None:
    """The value of one series of an exposition (None: absent)."""
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        head, _, value = line.rpartition(" ")
        if head == name or (want and head == f"{name}{{{want}}}"):
            return float(value)
    return None


async def test_the_running_gauge_moves_with_a_request_in_flight(nursery, tmp_path) -> None:
    eng = ScriptEngine("m")
    eng.script = lambda path, raw: [(0.0, SSE_HEAD), (60.0, b"data: [DONE]\n\n")]
    with trio.fail_after(30):
        running = await start(nursery, tmp_path, {"e": eng})
        async with httpx2.AsyncClient(headers=JSON, base_url=running.url, timeout=30) as client:
            async def metric() -> float | None:
                text = (await client.get("/metrics")).text
                return sample(text, "nvpair_requests_running", engine="e", model="m")

            assert await metric() == 0
            async with trio.open_nursery() as n:
                n.start_soon(lambda: client.post(CHAT, content=body(stream=True)))
                # (no event: a scrape's body may be up to a second old, docs/metrics.md)
                while await metric() != 1:  # noqa: ASYNC110
                    await trio.sleep(0.05)
                n.cancel_scope.cancel()  # the client goes
            while await metric() != 0:  # noqa: ASYNC110
                await trio.sleep(0.05)


async def test_a_cold_start_is_in_the_histograms_the_gauge_and_the_queue_header(
        nursery, tmp_path, logging_restored) -> None:
    """The wait for an on-demand start is part of what the client waited: in the request
    duration and first-byte histograms (before: only the relay after it), and in
    histograms of its own; the waiting gauge shows it while it waits. The log line of the
    start names the request that caused it."""
    settings = on_demand(tmp_path, {"a": sim_command("vllm", "--load-s", "1.5")})
    out = io.StringIO()
    setup_logging(msgspec.structs.replace(settings, log_format="json"), out)
    with trio.fail_after(40):
        running = await nursery.start(service.run, settings)
        async with httpx2.AsyncClient(headers=JSON, base_url=running.url, timeout=30) as client:
            async def metrics() -> str:
                return (await client.get("/metrics")).text

            answer: list[httpx2.Response] = []

            async def ask() -> None:
                answer.append(await client.post(CHAT, content=payload("model-a")))

            async with trio.open_nursery() as n:
                n.start_soon(ask)
                await queued(running.board, "a", 1)  # (a new snapshot: a fresh body)
                waiting = await metrics()
            text = await metrics()
    assert sample(waiting, "nvpair_requests_waiting", engine="a", model="model-a") == 1
    [r] = answer
    assert r.status_code == 200
    waited_ms = int(r.headers["x-nvpair-queue-ms"])
    assert 1500 <= waited_ms < 30_000, waited_ms
    duration = sample(text, "nvpair_router_request_duration_seconds_sum")
    first_byte = sample(text, "nvpair_router_first_byte_seconds_sum")
    assert duration is not None and duration >= waited_ms / 1000, text
    assert first_byte is not None and first_byte >= waited_ms / 1000
    assert sample(text, "nvpair_router_queue_wait_seconds_count") == 1
    assert sample(text, "nvpair_router_queue_wait_seconds_sum") == pytest.approx(
        waited_ms / 1000, abs=0.002)
    assert sample(text, "nvpair_router_activation_seconds_count") == 1
    activation = sample(text, "nvpair_router_activation_seconds_sum")
    assert activation is not None and 1.5 <= activation <= waited_ms / 1000 + 0.002
    assert sample(text, "nvpair_requests_waiting", engine="a", model="model-a") == 0
    started = [line for line in map(json.loads, out.getvalue().splitlines())
               if line["message"] == "started a for a request (queued 1)"]
    assert [(line["engine"], line["request_id"]) for line in started] == [
        ("a", r.headers["x-request-id"])]
