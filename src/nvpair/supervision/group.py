"""This node's part of a multi-node group: the head's loop or a rank's, and its process.

The head (rank 0) steps the group's state machine (``nvpair.state.group``) from its own
process and the ranks' reports, and publishes its decision in its advert; a rank runs its
process only for the head's current epoch and reports it. Both are level-triggered: any
change (a peer's advert, the board, a process) wakes the loop, which recomputes what should
run and makes it so. Processes are ``nvpair.supervision.process.run_engine_process``: their own
session, stopped with the role's signal, grace and SIGKILL, on record for
``nvpair.supervision.orphans``, a log file per epoch (the last ``LOGS_KEPT`` kept).

With ``on_exit = "keep"`` a rank's process outlives its nvpair (``nvpair.supervision.kept``):
its record carries its epoch and its head's boot, and the next nvpair adopts it into a
slot of that epoch; the rank's step then keeps it while the head still has that boot and
epoch, and stops it like any old-epoch process once the head has moved on. The end of an
epoch always stops it. The head's own process always stops with its nvpair.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import NamedTuple, Protocol

import httpx2
import msgspec
import trio

from nvpair.base.ages import age
from nvpair.base.boundary import Part, failure_line
from nvpair.base.changes import Changes
from nvpair.base.logs import DEFAULT_RATE, EngineLog, RateCap
from nvpair.config.command import build_command, engine_env
from nvpair.config.group import GroupSettings, definition, role_manifest, role_values
from nvpair.config.settings import EngineSpec, placeholder_values
from nvpair.state import group as machine
from nvpair.state.group import RUNNING, GroupTag, Head, KeyView, Member, Policy, Proc, Report
from nvpair.state.snapshot import Board
from nvpair.supervision.kept import output_path
from nvpair.supervision.lifecycle import DRAIN_POLL_S
from nvpair.supervision.memproc import MemorySourceError, parse_listening, read_status
from nvpair.supervision.orphans import EngineProcs, Kept, Record, command_digest
from nvpair.supervision.process import EngineProcess, Stopping, describe_exit, run_engine_process

log = logging.getLogger("nvpair.group")

EPOCH_ENV = "NVPAIR_GROUP_EPOCH"
LOGS_KEPT = 5
#: the longest wait between two looks at the group (changes wake it sooner)
TICK_S = 1.0
#: how often a rank that is not ready yet is looked at (its probe, its socket)
STARTING_CHECK_S = 0.25
#: how soon a ready rank whose look failed is looked at again (its interval otherwise:
#: the steady cost stays the interval's, while a hung rank is still found in a few seconds)
RECHECK_S = 1.0
#: how often the memory of this node's group process is read (/proc/PID/status)
MEMORY_EVERY_S = 5.0


def next_look(ready: bool, ok: bool, interval_s: float) -> float:
    """Seconds until a rank is looked at again: soon while it starts, its interval while it
    answers, and soon after a failed look (a rank that stops answering is down after its
    failure threshold of looks, not that many intervals). A rank's exit needs no look: its
    process is nvpair's child."""
    if not ready:
        return STARTING_CHECK_S
    return interval_s if ok else min(RECHECK_S, interval_s)


def memory_of(pid: int | None) -> int | None:
    """A process's anonymous memory plus swap, coarsely (``machine.coarse``; None: not
    readable, or no process)."""
    if pid is None:
        return None
    try:
        return machine.coarse(read_status(pid).watched_bytes)
    except MemorySourceError:
        return None


class Heard(NamedTuple):
    """What this node heard from one node about one group."""

    report: Report | None
    #: the node's peer state: fresh, one-way, stale, gone, left, or none (never heard)
    peer: str
    #: seconds since its last advert (None: never heard)
    silent_s: float | None = None
    #: the host of its advertised URL (where its engine's ports are)
    host: str | None = None
    #: its nvpair's boot id: a rank's process belongs to one boot of its head
    boot: str | None = None


class GroupPeers(Protocol):
    """The peer table as a group reads it (``nvpair.peers.groups``)."""

    @property
    def version(self) -> int: ...

    async def wait_changed(self, since_version: int) -> int: ...

    def heard(self, node: str, group: str, now: float) -> Heard: ...

    def own_host(self) -> str | None: ...


class Reports:
    """This node's reports on its groups, for its advert (``nvpair.peers.advert``)."""

    def __init__(self) -> None:
        self.items: dict[str, Report] = {}
        self.changes = Changes()
        #: moves after every step of a group's loop (GET /v1/events' cue: nvpair.state.events)
        self.steps = Changes()
        #: called on every change (the advertiser refreshes, so peers hear at once)
        self.listeners: list[Callable[[], None]] = []

    def set(self, report: Report) -> None:
        if self.items.get(report.name) == report:
            return
        self.items[report.name] = report
        self.changes.bump()
        for listener in self.listeners:
            listener()

    def drop(self, name: str) -> None:
        """Group ``name`` is no longer on this node (a reload removed it)."""
        if self.items.pop(name, None) is not None:
            self.changes.bump()
            for listener in self.listeners:
                listener()

    def all(self) -> tuple[Report, ...]:
        return tuple(self.items[k] for k in sorted(self.items))


