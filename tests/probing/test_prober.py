"""The probe loops of one engine, with a fake engine and Trio's autojump clock; and
``run_probes``, which runs them each in its own fault boundary, enrolled in the sweep."""

import itertools
import logging
from functools import partial

import httpx2
import pytest
import trio
import trio.testing
from tests.fakes import FakeEngine, engine_spec, served, vllm_routes
from tests.managed import states_during, wait_state

from nvpair.probing.prober import ProbeMemory, run_probes
from nvpair.probing.probes import MAX_BODY
from nvpair.probing.sweep import Sweep
from nvpair.state.snapshot import Board
from nvpair.state.transitions import effective_state, initial_state


async def start(nursery: trio.Nursery, spec, fake: FakeEngine) -> Board:
    """``spec``'s probes of ``fake``, served on 127.0.0.1 (as production probes: a probe
    slower than 4 s on a connection of its own)."""
    spec = await served(nursery, fake, spec)
    board = Board((initial_state(spec),))
    await nursery.start(lambda task_status: run_probes(spec, board, task_status=task_status))
    return board


async def test_ready_then_health_at_the_manifest_rate(nursery, autojump_clock) -> None:
    spec = engine_spec("vllm")
    fake = FakeEngine(vllm_routes())
    board = await start(nursery, spec, fake)
    await trio.sleep(0.1)
    assert board.current.engines[0].state == "ready"
    before = fake.counts["/health"]
    await trio.sleep(600)
    # 5 s health interval (plus up to 5 % jitter): about 115-120 probes in 600 s, never more.
    sent = fake.counts["/health"] - before
    assert 110 <= sent <= 121, sent
    assert fake.max_in_flight <= 2  # liveness and identity may overlap; never doubled


async def test_probes_slower_than_keep_alive_go_on_connections_of_their_own(
        nursery, autojump_clock) -> None:
    """As in production: the identity (60 s), model list (30 s) and health (5 s) probes,
    slower than the 4 s keep-alive, each go on a connection of their own, closed after the
    answer (nvpair.probing.oneshot); only the ready probe (2 s) reuses a kept connection."""
    fake = FakeEngine(vllm_routes())
    spec = await served(nursery, fake, engine_spec("vllm"))
    board = Board((initial_state(spec),))
    sweep = Sweep(board, 5.0)
    prober = await nursery.start(lambda task_status: run_probes(
        spec, board, sweep, task_status=task_status))
    await nursery.start(sweep.run)
    assert prober.client.target is not None  # (a MockTransport has none: all pooled)
    await wait_state(board, "e", "ready")
    ready_requests = fake.counts["/health"]
    await trio.sleep(300)
    health = fake.counts["/health"] - ready_requests
    assert health >= 50 and fake.counts["/version"] >= 5 and fake.counts["/v1/models"] >= 10
    for path in ("/version", "/v1/models"):
        assert fake.closing[path] == fake.counts[path], (path, fake.closing, fake.counts)
    assert fake.closing["/health"] >= health
    one_shot = sum(fake.closing.values())
    assert one_shot <= fake.connections <= one_shot + 2  # (+ the ready probe's kept one)


async def test_a_ready_tick_publishes_once_with_its_identity_check(nursery, autojump_clock) -> None:
    """The ready probe, the identity check it asks for and the outcome: one new snapshot
    (each publish wakes every reader that waits for a change)."""
    fake = FakeEngine(vllm_routes())
    spec = await served(nursery, fake, engine_spec("vllm"))
    board = Board((initial_state(spec),))
    before = board.current.version
    await nursery.start(lambda task_status: run_probes(spec, board, task_status=task_status))
    await trio.testing.wait_all_tasks_blocked()
    e = board.current.engines[0]
    assert e.state == "ready" and e.identity is not None and fake.counts["/version"] == 1
    assert board.current.version == before + 1


