"""The group state machine and its epoch rules, as pure functions: no I/O, no clock."""

from __future__ import annotations

import msgspec
import pytest

from nvpair.state.group import (
    HISTORY_KEPT,
    Decision,
    Head,
    KeyView,
    Member,
    Policy,
    Proc,
    Report,
    apply_key,
    backoff_s,
    coarse,
    first_epoch,
    head_may_run,
    reconcile,
    report,
    restart,
    start,
    step,
    stop,
    wake_at,
)

POLICY = Policy(ranks=2, startup_budget_s=100.0)


def members(epoch: int, *states: str, exit: str | None = None) -> tuple[Member, ...]:
    return tuple(Member(rank=i + 1, node=f"n{i + 1}", state=s, epoch=epoch,  # type: ignore[arg-type]
                        exit=exit if s == "down" else None) for i, s in enumerate(states))


def ready(h: Head, now: float) -> Head:
    h = step(h, now, Proc("ready", h.epoch), members(h.epoch, "ready", "ready"), POLICY)
    assert h.state == "ready"
    return h


def through_restart(h: Head, now: float) -> tuple[Head, float]:
    """From down, the ranks report their old process stopped; then the backoff runs out."""
    assert h.state == "down"
    wait = max(h.next_start_at - now, 0.0)
    h = step(h, now, Proc(), members(h.epoch, "stopped", "stopped"), POLICY)
    if wait > 0:
        assert h.state == "restarting"
        h = step(h, h.next_start_at, Proc(), members(h.epoch, "stopped", "stopped"), POLICY)
    assert h.state == "forming"
    return h, wait


def test_ready_only_after_the_last_rank() -> None:
    h = first_epoch(persisted=6, seen=4, now=0.0)
    assert (h.epoch, h.state) == (7, "forming")
    h = step(h, 1, Proc("ready", 7), members(7, "ready", "starting"), POLICY)
    assert h.state == "forming"
    h = step(h, 2, Proc("starting", 7), members(7, "ready", "ready"), POLICY)
    assert h.state == "forming"
    h = step(h, 3, Proc("ready", 7), members(7, "ready", "ready"), POLICY)
    assert h.state == "ready"
    assert report(h, Proc("ready", 7), members(7, "ready", "ready"), POLICY, "g") == Report(
        name="g", rank=0, epoch=7, state="ready", run=True, go=False, ranks_ready=2)


def test_a_ready_rank_of_an_older_epoch_does_not_count() -> None:
    h = first_epoch(0, 0, 0.0)
    h = step(h, 1, Proc("ready", 1), (*members(1, "ready"), Member(2, "n2", "ready", 0)), POLICY)
    assert h.state == "forming"


def test_a_rank_that_exits_turns_the_group_down_at_once_and_ends_the_epoch() -> None:
    h = ready(first_epoch(0, 0, 0.0), 1)
    h = step(h, 5, Proc("ready", 1), members(1, "ready", "down", exit="exited with signal 9"),
             POLICY)
    assert (h.state, h.epoch) == ("down", 2)
    assert h.reason == "rank 2 (n2) exited with signal 9"
    assert h.history[-1].epoch == 1 and h.history[-1].ended_at == 5
    assert h.history[-1].reason == "rank 2 (n2) exited with signal 9"
    # the new epoch tells every rank to stop: run is off while down
    assert not report(h, Proc("ready", 1), (), POLICY, "g").run
    # the head's own process is still there: no restart yet
    assert step(h, 6, Proc("ready", 1), members(2, "stopped", "stopped"), POLICY).state == "down"
    h, wait = through_restart(h, 6)
    assert wait == 9.0 and h.epoch == 2  # 10 s from the down at 5
    assert (h.history[-1].epoch, h.history[-1].started_at) == (2, 15)


