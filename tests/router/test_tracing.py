"""Traces of routed requests, end to end: nvpair exports to a real OTLP/HTTP receiver on
127.0.0.1 (``tests.otlp_receiver``, decoding with opentelemetry-proto), and the span tree
of each kind of request is read back from what it received."""

from __future__ import annotations

import re

import httpx2
import msgspec
import trio
from opentelemetry.proto.trace.v1.trace_pb2 import Span
from tests.managed import sim_command, wait_state
from tests.otlp_receiver import Receiver, attrs, tree
from tests.router.script_engine import JSON, ScriptEngine, json_script, sse_script
from tests.router.test_activation import GB, on_demand, payload
from tests.router.test_multimodel import FAST, models_dir
from tests.router.test_multimodel import chat as multi_chat
from tests.router.test_peer_routing import chat, two_nodes
from tests.router.test_relay import CHAT, body, start
from tests.test_sleep import FAST as SLEEP_FAST

from nvpair import service
from nvpair.base.traceparent import parse
from nvpair.config.settings import Settings, TracingSettings, load_settings
from nvpair.sim import SimOptions, serve_sim

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def traced(settings: Settings, receiver: Receiver, **kw: object) -> Settings:
    tracing = TracingSettings(endpoint=receiver.url, sample_ratio=1.0, service_name="nvpair",
                              timeout_s=10.0)
    return msgspec.structs.replace(settings, tracing=msgspec.structs.replace(tracing, **kw))


def tracing_toml(receiver: Receiver) -> str:
    return f"[tracing]\notlp_endpoint = '{receiver.url}'\n"


def servers(spans: list[Span]) -> list[Span]:
    return [s for s in spans if s.kind == s.SPAN_KIND_SERVER]


def children(spans: list[Span], parent: Span) -> dict[str, list[Span]]:
    out: dict[str, list[Span]] = {}
    for s in spans:
        if s.parent_span_id == parent.span_id and s.trace_id == parent.trace_id:
            out.setdefault(s.name, []).append(s)
    return out


def within(child: Span, parent: Span) -> bool:
    return (parent.start_time_unix_nano <= child.start_time_unix_nano
            <= child.end_time_unix_nano <= parent.end_time_unix_nano)


async def test_a_streamed_request_is_one_trace_whose_upstream_span_the_engine_sees(
        nursery, tmp_path) -> None:
    receiver = Receiver()
    await nursery.start(receiver.serve)
    eng = ScriptEngine("m")
    eng.script = lambda path, raw: sse_script(5, model="m")
    with trio.fail_after(30):
        running = await start(nursery, tmp_path, {"e": eng}, top=tracing_toml(receiver))
        async with httpx2.AsyncClient(headers=JSON, base_url=running.url) as client:
            r = await client.post(CHAT, content=body(stream=True))
        spans = await receiver.wait_for(lambda s: len(servers(s)) == 1)
    assert r.status_code == 200
    [server] = servers(spans)
    assert not server.parent_span_id  # (no traceparent came: a trace of its own)
    a = attrs(server)
    assert a["gen_ai.request.model"] == "m" and a["gen_ai.operation.name"] == "chat"
    assert a["http.route"] == CHAT and a["http.response.status_code"] == 200
    assert a["nvpair.streaming"] is True and a["nvpair.engine"] == "e"
    assert a["nvpair.request_id"] == r.headers["x-request-id"]
    assert a["nvpair.response.bytes"] == len(r.content)
    assert isinstance(a["nvpair.first_chunk_ms"], int)
    [upstream] = children(spans, server)["upstream"]
    assert upstream.kind == upstream.SPAN_KIND_CLIENT and within(upstream, server)
    assert attrs(upstream) == {"nvpair.engine": "e", "http.response.status_code": 200}
    # the engine got nvpair's own traceparent: this trace, the upstream span as its parent
    sent = parse(eng.requests[0][2]["traceparent"].encode())
    assert sent is not None and sent.sampled
    assert (sent.trace_id, sent.parent_id) == (server.trace_id, upstream.span_id)
    assert receiver.resources[0]["service.name"] == "nvpair"


