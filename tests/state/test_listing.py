"""The listing built engine by engine is the one tests/listing_oracle.models_doc defines,
byte for byte, after any sequence of changes (hypothesis), and it rebuilds only what
changed."""

from collections.abc import Iterator
from contextlib import contextmanager

import msgspec
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.listing_oracle import models_doc

from nvpair.http.asgi import encoder
from nvpair.state.listing import ModelsBody, catalog
from nvpair.state.snapshot import Board, EngineState, Model

NAMES = ("a", "b", "c", "d")
IDS = ("m1", "m2", "org/m3", "m4")

models = st.lists(st.builds(Model, id=st.sampled_from(IDS), created=st.integers(0, 3),
                            owned_by=st.sampled_from(("", "me"))), max_size=4).map(tuple)
changes = st.fixed_dictionaries({
    "state": st.sampled_from(("starting", "ready", "stale", "unhealthy", "down")),
    "models": models,
    "aliases": st.lists(st.sampled_from(("fast", "m1", "slow")), max_size=2).map(tuple),
    "models_stale": st.booleans(),
    "checked_at": st.one_of(st.none(), st.floats(-40, 0)),
    "restarts": st.integers(0, 3),
})


def engine(name: str) -> EngineState:
    return EngineState(name=name, kind="ollama", url="http://127.0.0.1:1", managed=False,
                       overdue_after_s=30.0)


def ready_board() -> Board:
    """NAMES, each ready with one model of its own (``<name>-x``)."""
    board = Board(tuple(engine(n) for n in NAMES))
    for n in NAMES:
        board.update(n, lambda e: msgspec.structs.replace(
            e, state="ready", models=(Model(f"{e.name}-x"),), checked_at=trio.current_time()))
    return board


def big_board() -> Board:
    """NAMES, ready: "a" and "b" with 6,000 models each (a part over 256 KiB), the others
    with 3."""
    board = Board(tuple(engine(n) for n in NAMES))
    many = tuple(Model(f"org/model-{i:05d}-" + "x" * 40) for i in range(6000))  # > 256 KiB
    for n in NAMES:
        board.update(n, lambda e, n=n: msgspec.structs.replace(
            e, state="ready", models=tuple(msgspec.structs.replace(m, id=f"{n}/{m.id}")
                                           for m in (many if n in "ab" else many[:3])),
            checked_at=trio.current_time()))
    return board


class StepsOf(trio.abc.Instrument):
    """Counts the steps ``task`` takes while added."""

    def __init__(self, task: trio.lowlevel.Task) -> None:
        self.task, self.count = task, 0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        if task is self.task:
            self.count += 1


@contextmanager
def steps_counted() -> Iterator[StepsOf]:
    """The steps this task takes within the block."""
    steps = StepsOf(trio.lowlevel.current_task())
    trio.lowlevel.add_instrument(steps)
    try:
        yield steps
    finally:
        trio.lowlevel.remove_instrument(steps)


def body(models: ModelsBody, board: Board, now: float) -> bytes:
    return b'{"object":"list","data":[' + models.data(board, now) + b"]}"


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(NAMES), changes, st.floats(0, 20)), max_size=12))
def test_the_listing_is_models_doc_after_any_changes(steps: list) -> None:
    async def main() -> None:
        board = Board(tuple(engine(n) for n in NAMES))
        built = ModelsBody("node1")
        for name, change, dt in steps:
            await trio.sleep(dt)  # (virtual time: ready engines may turn stale meanwhile)
            now = trio.current_time()
            at = change["checked_at"]
            fields = {**change, "checked_at": None if at is None else now + at}
            board.update(name, lambda e, fields=fields: msgspec.structs.replace(e, **fields))
            want = encoder.encode(models_doc(board.current, now, "node1"))
            assert body(built, board, now) == want
            items = {m["id"]: m for m in msgspec.json.decode(want)["data"]}
            for model_id in (*IDS, "fast", "nope"):
                got = built.item(board, now, model_id)
                got_doc = None if got is None else msgspec.json.decode(encoder.encode(got))
                assert got_doc == items.get(model_id)

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


async def test_a_probe_counter_moves_the_snapshot_not_the_listing() -> None:
    board = Board((engine("a"),))
    board.update("a", lambda e: msgspec.structs.replace(
        e, state="ready", models=(Model("m"),), checked_at=trio.current_time()))
    listing, version = board.listing.version, board.current.version
    board.update("a", lambda e: msgspec.structs.replace(
        e, restarts=3, checked_at=trio.current_time()))
    assert board.current.version == version + 1 and board.listing.version == listing
    board.update("a", lambda e: msgspec.structs.replace(e, models_stale=True))
    assert board.listing.version == listing + 1


async def test_a_ready_engine_overdue_moves_the_listing_with_time_alone(autojump_clock) -> None:
    board = Board((engine("a"),))
    board.update("a", lambda e: msgspec.structs.replace(
        e, state="ready", models=(Model("m"),), checked_at=trio.current_time()))
    version = board.listing.version
    start = trio.current_time()
    assert await board.wait_listed(version) == version + 1
    assert 30.0 <= trio.current_time() - start < 30.1  # overdue_after_s, not a poll
    assert catalog(board, trio.current_time()).items["m"].state == "stale"


