"""A multi-node group's states and epoch rules, as pure functions (no I/O, no clock).

The head decides and the ranks reconcile. The head keeps a ``Head`` and moves it with
``step`` from what it observes: its own process (``Proc``) and each rank's report
(``Member``, ``unknown`` while that rank's peer is not fresh). Each rank asks
``reconcile`` what to do with its own process from the head's newest ``Report``.

Group states::

    forming -> ready -> degraded -> down -> restarting -> forming
    stopped (asked to), failed (the restart budget is spent: stopped, history kept)

* ``ready``: the head's process is ready and every rank is ready in the same epoch.
* ``degraded``: a rank's peer went silent (unknown) for at most ``grace_s``; a rank that
  reports its process gone (exited, stopped, fenced, starting again) is ``down`` at once.
* ``down``: the epoch is over. The epoch number moves on at once, so every rank stops its
  old-epoch process; the head waits until each rank reports it stopped (or ``settle_s``).
* ``restarting``: the backoff (initial doubling to max, reset after ``reset_after_s``
  ready); past ``max_count`` restarts in ``per_s`` the group is ``failed``.
* While ``forming``, a missing rank counts only against the startup budget.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

GroupState = Literal["forming", "ready", "degraded", "down", "restarting", "stopped", "failed"]
#: a rank as the head sees it: ``unknown`` when its peer is not fresh or says nothing.
RankState = Literal["starting", "ready", "stopping", "down", "unknown", "fenced", "stopped"]
ProcState = Literal["none", "starting", "ready", "exited"]
StartOrder = Literal["together", "head_first", "ranks_first"]
#: states in which rank processes of the current epoch may run.
RUNNING: frozenset[str] = frozenset({"forming", "ready", "degraded"})
HISTORY_KEPT = 20
#: what the head waits beyond the grace for ranks it cannot hear to stop their process.
SETTLE_EXTRA_S = 5.0

Name = Annotated[str, msgspec.Meta(max_length=64)]
Words = Annotated[str, msgspec.Meta(max_length=300)]


class Report(msgspec.Struct, frozen=True, omit_defaults=True):
    """One node's word on one group, in its peer advert. The head's (rank 0) carries the
    group's state and epoch and what the ranks may do; a rank's, its own process."""

    name: Name
    rank: Annotated[int, msgspec.Meta(ge=0, le=255)]
    epoch: Annotated[int, msgspec.Meta(ge=0)]
    #: the head: a GroupState; a rank: a RankState of its own process
    state: Name
    #: the head only: ranks may keep processes of this epoch
    run: bool = False
    #: the head only: ranks may start their process for this epoch
    go: bool = False
    pid: Annotated[int, msgspec.Meta(ge=0)] | None = None
    exit_code: int | None = None
    #: how the process ended, in words
    exit: Words | None = None
    ranks_ready: Annotated[int, msgspec.Meta(ge=0)] = 0
    #: its process's anonymous memory plus swap, to about 5 % (None: unread)
    memory_bytes: Annotated[int, msgspec.Meta(ge=0)] | None = None
    #: a rank: its process outlives its nvpair (``on_exit = "keep"``), so its nvpair's
    #: leave is not the process's end (the head waits ``grace_s`` for it, as for silence)
    kept: bool = False
    #: the group's definition as this node's config says it (``config.group.definition``):
    #: a rank starts a process only for a head whose definition is its own
    config: Annotated[str, msgspec.Meta(max_length=64)] | None = None


def coarse(n: int) -> int:
    """``n`` bytes to about 3-6 % (at least 1 MiB steps), so a report's memory, and with it
    the advert, changes only when the memory really moves."""
    step = max(1 << 20, 1 << max(n.bit_length() - 5, 0))
    return max(n, 0) // step * step


class GroupTag(msgspec.Struct, frozen=True, gc=False):
    """``nvpair.group`` of the head's models in ``/v1/models`` (and in its advert)."""

    name: Name
    epoch: Annotated[int, msgspec.Meta(ge=0)]
    ranks_ready: Annotated[int, msgspec.Meta(ge=0)]
    #: how many ranks besides the head
    ranks: Annotated[int, msgspec.Meta(ge=0)]


class Policy(msgspec.Struct, frozen=True):
    ranks: int  # the number of ranks besides the head
    grace_s: float = 5.0
    startup_budget_s: float = 600.0
    initial_s: float = 10.0
    max_s: float = 300.0
    reset_after_s: float = 600.0
    max_count: int = 10
    per_s: float = 3600.0
    #: "head": a head that exits is restarted alone, its ranks stay up (llama.cpp RPC)
    restart: Literal["group", "head"] = "group"
    start_order: StartOrder = "together"

    @property
    def settle_s(self) -> float:
        return self.grace_s + SETTLE_EXTRA_S