async def test_an_incoming_traceparent_is_continued_and_a_bad_one_is_not(
        nursery, tmp_path) -> None:
    receiver = Receiver()
    await nursery.start(receiver.serve)
    eng = ScriptEngine("m")
    eng.script = lambda path, raw: json_script({"ok": 1})
    with trio.fail_after(30):
        running = await start(nursery, tmp_path, {"e": eng}, top=tracing_toml(receiver))
        async with httpx2.AsyncClient(headers=JSON, base_url=running.url) as client:
            given = await client.post(CHAT, content=body(), headers={"traceparent": TRACEPARENT})
            bad = await client.post(CHAT, content=body(), headers={
                "traceparent": TRACEPARENT.replace("-01", "-01-more")})
            unsampled = await client.post(CHAT, content=body(), headers={
                "traceparent": TRACEPARENT.replace("-01", "-00")})
            last = await client.post(CHAT, content=body())  # (once it is in, all before are)
        spans = await receiver.wait_for(lambda s: any(
            attrs(x).get("nvpair.request_id") == last.headers["x-request-id"]
            for x in servers(s)))
    assert {given.status_code, bad.status_code, unsampled.status_code} == {200}
    by_id = {attrs(s)["nvpair.request_id"]: s for s in servers(spans)}
    assert unsampled.headers["x-request-id"] not in by_id  # the client said: not sampled
    continued = by_id[given.headers["x-request-id"]]
    assert continued.trace_id.hex() == TRACEPARENT.split("-")[1]
    assert continued.parent_span_id.hex() == TRACEPARENT.split("-")[2]
    fresh = by_id[bad.headers["x-request-id"]]
    assert fresh.trace_id.hex() != TRACEPARENT.split("-")[1] and not fresh.parent_span_id
    # the engine sees the same trace with nvpair's span as the parent; unsampled, the
    # client's own header passes untouched
    [upstream] = children(spans, continued)["upstream"]
    assert eng.requests[0][2]["traceparent"] == (
        f"00-{continued.trace_id.hex()}-{upstream.span_id.hex()}-01")
    assert eng.requests[2][2]["traceparent"] == TRACEPARENT.replace("-01", "-00")


async def test_a_request_routed_to_a_peer_is_one_trace_across_both_nodes(
        nursery, tmp_path) -> None:
    receiver = Receiver()
    await nursery.start(receiver.serve)
    with trio.fail_after(40):
        a, _, _, engine_b = await two_nodes(nursery, tmp_path,
                                                   top=tracing_toml(receiver))
        engine_b.script = lambda path, body: json_script({"answer": "from b"})
        async with httpx2.AsyncClient(base_url=a.url, headers={
                **JSON, "authorization": "Bearer user-token-of-a"}) as client:
            r = await client.post(CHAT, content=chat("m-b"))
        spans = await receiver.wait_for(lambda s: len(servers(s)) == 2)
    assert r.status_code == 200 and r.headers["x-nvpair-node"] == "b"
    [on_a] = [s for s in servers(spans) if attrs(s)["nvpair.node"] == "a"]
    [on_b] = [s for s in servers(spans) if attrs(s)["nvpair.node"] == "b"]
    [hop] = children(spans, on_a)["peer"]
    assert attrs(hop)["nvpair.peer"] == "b" and within(hop, on_a)
    assert on_b.trace_id == on_a.trace_id and on_b.parent_span_id == hop.span_id
    [upstream] = children(spans, on_b)["upstream"]
    assert attrs(upstream)["nvpair.engine"] == "e-b"
    sent = parse(engine_b.requests[-1][2]["traceparent"].encode())
    assert sent is not None and (sent.trace_id, sent.parent_id) == (on_a.trace_id,
                                                                    upstream.span_id)
    assert {r["service.instance.id"] for r in receiver.resources} == {"a", "b"}


