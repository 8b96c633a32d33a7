"""Pure parts: fault matching and flapping, accounting, options validation."""

from __future__ import annotations

import pytest

from nvpair.sim import Fault, SimOptions
from nvpair.sim.accounting import Accounting
from nvpair.sim.faults import FaultBook


def test_fault_paths_match_exactly_or_by_prefix():
    assert Fault("hang").matches("/anything")
    fault = Fault("slow", paths=("/health", "/v1/*"))
    assert fault.matches("/health") and fault.matches("/v1/models")
    assert not fault.matches("/health_generate") and not fault.matches("/v2")


def test_fault_validation():
    with pytest.raises(ValueError):
        Fault("explode")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        Fault("slow", seconds=-1)
    with pytest.raises(ValueError):
        Fault("error", status=42)


def test_flap_alternates_per_request_then_per_period():
    book = FaultBook()
    book.set(Fault("flap"), now=0.0)
    assert [book.flap_unhealthy(0.0) for _ in range(4)] == [False, True, False, True]
    book.set(Fault("flap", seconds=1.0), now=10.0)
    assert [book.flap_unhealthy(t) for t in (10.5, 11.5, 12.5, 13.5)] == [
        False, True, False, True]
    book.set(Fault("none"), now=0.0)
    assert book.active() == ()


def test_accounting_counts_statuses_errors_aborts():
    changes: list[int] = []
    acc = Accounting(on_change=lambda: changes.append(1))
    for status, aborted, reset in ((200, False, False), (503, False, False),
                                   (None, True, False), (None, False, True)):
        acc.begin("/p")
        acc.end("/p", status, aborted=aborted, reset=reset, elapsed=0.1)
    total, paths = acc.snapshot()
    stats = paths["/p"]
    assert (stats.count, stats.in_flight, stats.errors, stats.aborted, stats.resets) == (
        4, 0, 2, 1, 1)
    assert stats.statuses == {200: 1, 503: 1}
    assert stats.latency_p50_s == pytest.approx(0.1) and total.count == 4
    assert len(changes) == 8


def test_accounting_reset_keeps_in_flight():
    acc = Accounting()
    acc.begin("/p")
    acc.reset()
    assert acc.snapshot()[1]["/p"].in_flight == 1
    acc.end("/p", 200, aborted=False, reset=False, elapsed=0.0)
    assert acc.snapshot()[1]["/p"].in_flight == 0


def test_options_validation_and_defaults():
    with pytest.raises(ValueError):
        SimOptions(kind="nope")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        SimOptions(kind="sglang", nnodes=2, node_rank=2)
    options = SimOptions(kind="llamacpp", served_name="a")
    assert options.served == "a" and options.model_name.endswith(".gguf")
    assert SimOptions(kind="sglang", nnodes=3).workers_needed == 2
