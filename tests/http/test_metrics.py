"""/metrics: the exposition from a hand-built snapshot and counters, checked line by line,
by ``promtool check metrics`` when it is installed, and through the API (token, counts)."""

from __future__ import annotations

import re
import shutil
from typing import get_args

import httpx2
import msgspec
import pytest
import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st
from tests.managed import wait_state

from nvpair import service
from nvpair.base.histogram import SWEEP_BUCKETS_S, Histogram
from nvpair.config.settings import load_settings
from nvpair.http.api import Api, route_label
from nvpair.http.asgi import Mount
from nvpair.http.metrics import ENGINE_STATES, PEER_STATES, Metrics, escape, number
from nvpair.peers.table import PeerState
from nvpair.sim import SimOptions, serve_sim
from nvpair.state.snapshot import Board, EngineState, Identity, Model, ProbeStats, State
from nvpair.state.traffic import Traffic

SAMPLE = re.compile(r'^([a-zA-Z_][a-zA-Z0-9_]*)(?:\{(.*)\})? (\S+)$')
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)",?')


def unescape(value: str) -> str:
    return re.sub(r"\\(.)", lambda m: {"n": "\n"}.get(m.group(1), m.group(1)), value)


def samples(text: str) -> list[tuple[str, dict[str, str], str]]:
    """Every sample line as (name, labels, value); fails on a line of another shape."""
    out = []
    for line in text.removesuffix("\n").split("\n"):  # the format's lines: "\n" only
        if line.startswith("# HELP ") or line.startswith("# TYPE "):
            continue
        m = SAMPLE.match(line)
        assert m, line
        labels: dict[str, str] = {}
        raw = m.group(2) or ""
        pos = 0
        while pos < len(raw):
            lm = LABEL.match(raw, pos)
            assert lm, (line, raw[pos:])
            labels[lm.group(1)] = unescape(lm.group(2))
            pos = lm.end()
        out.append((m.group(1), labels, m.group(3)))
    return out


def value(text: str, name: str, **labels: str) -> str:
    found = [v for n, lb, v in samples(text) if n == name
             and all(lb.get(k) == want for k, want in labels.items())]
    assert len(found) == 1, (name, labels, found)
    return found[0]


def stats(requests: int, failures: int = 0, timeouts: int = 0) -> ProbeStats:
    return ProbeStats(path="/health", requests=requests, failures=failures, timeouts=timeouts,
                      latency_ms_total=2.5 * requests)


def engine(name: str, state: State = "ready", **kw: object) -> EngineState:
    return EngineState(name=name, kind="vllm", url="http://127.0.0.1:8000", managed=False,
                       state=state, **kw)  # type: ignore[arg-type]


class Peers:
    def __init__(self, states: dict[str, str]) -> None:
        self._states = states
        self.version = 1

    def states(self, now: float) -> dict[str, str]:
        return self._states


def test_the_state_lists_are_nvpairs() -> None:
    assert set(ENGINE_STATES) == set(get_args(State))
    assert set(PEER_STATES) == set(get_args(PeerState))


def full_metrics(now: float) -> Metrics:
    board = Board((
        engine("a", checked_at=now - 2.0, restarts=3,
               probes=(("health", stats(10, 3, 1)), ("models", stats(4)))),
        engine('we"ird\\na\nme', "unhealthy", probes=(("ready", stats(5, 5, 5)),)),
    ))
    traffic = Traffic()
    traffic.started("a")
    traffic.answered("a", 200, now - 0.3, now - 0.15)
    traffic.answered("a", 502, now - 0.01, None)
    sweep = Histogram(SWEEP_BUCKETS_S)
    sweep.observe(0.2)
    m = Metrics(board, traffic, node="n1", peers=Peers({"b": "fresh", "c": "gone"}),
                sweep=sweep, streams=lambda: 2, wall=lambda: 1_000_000.0)
    m.api[("/v1/models", 200)] = 7
    return m


