"""The engine state machine: pure transitions, no I/O."""

import math

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st
from tests.fakes import engine_spec

from nvpair.config.manifest import GENERATING_MIN_INTERVAL_S, ProbeSpec
from nvpair.probing.probes import Listing
from nvpair.state.snapshot import EngineState, Identity, Model, ProbeStats
from nvpair.state.transitions import (
    AWAITED_READY_INTERVAL_S,
    Outcome,
    after_identity,
    after_liveness,
    after_models,
    effective_state,
    initial_state,
    listing_failed,
    liveness_probe,
    models_missed,
    next_interval,
    overdue_after,
    part_failed,
    rescheduled,
    steady_models,
    with_probe,
)

HEALTH = ProbeSpec(path="/health", failure_threshold=3, success_threshold=2)
READY = ProbeSpec(path="/health", failure_threshold=1)
OK = Outcome(ok=True, http_status=200, latency_ms=1.0)
FAIL = Outcome(ok=False, kind="status", http_status=503, error="503")
TIMEOUT = Outcome(ok=False, kind="timeout", error="slow")
REFUSED = Outcome(ok=False, kind="refused", error="refused")


def engine(state: str = "starting", managed: bool = False) -> EngineState:
    return EngineState(name="e", kind="vllm", url="http://x", managed=managed, state=state)  # type: ignore[arg-type]


def test_ready_probe_success_makes_ready() -> None:
    e = after_liveness(engine(), "ready", READY, OK, now=10.0)
    assert (e.state, e.checked_at, e.since) == ("ready", 10.0, 10.0)
    assert e.probe("ready").requests == 1  # type: ignore[union-attr]


def test_loading_engine_stays_starting() -> None:
    e = after_liveness(engine(), "ready", READY, FAIL, now=1.0)
    assert e.state == "starting" and e.error == "503"


def test_health_failures_go_stale_then_unhealthy_then_recover() -> None:
    e = after_liveness(engine(), "ready", READY, OK, now=0.0)
    states = []
    for i, outcome in enumerate([TIMEOUT, FAIL, TIMEOUT, OK, OK], start=1):
        e = after_liveness(e, "health", HEALTH, outcome, now=float(i))
        states.append(e.state)
    # Three failures reach the threshold; recovery from unhealthy needs two successes.
    assert states == ["stale", "stale", "unhealthy", "unhealthy", "ready"]
    stats = e.probe("health")
    assert stats is not None
    assert (stats.requests, stats.failures, stats.timeouts) == (5, 3, 2)


def test_stale_recovers_on_one_success() -> None:
    e = after_liveness(engine("ready"), "health", HEALTH, FAIL, now=1.0)
    assert e.state == "stale"
    e = after_liveness(e, "health", HEALTH, OK, now=2.0)
    assert e.state == "ready"


def test_refused_is_down_unless_managed_and_starting() -> None:
    assert after_liveness(engine("ready"), "health", HEALTH, REFUSED, now=1).state == "down"
    assert after_liveness(engine("starting"), "ready", READY, REFUSED, now=1).state == "down"
    managed = after_liveness(engine("starting", managed=True), "ready", READY, REFUSED, now=1)
    assert managed.state == "starting"


def test_mismatch_keeps_engine_unhealthy_even_when_it_answers() -> None:
    import msgspec

    e = msgspec.structs.replace(engine(), mismatch="serves x, expected y")
    e = after_liveness(e, "ready", READY, OK, now=1.0)
    assert e.state == "unhealthy" and e.error == "serves x, expected y"


def test_stopped_engine_stays_stopped() -> None:
    e = after_liveness(engine("stopped"), "health", HEALTH, OK, now=1.0)
    assert e.state == "stopped"


def test_overdue_health_reads_as_stale() -> None:
    e = after_liveness(engine(), "ready", READY, OK, now=0.0)
    assert effective_state(e, now=5.0, overdue_after=8.0) == "ready"
    assert effective_state(e, now=9.0, overdue_after=8.0) == "stale"