class Member(msgspec.Struct, frozen=True):
    """What the head knows of one rank (ranks 1..n)."""

    rank: int
    node: str
    state: RankState = "unknown"
    #: the epoch its report is for (None: no report)
    epoch: int | None = None
    exit: str | None = None


class Proc(msgspec.Struct, frozen=True):
    """The head's own process: for which epoch, and how it is."""

    state: ProcState = "none"
    epoch: int | None = None
    exit: str | None = None


class EpochRecord(msgspec.Struct, frozen=True):
    epoch: int
    started_at: float
    ended_at: float | None = None
    reason: str | None = None


class Head(msgspec.Struct, frozen=True):
    epoch: int
    state: GroupState = "forming"
    since: float = 0.0
    stopped: bool = False  # a person asked for it to stop
    #: why the last epoch ended, in words
    reason: str | None = None
    next_start_at: float = 0.0
    ready_since: float | None = None
    lost_since: float | None = None
    #: restarts since the backoff last reset (the next wait is initial_s x 2^consecutive)
    consecutive: int = 0
    #: when the restarts of the budget window happened
    restarts: tuple[float, ...] = ()
    total_restarts: int = 0
    #: the head restarts alone (restart = "head"): ranks keep their processes meanwhile
    keep_ranks: bool = False
    history: tuple[EpochRecord, ...] = ()


def first_epoch(persisted: int, seen: int, now: float) -> Head:
    """The head's first state at start: an epoch past any it or a rank ever ran."""
    epoch = max(persisted, seen) + 1
    return Head(epoch=epoch, since=now, history=(EpochRecord(epoch, now),))


def backoff_s(policy: Policy, consecutive: int) -> float:
    """The wait before restart number ``consecutive + 1``: initial, doubled, capped."""
    return float(min(policy.initial_s * 2 ** min(consecutive, 30), policy.max_s))


def _end(h: Head, now: float, reason: str) -> tuple[EpochRecord, ...]:
    history = list(h.history)
    if history and history[-1].epoch == h.epoch and history[-1].ended_at is None:
        history[-1] = msgspec.structs.replace(history[-1], ended_at=now, reason=reason)
    return tuple(history[-HISTORY_KEPT:])


def _begin(h: Head, now: float, epoch: int) -> tuple[EpochRecord, ...]:
    return (*h.history, EpochRecord(epoch, now))[-HISTORY_KEPT:]


def _down(h: Head, now: float, policy: Policy, reason: str, *, keep_ranks: bool = False
          ) -> Head:
    """The epoch ends: count a restart against the budget, or fail."""
    window = tuple(t for t in h.restarts if now - t < policy.per_s)
    history = _end(h, now, reason)
    if len(window) >= policy.max_count:
        why = (f"{reason}; {len(window)} restarts in the last {policy.per_s:g} s, so it is "
               "stopped: start it again when fixed")
        return msgspec.structs.replace(h, state="failed", since=now, reason=why,
                                       history=_end(h, now, why), restarts=window,
                                       ready_since=None, lost_since=None, keep_ranks=False)
    wait = backoff_s(policy, h.consecutive)
    epoch = h.epoch if keep_ranks else h.epoch + 1
    return msgspec.structs.replace(
        h, epoch=epoch, state="restarting" if keep_ranks else "down", since=now,
        reason=reason, next_start_at=now + wait, ready_since=None, lost_since=None,
        consecutive=h.consecutive + 1, restarts=(*window, now),
        total_restarts=h.total_restarts + 1, keep_ranks=keep_ranks, history=history)


def _rank_words(m: Member) -> str:
    return f"rank {m.rank} ({m.node})"


def _lost(m: Member, epoch: int) -> str | None:
    """Why rank ``m`` no longer serves ``epoch`` (None: it may still)."""
    if m.state == "unknown" or m.epoch != epoch:
        return None
    if m.state == "down":
        return f"{_rank_words(m)} {m.exit or 'exited'}"
    if m.state == "fenced":
        return f"{_rank_words(m)} fenced itself (it lost the head)"
    return None