def _ipv4_hex(host: str) -> str | None:
    """An IPv4 address as ``/proc/net/tcp`` writes it (little-endian hex), else None."""
    try:
        packed = socket.inet_aton(host)
    except OSError:
        return None
    return packed[::-1].hex().upper()


def listening(port: int, host: str = "0.0.0.0", proc_net: Path = Path("/proc/net")) -> bool:
    """Whether a TCP socket listens on ``host:port`` on this machine (``/proc/net/tcp`` and
    ``tcp6``, state 0A; any address for 0.0.0.0, ::, or a host name): an rpc-server is
    never connected to, since it serves one client at a time."""
    exact = None if host in ("0.0.0.0", "::") else _ipv4_hex(host)
    for name in ("tcp", "tcp6"):
        try:
            text = (proc_net / name).read_text()
        except OSError:
            continue
        for found in parse_listening(text):
            if found.port == port and (exact is None or name == "tcp6"
                                       or found.address in (exact, "00000000")):
                return True
    return False


def read_epoch(path: Path) -> int:
    """The epoch kept in ``path``; 0 when there is none or it holds anything else (said
    once in the log: the head then starts past what its ranks report)."""
    try:
        data = path.read_bytes()[:64]
    except OSError:
        return 0
    text = data.decode("ascii", "replace").strip()
    if not re.fullmatch(r"[0-9]{1,15}", text):
        log.warning("%s does not hold an epoch; starting from 0", path)
        return 0
    return int(text)


def prune_logs(log_dir: Path, name: str, keep: int) -> None:
    """Remove all but the newest ``keep`` epoch logs of group ``name`` (``NAME.eN.log``)."""
    try:
        found = [(int(m[1]), p) for p in log_dir.glob(f"{name}.e*.log")
                 if (m := re.fullmatch(rf"{re.escape(name)}\.e(\d{{1,15}})\.log", p.name))]
    except OSError:
        return
    for _, path in sorted(found)[:max(len(found) - keep, 0)]:
        with contextlib.suppress(OSError):
            path.unlink(missing_ok=True)


class Slot:
    """One process of one epoch, from spawn to reap."""

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch
        self.scope = trio.CancelScope()
        self.handle: EngineProcess | None = None
        self.started_at = trio.current_time()
        self.ready = False
        self.stopping = False
        self.fenced = False
        self.done = False
        self.exit: str | None = None
        self.exit_code: int | None = None
        #: the boot of the head it was started for (a rank's)
        self.head_boot: str | None = None
        #: a kept process a previous nvpair left (``on_exit = "keep"``), adopted
        self.adopted = False
        #: started from a config a reload has changed since (a rank stops it once its
        #: head's definition of the group agrees with the new one)
        self.stale = False
        #: why it was stopped, for the head (a rank's report)
        self.stop_reason: str | None = None
        #: an adopted process's readiness is known: its first look answered, or as many
        #: looks as the failure threshold did not (until then it reports ``unknown``)
        self.looked = False

    @property
    def pid(self) -> int | None:
        return None if self.handle is None else self.handle.pid

    @property
    def alive(self) -> bool:
        return not self.done


class Status(msgspec.Struct, frozen=True):
    """What ``GET /v1/groups/{name}`` shows of this node's part (``nvpair.http.groups``)."""

    name: str
    node: str
    rank: int
    role: str
    ranks: tuple[str, ...]
    head: Head | None = None
    members: tuple[Member, ...] = ()
    report: Report | None = None
    #: a rank's: the head's last report
    head_report: Report | None = None
    #: per rank: (node, state since, pid, exit words, exit code)
    detail: tuple[tuple[int, float, int | None, str | None, int | None], ...] = ()
    error: str | None = None
    log_file: str | None = None
    #: the head's own process: none, starting, ready, exited
    head_proc: str = "none"
    #: per rank: its process's memory as last reported (this node's: as last read)
    memory: tuple[int | None, ...] = ()


def policy_of(spec: EngineSpec) -> Policy:
    """The head's state machine's settings from a group's engine."""
    g = spec.group
    assert g is not None
    return Policy(
        ranks=g.nnodes - 1, grace_s=g.rank_lost_grace_s,
        startup_budget_s=spec.startup_budget_s, initial_s=g.backoff.initial_s,
        max_s=g.backoff.max_s, reset_after_s=g.backoff.reset_after_s,
        max_count=g.max_restarts.count, per_s=g.max_restarts.per_s, restart=g.restart,
        start_order=g.start_order)