async def test_every_family_with_its_values() -> None:
    now = trio.current_time()
    m = full_metrics(now)
    text = m.body().decode()
    assert value(text, "nvpair_build_info", node="n1") == "1"
    assert value(text, "nvpair_engine_up", engine="a") == "1"
    weird = 'we"ird\\na\nme'
    assert value(text, "nvpair_engine_up", engine=weird) == "0"
    assert value(text, "nvpair_engine_state", engine="a", state="ready", kind="vllm") == "1"
    assert value(text, "nvpair_engine_state", engine="a", state="down") == "0"
    assert value(text, "nvpair_engine_state", engine=weird, state="unhealthy") == "1"
    assert float(value(text, "nvpair_engine_last_ok_timestamp_seconds", engine="a")) == 999_998.0
    assert value(text, "nvpair_engine_restarts_total", engine="a") == "3"
    req = "nvpair_probe_requests_total"
    assert value(text, req, engine="a", probe="health", outcome="ok") == "7"
    assert value(text, req, engine="a", probe="health", outcome="error") == "2"
    assert value(text, req, engine="a", probe="health", outcome="timeout") == "1"
    assert value(text, req, engine="a", probe="models", outcome="ok") == "4"
    assert not [s for s in samples(text) if s[0] == req and s[1].get("probe") == "models"
                and s[1]["outcome"] != "ok"]  # no error nor timeout yet: no series
    assert value(text, req, engine=weird, probe="ready", outcome="timeout") == "5"
    assert value(text, "nvpair_probe_duration_seconds_count", kind="vllm", probe="health") == "10"
    assert float(value(text, "nvpair_probe_duration_seconds_sum", kind="vllm",
                       probe="health")) == 0.025
    assert value(text, "nvpair_sweep_duration_seconds_bucket", le="0.1") == "0"
    assert value(text, "nvpair_sweep_duration_seconds_bucket", le="0.25") == "1"
    assert value(text, "nvpair_sweep_duration_seconds_count") == "1"
    assert value(text, "nvpair_peer_state", peer="c", state="gone") == "1"
    assert value(text, "nvpair_peer_state", peer="c", state="fresh") == "0"
    assert value(text, "nvpair_router_requests_total", engine="a", code="502") == "1"
    assert value(text, "nvpair_router_in_flight", engine="a") == "1"
    assert value(text, "nvpair_router_in_flight", engine=weird) == "0"
    assert value(text, "nvpair_router_first_byte_seconds_count") == "1"
    assert value(text, "nvpair_router_first_byte_seconds_bucket", le="0.1") == "0"
    assert value(text, "nvpair_router_first_byte_seconds_bucket", le="0.25") == "1"
    assert value(text, "nvpair_router_request_duration_seconds_count") == "2"
    assert value(text, "nvpair_router_request_duration_seconds_bucket", le="+Inf") == "2"
    assert value(text, "nvpair_api_requests_total", route="/v1/models", code="200") == "7"
    assert value(text, "nvpair_events_streams") == "2"
    # each family once, its HELP and TYPE before its samples, names by the rules
    types = re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M)
    assert len(types) == len({n for n, _ in types})
    for name, kind in types:
        assert ":" not in name and name.startswith("nvpair_")
        assert name.endswith("_total") == (kind == "counter"), name
    assert text.endswith("\n")


async def test_the_gateway_gauges_name_each_engine_and_its_one_model() -> None:
    """Waiting (the board's queue) and running (the router's in-flight count) per engine,
    with its one model as a label (escaped), none for an engine that lists several; the
    queue-wait and activation histograms as observed."""
    one = engine("a", queued=3, models=(Model('org/m"7b'),))
    many = engine("b", models=(Model("x"), Model("y")))
    unread = engine("c", state="starting", identity=Identity(model="from-identity"))
    traffic = Traffic()
    traffic.started("a")
    traffic.started("b")
    traffic.started("b")
    traffic.queue_wait.observe(1.7)
    traffic.activation.observe(1.6)
    text = Metrics(Board((one, many, unread)), traffic, node="n").body().decode()
    model = 'org/m"7b'  # (read back unescaped)
    assert value(text, "nvpair_requests_waiting", engine="a", model=model) == "3"
    assert value(text, "nvpair_requests_running", engine="a", model=model) == "1"
    assert value(text, "nvpair_requests_waiting", engine="b", model="") == "0"
    assert value(text, "nvpair_requests_running", engine="b", model="") == "2"
    assert value(text, "nvpair_requests_running", engine="c", model="from-identity") == "0"
    assert value(text, "nvpair_router_queue_wait_seconds_bucket", le="2.5") == "1"
    assert value(text, "nvpair_router_queue_wait_seconds_bucket", le="1.0") == "0"
    assert value(text, "nvpair_router_activation_seconds_count") == "1"
    assert value(text, "nvpair_router_activation_seconds_bucket", le="2.5") == "1"