async def test_one_engine_changed_re_encodes_that_engine_only() -> None:
    board = ready_board()
    built = ModelsBody("n")
    now = trio.current_time()
    built.data(board, now)
    assert built._encoded is not None
    before = built._encoded.parts
    board.update("b", lambda e: msgspec.structs.replace(e, models_stale=True))
    built.data(board, now)
    after = built._encoded.parts
    assert [p for p, part in enumerate(after) if part is not before[p]] == [1]


async def test_stepwise_parts_are_the_same_bytes_and_yield_after_each_big_join(
        autojump_clock) -> None:
    """When the ages move, every big engine's part is joined again: one checkpoint after
    each (a step of the loop per engine, not one for all); the bytes are parts' bytes,
    and a second call joins nothing."""
    board = big_board()
    built, plain = ModelsBody("n"), ModelsBody("n")
    now = trio.current_time()
    with steps_counted() as steps:
        got = await built.parts_stepwise(board, now)
        first = steps.count
        again = await built.parts_stepwise(board, now)
    assert got == plain.parts(board, now) and again == got
    assert first == 2  # after "a" and after "b" (the small ones end no step)
    assert steps.count == first  # nothing joined the second time: no checkpoint


@given(st.floats(-1e6, 1e6), st.lists(st.one_of(st.none(), st.floats(-1e6, 1e6))))
def test_ages_of_many_are_each_age(now: float, ats: list[float | None]) -> None:
    """The one-pass ages a listing encodes are the ages of one at a time (never below 0,
    ms resolution, None for never)."""
    from nvpair.base.ages import ages
    got = ages(now, ats)
    assert all(a is None or a >= 0 for a in got)
    assert [None if a is None else round(max(0.0, now - a), 3) for a in ats] == got


async def test_a_board_left_with_no_engines_lists_nothing() -> None:
    """A new layout re-sorts the order even when no engine is left to move it."""
    board = ready_board()
    built = ModelsBody("n")
    now = trio.current_time()
    assert built.data(board, now).count(b'"id"') == len(NAMES)
    board.publish(())
    assert catalog(board, now).order == () and built.data(board, now) == b""


def listed_ids(parts: list[bytes]) -> list[str]:
    """The model ids of a body's parts, in order (the parts must make valid JSON)."""
    return [m["id"] for m in msgspec.json.decode(
        b'{"object":"list","data":[' + b",".join(parts) + b"]}")["data"]]


async def test_a_stepwise_walk_returns_the_one_version_it_took_while_the_listing_moves(
        autojump_clock) -> None:
    """The listing moves while a walk waits at a checkpoint (engine "b", big, no longer
    listed, and another reader takes the new version): the walk returns the version it
    took, whole and byte for byte (never an empty part, a ",," in the body, nor a model
    twice or missing); the other reader has the new one; and the next walk, after the
    old walk ended, is the new one too (the old walk's parts do not replace the newer)."""
    board = big_board()
    walking, other = ModelsBody("n"), ModelsBody("n")
    now = trio.current_time()
    want_before = encoder.encode(models_doc(board.current, now, "n"))
    seen_by_other: list[bytes] = []

    class Between(trio.abc.Instrument):
        """After the walker's first step (it ended at the checkpoint after "a")."""

        walker: trio.lowlevel.Task | None = None
        done = False

        def after_task_step(self, task: trio.lowlevel.Task) -> None:
            if task is self.walker and not self.done:
                self.done = True
                board.update("b", lambda e: msgspec.structs.replace(e, state="down"))
                seen_by_other.extend(other.parts(board, now))
                walking.parts(board, now)  # (a reader of the same body, of the new one)

    between = Between()
    between.walker = trio.lowlevel.current_task()  # (its next step ends at the checkpoint)
    trio.lowlevel.add_instrument(between)
    try:
        got = await walking.parts_stepwise(board, now)
    finally:
        trio.lowlevel.remove_instrument(between)
    assert between.done
    assert all(got) and b",," not in b",".join(got)
    assert b'{"object":"list","data":[' + b",".join(got) + b"]}" == want_before
    ids = listed_ids(got)
    assert len(ids) == len(set(ids)) == 6000 * 2 + 3 + 3
    want_after = encoder.encode(models_doc(board.current, now, "n"))
    new = listed_ids(seen_by_other)
    assert len(new) == len(set(new)) == 6000 + 3 + 3
    for parts in (seen_by_other, walking.parts(board, now)):
        assert b'{"object":"list","data":[' + b",".join(parts) + b"]}" == want_after


async def test_a_stepwise_walk_of_many_small_engines_ends_a_step_every_few_hundred(
        autojump_clock) -> None:
    from nvpair.state.listing import STEP_ENGINES
    names = [f"e{i:04d}" for i in range(STEP_ENGINES * 2 + 10)]
    board = Board(tuple(engine(n) for n in names))
    for n in names:
        board.update(n, lambda e: msgspec.structs.replace(
            e, state="ready", models=(Model(f"{e.name}-x"),), checked_at=trio.current_time()))
    built, plain = ModelsBody("n"), ModelsBody("n")
    now = trio.current_time()
    with steps_counted() as steps:
        got = await built.parts_stepwise(board, now)
    assert got == plain.parts(board, now) and len(got) == len(names)
    assert steps.count == 2  # after 256 and after 512 engines' parts
