"""The router's choice reads a model index kept per listing version (never a scan of every
engine's models per request)."""

import random

import msgspec
import trio

from nvpair.router.select import Known, choose
from nvpair.snapshot import Board, EngineState, Model
from nvpair.traffic import Traffic


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
    assert pick("m") == ((), "no engine serving 'm' is ready (a is unhealthy, b is ready)")
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
