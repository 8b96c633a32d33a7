"""The model-list sweep: one shared deadline, quick engines listed even when others hang."""

from functools import partial

import httpx2
import msgspec
import pytest
import trio
from tests.fakes import FakeEngine, engine_spec, served, vllm_routes
from tests.managed import states_during, wait_state
from tests.stub_http import serve_stub

from nvpair import service
from nvpair.config.settings import load_settings
from nvpair.probing import probes
from nvpair.probing.prober import run_probes
from nvpair.probing.sweep import Sweep
from nvpair.sim import SimOptions, serve_sim
from nvpair.state.snapshot import Board
from nvpair.state.transitions import initial_state


async def start_all(nursery, fakes: dict[str, FakeEngine], deadline: float = 5.0):
    """The engines, each ``fakes[name]`` on a port of 127.0.0.1, probed and swept."""
    specs = [await served(nursery, fake, engine_spec("vllm", name=name))
             for name, fake in fakes.items()]
    board = Board(tuple(initial_state(s) for s in specs))
    sweep = Sweep(board, deadline)
    for spec in specs:
        await nursery.start(lambda task_status, spec=spec: run_probes(
            spec, board, sweep, task_status=task_status))
    await nursery.start(sweep.run)
    return board, sweep


async def test_first_sweep_lists_quick_engines_within_the_deadline(nursery, autojump_clock) -> None:
    fakes = {f"quick{i}": FakeEngine(vllm_routes(f"model-{i}")) for i in range(6)}
    for i in range(2):
        slow = FakeEngine(vllm_routes(f"slow-{i}"))
        slow.hang.add("/v1/models")
        fakes[f"slow{i}"] = slow
    started = trio.current_time()
    board, _ = await start_all(nursery, fakes)
    version = board.current.version
    while True:
        snap = await board.wait_changed(version)
        version = snap.version
        listed = {m.id for e in snap.engines for m in e.models}
        if {f"model-{i}" for i in range(6)} <= listed:
            break
    assert trio.current_time() - started < 5.0
    await trio.sleep(6)
    snap = board.current
    slow = snap.engine("slow0")
    assert slow is not None and slow.models == () and slow.state == "ready"
    stats = slow.probe("models")
    assert stats is not None and "sweep deadline" in (stats.error or "")


async def test_a_late_engine_keeps_its_last_list_marked_stale(nursery, autojump_clock) -> None:
    fake = FakeEngine(vllm_routes("m1"))
    board, _ = await start_all(nursery, {"e": fake}, deadline=5.0)
    await trio.sleep(2)
    assert [m.id for m in board.current.engines[0].models] == ["m1"]
    fake.hang.add("/v1/models")
    await trio.sleep(40)  # past the 30 s models interval and the 5 s deadline
    e = board.current.engines[0]
    assert [m.id for m in e.models] == ["m1"] and e.models_stale


async def test_model_list_is_refreshed_on_its_interval(nursery, autojump_clock) -> None:
    fake = FakeEngine(vllm_routes("m1"))
    board, _ = await start_all(nursery, {"e": fake})
    await trio.sleep(1)
    fake.routes.update(vllm_routes("m2"))
    await trio.sleep(31)
    assert [m.id for m in board.current.engines[0].models] == ["m2"]
    assert fake.counts["/v1/models"] == 2


async def test_an_engine_without_a_models_probe_is_never_due(nursery, autojump_clock) -> None:
    """Such a manifest is allowed; its engine must not leave a due time in the past, which
    would wake the sweep at once, forever (a busy loop)."""
    spec = await served(nursery, FakeEngine(vllm_routes()), engine_spec("vllm", name="e"))
    spec = msgspec.structs.replace(spec, probes=msgspec.structs.replace(spec.probes, models=None))
    board = Board((initial_state(spec),))
    sweep = Sweep(board, 5.0)
    await nursery.start(lambda task_status: run_probes(
        spec, board, sweep, task_status=task_status))
    await trio.sleep(1)
    assert board.current.engines[0].state == "ready"
    assert sweep.due(trio.current_time()) == []
    assert sweep.next_wake() == float("inf")


# An engine whose every answer is JSON nested 5,000 levels deep (2 KB), next to a healthy one.
NESTED = b"[" * 5000 + b"]" * 5000