def series_per_engine(text: str, name: str) -> int:
    return sum(1 for _, labels, _ in samples(text) if labels.get("engine") == name)


async def test_about_twenty_series_per_engine() -> None:
    """A served engine shows 19 series; the most any engine shows is 12 + 3 per probe + 1 +
    one per status code the router sent for it (29 with four probes failing both ways and
    four codes): never one per model, request or error message. (The 2 of the gateway's
    gauges, waiting and running, carry the engine's one model as a label.)"""
    now = trio.current_time()
    text = full_metrics(now).body().decode()
    assert series_per_engine(text, "a") == 9 + 1 + 1 + 1 + 4 + 2 + 1 + 2  # 21 (9 states)
    # the worst an engine shows: every probe failed both ways, answers of four codes
    probes = tuple((p, stats(10, 5, 2)) for p in ("ready", "health", "identity", "models"))
    traffic = Traffic()
    for code in (200, 429, 502, 504):
        traffic.answered("x", code, now, now)
    text = Metrics(Board((engine("x", checked_at=now, probes=probes),)), traffic,
                   node="n").body().decode()
    assert series_per_engine(text, "x") == 31  # (9 states)
    # a managed engine: one more, the lines of its output dropped above the rate cap
    flooded = msgspec.structs.replace(engine("m"), managed=True, log_dropped=171_200)
    text = Metrics(Board((flooded,)), node="n").body().decode()
    assert value(text, "nvpair_engine_log_dropped_lines_total", engine="m") == "171200"
    assert series_per_engine(text, "m") == series_per_engine(
        Metrics(Board((engine("m"),)), node="n").body().decode(), "m") + 1


@given(st.text(max_size=40))
def test_label_values_read_back_as_written(text: str) -> None:
    line = f'm{{engine="{escape(text)}"}} 1'
    [(name, labels, v)] = samples(line)
    assert name == "m" and v == "1" and labels == {"engine": text}


@given(st.text(max_size=60))
def test_routes_are_a_bounded_set(path: str) -> None:
    mounts = [Mount(handler=None, paths=frozenset({"/v1/chat/completions"})),  # type: ignore[arg-type]
              Mount(handler=None, prefix="/v1/peers")]  # type: ignore[arg-type]
    label = route_label("/" + path, mounts)
    assert "\n" not in label
    assert (label in {"other", "/v1/models/{model}", "/v1/models/{model}/wake",
                      "/v1/engines/{name}", "/v1/peers*",
                      "/v1/chat/completions", "/healthz", "/metrics", "/v1/models",
                      "/v1/cluster/models", "/v1/engines", "/v1/events"}
            or label in {f"/v1/engines/{{name}}/{a}" for a in ("start", "stop", "restart",
                                                               "logs")}), label


def test_numbers() -> None:
    assert [number(x) for x in (3, 0.25, float("inf"), float("nan"), 1e-9)] == [
        "3", "0.25", "+Inf", "NaN", "1e-09"]


async def test_cached_per_version_and_second(autojump_clock: trio.testing.MockClock) -> None:
    board = Board((engine("a"),))
    m = Metrics(board, Traffic(), node="n")
    first = m.body()
    m.api[("/metrics", 200)] = 1
    assert m.body() is first  # the same second and snapshot: the cached body
    await trio.sleep(1.0)
    second = m.body()
    assert second is not first and b'route="/metrics",code="200"} 1' in second
    board.update("a", lambda e: msgspec.structs.replace(e, restarts=1))
    assert b'nvpair_engine_restarts_total{engine="a"} 1' in m.body()


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool is not installed (Debian: apt-get install prometheus)")
    return path


