"""The API's documents from one snapshot: pure functions, no I/O."""

from tests.listing_oracle import models_doc

from nvpair.http.views import engine_status, engines_doc
from nvpair.state.snapshot import EngineState, Model, Snapshot


def engine(name: str, state: str, **kw: object) -> EngineState:
    return EngineState(name=name, kind="llamacpp", url="http://127.0.0.1:1", managed=False,
                       state=state, **kw)  # type: ignore[arg-type]


def test_optional_engines_are_hidden_until_they_answer() -> None:
    snap = Snapshot(version=3, engines=(
        engine("guess", "down", optional=True), engine("found", "ready", optional=True,
                                                       checked_at=1.0),
        engine("mine", "down")))
    assert [e["name"] for e in engines_doc(snap, 2.0, "n")["engines"]] == ["found", "mine"]


def test_models_list_ready_engines_first_and_overdue_ones_as_stale() -> None:
    snap = Snapshot(version=1, engines=(
        engine("late", "ready", models=(Model("m"), Model("x")), checked_at=0.0,
               overdue_after_s=30.0),
        engine("fresh", "ready", models=(Model("m"),), checked_at=95.0,
               aliases=("fast",))))
    data = models_doc(snap, 100.0, "n")["data"]
    assert [(m["id"], m["nvpair"]["engine"], m["nvpair"]["engines"]) for m in data] == [
        ("m", "fresh", ["fresh", "late"]), ("fast", "fresh", ["fresh"]), ("x", "late", ["late"])]
    assert data[0]["owned_by"] == "llamacpp" and data[1]["nvpair"]["alias_of"] == "m"
    assert data[2]["nvpair"]["state"] == "stale" and data[2]["nvpair"]["stale"]
    status = engine_status(snap.engines[0], snap, 100.0, "n")
    assert status["state"] == "stale" and status["checked_age_s"] == 100.0