def _old_json(body: bytes, what: str, error=None):  # the decode before RecursionError was caught
    return msgspec.json.decode(body)


@pytest.mark.parametrize("decoder", ["current", "without_its_fix"])
async def test_a_hostile_engine_answer_stays_that_engines_failure(
        nursery, tmp_path, monkeypatch, decoder: str) -> None:
    """The node keeps serving and listing the healthy engine. With today's decoder the
    answer is a one-line body error; with the old one (RecursionError out of the listing)
    the sweep's boundary alone keeps the node up and makes the engine unhealthy."""
    if decoder == "without_its_fix":
        monkeypatch.setattr(probes, "decode_json", _old_json)
    bad = await nursery.start(partial(serve_stub, body=NESTED))
    good = await nursery.start(serve_sim, SimOptions(kind="llamacpp", model="good-model"))
    await good.wait_phase("ready")
    path = tmp_path / "nvpair.toml"
    path.write_text(
        "listen = '127.0.0.1:0'\nsweep_deadline_s = 2\n"
        f"[[engines]]\nname = 'bad'\nkind = 'openai'\nport = {bad}\n"
        "[engines.probes.ready]\ninterval_s = 0.2\ntimeout_s = 0.2\n"
        f"[[engines]]\nname = 'good'\nkind = 'llamacpp'\nport = {good.port}\n")
    with trio.fail_after(20):
        running = await nursery.start(service.run, load_settings(str(path)))
        if decoder == "current":
            e = await wait_state(running.board, "bad", "ready", where=lambda e: bool(
                e.probe("models") and e.probe("models").error))
            assert "nested too deeply" in e.probe("models").error
        else:
            e = await wait_state(running.board, "bad", "unhealthy")
            assert e.error is not None and "\n" not in e.error
            assert "internal error in nvpair (RecursionError" in e.error, e.error
            assert "internal error" in (e.probe("models").error or "")
        assert e.models == ()
        await wait_state(running.board, "good", "ready", where=lambda e: bool(e.models))
        async with httpx2.AsyncClient(base_url=running.url) as client:
            for _ in range(3):  # and on: past the next sweeps of the bad engine
                assert (await client.get("/healthz")).status_code == 200
                ids = [m["id"] for m in (await client.get("/v1/models")).json()["data"]]
                assert ids == ["good-model"]
                await trio.sleep(0.5)


async def test_a_failing_listing_keeps_the_batch_and_the_sweep(nursery, autojump_clock,
                                                               monkeypatch) -> None:
    """One engine whose listing raises (a TypeError, a bug) fails alone: the others of its
    batch are listed, its bookkeeping runs (it is listed again when due), and it recovers."""
    real = probes.parse_listing
    broken = {"m-bad"}

    def parse(body: bytes, fmt, path):  # a parser bug that only one engine's answer hits
        listing = real(body, fmt, path)
        if any(m.id in broken for m in listing.models):
            raise TypeError("unhashable type: 'dict'")
        return listing

    monkeypatch.setattr(probes, "parse_listing", parse)
    fakes = {"good": FakeEngine(vllm_routes("m-good")), "bad": FakeEngine(vllm_routes("m-bad"))}
    board, _ = await start_all(nursery, fakes)
    failed = await wait_state(board, "bad", "unhealthy")
    assert "internal error in nvpair (TypeError: unhashable type" in (failed.error or "")
    await trio.sleep(2)
    good, bad = board.current.engine("good"), board.current.engine("bad")
    assert [m.id for m in good.models] == ["m-good"]
    # the failure stays on its model list until a listing works (a good health probe
    # moves the state on by the usual rules)
    assert "TypeError" in (bad.probe("models").error or "") and bad.models == ()
    assert fakes["bad"].counts["/v1/models"] == 1
    broken.clear()  # the bug is gone (or the engine answers otherwise): due again, listed
    await trio.sleep(31)
    bad = board.current.engine("bad")
    assert fakes["bad"].counts["/v1/models"] == 2
    assert bad.state == "ready" and [m.id for m in bad.models] == ["m-bad"]