def step(h: Head, now: float, proc: Proc, members: tuple[Member, ...], policy: Policy) -> Head:
    """The head's next state from what it sees now (level-triggered: call it on any change
    and when ``wake_at`` comes)."""
    if h.stopped:
        if h.state != "stopped":
            return msgspec.structs.replace(h, state="stopped", since=now,
                                           reason="stopped by request",
                                           history=_end(h, now, "stopped by request"),
                                           ready_since=None, lost_since=None,
                                           keep_ranks=False)
        return h
    if h.state == "failed":
        return h
    head_exit = proc.state == "exited" and proc.epoch == h.epoch
    if h.state in RUNNING:
        if head_exit:
            reason = f"the head {proc.exit or 'exited'}"
            return _down(h, now, policy, reason, keep_ranks=policy.restart == "head")
        for m in members:
            if (why := _lost(m, h.epoch)) is not None:
                return _down(h, now, policy, why)
        ready = proc.state == "ready" and proc.epoch == h.epoch and all(
            m.state == "ready" and m.epoch == h.epoch for m in members)
        if h.state == "forming":
            if ready:
                return msgspec.structs.replace(h, state="ready", since=now, ready_since=now)
            if now - h.since > policy.startup_budget_s:
                waiting = [_rank_words(m) for m in members
                           if not (m.state == "ready" and m.epoch == h.epoch)]
                if not (proc.state == "ready" and proc.epoch == h.epoch):
                    waiting.insert(0, "the head")
                return _down(h, now, policy, f"not ready within the startup budget "
                             f"({policy.startup_budget_s:g} s): waiting for "
                             f"{', '.join(waiting) or 'nothing'}")
            return h
        # ready or degraded: a rank not ready in this epoch
        gone = [m for m in members if not (m.state == "ready" and m.epoch == h.epoch)]
        if proc.state != "ready" or proc.epoch != h.epoch:
            return _down(h, now, policy, "the head is no longer ready")
        silent = [m for m in gone if m.state == "unknown"]
        if len(silent) < len(gone):  # a rank starting again, or stopped: its epoch is over
            m = next(m for m in gone if m.state != "unknown")
            why = m.exit if m.state == "stopped" and m.exit else f"is {m.state}"
            return _down(h, now, policy, f"{_rank_words(m)} {why} (epoch {m.epoch})")
        if not gone:
            reset = (h.ready_since is not None
                     and now - h.ready_since >= policy.reset_after_s)
            if h.state == "degraded":
                return msgspec.structs.replace(h, state="ready", since=now, lost_since=None,
                                               consecutive=0 if reset else h.consecutive)
            if reset and h.consecutive:
                return msgspec.structs.replace(h, consecutive=0)
            return h
        lost_since = h.lost_since if h.lost_since is not None else now
        if now - lost_since > policy.grace_s:
            words = ", ".join(_rank_words(m) for m in silent)
            return _down(h, now, policy, f"{words} silent for more than {policy.grace_s:g} s "
                         "(its node is frozen, cut off or gone)")
        if h.state == "ready":
            return msgspec.structs.replace(h, state="degraded", since=now, lost_since=now)
        return h
    if h.state == "down":
        settled = all(m.state in ("stopped", "fenced", "down") and m.epoch == h.epoch
                      for m in members)
        head_gone = proc.state in ("none", "exited")
        if head_gone and (settled or now - h.since >= policy.settle_s):
            h = msgspec.structs.replace(h, state="restarting", since=now)
        else:
            return h
    if h.state == "restarting":
        if h.keep_ranks:  # the head alone: its ranks must still be there
            for m in members:
                if (why := _lost(m, h.epoch)) is not None:
                    h = msgspec.structs.replace(h, keep_ranks=False, epoch=h.epoch + 1,
                                                state="down", since=now, reason=why)
                    return h
        if now >= h.next_start_at and (proc.state in ("none", "exited")):
            return msgspec.structs.replace(
                h, state="forming", since=now, keep_ranks=False,
                history=_begin(h, now, h.epoch))  # (the head alone: a new try, same epoch)
        return h
    return h  # stopped and not asked to stop: start() moves it


def wake_at(h: Head, policy: Policy) -> float:
    """When ``step`` may move the state with time alone (inf: only a change can)."""
    if h.state == "forming":
        return h.since + policy.startup_budget_s + 1e-6
    if h.state == "degraded" and h.lost_since is not None:
        return h.lost_since + policy.grace_s + 1e-6
    if h.state == "ready" and h.ready_since is not None and h.consecutive:
        return h.ready_since + policy.reset_after_s
    if h.state == "down":
        return h.since + policy.settle_s
    if h.state == "restarting":
        return h.next_start_at
    return float("inf")


def stop(h: Head) -> Head:
    return msgspec.structs.replace(h, stopped=True)


def start(h: Head, now: float) -> Head:
    """A person asks for the group to run: a stopped or failed group forms a new epoch at
    once, with a fresh budget; a running one is left alone."""
    if h.state not in ("stopped", "failed"):
        return msgspec.structs.replace(h, stopped=False)
    epoch = h.epoch + 1
    return msgspec.structs.replace(
        h, stopped=False, state="forming", since=now, epoch=epoch, consecutive=0,
        restarts=(), reason=None, keep_ranks=False, history=_begin(h, now, epoch))