def test_down_waits_for_silent_ranks_only_the_settle_time() -> None:
    h = ready(first_epoch(0, 0, 0.0), 1)
    h = step(h, 2, Proc("exited", 1, "exited with code 1"), members(1, "ready", "ready"), POLICY)
    assert h.state == "down" and h.reason == "the head exited with code 1"
    quiet = (Member(1, "n1", "stopped", 2), Member(2, "n2", "unknown", 1))
    assert step(h, 2 + POLICY.settle_s - 0.1, Proc(), quiet, POLICY).state == "down"
    assert wake_at(h, POLICY) == 2 + POLICY.settle_s
    assert step(h, 2 + POLICY.settle_s, Proc(), quiet, POLICY).state in ("restarting",
                                                                          "forming")


def test_backoff_doubles_to_the_cap_then_the_budget_fails_the_group() -> None:
    assert [backoff_s(POLICY, n) for n in range(7)] == [10, 20, 40, 80, 160, 300, 300]
    h = first_epoch(0, 0, 0.0)
    now = 0.0
    waits = []
    for _ in range(10):  # a rank that fails at start, every time
        now += 1
        h = step(h, now, Proc("starting", h.epoch), members(h.epoch, "down", "starting",
                                                                exit="exited with code 1"),
                 POLICY)
        assert h.state == "down"
        h, wait = through_restart(h, now)
        waits.append(wait)
        now = h.since
    assert waits == [10, 20, 40, 80, 160, 300, 300, 300, 300, 300]
    assert now < 3600
    h = step(h, now + 1, Proc("starting", h.epoch), members(h.epoch, "down", "starting"), POLICY)
    assert h.state == "failed" and h.total_restarts == 10
    assert h.reason is not None and "10 restarts in the last 3600 s" in h.reason
    assert h.history[-1].reason == h.reason and len(h.history) == 11
    assert not report(h, Proc(), (), POLICY, "g").run
    assert step(h, now + 9999, Proc(), members(h.epoch, "stopped", "stopped"), POLICY) == h
    # a person starts it again: a new epoch at once, a fresh budget
    h2 = start(h, now + 10)
    assert (h2.state, h2.epoch, h2.consecutive, h2.restarts) == ("forming", h.epoch + 1, 0, ())


def test_restarts_outside_the_window_do_not_count() -> None:
    h = msgspec.structs.replace(ready(first_epoch(0, 0, 0.0), 1), restarts=(0.0,) * 10)
    h = step(h, 3601, Proc("ready", 1), members(1, "down", "ready"), POLICY)
    assert h.state == "down" and h.restarts == (3601,)


def test_history_keeps_the_last_20_epochs() -> None:
    h = first_epoch(0, 0, 0.0)
    for i in range(30):
        h = restart(h, float(i))
        h, _ = through_restart(h, float(i))
    assert len(h.history) == HISTORY_KEPT
    assert [r.epoch for r in h.history] == list(range(h.epoch - 19, h.epoch + 1))


def test_a_silent_rank_degrades_then_downs_after_the_grace() -> None:
    h = ready(first_epoch(0, 0, 0.0), 1)
    silent = (Member(1, "n1", "ready", 1), Member(2, "n2", "unknown", 1))
    h = step(h, 10, Proc("ready", 1), silent, POLICY)
    assert h.state == "degraded" and wake_at(h, POLICY) == pytest.approx(15)
    back = step(h, 14, Proc("ready", 1), members(1, "ready", "ready"), POLICY)
    assert back.state == "ready"
    assert step(h, 15, Proc("ready", 1), silent, POLICY).state == "degraded"
    down = step(h, 15.1, Proc("ready", 1), silent, POLICY)
    assert down.state == "down" and down.reason is not None
    assert down.reason.startswith("rank 2 (n2) silent for more than 5 s")


def test_a_rank_starting_again_in_a_ready_epoch_is_a_lost_rank() -> None:
    h = ready(first_epoch(0, 0, 0.0), 1)
    h = step(h, 3, Proc("ready", 1), members(1, "ready", "starting"), POLICY)
    assert h.state == "down" and h.reason == "rank 2 (n2) is starting (epoch 1)"