async def test_hung_engine_turns_stale_then_unhealthy(nursery, autojump_clock) -> None:
    spec = engine_spec("vllm")
    fake = FakeEngine(vllm_routes())
    board = await start(nursery, spec, fake)
    await trio.sleep(1)
    assert board.current.engines[0].state == "ready"
    fake.hang.add("/health")
    hung_at = trio.current_time()
    states: list[tuple[float, str]] = []
    version = board.current.version
    while not states or states[-1][1] != "unhealthy":
        snap = await board.wait_changed(version)
        version = snap.version
        e = snap.engines[0]
        if not states or states[-1][1] != e.state:
            states.append((trio.current_time() - hung_at, e.state))
    health = spec.probes.health
    # stale within one interval + timeout; unhealthy after failure_threshold timeouts.
    assert [s for _, s in states] == ["stale", "unhealthy"], states
    assert states[0][0] <= health.interval_s * 1.05 + health.timeout_s
    limit = health.failure_threshold * (health.interval_s * 1.05 + health.timeout_s)
    assert states[-1][0] <= limit
    e = board.current.engines[0]
    assert e.probe("health").timeouts >= 3  # type: ignore[union-attr]
    # Every request to the hung path was cancelled; none left in flight beyond the current one.
    assert fake.in_flight <= 1


async def test_refused_engine_is_down_and_comes_back(nursery, autojump_clock) -> None:
    spec = engine_spec("vllm")
    fake = FakeEngine(vllm_routes())
    fake.refuse = True
    board = await start(nursery, spec, fake)
    await trio.sleep(1)
    assert board.current.engines[0].state == "down"
    fake.refuse = False
    await trio.sleep(3)
    assert board.current.engines[0].state == "ready"


async def test_identity_mismatch_is_reported_not_listed(nursery, autojump_clock) -> None:
    spec = engine_spec("llamacpp", model="deepseek-v4.1-flash")
    fake = FakeEngine({
        "/health": (200, {"status": "ok"}),
        "/props": (200, {"model_alias": "qwen3-8b", "model_path": "/m/qwen3-8b.gguf",
                         "build_info": "b1-x", "total_slots": 4}),
    })
    board = await start(nursery, spec, fake)
    await trio.sleep(2)
    e = board.current.engines[0]
    assert e.state == "unhealthy"
    assert e.error == f"127.0.0.1:{fake.port} serves qwen3-8b, expected deepseek-v4.1-flash"


async def test_wrong_kind_is_reported(nursery, autojump_clock) -> None:
    spec = engine_spec("llamacpp")
    fake = FakeEngine({"/health": (200, {"status": "ok"}), "/props": (200, {"hello": 1})})
    board = await start(nursery, spec, fake)
    await trio.sleep(2)
    e = board.current.engines[0]
    assert e.state == "unhealthy"
    assert "does not look like llamacpp" in (e.error or "")


async def test_generating_fallback_needs_opt_in(nursery, autojump_clock) -> None:
    spec = engine_spec("sglang")
    fake = FakeEngine({"/health": (200, "")})  # an old SGLang: no /ready, /health generates
    board = await start(nursery, spec, fake)
    await trio.sleep(10)
    e = board.current.engines[0]
    assert e.state == "starting"
    assert "allow_generating_probes" in (e.error or "")
    assert fake.counts["/health"] == 0


async def test_generating_fallback_with_opt_in_runs_at_a_low_rate(nursery, autojump_clock) -> None:
    spec = engine_spec("sglang", allow_generating_probes=True)
    fake = FakeEngine({"/health": (200, ""), "/model_info": (200, {
        "model_path": "m", "is_generation": True})})
    fake.delay["/health"] = 1.0  # it generates a token
    board = await start(nursery, spec, fake)
    await trio.sleep(300)
    assert board.current.engines[0].state == "ready"
    health = board.current.engines[0].probe("health")
    ready = board.current.engines[0].probe("ready")
    assert health is not None and health.path == "/health"  # the status says what is asked
    assert ready is not None and ready.path == "/health"
    # /ping is missing too, so health falls back to /health: at most one per 30 s, also
    # where the ready probe hands over to health (both fall back to /health) and with
    # the schedule's jitter.
    times = fake.times["/health"]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert len(times) >= 300 / 31 - 1 and min(gaps) >= 30 - 1e-9, gaps  # float sums
    # ... and a result 30 s old is on schedule there, not overdue: never shown stale.
    for _ in range(60):
        await trio.sleep(1)
        e = board.current.engines[0]
        assert effective_state(e, trio.current_time(), e.overdue_after_s) == "ready"