@pytest.mark.parametrize(("state", "probe"), [
    ("starting", "ready"), ("down", "ready"), ("ready", "health"), ("stale", "health"),
    ("unhealthy", "health"), ("stopped", "health")])
def test_the_next_liveness_probe_follows_the_state(state: str, probe: str) -> None:
    assert liveness_probe(state) == probe  # type: ignore[arg-type]


def test_initial_state_is_starting_and_overdue_follows_the_health_schedule() -> None:
    spec = engine_spec("vllm")
    e = initial_state(spec, now=7.0)
    health = spec.probes.health
    assert (e.state, e.since, e.name, e.kind) == ("starting", 7.0, "e", "vllm")
    assert e.overdue_after_s == overdue_after(health.interval_s, health.timeout_s)
    assert e.overdue_after_s == health.interval_s + health.timeout_s + 1.0
    assert rescheduled(e, 30.0, 2.0).overdue_after_s == 33.0


# -- identity ------------------------------------------------------------------------------

LLAMA = engine_spec("llamacpp", model="want")  # its identity names the model
VLLM = engine_spec("vllm", model="want")  # its identity names none: the model list does
IDENT_OK = Outcome(ok=True, http_status=200, latency_ms=1.0, path="/props")


def ready(spec=LLAMA) -> EngineState:
    e = initial_state(spec, now=0.0)
    return msgspec.structs.replace(e, state="ready", identity=Identity(model="want"))


def test_an_identity_serving_another_model_is_a_mismatch_until_it_serves_the_right_one() -> None:
    e = after_identity(ready(), LLAMA, IDENT_OK, 1.0, identity=Identity(model="other"),
                       names=("other", "/m/other.gguf"))
    assert (e.state, e.mismatch_by) == ("unhealthy", "identity")
    assert e.error == e.mismatch == "127.0.0.1:8080 serves other, expected want"
    assert e.identity == Identity(model="other")
    assert e.probe("identity").requests == 1  # type: ignore[union-attr]
    e = after_identity(e, LLAMA, IDENT_OK, 2.0, identity=Identity(model="want"),
                       names=("want",))
    assert (e.mismatch, e.mismatch_by, e.state) == (None, None, "unhealthy")
    # cleared: the next good health probe (two, from unhealthy) makes it ready
    health = LLAMA.probes.health
    for now in (3.0, 4.0):
        e = after_liveness(e, "health", health, IDENT_OK, now)
    assert e.state == "ready" and e.error is None


def test_another_kind_of_server_is_a_mismatch_and_who_answers_is_forgotten() -> None:
    gone = Outcome(ok=False, kind="status", http_status=404, error="404", path="/props")
    e = after_identity(ready(), LLAMA, gone, 1.0)
    assert (e.state, e.mismatch_by, e.identity) == ("unhealthy", "identity", None)
    assert e.error == "127.0.0.1:8080 does not look like llamacpp: GET /props answered 404"
    bad = Outcome(ok=False, kind="mismatch", http_status=200, path="/props",
                  error="does not look like llamacpp: GET /props lacks total_slots")
    e = after_identity(ready(), LLAMA, bad, 1.0, wrong=bad.error)
    assert e.identity is None and e.mismatch_by == "identity"
    assert e.error == "127.0.0.1:8080 does not look like llamacpp: GET /props lacks total_slots"
    assert e.probe("identity").failures == 1  # type: ignore[union-attr]


def test_an_unconfirmed_identity_finds_and_clears_nothing() -> None:
    e = msgspec.structs.replace(ready(), mismatch="m", mismatch_by="identity", state="unhealthy")
    refused = Outcome(ok=False, kind="status", http_status=401, error="401", path="/props")
    after = after_identity(e, LLAMA, refused, 1.0, path="/props")
    assert (after.mismatch, after.identity, after.state) == ("m", e.identity, "unhealthy")
    assert after.notice is not None and "GET /props (401)" in after.notice


