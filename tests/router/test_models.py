"""``ModelSlots``: nvpair's account of a multi-model engine's slots, under Trio's clock
(the engine's side, which /models/unload reaches, is a recorder: what is checked is what
nvpair decides and when)."""

from __future__ import annotations

import trio
import trio.testing

from nvpair.router.models import ModelSlots
from nvpair.state.snapshot import Board, EngineState, Identity, Model


def router_board(models_max: int | None, *loaded: str) -> Board:
    models = tuple(Model(id=m, state="ready" if m in loaded else "cold")
                   for m in ("alpha", "beta", "gamma"))
    return Board((EngineState(name="r", kind="llamacpp", url="http://127.0.0.1:1",
                              managed=False, state="ready", models=models, models_at=0.0,
                              identity=Identity(router=True, models_max=models_max)),))


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str | None]] = []

    async def __call__(self, name: str, path: str, model: str | None) -> tuple[int, bytes]:
        await trio.lowlevel.checkpoint()
        self.calls.append((path, model))
        return 200, b'{"success":true}'


async def test_two_requests_never_both_take_the_last_slot(autojump_clock) -> None:
    """Nothing loaded, one slot: alpha and beta come together. The second waits for the
    first to end, then nvpair unloads the first (idle now) and sends the second."""
    slots = ModelSlots(router_board(1))
    control = Recorder()
    log: list[str] = []

    async def request(model: str, seconds: float) -> None:
        async with slots.held("r", model, control):
            log.append(f"{model} in at {trio.current_time():g}")
            await trio.sleep(seconds)
        log.append(f"{model} out")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(request, "alpha", 5.0)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(request, "beta", 1.0)
    assert log == ["alpha in at 0", "alpha out", "beta in at 5", "beta out"]
    assert control.calls == [("/models/unload", "alpha")]


async def test_a_loaded_model_and_a_free_slot_go_at_once(autojump_clock) -> None:
    slots = ModelSlots(router_board(2, "alpha"))
    control = Recorder()
    async with slots.held("r", "alpha", control), slots.held("r", "beta", control):
        assert slots.in_flight("r", "alpha") == slots.in_flight("r", "beta") == 1
        assert trio.current_time() == 0
    assert control.calls == []  # a second slot was free: nothing unloaded
    assert slots.in_flight("r", "alpha") == 0


async def test_the_least_recently_used_idle_model_is_the_one_unloaded(autojump_clock) -> None:
    slots = ModelSlots(router_board(2))
    control = Recorder()
    for model in ("alpha", "beta"):
        async with slots.held("r", model, control):
            await trio.sleep(1)
    async with slots.held("r", "beta", control):  # beta used last
        pass
    async with slots.held("r", "gamma", control):
        pass
    assert control.calls == [("/models/unload", "alpha")]


async def test_a_single_model_engine_is_not_held(autojump_clock) -> None:
    board = Board((EngineState(name="s", kind="llamacpp", url="http://127.0.0.1:1",
                               managed=False, state="ready", identity=Identity(slots=4)),))
    slots = ModelSlots(board)
    control = Recorder()
    async with slots.held("s", "m", control), slots.held(None, "m", control):
        assert slots.in_flight("s", "m") == 0
    assert control.calls == []


async def test_an_answer_shows_the_model_ready_and_an_unload_cold(autojump_clock) -> None:
    """Ahead of the next model list: a model that answered is loaded; one nvpair
    unloaded (200) is cold; a 5xx or no answer says nothing."""
    board = router_board(1, "alpha")
    slots = ModelSlots(board)
    control = Recorder()

    def states() -> dict[str, str | None]:
        e = board.current.engine("r")
        assert e is not None
        return {m.id: m.state for m in e.models}

    async with slots.held("r", "beta", control):
        assert states() == {"alpha": "cold", "beta": "cold", "gamma": "cold"}
        slots.answered("r", "beta", 503)
        slots.answered("r", "beta", 0)
        assert states()["beta"] == "cold"
        slots.answered("r", "beta", 200)
        assert states()["beta"] == "ready"