async def test_an_oversized_answer_is_an_error_not_a_crash(nursery, autojump_clock) -> None:
    """A models list over the 4 MiB cap: the probe fails with a clear error; nothing else."""
    fake = FakeEngine(vllm_routes())
    fake.routes["/v1/models"] = (200, "x" * (MAX_BODY + 1))
    spec = await served(nursery, fake, engine_spec("vllm"))
    board = Board((initial_state(spec),))
    prober = await nursery.start(lambda task_status: run_probes(
        spec, board, task_status=task_status))
    outcome, answer = await prober.probe("models")
    assert answer is None and not outcome.ok
    assert outcome.error == "GET /v1/models answered more than 4 MiB"
    outcome, answer = await prober.probe("health")  # the engine's client is still fine
    assert outcome.ok and answer is not None


async def watch_states(board: Board, seconds: float) -> list[str]:
    """Every state the engine is in, sampled on each change, for ``seconds``."""
    seen: list[str] = []
    version = -1
    with trio.move_on_after(seconds):
        while True:
            snap = await board.wait_changed(version)
            version = snap.version
            seen.append(snap.engines[0].state)
    return seen


async def test_another_kind_of_server_on_the_port_is_never_listed(
        nursery, autojump_clock) -> None:
    # llama.cpp configured, vLLM answering: /health is fine, /props is 404.
    spec = engine_spec("llamacpp")
    fake = FakeEngine(vllm_routes())
    board = await start(nursery, spec, fake)
    states = await watch_states(board, 120)
    e = board.current.engines[0]
    assert "ready" not in states and e.state == "unhealthy"
    assert e.error == (f"127.0.0.1:{fake.port} does not look like llamacpp: "
                       "GET /props answered 404")


async def test_a_web_page_on_the_port_is_never_listed(nursery, autojump_clock) -> None:
    html = (200, "<html><body>It works!</body></html>")
    spec = engine_spec("vllm")
    board = await start(nursery, spec, FakeEngine({"/health": html, "/version": html,
                                                   "/v1/models": html}))
    states = await watch_states(board, 120)
    e = board.current.engines[0]
    assert "ready" not in states and e.state == "unhealthy"
    assert e.error is not None and "does not look like vllm: GET /version is not JSON" in e.error


async def test_not_listed_until_its_identity_answers(nursery, autojump_clock) -> None:
    spec = engine_spec("vllm")
    fake = FakeEngine(vllm_routes())
    fake.hang.add("/version")
    board = await start(nursery, spec, fake)
    states = await watch_states(board, 30)
    e = board.current.engines[0]
    assert "ready" not in states and e.state == "starting"
    assert e.error is not None and "who answers is not confirmed yet" in e.error
    fake.hang.clear()
    # identity retries back off up to its interval (60 s): listed within one of them
    ident = spec.probes.identity
    assert ident is not None
    await watch_states(board, ident.interval_s * 1.05 + ident.timeout_s + 5)
    assert board.current.engines[0].state == "ready"


async def test_a_vllm_serving_another_model_stays_unlisted(nursery, autojump_clock) -> None:
    """The model check of a vLLM is the sweep's (its /version names no model); the identity
    probe must not clear what the sweep found."""
    fake = FakeEngine(vllm_routes("wrong-model"))
    spec = await served(nursery, fake, engine_spec("vllm", model="expected-model"))
    board = Board((initial_state(spec),))
    sweep = Sweep(board, 5.0)
    await nursery.start(lambda task_status: run_probes(
        spec, board, sweep, task_status=task_status))
    await nursery.start(sweep.run)
    await watch_states(board, 30)
    assert board.current.engines[0].state == "unhealthy"
    states = await watch_states(board, 600)  # identity every 60 s, models every 30 s
    assert set(states) == {"unhealthy"}, states
    assert "serves wrong-model, expected expected-model" in (board.current.engines[0].error or "")


async def start_with_sweep(nursery: trio.Nursery, spec, fake: FakeEngine, *,
                           mocked: bool = False) -> Board:
    """``start``, with the sweep; ``mocked``: through ``fake.transport()`` (every probe
    pooled), not a socket."""
    if not mocked:
        spec = await served(nursery, fake, spec)
    board = Board((initial_state(spec),))
    sweep = Sweep(board, 5.0)
    await nursery.start(lambda task_status: run_probes(
        spec, board, sweep, transport=fake.transport() if mocked else None,
        task_status=task_status))
    await nursery.start(sweep.run)
    return board