def test_the_identity_probe_never_clears_the_model_lists_mismatch() -> None:
    e = msgspec.structs.replace(ready(VLLM), mismatch="m", mismatch_by="models",
                                state="unhealthy", error="m")
    after = after_identity(e, VLLM, IDENT_OK, 1.0, identity=Identity(version="0.11"))
    assert (after.mismatch, after.mismatch_by, after.state) == ("m", "models", "unhealthy")


# -- the model list ------------------------------------------------------------------------

LISTED = Outcome(ok=True, http_status=200, latency_ms=1.0, path="/v1/models")
FAILED_LIST = Outcome(ok=False, kind="status", http_status=500, error="answered 500",
                      path="/v1/models")


def test_a_listing_is_taken_with_what_was_left_out() -> None:
    listing = Listing((Model("want"),), left_out=3, why="3 ids over 512 characters")
    e = after_models(ready(VLLM), VLLM, LISTED, 5.0, listing=listing)
    assert ([m.id for m in e.models], e.models_at, e.models_stale) == (["want"], 5.0, False)
    assert (e.models_left_out, e.models_left_out_why) == (3, "3 ids over 512 characters")
    assert e.state == "ready" and e.mismatch is None


def test_a_failed_listing_keeps_the_list_marked_stale() -> None:
    e = after_models(ready(VLLM), VLLM, LISTED, 5.0, listing=Listing((Model("want"),)))
    failed = Outcome(ok=False, kind="body", http_status=200, error="not JSON", path="/v1/models")
    e = after_models(e, VLLM, failed, 6.0)
    assert [m.id for m in e.models] == ["want"] and e.models_stale and e.models_at == 5.0
    assert e.probe("models").error == "not JSON"  # type: ignore[union-attr]
    empty = after_models(ready(VLLM), VLLM, failed, 6.0)
    assert not empty.models_stale  # nothing listed: nothing stale


def test_a_list_without_the_model_is_a_mismatch_only_the_model_list_clears() -> None:
    e = after_models(ready(VLLM), VLLM, LISTED, 1.0, listing=Listing((Model("a"), Model("b"))))
    assert (e.state, e.mismatch_by) == ("unhealthy", "models")
    assert e.error == "127.0.0.1:8000 serves a, b, expected want"
    none = after_models(ready(VLLM), VLLM, LISTED, 1.0, listing=Listing(()))
    assert none.error == "127.0.0.1:8000 serves no model, expected want"
    e = after_models(e, VLLM, LISTED, 2.0, listing=Listing((Model("org/want"),)))
    assert (e.mismatch, e.mismatch_by) == (None, None)
    found = msgspec.structs.replace(ready(VLLM), mismatch="m", mismatch_by="identity")
    kept = after_models(found, VLLM, LISTED, 2.0, listing=Listing((Model("want"),)))
    assert (kept.mismatch, kept.mismatch_by) == ("m", "identity")


def test_a_kind_whose_identity_names_the_model_is_not_checked_by_its_list() -> None:
    e = after_models(ready(LLAMA), LLAMA, LISTED, 1.0, listing=Listing((Model("alias"),)))
    assert e.mismatch is None and e.state == "ready"


def test_a_missed_listing_is_a_timeout_and_stale() -> None:
    models = VLLM.probes.models
    assert models is not None
    e = models_missed(ready(VLLM), models, 5.0, 9.0)
    stats = e.probe("models")
    assert e.models_stale and stats is not None and stats.timeouts == 1
    assert stats.error == "model list did not answer within the 5 s sweep deadline"
    assert e.state == "ready"


# -- a fault boundary's failure ------------------------------------------------------------

def test_a_failing_listing_makes_the_engine_unhealthy_with_the_reason() -> None:
    listed = after_models(ready(VLLM), VLLM, LISTED, 1.0, listing=Listing((Model("want"),)))
    e = listing_failed(listed, VLLM.probes.models, "internal error in nvpair (TypeError)", 2.0)
    assert (e.state, e.error, e.since) == ("unhealthy", "internal error in nvpair (TypeError)",
                                           2.0)
    assert e.models_stale and e.probe("models").failures == 1  # type: ignore[union-attr]
    unknown = listing_failed(listed, None, "x", 2.0)  # its prober gone: nothing counted
    assert unknown.probe("models").failures == 0  # type: ignore[union-attr]
    stopped = msgspec.structs.replace(listed, state="stopped")
    assert listing_failed(stopped, VLLM.probes.models, "x", 2.0).state == "stopped"


