from nvpair.manifest import ProbeSpec
from nvpair.snapshot import EngineState
from nvpair.state import Outcome, after_liveness, effective_state

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