async def test_a_cold_request_shows_its_queue_its_activation_and_the_eviction_it_caused(
        nursery, tmp_path) -> None:
    """a and b fit one at a time: a request for a starts a (queue, activation); then one for
    b waits while a is evicted and b starts (queue, activation, its eviction of a)."""
    receiver = Receiver()
    await nursery.start(receiver.serve)
    settings = traced(on_demand(
        tmp_path, {"a": sim_command("vllm", "--load-s", "0.3"),
                   "b": sim_command("vllm", "--load-s", "0.6")},
        activation=f"memory_budget_bytes = {10 * GB}", extra=f"memory_bytes = {6 * GB}",
        b="priority = 2"), receiver)
    with trio.fail_after(60):
        running = await nursery.start(service.run, settings)
        async with httpx2.AsyncClient(headers=JSON, base_url=running.url, timeout=30) as client:
            first = await client.post(CHAT, content=payload("model-a"))
            second = await client.post(CHAT, content=payload("model-b"))
        spans = await receiver.wait_for(lambda s: len(servers(s)) == 2)
        await wait_state(running.board, "a", "cold")
    assert first.status_code == 200 and second.status_code == 200, second.text
    by_id = {attrs(s)["nvpair.request_id"]: s for s in servers(spans)}
    for r, name, victims in ((first, "a", []), (second, "b", ["a"])):
        server = by_id[r.headers["x-request-id"]]
        kids = children(spans, server)
        assert sorted(kids) == ["activation", "queue", "upstream"], tree(spans)
        [queue], [activation], [upstream] = kids["queue"], kids["activation"], kids["upstream"]
        assert attrs(queue) == {"nvpair.engine": name, "nvpair.queue.position": 0,
                                "nvpair.engine.priority": 2 if name == "b" else 0}
        assert attrs(server)["nvpair.queue_ms"] == int(r.headers["x-nvpair-queue-ms"])
        a = attrs(activation)
        assert a["nvpair.engine"] == name and a["nvpair.activation"] == "start"
        load_s = 0.3 if name == "a" else 0.6
        assert load_s <= a["nvpair.engine.startup_s"] < 20  # type: ignore[operator]
        assert within(queue, server) and within(activation, server)
        assert upstream.start_time_unix_nano >= queue.end_time_unix_nano
        evictions = children(spans, activation).get("eviction", [])
        assert [attrs(e)["nvpair.engine"] for e in evictions] == victims
        for e in evictions:
            assert attrs(e)["nvpair.eviction.bytes"] == 6 * GB and within(e, activation)
    cold = by_id[second.headers["x-request-id"]]
    print(tree(receiver.trace(cold.trace_id)))  # (docs/observability.md shows it)


async def test_a_hung_collector_changes_nothing_and_its_spans_are_dropped_and_counted(
        nursery, tmp_path) -> None:
    receiver = Receiver(hang=True)
    await nursery.start(receiver.serve)
    eng = ScriptEngine("m")
    eng.script = lambda path, raw: json_script({"ok": 1})
    with trio.fail_after(40):
        running = await start(nursery, tmp_path, {"e": eng}, top=tracing_toml(receiver)
                              + "timeout_s = 1\n")
        assert running.spans is not None
        async with httpx2.AsyncClient(headers=JSON, base_url=running.url) as client:
            for _ in range(20):
                with trio.fail_after(2):  # (the engine answers at once; so does nvpair)
                    r = await client.post(CHAT, content=body())
                assert r.status_code == 200
            # the POST holding them fails after timeout_s: its spans are dropped, counted
            exporter = running.spans
            assert await trio.to_thread.run_sync(
                exporter.wait, lambda e: e.dropped >= 40, 10.0)
            text = (await client.get("/metrics")).text
    assert receiver.posts >= 1 and running.spans.exported == 0
    assert re.search(r"^nvpair_trace_spans_dropped_total (\d+)$", text, re.M)
    assert "nvpair_trace_spans_exported_total 0\n" in text