def test_a_failing_listing_holds_until_a_listing_works() -> None:
    """Good health probes do not make it ready while its listing fails (it flapped at every
    listing before); a good listing clears it, and the next good health probe recovers it.
    An identity mismatch found meanwhile is not the listing's to clear."""
    listed = after_models(ready(VLLM), VLLM, LISTED, 1.0, listing=Listing((Model("want"),)))
    e = listing_failed(listed, VLLM.probes.models, "internal error in nvpair (TypeError)", 2.0)
    for i in range(3):
        e = after_liveness(e, "health", HEALTH, OK, now=3.0 + i)
    assert (e.state, e.error) == ("unhealthy", "internal error in nvpair (TypeError)")
    e = after_models(e, VLLM, LISTED, 6.0, listing=Listing((Model("want"),)))
    e = after_liveness(e, "health", HEALTH, OK, now=7.0)
    assert (e.state, e.error, e.mismatch) == ("ready", None, None)
    # a listing that ran (the engine's answer refused, a ProbeError) clears it too: the
    # list is stale by the usual rule, and a model mismatch found by a list stays
    e = listing_failed(listed, VLLM.probes.models, "internal error in nvpair (TypeError)", 2.0)
    e = after_models(e, VLLM, FAILED_LIST, 3.0)
    for i in range(2):  # (success_threshold)
        e = after_liveness(e, "health", HEALTH, OK, now=4.0 + i)
    assert (e.state, e.mismatch, e.models_stale) == ("ready", None, True)
    wrong = after_models(ready(VLLM), VLLM, LISTED, 1.0, listing=Listing((Model("other"),)))
    e = after_models(listing_failed(wrong, VLLM.probes.models, "x", 2.0), VLLM, FAILED_LIST,
                     3.0)
    for i in range(2):
        e = after_liveness(e, "health", HEALTH, OK, now=4.0 + i)
    assert (e.state, e.mismatch_by) == ("unhealthy", "models")
    found = after_identity(listed, VLLM, IDENT_OK, 2.0, wrong="does not look like vllm")
    e = listing_failed(found, VLLM.probes.models, "x", 3.0)
    e = after_models(e, VLLM, LISTED, 4.0, listing=Listing((Model("want"),)))
    e = after_liveness(e, "health", HEALTH, OK, now=5.0)
    assert (e.state, e.mismatch_by) == ("unhealthy", "identity")


def test_a_failing_loop_makes_the_engine_unhealthy_unless_stopped() -> None:
    e = part_failed(ready(), "internal error in nvpair (KeyError: 'x')", 3.0)
    assert (e.state, e.error, e.since) == ("unhealthy", "internal error in nvpair (KeyError: 'x')",
                                           3.0)
    stopped = msgspec.structs.replace(ready(), state="stopped")
    assert part_failed(stopped, "x", 3.0) == stopped


def test_a_model_keeps_the_created_of_its_first_sighting_while_it_stays_listed() -> None:
    """vLLM and llama-server put the current time in every answer's ``created``: such a
    re-listing is no change (the same tuple, so the listing version does not move);
    a model that comes or goes is one, and the models still listed keep their first time."""
    first = after_models(ready(VLLM), VLLM, LISTED, 1.0,
                         listing=Listing((Model("want", created=100, owned_by="vllm"),)))
    again = after_models(first, VLLM, LISTED, 31.0,
                         listing=Listing((Model("want", created=130, owned_by="vllm"),)))
    assert again.models is first.models and again.models[0].created == 100
    grown = after_models(again, VLLM, LISTED, 61.0, listing=Listing((
        Model("new", created=160, owned_by="vllm"), Model("want", created=160, owned_by="vllm"))))
    assert grown.models == (Model("new", 160, "vllm"), Model("want", 100, "vllm"))
    moved = after_models(grown, VLLM, LISTED, 91.0,
                         listing=Listing((Model("want", created=190, owned_by="other"),)))
    assert moved.models == (Model("want", 190, "other"),)  # another owner: another model