async def test_a_server_without_the_kinds_identity_that_takes_the_port_stays_unlisted(
        nursery, autojump_clock) -> None:
    """The identity probe's "does not look like vllm" is not the sweep's to clear, even
    when the newcomer lists the same model."""
    fake = FakeEngine(vllm_routes())
    board = await start_with_sweep(nursery, engine_spec("vllm"), fake)
    await watch_states(board, 10)
    assert board.current.engines[0].state == "ready"
    del fake.routes["/version"]  # another OpenAI-style server now answers on the port
    states = await watch_states(board, 600)
    after = states[states.index("unhealthy"):]
    assert "ready" not in after, states
    assert "does not look like vllm" in (board.current.engines[0].error or "")


async def test_an_engine_upgraded_in_place_goes_back_to_the_manifests_path(
        nursery, autojump_clock) -> None:
    info = (200, {"model_path": "m", "is_generation": True})
    old = {"/ready": (200, ""), "/ping": (200, ""), "/get_model_info": info,
           "/v1/models": (200, {"object": "list", "data": [{"id": "m", "object": "model"}]})}
    fake = FakeEngine(old)  # an old SGLang: /get_model_info, no /model_info
    board = await start_with_sweep(nursery, engine_spec("sglang"), fake)
    await watch_states(board, 10)
    assert board.current.engines[0].state == "ready"
    fake.routes["/model_info"] = fake.routes.pop("/get_model_info")  # the upgrade
    states = await watch_states(board, 300)
    assert set(states) == {"ready"}, states
    ident = board.current.engines[0].probe("identity")
    assert ident is not None and ident.path == "/model_info" and ident.ok


async def test_a_server_with_neither_identity_path_gets_one_request_a_tick(
        nursery, autojump_clock) -> None:
    fake = FakeEngine({"/ready": (200, ""), "/ping": (200, "")})
    board = await start_with_sweep(nursery, engine_spec("sglang"), fake)
    await watch_states(board, 600)
    e = board.current.engines[0]
    assert e.state == "unhealthy" and "does not look like sglang" in (e.error or "")
    asked = fake.counts["/model_info"] + fake.counts["/get_model_info"]
    assert asked <= 600 / 60 + 3, fake.counts  # the identity interval, plus the first pair


# -- the engine-side budget: requests per hour in each state, per kind ---------------------

#: each kind's good answers (what the fake engine says on its probe paths)
KIND_ROUTES: dict[str, dict[str, tuple[int, object]]] = {
    "sglang": {
        "/ready": (200, ""), "/ping": (200, ""),
        "/model_info": (200, {"model_path": "m", "is_generation": True}),
        "/v1/models": (200, {"object": "list", "data": [{"id": "m"}]}),
    },
    "vllm": vllm_routes(),
    "llamacpp": {
        "/health": (200, {"status": "ok"}),
        "/props": (200, {"build_info": "b6000", "total_slots": 4, "model_path": "m"}),
        "/v1/models": (200, {"object": "list", "data": [{"id": "m"}]}),
    },
    "ollama": {
        "/api/version": (200, {"version": "0.12.0"}),
        "/api/tags": (200, {"models": [{"name": "m"}]}),
    },
    "tgi": {
        "/info": (200, {"model_id": "m", "router": "text-generation-router", "version": "3"}),
        "/health": (200, ""),
        "/v1/models": (200, {"object": "list", "data": [{"id": "m"}]}),
    },
    "openai": {"/v1/models": (200, {"object": "list", "data": [{"id": "m"}]})},
}

#: the requests per hour docs/states.md promises, per kind and state
SCHEDULE = {
    #         ready  identity unconfirmed  unhealthy  flapping
    "sglang": (840, 786, 840, 840),
    "vllm": (900, 786, 900, 900),
    "llamacpp": (900, 786, 900, 900),
    "ollama": (900, 3600, 900, 900),
    "tgi": (360, 1800, 360, 360),
    "openai": (480, 1800, 480, 480),
}
STATES = ("ready", "unconfirmed", "unhealthy", "flapping")


FLAP_S = 20.0


