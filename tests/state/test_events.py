"""The change journal (nvpair.state.events) over a hand-built board: seq, coalescing, resume."""

from __future__ import annotations

import msgspec
import trio
from hypothesis import given
from hypothesis import strategies as st

from nvpair.state.events import Journal, Stream, parse_event_id
from nvpair.state.snapshot import Board, EngineState, Model


def engine(name: str, **kw: object) -> EngineState:
    return EngineState(name=name, kind="vllm", url="http://127.0.0.1:8000", managed=False,
                       state="ready", models=(Model(id="m"),), **kw)  # type: ignore[arg-type]


def restart(board: Board, name: str) -> None:
    board.update(name, lambda e: msgspec.structs.replace(e, restarts=e.restarts + 1))


@given(st.text(max_size=80))
def test_any_last_event_id_parses_or_is_none(text: str) -> None:
    parsed = parse_event_id(text)
    if parsed is not None:
        boot, seq = parsed
        assert boot and seq >= 0
        assert parse_event_id(f"{boot}.{seq}") == parsed


@given(st.from_regex(r"[0-9a-f]{1,32}", fullmatch=True), st.integers(0, 2**63 - 1))
def test_ids_round_trip(boot: str, seq: int) -> None:
    assert parse_event_id(f"{boot}.{seq}") == (boot, seq)


def test_ids_of_other_shapes_are_none() -> None:
    for text in ("", "5", ".5", "abc.", "abc.-1", "abc.1e3", "a b.1", "abc.٣",
                 "x" * 33 + ".1", "abc." + "9" * 20):
        assert parse_event_id(text) is None, text


async def test_counters_change_nothing_and_content_one_seq_each(autojump_clock) -> None:
    board = Board((engine("a"), engine("b")))
    journal = Journal(board, node="n")
    stream, first = journal.subscribe()
    assert first is None  # a snapshot
    board.update("a", lambda e: msgspec.structs.replace(e, checked_at=trio.current_time()))
    journal.refresh(trio.current_time())
    assert journal.seq == 0 and not stream.pending
    restart(board, "a")
    restart(board, "b")
    journal.refresh(trio.current_time())
    assert journal.seq == 2
    assert [(e.seq, e.key) for e in stream.take()] == [(1, "engine:a"), (2, "engine:b")]


async def test_a_stream_keeps_the_latest_value_per_key_in_seq_order(autojump_clock) -> None:
    board = Board((engine("a"), engine("b")))
    journal = Journal(board, node="n")
    stream, _ = journal.subscribe()
    for name in ("a", "b", "a") * 100:
        restart(board, name)
        journal.refresh(trio.current_time())
    events = stream.take()
    assert [(e.key, e.seq) for e in events] == [("engine:b", 299), ("engine:a", 300)]
    assert msgspec.json.decode(events[-1].data)["restarts"] == 200


async def test_resume_inside_the_ring_gives_exactly_the_missed(autojump_clock) -> None:
    board = Board((engine("a"),))
    journal = Journal(board, node="n", ring=4)
    for _ in range(3):
        restart(board, "a")
        journal.refresh(trio.current_time())
    _, missed = journal.subscribe(last_event_id=journal.event_id(1))
    assert [e.seq for e in missed or ()] == [2, 3]
    assert journal.subscribe(last_event_id=journal.event_id(3))[1] == []
    for _ in range(5):
        restart(board, "a")
        journal.refresh(trio.current_time())
    assert journal.subscribe(last_event_id=journal.event_id(1))[1] is None  # out of the ring
    assert [e.seq for e in journal.subscribe(last_event_id=journal.event_id(4))[1] or ()] == [
        5, 6, 7, 8]
    assert journal.subscribe(last_event_id="other.3")[1] is None  # another boot
    assert journal.subscribe(last_event_id=journal.event_id(99))[1] is None  # from the future


async def test_an_engine_turning_stale_with_time_is_an_event(autojump_clock) -> None:
    board = Board((engine("a", checked_at=trio.current_time(), overdue_after_s=5.0),))
    journal = Journal(board, node="n")
    stream, _ = journal.subscribe(types=frozenset({"engine"}))
    async with trio.open_nursery() as nursery:
        await nursery.start(journal.run)
        with trio.fail_after(10):
            await stream.wait()
        nursery.cancel_scope.cancel()
    [event] = stream.take()
    assert msgspec.json.decode(event.data)["state"] == "stale"
    assert 5.0 < trio.current_time() < 5.1


async def test_full_and_close(autojump_clock) -> None:
    board = Board((engine("a"),))
    journal = Journal(board, node="n", max_streams=1)
    stream, _ = journal.subscribe()
    try:
        journal.subscribe()
        raise AssertionError("a second stream was admitted")
    except Exception as exc:
        assert "max_streams" in str(exc)
    journal.close()
    assert stream.closed
    with trio.fail_after(1):
        await stream.wait()