def test_a_rank_whose_nvpair_left_ends_the_epoch_at_once() -> None:
    h = ready(first_epoch(0, 0, 0.0), 1)
    left = (Member(1, "n1", "ready", 1), Member(2, "n2", "stopped", 1, "left (its nvpair "
                                                                       "stopped)"))
    h = step(h, 3, Proc("ready", 1), left, POLICY)
    assert h.state == "down" and h.reason == "rank 2 (n2) left (its nvpair stopped) (epoch 1)"


def test_forming_has_the_startup_budget_only() -> None:
    h = first_epoch(0, 0, 0.0)
    waiting = (Member(1, "n1", "ready", 1), Member(2, "n2", "unknown"))
    assert step(h, 100, Proc("ready", 1), waiting, POLICY).state == "forming"
    h = step(h, 100.1, Proc("ready", 1), waiting, POLICY)
    assert h.state == "down" and h.reason == (
        "not ready within the startup budget (100 s): waiting for rank 2 (n2)")


def test_the_backoff_resets_after_ten_minutes_ready() -> None:
    h = ready(msgspec.structs.replace(first_epoch(0, 0, 0.0), consecutive=3), 1)
    ok = members(1, "ready", "ready")
    assert step(h, 600, Proc("ready", 1), ok, POLICY).consecutive == 3
    assert wake_at(h, POLICY) == 601
    assert step(h, 601, Proc("ready", 1), ok, POLICY).consecutive == 0


def test_stop_start_restart() -> None:
    h = ready(first_epoch(0, 0, 0.0), 1)
    s = step(stop(h), 2, Proc("ready", 1), members(1, "ready", "ready"), POLICY)
    assert s.state == "stopped" and s.history[-1].reason == "stopped by request"
    assert not report(s, Proc(), (), POLICY, "g").run
    assert step(s, 99, Proc(), (), POLICY) == s
    again = start(s, 100)
    assert (again.state, again.epoch) == ("forming", 2)
    r = restart(h, 5)
    assert (r.state, r.epoch, r.next_start_at, r.consecutive) == ("down", 2, 5, 0)
    r, wait = through_restart(r, 6)
    assert wait == 0 and r.state == "forming"


def test_start_orders() -> None:
    h = first_epoch(0, 0, 0.0)
    none = members(1, "stopped", "stopped")
    rpc = msgspec.structs.replace(POLICY, start_order="ranks_first")
    assert not head_may_run(h, none, rpc, running=False)
    assert not head_may_run(h, members(1, "ready", "starting"), rpc, running=False)
    assert head_may_run(h, members(1, "ready", "ready"), rpc, running=False)
    assert report(h, Proc(), none, rpc, "g").go
    vllm = msgspec.structs.replace(POLICY, start_order="head_first")
    assert not report(h, Proc(), none, vllm, "g").go
    assert report(h, Proc("starting", 1), none, vllm, "g").go
    assert report(h, Proc(), none, POLICY, "g").go and head_may_run(h, none, POLICY, False)


def test_restart_head_keeps_the_ranks() -> None:
    rpc = msgspec.structs.replace(POLICY, restart="head", start_order="ranks_first")
    h = step(first_epoch(0, 0, 0.0), 1, Proc("ready", 1), members(1, "ready", "ready"), rpc)
    h = step(h, 2, Proc("exited", 1, "was killed by signal 6"), members(1, "ready", "ready"),
             rpc)
    assert (h.state, h.epoch, h.keep_ranks) == ("restarting", 1, True)
    assert report(h, Proc(), (), rpc, "g").run
    h = step(h, h.next_start_at, Proc(), members(1, "ready", "ready"), rpc)
    assert (h.state, h.epoch) == ("forming", 1)
    assert [(r.epoch, r.reason) for r in h.history] == [
        (1, "the head was killed by signal 6"), (1, None)]
    assert head_may_run(h, members(1, "ready", "ready"), rpc, running=False)
    # a rank lost while the head waits: the ranks' epoch is over too
    h2 = step(first_epoch(0, 0, 0.0), 1, Proc("ready", 1), members(1, "ready", "ready"), rpc)
    h2 = step(h2, 2, Proc("exited", 1), members(1, "ready", "ready"), rpc)
    h2 = step(h2, 3, Proc(), members(1, "ready", "down"), rpc)
    assert (h2.state, h2.epoch) == ("down", 2)