class StatefulEngine(FakeEngine):
    """A fake engine whose ``bad`` answers start after ``good_first`` good ones on their
    path, or (``flap``) alternate with good ones every FLAP_S."""

    def __init__(self, routes: dict[str, tuple[int, object]]) -> None:
        super().__init__(routes)
        self.good = dict(routes)
        self.bad: dict[str, tuple[int, object]] = {}
        self.good_first = 0
        self.flap = False

    async def handle(self, request: httpx2.Request) -> httpx2.Response:
        path = request.url.path
        if path in self.bad:
            n = self.counts[path]  # answered so far on this path
            bad = (int(trio.current_time() // FLAP_S) % 2 == 1 if self.flap
                   else n >= self.good_first)
            self.routes[path] = self.bad[path] if bad else self.good[path]
        return await super().handle(request)


def hostile_routes(kind: str, state: str) -> tuple[FakeEngine, str]:
    """The fake engine of ``kind`` in ``state``, and the state nvpair must see."""
    spec = engine_spec(kind)
    fake = StatefulEngine(dict(KIND_ROUTES[kind]))
    ident, health = spec.probes.identity, spec.probes.health
    if state == "unconfirmed":
        if ident is None:  # openai: nothing to confirm; a server still loading
            fake.routes[spec.probes.ready.path] = (503, "loading")
        elif kind == "llamacpp":  # /props wants an API key nvpair does not have
            fake.routes[ident.path] = (401, {"error": {"message": "Invalid API Key"}})
        elif ident.path == spec.probes.ready.path:  # Ollama, TGI: no separate identity
            fake.routes[ident.path] = (503, "loading")
        else:
            fake.routes[ident.path] = (503, "busy")
        return fake, "starting"
    if state == "unhealthy":  # ready once, then its health fails
        fake.bad[health.path] = (503, "unhealthy")
        fake.good_first = 2
        return fake, "unhealthy"
    if state == "flapping":
        fake.bad[health.path] = (503, "unhealthy")
        fake.flap = True
        return fake, ""
    return fake, "ready"


@pytest.mark.parametrize("state", STATES)
@pytest.mark.parametrize("kind", sorted(KIND_ROUTES))
async def test_requests_per_hour_stay_within_the_schedule(
        kind: str, state: str, nursery, autojump_clock) -> None:
    fake, want = hostile_routes(kind, state)
    spec = engine_spec(kind)
    # (an hour of probes each, 25 times: over a socket these took 35 s in all, not 14, and
    # what they count is the schedule, which is the same on either path)
    board = await start_with_sweep(nursery, spec, fake, mocked=True)
    await trio.sleep(3600)
    sent = sum(fake.counts.values())
    limit = SCHEDULE[kind][STATES.index(state)]
    assert sent <= limit, (sent, dict(fake.counts))
    assert sent >= 0.85 * limit, (sent, dict(fake.counts))  # the table is the real schedule
    if want:
        assert board.current.engines[0].state == want, board.current.engines[0].error


# -- run_probes: the loops in their boundaries, the prober enrolled in the sweep -----------

async def test_a_probe_loop_that_raises_is_the_engines_failure_and_restarts(
        nursery, autojump_clock, caplog) -> None:
    """An exception out of a probe loop (here: the engine's answer path raises something no
    probe expects, a bug) makes the engine unhealthy with the reason in one line, is logged
    once, and the loop runs again after its backoff; it never leaves run_probes."""
    caplog.set_level(logging.INFO, logger="nvpair")
    spec = engine_spec("vllm")
    fake = FakeEngine(vllm_routes("m"))
    broken = True
    handle = fake.handle
    tries: list[float] = []

    async def answer(request: httpx2.Request) -> httpx2.Response:
        if broken and request.url.path == "/health":
            tries.append(trio.current_time())
            raise KeyError("x-nvpair-bug")  # not an httpx2 error: escapes the probe
        return await handle(request)

    board = Board((initial_state(spec),))
    sweep = Sweep(board, 5.0)
    await nursery.start(lambda task_status: run_probes(
        spec, board, sweep, transport=httpx2.MockTransport(answer), task_status=task_status))
    e = await wait_state(board, "e", "unhealthy")
    assert e.error is not None and "\n" not in e.error
    assert "internal error in nvpair (KeyError: 'x-nvpair-bug')" in e.error, e.error
    await trio.sleep(120)  # retried with backoff (1, 2, 4... s), logged once
    gaps = [b - a for a, b in itertools.pairwise(tries)]
    assert 5 <= len(tries) <= 9 and gaps == sorted(gaps) and gaps[0] >= 1, gaps
    assert board.current.engine("e").state == "unhealthy"
    bugs = [r for r in caplog.records if "unexpected error" in r.getMessage()]
    assert len(bugs) == 1 and bugs[0].exc_info is not None
    broken = False
    ready = await wait_state(board, "e", "ready", within=120)
    assert ready.error is None
    await trio.testing.wait_all_tasks_blocked()  # the boundary has seen the good probe
    assert any("works again" in r.getMessage() for r in caplog.records)
    assert "e" in sweep.probers  # run_probes is still running
    # a second failure is watched again (the recovery watcher runs per failure)
    broken = True
    await wait_state(board, "e", "unhealthy", within=120)
    broken = False
    await wait_state(board, "e", "ready", within=120)
    await trio.testing.wait_all_tasks_blocked()
    assert sum("works again" in r.getMessage() for r in caplog.records) == 2


async def test_the_prober_is_enrolled_in_the_sweep_while_its_probes_run(
        nursery, autojump_clock) -> None:
    """Enrolled from ``started`` until run_probes ends; a later prober of the same engine
    (a restart) is not removed when the earlier one ends."""
    spec = await served(nursery, FakeEngine(vllm_routes()), engine_spec("vllm"))
    board = Board((initial_state(spec),))
    sweep = Sweep(board, 5.0)

    async def probing(task_status) -> None:  # run_probes in a nursery the test can cancel
        async with trio.open_nursery() as own:
            prober = await own.start(partial(run_probes, spec, board, sweep))
            task_status.started((prober, own.cancel_scope))

    probers, scopes = [], []
    for _ in range(2):
        prober, scope = await nursery.start(probing)
        probers.append(prober)
        scopes.append(scope)
        assert sweep.probers["e"] is prober
    assert probers[0].path("models") == "/v1/models"
    scopes[0].cancel()
    await trio.testing.wait_all_tasks_blocked()
    assert sweep.probers["e"] is probers[1]
    scopes[1].cancel()
    await trio.testing.wait_all_tasks_blocked()
    assert "e" not in sweep.probers


async def test_a_generating_request_cut_short_still_counts_against_the_budget(
        nursery, autojump_clock) -> None:
    """A generating request cancelled in flight (the engine's probes restart) may have
    reached the engine: the restarted probes send none for 30 s after it (before, the cut
    request was never recorded and the restarted prober sent the next one at once)."""
    fake = FakeEngine({"/health": (200, ""), "/model_info": (200, {
        "model_path": "m", "is_generation": True})})
    fake.hang.add("/health")  # it generates, slowly
    spec = await served(nursery, fake, engine_spec("sglang", allow_generating_probes=True))
    board = Board((initial_state(spec),))
    memory = ProbeMemory()

    async def probing(task_status) -> None:
        async with trio.open_nursery() as own:
            await own.start(partial(run_probes, spec, board, memory=memory))
            task_status.started(own.cancel_scope)

    scope = await nursery.start(probing)
    while fake.counts["/health"] == 0:
        await board.wait_changed(board.current.version)
    sent_at = fake.times["/health"][0]
    scope.cancel()  # the probes restart (an engine restart does the same)
    await trio.testing.wait_all_tasks_blocked()
    fake.hang.discard("/health")
    await nursery.start(probing)
    await trio.sleep(60)
    times = fake.times["/health"]
    assert len(times) >= 2 and times[1] >= sent_at + 30 - 1e-9, times


async def test_an_identity_loop_that_keeps_raising_keeps_the_engine_unhealthy(
        nursery, autojump_clock, monkeypatch) -> None:
    """Once ready, an identity loop that raises at each check (a bug) holds the engine
    unhealthy until an identity check works again; good health probes alone do not make it
    ready meanwhile (before, it flapped: unhealthy at each check, ready at the next health
    probe)."""
    from nvpair.probing import probes

    real = probes.parse_identity
    broken = False

    def parse(body, spec, kind):  # type: ignore[no-untyped-def]
        if broken:
            raise TypeError("unhashable type: 'dict'")
        return real(body, spec, kind)

    monkeypatch.setattr(probes, "parse_identity", parse)
    spec = engine_spec("vllm")
    fake = FakeEngine(vllm_routes())
    board = await start(nursery, spec, fake)
    await wait_state(board, "e", "ready")
    broken = True
    await wait_state(board, "e", "unhealthy", within=70)
    states = await states_during(board, 300)
    assert fake.counts["/version"] >= 4 and fake.counts["/health"] >= 50
    assert set(states) == {"unhealthy"}, states
    broken = False
    e = await wait_state(board, "e", "ready", within=130)
    assert e.error is None