def test_filters() -> None:
    stream = Stream(frozenset({"engine"}), engine="a")
    from nvpair.state.events import Event
    stream.offer(Event(1, "engine", "engine:b", b"{}", "b"))
    stream.offer(Event(2, "peer", "peer:x", b"{}"))
    stream.offer(Event(3, "engine", "engine:a", b"{}", "a"))
    assert [e.seq for e in stream.take()] == [3]


async def test_a_removed_engine_and_content_kept_across_counter_changes(autojump_clock) -> None:
    board = Board(tuple(engine(f"e{i}", checked_at=trio.current_time()) for i in range(3)))
    journal = Journal(board, node="n")
    stream, _ = journal.subscribe(types=frozenset({"engine"}))
    seq = journal.seq
    for _ in range(5):  # counters only: nothing to say
        board.update("e1", lambda e: msgspec.structs.replace(e, checked_at=trio.current_time()))
        journal.refresh(trio.current_time())
    assert journal.seq == seq and not stream.pending
    board.update("e1", lambda e: msgspec.structs.replace(e, restarts=1))
    board.publish(tuple(e for e in board.current.engines if e.name != "e2"))
    journal.refresh(trio.current_time())
    events = {e.key: msgspec.json.decode(e.data) for e in stream.take()}
    assert events == {"engine:e1": events["engine:e1"],
                      "engine:e2": {"name": "e2", "removed": True}}
    # (and a "models" event: the engines changed, so the listing moved)
    assert events["engine:e1"]["restarts"] == 1 and journal.seq == seq + 3


def test_content_key_moves_with_every_field_the_content_shows() -> None:
    """content_key lists what engine_content is built from by hand: a field added to the
    content and not to the key would change no event. Each EngineState field is changed
    in turn; wherever the content changes, the key must too."""
    from nvpair.state.events import content_key, engine_content
    from nvpair.state.memory import EngineMemory
    from nvpair.state.snapshot import Identity
    base = engine("a", checked_at=0.0)
    other: dict[str, object] = {
        str: "x-changed", int: 7, float: 99.0, bool: True, type(None): "x"}
    changes: dict[str, object] = {
        "state": "unhealthy", "models": (Model("n"),), "aliases": ("fast",),
        "identity": Identity(model="m"), "memory": EngineMemory(),
        "probes": (("health", None),), "group": None}
    checked = 0
    for field in EngineState.__struct_fields__:
        if field == "name":  # (the journal keeps the key per name)
            continue
        value = getattr(base, field)
        new = changes.get(field, other.get(type(value)))
        if new is None or new == value:
            continue
        try:
            changed = msgspec.structs.replace(base, **{field: new})
        except (TypeError, msgspec.ValidationError):
            continue
        checked += 1
        if engine_content(changed, 1.0) != engine_content(base, 1.0):
            assert content_key(changed, 1.0) != content_key(base, 1.0), field
    assert checked > 20


async def test_an_episode_of_dropped_output_is_an_event_its_count_is_not(
        autojump_clock) -> None:
    """The count moves every second of a flood (status and /metrics have it); the
    episode's start, in words, and its end are one event each."""
    board = Board((engine("a"),))
    journal = Journal(board, node="n")
    stream, _ = journal.subscribe()
    words = "engine a wrote 180,000 lines/s (1.1 MB/s); 171,200 dropped; the newest kept"
    for dropped, dropping in ((171_200, words), (351_200, words), (530_000, words),
                              (530_000, None)):
        board.update("a", lambda e, d=dropped, w=dropping: msgspec.structs.replace(
            e, log_dropped=d, log_dropping=w))
        journal.refresh(trio.current_time())
    assert journal.seq == 2
    assert [msgspec.json.decode(e.data)["log"] for e in stream.take()] == [{"dropping": None}]
    assert [msgspec.json.decode(e.data)["log"] for e in journal.ring] == [
        {"dropping": words}, {"dropping": None}]


def test_an_engine_event_shows_each_models_own_state() -> None:
    """A multi-model engine's models each in their own state (docs/multi-model.md), and a
    change of one model's state is an event; a stale engine's models are stale."""
    from nvpair.state.events import content_key, engine_content
    models = (Model("alpha", state="ready"), Model("beta", state="cold"), Model("one"))
    e = msgspec.structs.replace(engine("r", checked_at=0.0), models=models)
    assert engine_content(e, 1.0)["model_states"] == {
        "alpha": "ready", "beta": "cold", "one": "ready"}
    moved = msgspec.structs.replace(e, models=(models[0], Model("beta", state="loading"),
                                               models[2]))
    assert content_key(moved, 1.0) != content_key(e, 1.0)
    stale = engine_content(e, 1.0 + e.overdue_after_s + 1)
    assert stale["model_states"] == {"alpha": "stale", "beta": "stale", "one": "stale"}