def test_memory_is_coarse() -> None:
    assert coarse(0) == 0 and coarse(5 << 20) == 5 << 20 and coarse((5 << 20) + 7) == 5 << 20
    for n in (3 << 20, 123_456_789, 106 << 30, (1 << 40) + 12345):
        assert 0.93 * n < coarse(n) <= n
    assert coarse(106 << 30) == coarse((106 << 30) + (100 << 20))  # 100 MB more: no change


HEAD = Report(name="g", rank=0, epoch=5, state="forming", run=True, go=True)


@pytest.mark.parametrize(("head", "peer", "silent", "running", "started", "expected"), [
    (HEAD, "fresh", 0.1, None, None, (5, True, False)),
    (HEAD, "fresh", 0.1, None, 5, (None, False, False)),  # exited: waits for the next epoch
    (HEAD, "fresh", 0.1, 5, 5, (5, False, False)),
    (HEAD, "fresh", 0.1, 4, 4, (None, False, False)),  # an old epoch: stopped at once
    (msgspec.structs.replace(HEAD, run=False, state="down"), "fresh", 0.1, 5, 5,
     (None, False, False)),
    (msgspec.structs.replace(HEAD, go=False), "fresh", 0.1, None, None, (None, False, False)),
    (HEAD, "stale", 29.0, 5, 5, (5, False, False)),  # the head silent: kept until the fence
    (HEAD, "stale", 30.5, 5, 5, (None, False, True)),
    (HEAD, "gone", 31.0, None, 5, (None, False, False)),
    (None, "none", None, 5, 5, (None, False, True)),  # a head never heard of
    (HEAD, "left", 1.0, 5, 5, (None, False, False)),  # the head's nvpair stopped
    (None, "fresh", 0.1, 5, 5, (None, False, False)),  # heard, without it: removed there
])
def test_reconcile(head, peer, silent, running, started, expected) -> None:
    d = reconcile(head, peer, silent, running, started, fence_after_s=30.0)
    assert (d.epoch, d.start, d.fenced) == expected


START, RUN = Decision(5, start=True), Decision(5)


@pytest.mark.parametrize(("d", "key", "running", "expected"), [
    (START, KeyView(5, "n0"), None, (5, True, False)),  # the key agrees: as the advert says
    (RUN, KeyView(5, "n0"), 5, (5, False, False)),
    (START, None, None, (None, False, False)),  # not read yet: nothing starts
    (RUN, None, 5, (5, False, False)),  # ... and nothing stops for it
    (RUN, KeyView(None), 5, (None, False, True)),  # the key gone: fenced at once
    (START, KeyView(None), None, (None, False, False)),
    (RUN, KeyView(9, "n7"), 5, (None, False, False)),  # another head's key: run nothing
    (START, KeyView(9, "n7"), None, (None, False, False)),
    (START, KeyView(4, "n0"), None, (None, False, False)),  # advert and key disagree
    (RUN, KeyView(6, "n0"), 5, (None, False, False)),
    (Decision(None, reason="x"), KeyView(5, "n0"), 5, (None, False, False)),
])
def test_a_rank_is_held_to_the_epoch_key(d, key, running, expected) -> None:
    out = apply_key(d, key, "n0", running)
    assert (out.epoch, out.start, out.fenced) == expected
    assert out.reason or out == d