class GroupRunner:
    """Runs this node's role of one group until cancelled."""

    def __init__(self, spec: EngineSpec, board: Board, peers: GroupPeers, reports: Reports,
                 node: str, log_dir: Path | None, procs: EngineProcs,
                 state_dir: Path | None, log_rate: RateCap = DEFAULT_RATE) -> None:
        assert spec.group is not None
        self.spec = spec
        self.group: GroupSettings = spec.group
        self.board = board
        self.peers = peers
        self.reports = reports
        self.node = node
        self.log_dir = log_dir
        self.log_rate = log_rate  # (the config's log_lines_per_s, log_bytes_per_s)
        self.procs = procs
        self.state_dir = state_dir
        self.policy = policy_of(spec)
        #: the group's definition as this node's config says it (in its report)
        self.config = definition(self.group, spec.manifest, placeholder_values(spec))
        #: routed requests in flight on the head's engine (the router's count; a reload's
        #: restart of the group, or its removal, waits for them: nothing generating is cut)
        self.in_flight: Callable[[], int] = lambda: 0
        #: the head: a reload's restart waits for the requests in flight (admits none)
        self._draining = False
        self._renew_epoch: int | None = None
        #: a reload removed the group: the head admits nothing and stops it; a rank stops
        #: its process
        self._retiring = False
        #: why this node's part waits (its config and the head's disagree), in words
        self.note: str | None = None
        self.head: Head | None = None
        self.slot: Slot | None = None
        #: a rank whose process outlives its nvpair (``on_exit = "keep"``, with a state
        #: directory); the head's never does (its new boot restarts the group anyway)
        self.keep = spec.on_exit == "keep" and self.group.rank != 0 and procs.dir is not None
        #: a rank held stopped on this node (``hold``: ``nvpair stop-engines``)
        self.held = False
        #: an adopted process's command digest, until the head is first heard: another
        #: command in the config now (changed while nvpair was down) stops it
        self._adopted_digest: str | None = None
        self.started_epoch: int | None = None
        self.fenced = False
        self.members: tuple[Member, ...] = ()
        self._wake = Changes()
        self._since: dict[int, tuple[str, float]] = {}
        self.part = Part(f"group {spec.name}", self._failed, logger=log)
        self.error: str | None = None
        self.log: EngineLog | None = None
        self._nursery: trio.Nursery | None = None
        self._reaper: trio.Nursery | None = None
        self._output = Part(f"group {spec.name}: output", logger=log)
        self._client: httpx2.AsyncClient | None = None
        self.heard_head: Heard | None = None
        #: with the etcd backend, the head claims each epoch before it starts anything
        #: (``nvpair.peers.epochkey``): None once claimed, else why not
        self.claim: Callable[[int], Awaitable[str | None]] | None = None
        self._claimed: int | None = None
        #: with the etcd backend, on a rank: the epoch key as last read (its watch calls
        #: ``poke`` on every change)
        self.key_view: Callable[[], KeyView | None] | None = None
        self._claiming = False
        self.claim_error: str | None = None
        #: when this node's group process's memory was read, for which (pid, ready), what
        self._memory: tuple[float, tuple[int | None, bool], int | None] = (
            float("-inf"), (None, False), None)

    def poke(self) -> None:
        """Look at the group again now (something it reads changed)."""
        self._wake.bump()

    # -- a reload (docs/groups.md, "Reload") ------------------------------------------------

    def respec(self, spec: EngineSpec, *, restart: bool) -> None:
        """Take a reload's ``spec`` of this group (the same role). In place (``restart``
        false): its timings, backoff, fencing and probes, from the next look on. With
        ``restart``: what runs changes. The head drains its engine (admits nothing new;
        the routed requests in flight finish) and then starts a new epoch, as
        ``POST .../restart`` does; a rank stops its process once its head's definition of
        the group is its own (the head's restart ends the epoch anyway), and starts the
        next epoch's with the new command. Sync."""
        assert spec.group is not None and (spec.group.rank == 0) == (self.group.rank == 0)
        old_url = self.spec.url
        self.spec, self.group, self.policy = spec, spec.group, policy_of(spec)
        self.keep = (spec.on_exit == "keep" and self.group.rank != 0
                     and self.procs.dir is not None)
        self.config = definition(self.group, spec.manifest, placeholder_values(spec))
        if spec.url != old_url and self._client is not None and self._nursery is not None:
            client, self._client = self._client, None
            self._nursery.start_soon(client.aclose)
        if restart and self.group.rank != 0 and self.slot is not None:
            self.slot.stale = True
        elif restart and self.head is not None and (self.head.state in RUNNING
                                                    or self.head.keep_ranks):
            self._renew_epoch = self.head.epoch
            if not self._draining and self._nursery is not None:
                self._draining = True
                self._nursery.start_soon(self._renew)
        self._wake.bump()

    async def _renew(self) -> None:
        """The head, after a reload changed what runs: once no routed request is in
        flight on its engine, a new epoch (unless one began meanwhile: it runs the new
        config already)."""
        try:
            await self._drained()
            h = self.head
            if h is not None and h.epoch == self._renew_epoch and (
                    h.state in RUNNING or h.keep_ranks):
                self.head = machine.restart(h, trio.current_time(),
                                            "its config changed (reload)")
                self._save_epoch(self.head.epoch)
                log.info("group %s: its config changed (reload): epoch %d", self.spec.name,
                         self.head.epoch)
        finally:
            self._draining = False
            self._wake.bump()

    async def _drained(self) -> None:
        """Until no routed request is in flight on the head's engine (the router's count,
        looked at on each change of the group and every ``DRAIN_POLL_S``)."""
        while self.in_flight() > 0:
            version = self._wake.version
            with trio.move_on_after(DRAIN_POLL_S):
                await self._wake.wait_changed(version)

    async def retire(self) -> None:
        """A reload removed the group: the head admits nothing new, waits for the routed
        requests in flight, then stops the group (its ranks are told to stop); a rank
        stops its process (a kept one too). Returns once this node's process has ended."""
        self._retiring = True
        self._wake.bump()
        if self.group.rank == 0:
            await self._drained()
            if self.head is not None:
                self.head = machine.stop(self.head)
        self.held = True
        self._wake.bump()
        while self.slot is not None and not self.slot.done:
            version = self._wake.version
            if not self.slot.stopping:
                self._stop(self.slot)
            with trio.move_on_after(TICK_S):
                await self._wake.wait_changed(version)

    def _failed(self, reason: str | None) -> None:
        self.error = reason

    # -- requests (sync: recorded, the loop acts) -----------------------------------------

    def request(self, action: str) -> str | None:
        """``stop``, ``start`` or ``restart`` on the head; None, or why not (on a rank)."""
        if self.head is None:
            return f"this node is rank {self.group.rank} of group {self.spec.name}; ask the head"
        now = trio.current_time()
        if action == "stop":
            self.head = machine.stop(self.head)
        elif action == "start":
            self.head = machine.start(self.head, now)
        else:
            self.head = machine.restart(self.head, now)
        self._save_epoch(self.head.epoch)
        self._wake.bump()
        return None

    def hold(self, held: bool) -> str | None:
        """On a rank: stop its own process and start none (``held``: what ``nvpair
        stop-engines`` asks), or run again as the head says; None, or why not (the head's
        process is the group's: stop the group)."""
        if self.group.rank == 0:
            return (f"this node is the head of group {self.spec.name}: its process is the "
                    "group's; stop or start the group")
        if held != self.held:
            self.held = held
            log.info("group %s: rank %d %s on this node", self.spec.name, self.group.rank,
                     "held stopped" if held else "runs again as its head says")
            self._wake.bump()
        return None

    # -- the loop --------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        """Run until cancelled. Started value: None, at once. Cancellation stops this
        node's group process (its signal, grace, SIGKILL, shielded). Raises: nothing but
        Cancelled (a failure is the group's ``error``, retried with backoff)."""
        try:
            async with trio.open_nursery() as reaper:
                self._reaper = reaper
                async with trio.open_nursery() as nursery:
                    self._nursery = nursery
                    nursery.start_soon(self._forward_peers)
                    if self.group.rank == 0:  # the head's readiness is its engine's probes
                        nursery.start_soon(self._forward_board)
                        if self.spec.on_exit == "keep":
                            log.info("group %s: on_exit = keep keeps the ranks' processes; "
                                     "the head's stops with nvpair (a new head restarts its "
                                     "group)", self.spec.name)
                    elif self.keep:
                        self._adopt_kept()
                    task_status.started()
                    try:
                        await self.part.supervise(self._loop)
                    finally:
                        if self._client is not None:
                            with trio.CancelScope(shield=True):
                                await self._client.aclose()
        finally:  # once the process's output is read to its end: its epoch's log file
            if self.log is not None:
                self.log.close()

    async def _forward_peers(self) -> None:
        version = self.peers.version
        while True:
            version = await self.peers.wait_changed(version)
            self._wake.bump()

    async def _forward_board(self) -> None:
        version = self.board.current.version
        while True:
            version = (await self.board.wait_changed(version)).version
            self._wake.bump()

    async def _loop(self) -> None:
        while True:
            version = self._wake.version
            now = trio.current_time()
            wake = self._head_step(now) if self.group.rank == 0 else self._rank_step(now)
            self.part.ok()
            self.reports.steps.bump()
            timeout = max(min(wake - trio.current_time(), TICK_S), 0.0)
            with trio.move_on_after(timeout):
                await self._wake.wait_changed(version)

    # -- the head --------------------------------------------------------------------------

    def _proc(self) -> Proc:
        slot = self.slot
        if slot is None:
            return Proc()
        if slot.done:
            if slot.stopping:
                return Proc()
            return Proc("exited", slot.epoch, slot.exit)
        e = self.board.current.engine(self.spec.name)
        # a probe answered since this process started (the engine may have stayed ready
        # across a quick restart: its state's age says nothing of this process)
        ready = (e is not None and e.state == "ready" and e.checked_at is not None
                 and e.checked_at >= slot.started_at)
        return Proc("ready" if ready else "starting", slot.epoch)

    def _member_list(self, now: float) -> tuple[Member, ...]:
        out = []
        other = []
        for rank, node in enumerate(self.group.ranks[1:], start=1):
            heard = self.peers.heard(node, self.spec.name, now)
            r = heard.report
            if r is not None and r.config is not None and r.config != self.config:
                other.append(f"rank {rank} ({node})")
            if heard.peer == "left" and r is not None and r.rank == rank and not r.kept:
                # its nvpair said goodbye: its process is stopping, no grace to wait out
                # (a kept one runs on: silent, its grace applies)
                out.append(Member(rank, node, "stopped", r.epoch, "left (its nvpair stopped)"))
            elif r is None or heard.peer not in ("fresh", "one-way") or r.rank != rank:
                state: machine.RankState = "unknown"
                out.append(Member(rank, node, state, None if r is None else r.epoch))
            else:
                known = r.state if r.state in _RANK_STATES else "unknown"
                out.append(Member(rank, node, known, r.epoch, r.exit))  # type: ignore[arg-type]
            self._note(rank, out[-1].state, now)
        self.note = None if not other else (
            f"{', '.join(other)}: its config of group {self.spec.name} differs from this "
            "node's (another definition: ranks, dist_port or the rank's command line); it "
            "starts no process until they agree (reload it)")
        return tuple(out)

    def _note(self, rank: int, state: str, now: float) -> None:
        if self._since.get(rank, ("", 0.0))[0] != state:
            self._since[rank] = (state, now)

    def _head_step(self, now: float) -> float:
        members = self._member_list(now)
        self.members = members
        if self.head is None:
            seen = max((m.epoch or 0 for m in members), default=0)
            self.head = machine.first_epoch(self._load_epoch(), seen, now)
            self._save_epoch(self.head.epoch)
            log.info("group %s: epoch %d", self.spec.name, self.head.epoch)
        before = self.head
        proc = self._proc()
        h = machine.step(before, now, proc, members, self.policy)
        if h.epoch != before.epoch:
            self._save_epoch(h.epoch)
        if h.state != before.state or h.epoch != before.epoch:
            log.info("group %s: %s at epoch %d%s", self.spec.name, h.state, h.epoch,
                     f" ({h.reason})" if h.state in ("down", "failed") and h.reason else "")
        self.head = h
        if h.state == "forming" and before.state != "forming" and (
                self.slot is not None and self.slot.done):
            # a new try (the head alone, restart = "head", keeps its epoch): the exit of
            # the last one is history, not this try's
            self.slot, self.started_epoch = None, None
        slot = self.slot
        running = slot is not None and slot.alive and not slot.stopping
        if running and slot is not None and (slot.epoch != h.epoch or not machine.head_may_run(
                h, members, self.policy, running=True)):
            self._stop(slot)
        elif (not running and machine.head_may_run(h, members, self.policy, running=False)
              and self.started_epoch != h.epoch and (slot is None or slot.done)):
            if self.claim is None or self._claimed == h.epoch:
                self._start(h.epoch, self._head_values())
            elif not self._claiming and self._nursery is not None:
                self._claiming = True
                self._nursery.start_soon(self._claim, h.epoch)
        self._note(0, self._proc().state, now)
        own = machine.report(h, self._proc(), members, self.policy, self.spec.name)
        slot = self.slot
        if slot is not None and slot.alive:
            own = msgspec.structs.replace(own, pid=slot.pid)
        own = msgspec.structs.replace(own, memory_bytes=self._memory_now(),
                                      config=self.config)
        if self.claim is not None and self._claimed != h.epoch:  # not this head's epoch yet
            own = msgspec.structs.replace(own, run=False, go=False)
        self.reports.set(own)
        self._admit(h.state == "ready" and not self._draining and not self._retiring,
                    GroupTag(self.spec.name, h.epoch, own.ranks_ready,
                             self.group.nnodes - 1))
        return machine.wake_at(h, self.policy)

    async def _claim(self, epoch: int) -> None:
        """Claim ``epoch`` in etcd (``claim``), then wake the loop; a refusal or a failure is
        the group's ``claim_error`` and is tried again in a second."""
        assert self.claim is not None
        why: str | None = "the claim took too long"
        try:
            with trio.move_on_after(5.0):
                why = await self.claim(epoch)
        except Exception as exc:  # etcd away, an answer not etcd's: said, tried again
            why = f"cannot claim the epoch in etcd: {failure_line(exc)}"
        self.claim_error = None if why is None else f"epoch {epoch} not claimed: {why}"
        if why is None:
            self._claimed = epoch
        else:
            log.warning("group %s: %s", self.spec.name, self.claim_error)
            await trio.sleep(1.0)
        self._claiming = False
        self._wake.bump()

    def _memory_now(self) -> int | None:
        """This node's group process's memory, read at most every ``MEMORY_EVERY_S``."""
        slot = self.slot
        pid = slot.pid if slot is not None and slot.alive else None
        ready = slot is not None and slot.ready
        at, last, value = self._memory
        now = trio.current_time()
        if (pid, ready) != last or now - at >= MEMORY_EVERY_S:  # (again once it is loaded)
            value = memory_of(pid)
            self._memory = (now, (pid, ready), value)
        return value

    def _admit(self, admitting: bool, tag: GroupTag) -> None:
        """The router sends the head requests only while the whole group is ready; its
        models say which group and epoch they are of (``nvpair.group``)."""
        e = self.board.current.engine(self.spec.name)
        if e is not None and (e.admitting, e.group) != (admitting, tag):
            self.board.update(self.spec.name, lambda e: msgspec.structs.replace(
                e, admitting=admitting, group=tag))

    def _head_values(self) -> dict[str, object]:
        host = self.peers.own_host() or self.spec.host
        hosts = [host]
        for node in self.group.ranks[1:]:
            hosts.append(self.peers.heard(node, self.spec.name, trio.current_time()).host
                         or "127.0.0.1")
        return role_values(self.group, self.group.head, placeholder_values(self.spec),
                           rank=0, dist_host=host, rank_hosts=hosts)

    # -- a rank ----------------------------------------------------------------------------

    def _rank_step(self, now: float) -> float:
        heard = self.peers.heard(self.group.head_node, self.spec.name, now)
        self.heard_head = heard
        head = heard.report if heard.report is not None and heard.report.rank == 0 else None
        slot = self.slot
        running = slot.epoch if slot is not None and slot.alive and not slot.stopping else None
        if (running is not None and slot is not None and heard.boot is not None
                and heard.peer != "left" and slot.head_boot != heard.boot):
            running = -1  # started for another boot of the head: never its epoch
        # the head's definition of the group and this node's (a reload on one node and not
        # yet on the other): a process runs on for the head's epoch, none starts
        agree = head is None or head.config is None or head.config == self.config
        self.note = None if agree else (
            f"this node's config of group {self.spec.name} differs from its head's "
            f"({self.group.head_node}: ranks, dist_port or the rank's command line); no "
            "process starts until they agree (reload the one not yet reloaded)")
        if (running is not None and slot is not None and slot.stale and agree
                and head is not None):
            log.info("group %s: rank %d's config changed (reload): its process is stopped; "
                     "the next epoch's runs the new command", self.spec.name, self.group.rank)
            slot.stop_reason = "stopped: its config changed (reload)"
            running = -1  # (as a process of another epoch: stopped, the next one starts)
        if (self._adopted_digest is not None and head is not None and running is not None
                and agree):
            # the first word of the head: its host is known, so is the rank's command now
            if self._adopted_digest != self._rank_digest(heard.host):
                log.info("group %s: rank %d's command changed while nvpair was down: its "
                         "kept process is stopped", self.spec.name, self.group.rank)
                running = -1  # (as a process of another epoch: stopped, none started)
            self._adopted_digest = None
        silent_s = heard.silent_s
        if silent_s is None and running is not None and slot is not None and slot.adopted:
            # not heard since this nvpair began: an adopted process is fenced as a running
            # one is, once the head is silent for fence_after_s counted from its adoption
            silent_s = now - slot.started_at
        d = machine.reconcile(head, heard.peer, silent_s, running, self.started_epoch,
                              self.group.fence_after_s)
        if self.key_view is not None:  # the etcd backend: held to the group's epoch key
            d = machine.apply_key(d, self.key_view(), self.group.head_node, running)
        if self.held:
            d = machine.Decision(None, reason="held stopped on this node")
        elif d.start and not agree:
            d = machine.Decision(None, reason=self.note)
        if slot is not None and running is not None and d.epoch != running:
            if d.fenced:
                log.warning("group %s: %s", self.spec.name, d.reason)
            slot.fenced = d.fenced
            self.fenced = d.fenced
            self._stop(slot)
        if d.start and d.epoch is not None and (slot is None or slot.done):
            self.fenced = False
            self._start(d.epoch, self._rank_values(heard.host), heard.boot)
        report = msgspec.structs.replace(self._rank_report(head, agree), config=self.config)
        self.reports.set(msgspec.structs.replace(report, memory_bytes=self._memory_now())
                         if report.pid is not None else report)
        wake = float("inf")
        if (head is None or heard.peer not in ("fresh", "one-way")) and (
                silent_s is not None and running is not None):
            wake = now + max(self.group.fence_after_s - silent_s, 0.0) + 1e-3
        return wake

    def _rank_values(self, head_host: str | None) -> dict[str, object]:
        host = head_host or "127.0.0.1"
        return role_values(self.group, self.group.member, placeholder_values(self.spec),
                           rank=self.group.rank, dist_host=host, rank_hosts=[host])

    def _rank_digest(self, head_host: str | None) -> str:
        """The digest of the command this rank would start now (a kept record's digest)."""
        argv, extra = build_command(role_manifest(self.spec.manifest, self.group.my_role),
                                    None, self._rank_values(head_host))
        return command_digest(argv, {**extra, **self.spec.env})

    def _rank_report(self, head: Report | None, agree: bool = True) -> Report:
        slot = self.slot
        epoch = head.epoch if head is not None else (slot.epoch if slot is not None else 0)
        name, rank = self.spec.name, self.group.rank
        if slot is not None and slot.alive:
            state = ("stopping" if slot.stopping else "ready" if slot.ready
                     else "unknown" if slot.adopted and not slot.looked else "starting")
            return Report(name=name, rank=rank, epoch=slot.epoch, state=state, pid=slot.pid,
                          kept=self.keep)
        # a fenced or exited process is news for its own epoch only: once the head has
        # moved on, this rank is simply stopped (and may start the new epoch)
        if slot is not None and slot.fenced and slot.epoch == epoch:
            return Report(name=name, rank=rank, epoch=epoch, state="fenced",
                          exit=slot.exit, exit_code=slot.exit_code)
        if slot is not None and not slot.stopping and slot.epoch == epoch:
            return Report(name=name, rank=rank, epoch=epoch, state="down", exit=slot.exit,
                          exit_code=slot.exit_code)
        why = None if agree else "waits: its config of the group differs from the head's"
        if why is None and slot is not None and slot.epoch == epoch:
            why = slot.stop_reason
        return Report(name=name, rank=rank, epoch=epoch, state="stopped", exit=why)

    # -- processes -------------------------------------------------------------------------

    def _stop(self, slot: Slot) -> None:
        """End ``slot``'s process: its epoch is over (a kept one too: only nvpair's own exit
        leaves it running). A kept process still being spawned is stopped once it is."""
        if not slot.stopping:
            slot.stopping = True
            if slot.handle is not None:
                slot.handle.stop_on_cancel()
                slot.scope.cancel(reason="its epoch is over")
            elif not self.keep:
                slot.scope.cancel(reason="its epoch is over")
            self._wake.bump()

    def _start(self, epoch: int, values: dict[str, object], head_boot: str | None = None
               ) -> None:
        assert self._nursery is not None
        slot = Slot(epoch)
        slot.head_boot = head_boot
        self.slot = slot
        self.started_epoch = epoch
        self._nursery.start_soon(self._run_slot, slot, values)
        self._wake.bump()

    def _adopt_kept(self) -> None:
        """The rank's kept process a previous nvpair left (``reclaim`` found it, the same
        process), in a slot of its recorded epoch; the steps decide whether it stays."""
        record = self.procs.take(self.spec.name)
        if record is None:
            return
        assert self._nursery is not None
        kept = record.kept
        slot = Slot(kept.epoch if kept is not None and kept.epoch is not None else 0)
        slot.head_boot = None if kept is None else kept.head_boot
        slot.adopted = True
        self._adopted_digest = None if kept is None else kept.digest
        self.slot, self.started_epoch = slot, slot.epoch
        log.info("group %s: rank %d's process %d of epoch %d, left running by nvpair %d "
                 "(on_exit = keep), is adopted: it runs on while the head has that epoch",
                 self.spec.name, self.group.rank, record.pid, slot.epoch, record.nvpair_pid)
        self._nursery.start_soon(self._run_slot, slot, {}, record)

    async def _run_slot(self, slot: Slot, values: dict[str, object],
                        adopt: Record | None = None) -> None:
        role = self.group.my_role
        spec = self.spec
        where = f"[nvpair] group {spec.name} epoch {slot.epoch} rank {self.group.rank}"
        try:
            with slot.scope:
                keep: Kept | None = None
                if adopt is not None:  # (its argv is the record's: run_engine_process)
                    argv, env = list(adopt.argv), {}
                    keep = adopt.kept or Kept(digest=command_digest(argv, {}))
                    self.log = self._epoch_log(slot.epoch)
                    self.log.write(f"{where}: adopted process {adopt.pid}, left running by "
                                   f"nvpair {adopt.nvpair_pid} (on_exit = keep)")
                else:
                    argv, extra = build_command(role_manifest(spec.manifest, role), None,
                                                values)
                    env = engine_env(os.environ, extra, spec.env)
                    env[EPOCH_ENV] = str(slot.epoch)
                    if self.keep:
                        assert self.procs.dir is not None
                        keep = Kept(digest=command_digest(argv, {**extra, **spec.env}),
                                    output=str(output_path(self.procs.dir, spec.name)),
                                    epoch=slot.epoch, head_boot=slot.head_boot)
                    self.log = self._epoch_log(slot.epoch)
                    self.log.write(f"{where}: starting: {' '.join(argv)}")
                assert self._reaper is not None
                grace = role.stop_grace_s or spec.stop_grace_s
                run = partial(run_engine_process, argv, env, name=spec.name, log_to=self.log,
                              output=self._output, procs=self.procs, reaper=self._reaper,
                              stopping=Stopping(spec.manifest.stop.signal, grace),
                              keep=keep, adopt=adopt)
                async with trio.open_nursery() as lifetime:
                    slot.handle = await lifetime.start(run)
                    if slot.stopping:  # its epoch ended while it was spawned: a stop
                        slot.handle.stop_on_cancel()
                        slot.scope.cancel(reason="its epoch is over")
                    self._wake.bump()
                    if self.group.rank != 0:
                        lifetime.start_soon(self._watch_rank, slot)
                    await slot.handle.wait()
                    lifetime.cancel_scope.cancel(reason="the process exited")
        except Exception as exc:  # it could not start: that rank's or head's exit
            slot.exit = f"could not start: {' '.join(str(exc).split())[:200]}"
        finally:
            if slot.handle is not None and slot.handle.returncode is not None:
                slot.exit_code = slot.handle.returncode
                words = describe_exit(slot.exit_code)
                slot.exit = f"was {words}" if words.startswith("killed") else words
            slot.done = True
            self._wake.bump()

    async def _watch_rank(self, slot: Slot) -> None:
        """A rank's readiness: its probe, its process, or its listening socket."""
        role = self.group.member
        if role.ready == "process":
            slot.ready = slot.looked = True
            self._wake.bump()
            return
        failures = 0
        while True:
            ok = (listening(self.group.dist_port, self.spec.host) if role.ready == "listen"
                  else await self._probe_rank())
            if slot.adopted and not slot.looked:  # (unknown until then: the head waits)
                if ok or failures + 1 >= self._threshold():
                    slot.ready = ok
                    slot.looked = True
                    self._wake.bump()
            elif ok != slot.ready and (ok or failures + 1 >= self._threshold()):
                slot.ready = ok
                self._wake.bump()
            failures = 0 if ok else failures + 1
            await trio.sleep(next_look(slot.ready, ok, role.probe.interval_s
                                       if role.probe is not None else 2.0))

    def _threshold(self) -> int:
        probe = self.group.member.probe
        return probe.failure_threshold if probe is not None else 3

    async def _probe_rank(self) -> bool:
        probe = self.group.member.probe
        assert probe is not None
        if self._client is None:
            self._client = httpx2.AsyncClient(base_url=self.spec.url,
                                              headers={"User-Agent": "nvpair-probe"})
        with trio.move_on_after(probe.timeout_s):
            try:
                r = await self._client.request(probe.method, probe.path)
            except httpx2.HTTPError:
                return False
            return r.status_code in probe.expect_status
        return False

    # -- files -----------------------------------------------------------------------------

    def _epoch_log(self, epoch: int) -> EngineLog:
        if self.log is not None:
            self.log.close()
        if self.log_dir is None:
            return EngineLog(None, rate=self.log_rate, name=self.spec.name)
        prune_logs(self.log_dir, self.spec.name, LOGS_KEPT - 1)
        return EngineLog(self.log_dir / f"{self.spec.name}.e{epoch}.log", rate=self.log_rate,
                         name=self.spec.name)

    def _epoch_path(self) -> Path | None:
        return None if self.state_dir is None else self.state_dir / f"group-{self.spec.name}.epoch"

    def _load_epoch(self) -> int:
        path = self._epoch_path()
        return 0 if path is None else read_epoch(path)

    def _save_epoch(self, epoch: int) -> None:
        path = self._epoch_path()
        if path is None:
            return
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(f"{epoch}\n")
            tmp.replace(path)
        except OSError as exc:
            log.warning("group %s: cannot keep the epoch in %s: %s", self.spec.name, path,
                        exc.strerror)

    # -- reads -----------------------------------------------------------------------------

    def status(self, now: float) -> Status:
        detail = []
        memory: list[int | None] = []
        slot = self.slot
        for rank in range(self.group.nnodes):
            since = self._since.get(rank, ("", now))[1]
            pid = exit_words = code = None
            if rank == self.group.rank and slot is not None:
                pid, exit_words, code = slot.pid if slot.alive else None, slot.exit, \
                    slot.exit_code
            elif rank > 0 and self.group.rank == 0:
                heard = self.peers.heard(self.group.ranks[rank], self.spec.name, now)
                if heard.report is not None:
                    pid, exit_words = heard.report.pid, heard.report.exit
                    code = heard.report.exit_code
            detail.append((rank, age(now, since) or 0.0, pid, exit_words, code))
            if rank == self.group.rank:
                memory.append(self._memory[2] if pid is not None else None)
            elif rank > 0 and self.group.rank == 0:
                r = self.peers.heard(self.group.ranks[rank], self.spec.name, now).report
                memory.append(None if r is None or r.pid is None else r.memory_bytes)
            else:
                memory.append(None)
        return Status(name=self.spec.name, node=self.node, rank=self.group.rank,
                      role=self.group.role, ranks=self.group.ranks, head=self.head,
                      members=self.members, report=self.reports.items.get(self.spec.name),
                      detail=tuple(detail),
                      error=self.error or self.claim_error or self.note,
                      head_report=None if self.heard_head is None else self.heard_head.report,
                      head_proc=self._proc().state if self.group.rank == 0 else "none",
                      memory=tuple(memory),
                      log_file=None if self.log is None or self.log.path is None
                      else str(self.log.path))


_RANK_STATES = frozenset({"starting", "ready", "down", "unknown", "fenced", "stopped",
                          "stopping"})
