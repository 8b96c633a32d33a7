"""The board: two versions, the snapshot's (every change) and the listing's (listed fields
only, and a ready engine turning stale with time)."""

import msgspec
import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st

from nvpair.state.snapshot import Board, EngineState, Model, ProbeStats, shown_state
from nvpair.state.transitions import effective_state


def engine(name: str = "a", **kw: object) -> EngineState:
    return EngineState(name=name, kind="sglang", url="http://127.0.0.1:1", managed=False,
                       **kw)  # type: ignore[arg-type]


@given(st.sampled_from(["starting", "ready", "stale", "unhealthy", "down", "stopped"]),
       st.one_of(st.none(), st.floats(-100, 100)), st.floats(0, 100), st.floats(0, 60))
def test_the_listed_state_is_the_effective_state(state: str, checked: float | None,
                                                 now: float, overdue: float) -> None:
    e = engine(state=state, checked_at=checked, overdue_after_s=overdue)
    assert shown_state(e, now) == effective_state(e, now, overdue)


async def test_counters_and_ages_move_the_snapshot_not_the_listing() -> None:
    board = Board((engine(state="ready", models=(Model("m"),), checked_at=trio.current_time()),))
    listing = board.listing.version
    for i in range(1, 4):
        board.update("a", lambda e, i=i: msgspec.structs.replace(
            e, checked_at=trio.current_time(), restarts=i,
            probes=(("health", ProbeStats(path="/health", requests=i)),)))
    assert board.current.version == 4 and board.listing.version == listing
    assert board.current.listing == listing
    for change in ({"models": (Model("m"), Model("n"))}, {"aliases": ("fast",)},
                   {"models_stale": True}, {"state": "unhealthy"}, {"kind": "vllm"}):
        before = board.listing.version
        board.update("a", lambda e, change=change: msgspec.structs.replace(e, **change))
        assert board.listing.version == before + 1, change
        assert board.current.listing == board.listing.version


async def test_an_equal_new_model_list_moves_the_listing_only_when_types_differ() -> None:
    board = Board((engine(state="ready", models=(Model("m", created=1),)),))
    before = board.listing.version
    board.publish((engine(state="ready", models=(Model("m", created=1),)),))
    assert board.listing.version == before  # a sweep listing the same models
    board.publish((engine(state="ready", models=(Model("m", created=True),)),))  # type: ignore[arg-type]
    assert board.listing.version == before + 1  # True == 1, but peers refuse a bool


async def test_wait_listed_sleeps_through_probes_and_wakes_when_overdue(
        autojump_clock: trio.testing.MockClock) -> None:
    board = Board((engine(state="ready", models=(Model("m"),), checked_at=0.0,
                          overdue_after_s=30.0),))
    woke: list[float] = []

    async def waiter() -> None:
        version = board.listed(trio.current_time())
        while len(woke) < 2:
            version = await board.wait_listed(version)
            woke.append(trio.current_time())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiter)
        for _ in range(5):  # good health probes every 5 s: nothing listed changes
            await trio.sleep(5)
            board.update("a", lambda e: msgspec.structs.replace(
                e, checked_at=trio.current_time()))
        assert woke == []
        # no good probe from 25 s on: stale just after 55 s, ready again at 60 s
        await trio.sleep(35)
        board.update("a", lambda e: msgspec.structs.replace(e, checked_at=trio.current_time()))
    assert 55.0 < woke[0] < 55.1 and woke[1] == 60.0


async def test_touched_names_what_changed_and_everything_when_the_engines_change(
        autojump_clock: trio.testing.MockClock) -> None:
    board = Board(tuple(engine(f"e{i}", state="ready", checked_at=0.0, overdue_after_s=30.0)
                        for i in range(100)))
    touched = board.touched()
    assert touched.take() == (True, set())  # a new consumer has seen nothing
    board.update("e7", lambda e: msgspec.structs.replace(e, restarts=1))
    board.update("e9", lambda e: msgspec.structs.replace(e, checked_at=1.0))
    board.update("e7", lambda e: msgspec.structs.replace(e, restarts=2))
    assert touched.take() == (False, {"e7", "e9"})
    assert touched.take() == (False, set())
    await trio.sleep(30.5)  # everyone but e9 overdue: noticed when the listing is read
    board.listed(trio.current_time())
    assert touched.take() == (False, {f"e{i}" for i in range(100)} - {"e9"})
    board.publish(board.current.engines[1:])  # e0 removed
    assert touched.take()[0] is True
    assert board.current.engine("e0") is None and board.current.engine("e1") is not None
    assert board.current.engine("e50") is board.current.engines[49]