@given(st.lists(st.tuples(st.sampled_from("abc"), st.integers(0, 3), st.sampled_from("xy")),
                max_size=6),
       st.lists(st.tuples(st.sampled_from("abc"), st.integers(0, 3), st.sampled_from("xy")),
                max_size=6))
def test_steady_models_lists_what_the_engine_listed(old: list, new: list) -> None:
    before = tuple(Model(i, c, o) for i, c, o in old)
    after = tuple(Model(i, c, o) for i, c, o in new)
    kept = steady_models(before, after)
    assert [(m.id, m.owned_by) for m in kept] == [(m.id, m.owned_by) for m in after]
    if len(before) == len(after) and all(
            (a.id, a.owned_by) == (b.id, b.owned_by) for a, b in zip(before, after, strict=True)):
        assert kept is before
    for m, n in zip(kept, after, strict=True):
        earlier = {x.created for x in before if (x.id, x.owned_by) == (n.id, n.owned_by)}
        assert m.created in earlier if earlier else m is n


# -- the liveness loop's next tick (next_interval): the policy without the loop ---------------

VLLM_SPEC = engine_spec("vllm")  # ready every 2 s, health every 5 s, an identity probe


def ready_answered(e: EngineState, times: int = 1) -> EngineState:
    """``e`` after ``times`` good ready probes in a row (its counters, not its state)."""
    return with_probe(e, "ready", ProbeStats(path="/health", ok=True,
                                             consecutive_successes=times))


def test_the_next_tick_follows_the_probe_that_runs_next() -> None:
    starting = next_interval(engine("starting"), VLLM_SPEC, probe="ready", outcome=FAIL)
    ready = next_interval(engine("ready"), VLLM_SPEC, probe="ready", outcome=OK)
    assert (starting.probe, starting.interval) == ("ready", 2.0)
    assert (ready.probe, ready.interval) == ("health", 5.0)
    assert starting.not_before == ready.not_before == -math.inf
    assert not starting.awaited and not ready.awaited


def test_requests_waiting_for_a_start_shorten_a_cheap_ready_probe_only() -> None:
    waited = msgspec.structs.replace(engine("starting"), queued=3)
    cheap = next_interval(waited, VLLM_SPEC, probe="ready", outcome=FAIL)
    assert cheap.interval == AWAITED_READY_INTERVAL_S
    generating = next_interval(waited, VLLM_SPEC, probe="ready", outcome=FAIL,
                               generating=("ready",))
    assert generating.interval == GENERATING_MIN_INTERVAL_S  # (never sooner for waiters)
    ready = msgspec.structs.replace(engine("ready"), queued=3)
    assert next_interval(ready, VLLM_SPEC, probe="health", outcome=OK).interval == 5.0


def test_an_engine_that_only_awaits_its_identity_is_asked_at_the_health_interval() -> None:
    answers = ready_answered(engine("starting"))
    awaiting = next_interval(answers, VLLM_SPEC, probe="ready", outcome=OK)
    assert (awaiting.probe, awaiting.interval) == ("ready", 5.0)
    # not enough good answers yet, or the answer failed, or no identity probe: its own
    unsure = next_interval(ready_answered(engine("starting"), 0), VLLM_SPEC, probe="ready",
                           outcome=OK)
    failed = next_interval(answers, VLLM_SPEC, probe="ready", outcome=FAIL)
    no_identity = msgspec.structs.replace(
        VLLM_SPEC, probes=msgspec.structs.replace(VLLM_SPEC.probes, identity=None))
    alone = next_interval(answers, no_identity, probe="ready", outcome=OK)
    assert unsure.interval == failed.interval == alone.interval == 2.0
    known = msgspec.structs.replace(answers, identity=Identity(version="0.33.0"))
    assert next_interval(known, VLLM_SPEC, probe="ready", outcome=OK).interval == 2.0