def restart(h: Head, now: float, reason: str = "restart requested") -> Head:
    """A person (or a reload, ``reason``) asks for a new epoch now: no backoff and no
    budget spent."""
    if h.state in ("stopped", "failed"):
        return start(h, now)
    return msgspec.structs.replace(
        h, epoch=h.epoch + 1, state="down", since=now, next_start_at=now,
        reason=reason, ready_since=None, lost_since=None, keep_ranks=False,
        history=_end(h, now, reason))


def head_may_run(h: Head, members: tuple[Member, ...], policy: Policy,
                 running: bool) -> bool:
    """Whether the head's process should run now (``running``: it does already)."""
    if h.state not in RUNNING:
        return False
    if running or policy.start_order != "ranks_first":
        return True
    return all(m.state == "ready" and m.epoch == h.epoch for m in members)


def report(h: Head, proc: Proc, members: tuple[Member, ...], policy: Policy,
           name: str) -> Report:
    """The head's report in its advert."""
    run = h.state in RUNNING or (h.state == "restarting" and h.keep_ranks)
    go = h.state == "forming" and (policy.start_order != "head_first"
                                   or (proc.state in ("starting", "ready")
                                       and proc.epoch == h.epoch))
    ready = sum(1 for m in members if m.state == "ready" and m.epoch == h.epoch)
    return Report(name=name, rank=0, epoch=h.epoch, state=h.state, run=run, go=go,
                  ranks_ready=ready)


class Decision(msgspec.Struct, frozen=True):
    """What a rank does with its process: run it for ``epoch`` (None: have none)."""

    epoch: int | None
    #: start one now if none runs for that epoch
    start: bool = False
    #: the rank stops its process because it lost its head (not told to)
    fenced: bool = False
    reason: str | None = None


def reconcile(head: Report | None, head_peer: str, head_silent_s: float | None,
              running_epoch: int | None, started_epoch: int | None,
              fence_after_s: float) -> Decision:
    """A rank's decision from its head's newest report.

    ``head_peer``: the head's peer state (fresh, one-way, stale, gone, left, or none);
    ``head_silent_s``: how long since its last advert (None: never heard);
    ``running_epoch``: the epoch of this rank's running process (None: none runs);
    ``started_epoch``: the last epoch this rank started a process for (it starts at most
    one per epoch: a process that exited waits for the next epoch).
    """
    if head_peer == "left":
        return Decision(None, reason="the head left (its nvpair stopped)")
    if head is None and head_peer in ("fresh", "one-way"):
        # the head is heard and runs no such group (a reload removed it there): it never
        # will for this epoch, so nothing runs for it
        return Decision(None, reason="the head runs no such group (not in its config)")
    if head is None or head_peer not in ("fresh", "one-way"):
        silent = head_silent_s is None or head_silent_s > fence_after_s
        if running_epoch is not None and silent:
            return Decision(None, fenced=True, reason=(
                f"no word from the head for more than {fence_after_s:g} s: fenced"))
        return Decision(running_epoch, reason="waiting for the head")
    if not head.run:
        return Decision(None, reason=f"the group is {head.state}")
    if running_epoch is not None and running_epoch != head.epoch:
        return Decision(None, reason=f"epoch {running_epoch} is over (now {head.epoch})")
    if running_epoch == head.epoch:
        return Decision(head.epoch)
    if head.go and started_epoch != head.epoch:
        return Decision(head.epoch, start=True)
    return Decision(None, reason=f"waiting to start epoch {head.epoch}")


class KeyView(msgspec.Struct, frozen=True):
    """The etcd epoch key as a rank last read it (``nvpair.peers.epochkey.EpochWatch``):
    ``epoch`` None when the key is absent (no head holds it: its lease is gone)."""

    epoch: int | None = None
    node: str | None = None


def apply_key(d: Decision, key: KeyView | None, head_node: str,
              running_epoch: int | None) -> Decision:
    """With the etcd backend, a rank runs a process only for the epoch its head holds
    under the group's key: ``d`` (from the head's advert) held to it. ``key`` None: not
    read yet (nothing starts, nothing stops for it). A key that is gone fences a running
    process at once (its head's lease ended); a key held by another node, or for another
    epoch than the head's advert says, runs nothing until they agree."""
    if key is None:
        return Decision(running_epoch, reason="waiting for the epoch key") if d.start else d
    if key.epoch is None:
        if running_epoch is not None:
            return Decision(None, fenced=True, reason=(
                "the epoch key is gone (the head's etcd lease ended): fenced"))
        return Decision(None, reason="waiting for the head to claim the epoch key")
    if key.node != head_node:
        return Decision(None, reason=(
            f"the epoch key is held by {key.node}, not by the head ({head_node})"))
    if d.epoch is not None and d.epoch != key.epoch:
        return Decision(None, reason=(
            f"the head's epoch {d.epoch} is not the key's ({key.epoch}): waiting"))
    return d