async def test_promtool_accepts_the_exposition() -> None:
    tool = promtool()
    body = full_metrics(trio.current_time()).body()
    with trio.fail_after(30):
        done = await trio.run_process([tool, "check", "metrics"], stdin=body,
                                      capture_stdout=True, capture_stderr=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert not done.stdout.strip() and not done.stderr.strip(), done.stdout + done.stderr


async def test_promtool_fails_on_a_broken_exposition() -> None:
    """The check above can fail: promtool refuses what a careless writer would send."""
    tool = promtool()
    bad = b"# TYPE nvpair_x counter\nnvpair_x{engine=\"a\nb\"} 1\n"
    with trio.fail_after(30):
        done = await trio.run_process([tool, "check", "metrics"], stdin=bad,
                                      capture_stdout=True, capture_stderr=True, check=False)
    assert done.returncode != 0


def client(api: Api) -> httpx2.AsyncClient:
    return httpx2.AsyncClient(transport=httpx2.ASGITransport(app=api),
                              base_url="http://127.0.0.1:14322")


async def test_the_route_behind_the_token_and_the_counts() -> None:
    board = Board((engine("a", checked_at=trio.current_time()),))
    api = Api(board, node="n", token="secret", metrics=Metrics(board, Traffic(), node="n"))
    async with client(api) as c:
        assert (await c.get("/metrics")).status_code == 401
        assert (await c.get("/healthz")).status_code == 200
        auth = {"authorization": "Bearer secret"}
        assert (await c.get("/v1/engines/a", headers=auth)).status_code == 200
        assert (await c.get("/v1/engines/nope", headers=auth)).status_code == 404
        assert (await c.post("/metrics", headers=auth)).status_code == 405
        assert (await c.get("/made/up/path", headers=auth)).status_code == 404
        r = await c.get("/metrics", headers=auth)
    assert r.status_code == 200
    assert r.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    text = r.text
    api_total = "nvpair_api_requests_total"
    assert value(text, api_total, route="/metrics", code="401") == "1"
    assert value(text, api_total, route="/metrics", code="405") == "1"
    assert value(text, api_total, route="/healthz", code="200") == "1"
    assert value(text, api_total, route="/v1/engines/{name}", code="200") == "1"
    assert value(text, api_total, route="/v1/engines/{name}", code="404") == "1"
    assert value(text, api_total, route="other", code="404") == "1"
    assert value(text, "nvpair_engine_up", engine="a") == "1"


async def test_without_metrics_the_route_is_not_found() -> None:
    async with client(Api(Board(()), node="n")) as c:
        assert (await c.get("/metrics")).status_code == 404


async def test_timestamps_follow_a_wall_clock_step() -> None:
    """Lines kept for an unchanged engine are rebuilt when the wall clock steps (NTP)."""
    now = trio.current_time()
    wall = [1_000_000.0]
    m = Metrics(Board((engine("a", checked_at=now - 2.0),)), node="n", wall=lambda: wall[0])
    snap = m.board.current
    assert b"} 999998.000\n" in m.render(snap, now, wall[0])
    assert b"} 999998.000\n" in m.render(snap, now, wall[0] + 0.001)  # jitter: kept
    assert b"} 1000058.000\n" in m.render(snap, now, wall[0] + 60.0)


async def test_a_running_nvpair_counts_a_routed_request(nursery, tmp_path) -> None:
    """Over real sockets: a chat completion through the router to a simulator shows in the
    router's counters and histograms, the API's counts and the sweep's durations."""
    sim = await nursery.start(serve_sim, SimOptions(kind="vllm", model="m"))
    conf = tmp_path / "nvpair.toml"
    conf.write_text(f"listen = '127.0.0.1:0'\n[[engines]]\nname = 'e'\nkind = 'vllm'\n"
                    f"port = {sim.port}\n")
    with trio.fail_after(30):
        running = await nursery.start(service.run, load_settings(str(conf)))
        await wait_state(running.board, "e", "ready", where=lambda e: bool(e.models))
        async with httpx2.AsyncClient(base_url=running.url) as c:
            r = await c.post("/v1/chat/completions", json={
                "model": "m", "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2})
            assert r.status_code == 200, r.text
            await trio.testing.wait_all_tasks_blocked(0.01)  # the listing's batch has ended
            assert running.sweep.durations.count >= 1
            text = (await c.get("/metrics")).text
    assert value(text, "nvpair_router_requests_total", engine="e", code="200") == "1"
    assert value(text, "nvpair_router_in_flight", engine="e") == "0"
    assert value(text, "nvpair_router_first_byte_seconds_count") == "1"
    assert value(text, "nvpair_router_request_duration_seconds_count") == "1"
    assert value(text, "nvpair_api_requests_total", route="/v1/chat/completions",
                 code="200") == "1"
    assert int(value(text, "nvpair_sweep_duration_seconds_count")) >= 1
    assert value(text, "nvpair_engine_up", engine="e") == "1"
    assert value(text, "nvpair_events_streams") == "0"
    assert int(value(text, "nvpair_probe_requests_total", engine="e", probe="models",
                     outcome="ok")) >= 1