def test_a_generating_probe_comes_no_sooner_than_its_minimum_after_the_last() -> None:
    ready = engine("ready")
    capped = next_interval(ready, VLLM_SPEC, probe="health", outcome=OK,
                           generating=("health",), generated_at=100.0)
    assert capped.interval == GENERATING_MIN_INTERVAL_S
    assert capped.not_before == 100.0 + GENERATING_MIN_INTERVAL_S
    # the next probe's path does not generate (another one's does): no bound
    free = next_interval(ready, VLLM_SPEC, probe="health", outcome=OK,
                         generating=("ready",), generated_at=100.0)
    assert (free.interval, free.not_before) == (5.0, -math.inf)
    never = next_interval(ready, VLLM_SPEC, probe="health", outcome=OK,
                          generating=("health",))
    assert never.not_before == -math.inf


def test_a_starting_on_demand_engine_nobody_waits_for_sleeps_until_a_request_waits() -> None:
    on_demand = msgspec.structs.replace(VLLM_SPEC, activation="on_demand")
    starting = engine("starting", managed=True)
    assert next_interval(starting, on_demand, probe="ready", outcome=FAIL).awaited
    waited = msgspec.structs.replace(starting, queued=1)
    assert not next_interval(waited, on_demand, probe="ready", outcome=FAIL).awaited
    assert not next_interval(starting, VLLM_SPEC, probe="ready", outcome=FAIL).awaited
    ready = engine("ready", managed=True)
    assert not next_interval(ready, on_demand, probe="ready", outcome=OK).awaited


# -- sleep (docs/sleep.md) --------------------------------------------------------------------

PROBED = {"sleep_probe": True}


def test_a_health_answer_saying_it_sleeps_makes_a_ready_engine_sleeping_and_back() -> None:
    e = after_liveness(engine(), "ready", READY, OK, now=0.0)
    e = after_liveness(e, "health", HEALTH, OK, now=1.0, sleeping=True, **PROBED)
    assert (e.state, e.since) == ("sleeping", 1.0)
    e = after_liveness(e, "health", HEALTH, OK, now=2.0, sleeping=True, **PROBED)
    assert (e.state, e.since, e.checked_at) == ("sleeping", 1.0, 2.0)
    e = after_liveness(e, "health", HEALTH, OK, now=3.0, sleeping=False, **PROBED)
    e = after_liveness(e, "health", HEALTH, OK, now=4.0, sleeping=False, **PROBED)
    assert e.state == "ready"  # (HEALTH's success_threshold: 2)


def test_a_waking_engine_stays_waking_while_it_still_says_it_sleeps() -> None:
    e = after_liveness(engine("waking"), "health", HEALTH, OK, now=1.0, sleeping=True,
                       **PROBED)
    assert e.state == "waking"


def test_a_sleeping_engine_fails_like_any_other_when_it_has_a_sleeping_probe() -> None:
    e = engine("sleeping")
    e = after_liveness(e, "health", HEALTH, TIMEOUT, now=1.0, **PROBED)
    assert e.state == "stale"
    assert after_liveness(engine("sleeping"), "health", HEALTH, REFUSED, now=1.0,
                          **PROBED).state == "down"


def test_without_a_sleeping_probe_only_nvpair_or_a_dead_port_moves_a_sleeping_engine() -> None:
    """SGLang answers /ready 503 while paused for its sleep: still sleeping."""
    for outcome in (OK, FAIL, TIMEOUT):
        e = after_liveness(engine("sleeping"), "health", HEALTH, outcome, now=1.0)
        assert e.state == "sleeping"
    assert after_liveness(engine("sleeping"), "health", HEALTH, REFUSED, now=1.0).state == "down"


@pytest.mark.parametrize("state", ["sleeping", "waking"])
def test_a_sleeping_engine_is_probed_by_health_only(state: str) -> None:
    assert liveness_probe(state) == "health"  # type: ignore[arg-type]
