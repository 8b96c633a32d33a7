"""The router's choice reads a model index kept per listing version (never a scan of every
engine's models per request)."""

import random
from pathlib import Path

import httpx2
import msgspec
import trio
from tests.fakes import engine_spec
from tests.managed import FAST_PROBES, wait_state

from nvpair import service
from nvpair.config.settings import load_settings
from nvpair.router.select import Known, choose
from nvpair.sim import SimOptions, serve_sim
from nvpair.state.snapshot import Board, EngineState, Model
from nvpair.state.traffic import Traffic


def engine(name: str, models: tuple[str, ...], state: str = "ready",
           aliases: tuple[str, ...] = ()) -> EngineState:
    return EngineState(name=name, kind="sglang", url="http://127.0.0.1:1", managed=False,
                       state=state, models=tuple(Model(m) for m in models),  # type: ignore[arg-type]
                       aliases=aliases, checked_at=trio.current_time())


async def test_choose_follows_the_listing_by_id_and_alias() -> None:
    board = Board((engine("a", ("m",), aliases=("fast",)), engine("b", ("m", "n")),
                   engine("c", ("x",), state="starting")))
    traffic, known, rng = Traffic(), Known(), random.Random(0)

    def pick(model: str) -> tuple[tuple[str, ...], str | None]:
        c = choose(board.current, model, traffic, known, trio.current_time(), rng)
        return tuple(sorted(c.engines)), c.reason

    assert pick("m") == (("a", "b"), None) and pick("fast") == (("a",), None)
    assert pick("x") == ((), "no engine serving 'x' is ready (c is starting)")
    assert pick("y") == ((), "the model 'y' does not exist on this node")
    board.update("a", lambda e: msgspec.structs.replace(e, state="unhealthy"))
    assert pick("m") == (("b",), None)
    assert pick("fast") == ((), "no engine serving 'fast' is ready (a is unhealthy)")
    board.update("b", lambda e: msgspec.structs.replace(e, models=(Model("n"),)))
    assert pick("m") == ((), "no engine serving 'm' is ready (a is unhealthy, "
                                 "b is ready but does not list it)")
    board.update("c", lambda e: msgspec.structs.replace(e, state="ready"))
    assert pick("x") == (("c",), None)


async def test_the_index_is_kept_per_listing_version_not_per_probe() -> None:
    board = Board(tuple(engine(f"e{i}", (f"m{i}",)) for i in range(50)))
    known = Known()
    choose(board.current, "m1", Traffic(), known, trio.current_time(), random.Random(0))
    seen = known._seen
    for i in range(5):  # probe results: counters only
        board.update("e3", lambda e, i=i: msgspec.structs.replace(e, restarts=i + 1))
        choose(board.current, "m1", Traffic(), known, trio.current_time(), random.Random(0))
    assert known._listing == board.current.listing and known._seen is seen


async def test_a_ready_engine_serves_its_configured_model_until_its_list_is_read() -> None:
    """The list comes a moment after the engine turns ready (the sweep reads it then): a
    client that saw it ready is routed, not refused, in between; once read, the list
    decides (an engine that serves another model no longer takes the configured one)."""
    board = Board((msgspec.structs.replace(engine("a", ()), state="starting"),))
    known = Known((engine_spec("vllm", name="a", model="m"),))
    traffic, rng = Traffic(), random.Random(0)

    def pick(model: str) -> tuple[tuple[str, ...], str | None]:
        c = choose(board.current, model, traffic, known, trio.current_time(), rng)
        return c.engines, c.reason

    assert pick("m") == ((), "no engine serving 'm' is ready (a is starting)")
    board.update("a", lambda e: msgspec.structs.replace(e, state="ready"))
    assert pick("m") == (("a",), None)
    assert pick("other")[0] == ()
    board.update("a", lambda e: msgspec.structs.replace(
        e, models=(Model("other"),), models_at=trio.current_time()))
    assert pick("other") == (("a",), None)
    assert pick("m") == ((), "no engine serving 'm' is ready (a is ready but does not list it)")


async def test_a_client_that_saw_the_engine_ready_is_routed_while_its_list_hangs(
        nursery, tmp_path: Path) -> None:
    """Real parts: an engine ready whose /v1/models never answers (the moment between
    ready and the first list, held open) takes a request for its configured model."""
    sim = await nursery.start(serve_sim, SimOptions(kind="vllm", model="m"))
    sim.set_fault("hang", paths=("/v1/models",))
    path = tmp_path / "nvpair.toml"
    path.write_text(f"listen = '127.0.0.1:0'\n[[engines]]\nname = 'e'\nkind = 'vllm'\n"
                    f"port = {sim.port}\nmodel = 'm'\n{FAST_PROBES}")
    payload = msgspec.json.encode({"model": "m", "max_tokens": 2,
                                   "messages": [{"role": "user", "content": "hi"}]})
    with trio.fail_after(20):
        running = await nursery.start(service.run, load_settings(str(path)))
        await wait_state(running.board, "e", "ready")
        async with httpx2.AsyncClient(base_url=running.url) as client:
            r = await client.post("/v1/chat/completions", content=payload,
                                  headers={"content-type": "application/json"})
        e = running.board.current.engine("e")
        assert e is not None and e.models_at is None  # (its list was never read)
        assert r.status_code == 200, r.text