async def test_a_listing_that_keeps_failing_keeps_the_engine_unhealthy(
        nursery, autojump_clock, monkeypatch) -> None:
    """While its listing keeps raising, the engine stays unhealthy: a good health probe
    alone does not make it ready until the next listing fails again (before, it flapped
    unhealthy/ready at every listing). A listing that works again recovers it."""
    real = probes.parse_listing
    broken = True

    def parse(body: bytes, fmt, path):  # a parser bug this engine's answer keeps hitting
        if broken:
            raise TypeError("unhashable type: 'dict'")
        return real(body, fmt, path)

    monkeypatch.setattr(probes, "parse_listing", parse)
    fake = FakeEngine(vllm_routes("m"))
    board, _ = await start_all(nursery, {"e": fake})
    await wait_state(board, "e", "unhealthy")
    states = await states_during(board, 120)
    assert fake.counts["/v1/models"] >= 4 and fake.counts["/health"] >= 20
    assert set(states) == {"unhealthy"}, states
    broken = False
    e = await wait_state(board, "e", "ready", within=40)
    assert [m.id for m in e.models] == ["m"] and e.error is None


async def test_the_same_answer_again_is_not_parsed_again(
        nursery, autojump_clock, monkeypatch) -> None:
    """An engine that lists the same bytes again costs a digest, not a parse (10,000 models
    are about 20 ms of the loop to parse); a changed answer is parsed and listed."""
    real = probes.parse_listing
    parsed: list[bytes] = []

    def parse(body: bytes, fmt, path):  # the real parser, counted
        parsed.append(body)
        return real(body, fmt, path)

    monkeypatch.setattr(probes, "parse_listing", parse)
    fake = FakeEngine(vllm_routes("m1"))
    board, _ = await start_all(nursery, {"e": fake})
    await wait_state(board, "e", "ready", where=lambda e: [m.id for m in e.models] == ["m1"])
    await trio.sleep(120)  # several more listings of the same bytes
    assert fake.counts["/v1/models"] >= 3 and len(parsed) == 1
    fake.routes["/v1/models"] = vllm_routes("m2")["/v1/models"]
    await wait_state(board, "e", "ready", where=lambda e: [m.id for m in e.models] == ["m2"],
                     within=60)
    assert len(parsed) == 2


async def test_a_large_unchanged_list_is_fetched_less_often_and_a_change_resets_it(
        nursery, autojump_clock) -> None:
    """A list of 10,000 models that comes back the same is fetched again later the larger
    it is (at most UNCHANGED_BYTES_PER_S a second, at most UNCHANGED_MAX_STRETCH
    intervals); a small one stays at the manifest's interval; a changed one is listed
    again at the interval."""
    from nvpair.probing import sweep as sweep_module
    big = {"object": "list", "data": [{"id": f"org/model-{i:05d}-" + "x" * 300,
                                       "object": "model", "created": 1, "owned_by": "me"}
                                      for i in range(10_000)]}
    size = len(msgspec.json.encode(big))
    interval = 30.0  # (vllm's models interval)
    stretched = min(max(interval, size / sweep_module.UNCHANGED_BYTES_PER_S),
                    interval * sweep_module.UNCHANGED_MAX_STRETCH)
    assert stretched > 2 * interval  # (the list is big enough to matter)
    fake, small = FakeEngine(vllm_routes("m1")), FakeEngine(vllm_routes("s1"))
    fake.routes["/v1/models"] = (200, big)
    board, sweep = await start_all(nursery, {"e": fake, "s": small})
    await wait_state(board, "e", "ready", where=lambda e: len(e.models) == 10_000)
    first = trio.current_time()
    await trio.sleep(interval + 1)  # listed again at the interval: unchanged now
    assert fake.counts["/v1/models"] == 2
    assert sweep.interval("e", interval) == stretched and sweep.interval("s", interval) == interval
    await trio.sleep(stretched - 2)  # not yet
    assert fake.counts["/v1/models"] == 2
    await trio.sleep(2 + 1)
    assert fake.counts["/v1/models"] == 3
    small_count = small.counts["/v1/models"]
    assert small_count >= int((trio.current_time() - first) / interval)  # every interval
    big["data"] = big["data"][:-1]  # a change: the interval again
    await trio.sleep(stretched + 1)
    assert fake.counts["/v1/models"] == 4 and len(board.current.engine("e").models) == 9_999
    assert sweep.interval("e", interval) == interval