async def test_a_model_a_multi_model_engine_loads_shows_the_load_and_the_unload(
        nursery, tmp_path) -> None:
    """llama-server in router mode, one model at a time, loading nothing by itself: the
    request for beta shows nvpair's unload of idle alpha (an eviction) and beta's load."""
    receiver = Receiver()
    await nursery.start(receiver.serve)
    with trio.fail_after(30):
        sim = await nursery.start(serve_sim, SimOptions(
            kind="llamacpp", models_dir=models_dir(tmp_path, "alpha", "beta"), models_max=1,
            models_autoload=False, model_load_s=0.5))
        await sim.wait_phase("ready")
        path = tmp_path / "nvpair.toml"
        path.write_text(f"listen = '127.0.0.1:0'\n{tracing_toml(receiver)}[[engines]]\n"
                        f"name = 'r'\nkind = 'llamacpp'\nport = {sim.port}\n{FAST}")
        running = await nursery.start(service.run, load_settings(str(path)))
        await wait_state(running.board, "r", "ready", where=lambda e: len(e.models) == 2)
        async with httpx2.AsyncClient(base_url=running.url, headers=JSON, timeout=20) as client:
            first = await client.post(CHAT, content=multi_chat("alpha"))
            second = await client.post(CHAT, content=multi_chat("beta"))
        spans = await receiver.wait_for(lambda s: len(servers(s)) == 2)
    assert first.status_code == 200 and second.status_code == 200, second.text
    by_id = {attrs(s)["nvpair.request_id"]: s for s in servers(spans)}
    server = by_id[second.headers["x-request-id"]]
    kids = children(spans, server)
    assert sorted(kids) == ["activation", "eviction", "upstream"], tree(spans)
    assert attrs(kids["eviction"][0]) == {"nvpair.engine": "r", "nvpair.model": "alpha"}
    [load] = kids["activation"]
    assert attrs(load) == {"nvpair.engine": "r", "nvpair.activation": "load",
                           "nvpair.model": "beta"}
    assert load.end_time_unix_nano - load.start_time_unix_nano >= 0.5e9
    assert kids["upstream"][0].start_time_unix_nano >= load.end_time_unix_nano


async def test_a_request_that_wakes_a_sleeping_engine_shows_the_wake(
        nursery, tmp_path) -> None:
    """A sleeping vLLM answers 503 asleep: nvpair wakes it first, in a span of its own."""
    receiver = Receiver()
    await nursery.start(receiver.serve)
    sim = await nursery.start(serve_sim, SimOptions(
        kind="vllm", model="gemma", enable_sleep_mode=True, dev_mode=True, wake_s=0.3))
    await sim.wait_phase("ready")
    with trio.fail_after(30):
        path = tmp_path / "nvpair.toml"
        path.write_text(f"listen = '127.0.0.1:0'\n{tracing_toml(receiver)}[[engines]]\n"
                        f"name = 'e'\nkind = 'vllm'\nport = {sim.port}\nmodel = 'gemma'\n"
                        f"sleep = true\n{SLEEP_FAST}")
        running = await nursery.start(service.run, load_settings(str(path)))
        await wait_state(running.board, "e", "ready", where=lambda e: bool(e.models))
        async with httpx2.AsyncClient(base_url=running.url, headers=JSON, timeout=20) as client:
            assert (await client.post("/v1/engines/e/sleep")).status_code == 202
            await wait_state(running.board, "e", "sleeping")
            r = await client.post(CHAT, content=body("gemma"))
        spans = await receiver.wait_for(lambda s: len(servers(s)) == 1)
    assert r.status_code == 200, r.text
    [server] = servers(spans)
    kids = children(spans, server)
    assert sorted(kids) == ["upstream", "wake"], tree(spans)
    [wake] = kids["wake"]
    assert attrs(wake) == {"nvpair.engine": "e"} and wake.status.code == 0
    assert wake.end_time_unix_nano - wake.start_time_unix_nano >= 0.3e9
    assert kids["upstream"][0].start_time_unix_nano >= wake.end_time_unix_nano
