"""The memory watch: every engine's anonymous memory and the node's headroom, read on a tick,
judged for a trend (``nvpair.supervision.memtrend``), published, and acted on when asked.

What is read (docs/memory.md): per engine, its processes' ``/proc/PID/status`` (``RssAnon``
+ ``VmSwap``: file-backed pages are weights and page cache); per node ``/proc/meminfo``,
PSI and nvpair's own cgroup v2 where there is one. Which processes are an engine's:

* a managed engine's process group (it leads its own: ``nvpair.supervision.process``);
* an adopted engine's listening process, found once from its socket (``/proc/net/tcp{,6}``
  inodes, then the ``fd`` directories), and its descendants; or the pid in the engine's
  ``pid_file``; or the processes of its ``cgroup``.

Membership is rescanned at most once a minute (``RESCAN_S``; a new pid of a managed engine
is taken at once, and read within ``FIRST_READING_S``, not at the next tick: a 15 s interval
showed a started engine as "no process known" for up to 15 s); the rescan and every
tick's reads run in a worker thread (``trio.to_thread.run_sync``), the trend and the
publishing on the loop, one ``Board.publish_memory`` per tick, which never moves the
listing version.

A failed read (a process gone, a permission) is that engine's memory ``error``, logged once
per change (``nvpair.base.boundary.Part``); the watch as a whole is supervised too.

``explain_exit`` tells the lifecycle whether an exit was a kill for memory;
``restart_when_quiet`` restarts a leaking managed engine at a quiet moment.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import msgspec
import trio

from nvpair.base.boundary import Part, failure_line
from nvpair.config.settings import EngineSpec, MemoryConfig
from nvpair.runtime import wakes
from nvpair.state.memory import EngineMemory, NodeMemory, ProcMemory
from nvpair.state.snapshot import Board, EngineState, Touched, shown_state
from nvpair.state.traffic import Traffic
from nvpair.supervision import memproc
from nvpair.supervision.lifecycle import Busy
from nvpair.supervision.memproc import MemorySourceError, ProcStatus
from nvpair.supervision.memtrend import (
    Trend,
    TrendDetector,
    TrendReading,
    TrendSettings,
    trend_line,
)
from nvpair.supervision.memtrend import reserve_bytes as auto_reserve

log = logging.getLogger("nvpair.memory")

#: membership (the processes of each engine) is rescanned at most this often
RESCAN_S = 60.0
#: engines judged per step of the loop (about 2 ms of it); a checkpoint between steps
JUDGED_PER_STEP = 64
#: the processes an engine's status lists, largest first
TOP = 5
#: states whose memory is judged (a process loading its weights is not leaking)
JUDGED = frozenset({"ready", "stale", "unhealthy"})
#: how often the quiet wait looks at the in-flight count
QUIET_POLL_S = 0.1
KILLED_FOR_MEMORY = "killed for memory (likely the OOM killer or earlyoom)"
_with = msgspec.structs.replace


class Restarter(Protocol):
    """What the action needs of an engine's runner
    (``nvpair.supervision.lifecycle.EngineRunner``)."""

    def request(self, action: Any) -> object: ...


def trend_settings(memory: MemoryConfig) -> TrendSettings:
    """The detector for the config: its time scale is ``window_h`` (buckets of a 36th of
    the window, the short window a 12th, ``critical`` within a 6th: at the default 6 h,
    10 min, 30 min and 1 h), the horizon ``horizon_h``."""
    scaled = TrendSettings().scaled(memory.window_h / 6)
    return replace(scaled, horizon_s=memory.horizon_h * 3600,
                   critical_s=min(scaled.critical_s, memory.horizon_h * 3600))


@dataclass
class Plan:
    """One engine as the worker thread reads it (a copy: the thread shares nothing)."""

    name: str
    mode: str  # group (managed), socket, pid_file, cgroup, none
    leader: int | None
    pids: tuple[int, ...]
    port: int = 0
    path: str | None = None  # pid_file or cgroup
    cgroup: str | None = None  # where oom_kill is counted (None: not looked up; "": none)
    lookup: bool = False  # look for its pid (a socket) this time


@dataclass
class Read:
    """What the thread read of one engine."""

    name: str
    leader: int | None
    pids: tuple[int, ...]
    statuses: list[tuple[int, ProcStatus]]
    cgroup: str | None
    oom_kill: int | None
    cgroup_max: int | None = None
    cgroup_current: int | None = None
    failure: Exception | None = None


@dataclass
class NodeRead:
    meminfo: memproc.Meminfo | None
    pressure: memproc.Pressure | None
    cgroup: memproc.CgroupMemory | None
    failure: Exception | None = None


@dataclass
class _Watched:
    spec: EngineSpec
    detector: TrendDetector
    part: Part
    #: the action's own boundary (restart_when_quiet)
    acts: Part
    leader: int | None = None
    pids: tuple[int, ...] = ()
    cgroup: str | None = None
    oom_kill: int | None = None
    memory: EngineMemory = field(default_factory=EngineMemory)
    trend: str = "flat"
    lookup: bool = True
    memory_restarts: int = 0
    restarted_at: float = -math.inf
    acting: bool = False


def collect(plans: list[Plan], rescan: bool, proc: Path, own_cgroup: str | None
            ) -> tuple[list[Read], NodeRead]:
    """Every engine's reads and the node's, in a worker thread (sync, never raises: a
    failure is that engine's ``Read.failure``, or the node's)."""
    entries = None
    if rescan and any(p.mode in ("group", "socket", "pid_file") for p in plans):
        try:
            entries = memproc.scan(proc)
        except MemorySourceError:
            entries = None
    looks = {p.port for p in plans if p.mode == "socket" and p.lookup}
    listeners: dict[int, list[int]] | None = None
    if looks:
        try:
            listeners = memproc.listening_pids_of(looks, proc)
        except OSError:  # (each engine then looks for itself, and fails as its own)
            listeners = None
    reads = []
    for plan in plans:
        try:
            reads.append(_read_engine(plan, entries, proc, listeners))
        except Exception as exc:  # a bug or a kernel surprise: this engine's state only
            reads.append(Read(plan.name, plan.leader, plan.pids, [], plan.cgroup, None,
                              failure=exc))
    try:
        meminfo = memproc.read_meminfo(proc)
        pressure = memproc.read_pressure(proc)
        cgroup = None if own_cgroup is None else memproc.read_cgroup(Path(own_cgroup))
        node = NodeRead(meminfo, pressure, cgroup)
    except Exception as exc:
        node = NodeRead(None, None, None, failure=exc)
    return reads, node


def _read_engine(plan: Plan, entries: list[memproc.ProcEntry] | None, proc: Path,
                 listeners: dict[int, list[int]] | None = None) -> Read:
    """One engine's reads. ``listeners``: port -> listening pids, looked up once for
    every engine of this tick that needs a look (``memproc.listening_pids_of``)."""
    leader, pids, cgroup = plan.leader, plan.pids, plan.cgroup
    if plan.mode == "pid_file":
        assert plan.path is not None
        new = memproc.read_pid_file(Path(plan.path))
        if new != leader:
            leader, pids = new, (new,)
    elif plan.mode == "socket" and plan.lookup:
        found = (listeners.get(plan.port, []) if listeners is not None
                 else memproc.listening_pids(plan.port, proc))
        if found:
            parents = {e.pid: e.ppid for e in (entries or memproc.scan(proc))}
            # the listener at the top (uvicorn's workers share their parent's socket)
            top = [p for p in found if parents.get(p) not in found] or found
            if top[0] != leader:
                leader, pids = top[0], (top[0],)
                cgroup = None
        else:
            leader, pids = None, ()
    if plan.mode == "cgroup":
        assert plan.path is not None
        where = memproc.find_cgroup(plan.path)
        if where is None:
            raise MemorySourceError(f"cgroup {plan.path}: not found under /sys/fs/cgroup "
                                    "(cgroup v2 with the memory controller)")
        cgroup = str(where)
        pids = tuple(memproc.cgroup_procs(where))
    elif leader is not None:
        if entries is not None:
            members = (memproc.group_members(leader, entries) if plan.mode == "group"
                       else memproc.descendants(leader, entries))
            pids = tuple(sorted({leader, *members}))
        elif leader not in pids:
            pids = (leader,)
        if cgroup is None or leader != plan.leader:  # looked up once per process ("": none)
            found_cg = memproc.cgroup_dir(leader, proc)
            cgroup = "" if found_cg is None else str(found_cg)
    statuses = []
    gone: MemorySourceError | None = None
    for pid in pids:
        try:
            statuses.append((pid, memproc.read_status(pid, proc)))
        except MemorySourceError as exc:
            if pid == leader or gone is None:
                gone = exc
    oom_kill = cg_max = cg_current = None
    if cgroup:
        try:
            cg = memproc.read_cgroup(Path(cgroup))
            oom_kill, cg_max, cg_current = cg.oom_kill, cg.max, cg.current
        except MemorySourceError:
            pass
    leader_gone = leader is not None and all(pid != leader for pid, _ in statuses)
    failure = gone if (pids and not statuses) or leader_gone else None
    kept = tuple(pid for pid, _ in statuses)
    return Read(plan.name, leader, kept if statuses else pids, statuses, cgroup, oom_kill,
                cg_max, cg_current, failure)


#: a managed engine's new process is read this soon after the reading before (seconds)
FIRST_READING_S = 2.0


class MemoryWatch:
    """The watch over every engine of the node (see the module docstring)."""

    def __init__(self, config: MemoryConfig, board: Board, specs: tuple[EngineSpec, ...], *,
                 traffic: Traffic | None = None,
                 runners: Mapping[str, Restarter] | None = None,
                 proc: Path = memproc.PROC, rescan_s: float = RESCAN_S) -> None:
        self.config = config
        self.board = board
        self.traffic = traffic
        self.runners = runners or {}
        self.proc = proc
        self.rescan_s = rescan_s
        self.settings = trend_settings(config)
        self.engines = {spec.name: _Watched(
            spec, TrendDetector(self.settings), Part(f"engine {spec.name}: memory", logger=log),
            Part(f"engine {spec.name}: memory restart", logger=log)) for spec in specs}
        self.node_detector = TrendDetector(self.settings)
        #: the wait for the next tick (a reload that changes the interval ends it)
        self._waiting: trio.CancelScope | None = None
        self.node = NodeMemory()
        self.node_trend = "flat"
        self._own_cgroup: str | None = None
        self._rescanned_at = -math.inf
        self._low_at_last = False
        self.part = Part("memory watch", logger=log)
        self.node_part = Part("memory watch: node", logger=log)
        self.ticks = 0
        #: seconds of the loop the last tick took (its worker thread's reads aside)
        self.loop_s = 0.0
        self._nursery: trio.Nursery | None = None

    # -- the loop -----------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        """Read every ``interval_s`` until cancelled.

        Started value: None, at once. Cancellation: a plain wait (a read in its worker
        thread is abandoned). Raises: nothing but Cancelled; a failure of a tick is the
        watch's part's (logged, retried after a backoff)."""
        cg = await trio.to_thread.run_sync(memproc.cgroup_dir, os.getpid(), self.proc)
        self._own_cgroup = None if cg is None else str(cg)
        unified = await trio.to_thread.run_sync(memproc.unified_memory, self.proc)
        self.node = NodeMemory(unified_memory=unified)
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            await self.part.supervise(self._loop)

    async def _loop(self) -> None:
        every = self.config.interval_s
        ticker = wakes.Ticker(every)
        touched = self.board.touched()
        while True:
            await self.tick()
            self.part.ok()
            if self.config.interval_s != every:  # (a reload changed it)
                every = self.config.interval_s
                ticker = wakes.Ticker(every)
            with trio.CancelScope() as self._waiting:  # (a reload's interval ends it)
                async with trio.open_nursery() as nursery:
                    async def first(wait: Any) -> None:
                        await wait()
                        nursery.cancel_scope.cancel()

                    nursery.start_soon(first, ticker.tick)
                    nursery.start_soon(first, partial(self._new_process, touched))

    async def _new_process(self, touched: Touched) -> None:
        """Return when a managed engine has a process the last reading did not know, but
        no sooner than ``FIRST_READING_S`` after that reading (engines started one after
        another cost at most one early reading a ``FIRST_READING_S``). Cancellation: a
        plain wait."""
        earliest = trio.current_time() + FIRST_READING_S
        while True:
            everything, names = touched.take()
            snap = self.board.current
            if any(self._unread(snap, name) for name in (self.engines if everything else names)):
                break
            await self.board.wait_changed(snap.version)
        await wakes.sleep_until(earliest, wakes.HOUSEKEEPING_S)

    def _unread(self, snap: Any, name: str) -> bool:
        w = self.engines.get(name)
        if w is None or not w.spec.managed:
            return False
        e = snap.engine(name)
        return e is not None and e.pid is not None and e.pid != w.leader

    async def tick(self) -> None:
        """One reading of every engine and the node, published once."""
        now = trio.current_time()
        rescan = now - self._rescanned_at >= self.rescan_s
        plans = self.plans(rescan)
        if rescan:
            self._rescanned_at = now
        reads, node = await trio.to_thread.run_sync(
            collect, plans, rescan, self.proc, self._own_cgroup, abandon_on_cancel=True)
        # judged in slices with a checkpoint between: at 1,024 engines the whole was one
        # 12-16 ms step of the loop; the readings are published once, at the end
        loop_s = 0.0
        started = time.perf_counter()
        judged = self._node(node, trio.current_time())
        published: dict[str, EngineMemory] = {}
        for first in range(0, len(reads), JUDGED_PER_STEP):
            if first:
                loop_s += time.perf_counter() - started
                await trio.lowlevel.checkpoint()
                started = time.perf_counter()
            published.update(self.judge(reads[first:first + JUDGED_PER_STEP],
                                        judged.headroom_bytes, trio.current_time()))
        self.node = judged
        self.board.publish_memory(published, judged)
        self.ticks += 1
        self.loop_s = loop_s + time.perf_counter() - started

    def plans(self, rescan: bool) -> list[Plan]:
        snap = self.board.current
        plans = []
        for name, w in self.engines.items():
            e = snap.engine(name)
            spec = w.spec
            if spec.managed:
                pid = None if e is None else e.pid
                if pid != w.leader:  # a new process (or none): a new series
                    self._reset(w, pid)
                plans.append(Plan(name, "group" if pid else "none", pid, w.pids,
                                  cgroup=w.cgroup))
            elif spec.cgroup is not None:
                plans.append(Plan(name, "cgroup", None, w.pids, path=spec.cgroup))
            elif spec.pid_file is not None:
                plans.append(Plan(name, "pid_file", w.leader, w.pids, path=spec.pid_file,
                                  cgroup=w.cgroup))
            else:
                ready = e is not None and e.state in ("ready", "stale")
                if not ready:
                    w.lookup = True  # its next time ready gets a look of its own
                lookup = (w.leader is None and (rescan or (ready and w.lookup))) or (
                    w.leader is not None and w.memory.error is not None and rescan)
                if lookup and not rescan:
                    w.lookup = False  # one look outside the rescans per time it is ready
                plans.append(Plan(name, "socket", w.leader, w.pids, port=spec.port,
                                  cgroup=w.cgroup, lookup=lookup))
        return plans

    def _reset(self, w: _Watched, leader: int | None) -> None:
        w.leader = leader
        w.pids = () if leader is None else (leader,)
        w.cgroup = None
        w.oom_kill = None
        w.detector = TrendDetector(self.settings)

    # -- judging and publishing (on the loop, sync) --------------------------------------

    def apply(self, reads: list[Read], node_read: NodeRead, now: float) -> None:
        """Judge the node and every engine's reading, and publish them once (sync)."""
        node = self._node(node_read, now)
        published = self.judge(reads, node.headroom_bytes, now)
        self.node = node
        self.board.publish_memory(published, node)

    def judge(self, reads: list[Read], headroom: int | None, now: float
              ) -> dict[str, EngineMemory]:
        """Each engine's reading through its leak detector: what to publish for it."""
        snap = self.board.current
        published: dict[str, EngineMemory] = {}
        for read in reads:
            w = self.engines[read.name]
            e = snap.engine(read.name)
            try:
                published[read.name] = self._engine(w, e, read, headroom, now)
            except Exception as exc:  # a bug in judging one engine: that engine's state
                published[read.name] = _with(w.memory, error=w.part.failed(exc))
        return published

    def _node(self, read: NodeRead, now: float) -> NodeMemory:
        old = self.node
        if read.failure is not None or read.meminfo is None:
            reason = self.node_part.failed(read.failure or MemorySourceError("no meminfo"))
            return _with(old, error=reason, at=now)
        self.node_part.ok()
        info = read.meminfo
        reserve = (auto_reserve(info.mem_available, info.anon_pages)
                   if self.config.reserve_bytes == "auto" else int(self.config.reserve_bytes))
        headroom = info.mem_available - reserve
        cg = read.cgroup
        if cg is not None and cg.max is not None:
            headroom = min(headroom, cg.max - cg.current)
        self.node_detector.add(now, info.mem_total - info.mem_available)
        r = self.node_detector.reading(now, max(headroom, 0))
        self._transition("node", self.node_trend, r, max(headroom, 0), "memory in use")
        self.node_trend = r.trend.value
        psi = read.pressure
        self._low_at_last = headroom < 0
        return NodeMemory(
            mem_total=info.mem_total, mem_available=info.mem_available,
            anon_pages=info.anon_pages, swap_total=info.swap_total, swap_free=info.swap_free,
            reserve_bytes=reserve, headroom_bytes=headroom,
            psi_some_avg10=None if psi is None else psi.some_avg10,
            psi_full_avg10=None if psi is None else psi.full_avg10,
            cgroup=None if cg is None else cg.path,
            cgroup_current=None if cg is None else cg.current,
            cgroup_max=None if cg is None else cg.max,
            oom_kills=None if cg is None else cg.oom_kill,
            unified_memory=old.unified_memory, trend=r.trend.value,
            slope_bytes_per_h=r.slope_bytes_per_h, exhaustion_s=r.exhaustion_s,
            why=r.why, at=now)

    def _engine(self, w: _Watched, e: EngineState | None, read: Read, headroom: int | None,
                now: float) -> EngineMemory:
        if read.leader != w.leader and not w.spec.managed:
            self._reset(w, read.leader)
        w.pids, w.cgroup = read.pids, read.cgroup
        if read.oom_kill is not None:
            w.oom_kill = read.oom_kill
        source = "cgroup" if w.spec.cgroup is not None else "proc"
        if read.failure is not None:
            reason = w.part.failed(read.failure)
        elif not read.statuses:
            reason = None
            w.part.ok()
            source = "none"
        else:
            reason = None
            w.part.ok()
        if not read.statuses:
            w.memory = EngineMemory(source="none" if reason is None else source, error=reason,
                                    memory_restarts=w.memory_restarts,
                                    action=w.memory.action, at=now,
                                    why="no process known" if reason is None else "")
            return w.memory
        anon = sum(s.rss_anon_bytes or 0 for _, s in read.statuses)
        swap = sum(s.swap_bytes or 0 for _, s in read.statuses)
        rss = sum(s.rss_bytes or 0 for _, s in read.statuses)
        top = sorted(read.statuses, key=lambda ps: -ps[1].watched_bytes)[:TOP]
        room = headroom
        if read.cgroup_max is not None and read.cgroup_current is not None:
            limit = read.cgroup_max - read.cgroup_current
            room = limit if room is None else min(room, limit)
        judged = e is not None and shown_state(e, now) in JUDGED
        if judged:
            w.detector.add(now, anon + swap)
        r = w.detector.reading(now, None if room is None else max(room, 0))
        if judged:
            self._transition(w.spec.name, w.trend, r, None if room is None else max(room, 0))
            w.trend = r.trend.value
            self._act(w, e, r, now)
        w.memory = EngineMemory(
            source=source, error=reason, rss_anon_bytes=anon, swap_bytes=swap,
            rss_bytes=rss, processes=len(read.statuses),
            top=tuple(ProcMemory(pid, s.name, s.rss_anon_bytes or 0, s.swap_bytes or 0)
                      for pid, s in top),
            trend=w.trend, slope_bytes_per_h=r.slope_bytes_per_h,
            exhaustion_s=r.exhaustion_s, floor_bytes=r.floor_bytes, covered_s=r.covered_s,
            why=r.why, memory_restarts=w.memory_restarts, action=w.memory.action, at=now)
        return w.memory

    def _transition(self, name: str, old: str, r: TrendReading, headroom: int | None,
                    what: str = "anonymous memory") -> None:
        if r.trend.value == old:
            return
        line = trend_line(name, r, headroom, what)
        level = logging.WARNING if r.trend in (Trend.LEAKING, Trend.CRITICAL) else logging.INFO
        log.log(level, "%s (was %s, now %s)", line, old, r.trend.value)

    # -- the action ---------------------------------------------------------------------

    def _act(self, w: _Watched, e: EngineState | None, r: TrendReading, now: float) -> None:
        if (self.config.action != "restart_when_quiet" or not w.spec.managed or w.acting
                or r.trend not in (Trend.LEAKING, Trend.CRITICAL) or e is None
                or e.state not in ("ready", "stale") or self._nursery is None
                or w.spec.name not in self.runners):
            return
        if now - w.restarted_at < self.config.min_restart_interval_h * 3600:
            return
        w.acting = True
        self._nursery.start_soon(self._restart_when_quiet, w, r)

    def _in_flight(self, name: str) -> int:
        entry = None if self.traffic is None else self.traffic.engines.get(name)
        return 0 if entry is None else entry.in_flight

    async def _restart_when_quiet(self, w: _Watched, r: TrendReading) -> None:
        name = w.spec.name
        try:
            with w.acts.guard():
                quiet, most = self.config.quiet_s, self.config.quiet_max_s
                self._say(w, f"leaking: waiting for {quiet:g} s with no request in flight "
                             f"(at most {most:g} s), then a restart")
                waited = "critical" if r.trend is Trend.CRITICAL else await self._quiet(
                    name, quiet, w, most)
                if waited in ("recovered", "gone"):
                    log.info("%s: %s; not restarted", name, "no longer leaking"
                             if waited == "recovered" else "its leaking process is gone")
                    self._say(w, None)
                    return
                if waited == "bound":
                    log.warning("%s: leaking, and no quiet moment of %g s in %g s "
                                "(quiet_max_s): draining it anyway (requests in flight "
                                "finish within its stop grace)", name, quiet, most)
                runner = self.runners[name]
                drain = getattr(runner, "drain", None)
                # an on-demand engine rests cold instead: its next request starts a new one
                then = "stop" if w.spec.activation == "on_demand" else "restart"
                if drain is not None:  # stop admitting, finish what is in flight, restart
                    result = drain(then=then, reason="memory")
                else:
                    result = runner.request("restart")
                if isinstance(result, Busy):
                    log.info("%s: leaking, but not restarted now: %s", name, result.reason)
                    self._say(w, None)
                    return
                w.memory_restarts += 1
                w.restarted_at = trio.current_time()
                slope = r.slope_bytes_per_h / 1e9
                doing, done = (("stopping", "stopped (cold until a request starts it)")
                               if then == "stop" and drain is not None
                               else ("restarting", "restarted"))
                log.warning("%s: %s for memory (anonymous memory %+.2f GB/h, "
                            "headroom runs out in about %.0f s); memory restart %d",
                            name, doing, slope, r.exhaustion_s or 0.0, w.memory_restarts)
                self._say(w, f"{done} for memory ({w.memory_restarts} so far)")
        finally:
            w.acting = False

    async def _quiet(self, name: str, quiet_s: float, w: _Watched, most_s: float) -> str:
        """Until no routed request has been in flight for ``quiet_s``: ``quiet``; the engine
        turned ``critical`` meanwhile (restart now), is no longer leaking (``recovered``)
        or its process is no longer the one judged, ready (``gone``: unloaded, evicted,
        exited, a new one starting; neither is restarted); or ``most_s`` went by without a
        quiet moment: ``bound``."""
        since: float | None = None
        deadline = trio.current_time() + most_s
        leader = w.leader
        while True:
            now = trio.current_time()
            e = self.board.current.engine(name)
            if e is None or e.pid != leader or e.state not in JUDGED:
                return "gone"  # (unloaded, evicted, exited, or a new process starting)
            if w.trend not in ("leaking", "critical"):
                return "recovered"
            if w.trend == "critical":
                return "critical"
            if self._in_flight(name) > 0:
                since = None
            elif since is None:
                since = now
            if since is not None and now - since >= quiet_s:
                return "quiet"
            if now >= deadline:
                return "bound"
            await trio.sleep(min(deadline - now, QUIET_POLL_S if since is None
                                 else min(QUIET_POLL_S, quiet_s - (now - since))
                                 or QUIET_POLL_S))

    def _say(self, w: _Watched, action: str | None) -> None:
        w.memory = _with(w.memory, action=action, memory_restarts=w.memory_restarts)
        self.board.publish_memory({w.spec.name: w.memory}, self.board.current.memory)

    # -- exits ----------------------------------------------------------------------------

    def explain_exit(self, name: str, code: int | None) -> str | None:
        """Whether engine ``name``'s process, which exited by itself with ``code``, was
        killed for memory: a SIGKILL or SIGTERM (nvpair sent none) while the node's
        headroom was under the reserve (at the last reading or now), or any exit while its
        cgroup's ``oom_kill`` count rose. Sync (two small reads); None: no sign of it."""
        w = self.engines.get(name)
        if w is None:
            return None
        try:
            if w.cgroup and w.oom_kill is not None:
                now_kills = memproc.read_cgroup(Path(w.cgroup)).oom_kill
                if now_kills > w.oom_kill:
                    return f"{KILLED_FOR_MEMORY}: the cgroup's oom_kill count rose"
            if code is None or -code not in (signal.SIGKILL, signal.SIGTERM):
                return None
            info = memproc.read_meminfo(self.proc)
        except Exception as exc:
            log.info("%s: could not tell whether the exit was for memory: %s", name,
                     failure_line(exc))
            return None
        reserve = (auto_reserve(info.mem_available, info.anon_pages)
                   if self.config.reserve_bytes == "auto" else int(self.config.reserve_bytes))
        if self._low_at_last or info.mem_available < reserve:
            return (f"{KILLED_FOR_MEMORY}: headroom under the reserve "
                    f"({info.mem_available / 1e9:.1f} GB available, reserve "
                    f"{reserve / 1e9:.1f} GB)")
        return None

    def set_config(self, config: MemoryConfig) -> None:
        """A reload's ``[memory]``: the action, the reserve and the interval (from the
        next tick) are taken at once; a change of the trend's windows starts every trend
        afresh (readings judged by other windows would mislead). Sync."""
        if config.interval_s != self.config.interval_s and self._waiting is not None:
            self._waiting.cancel(reason="memory.interval_s changed (reload)")
        self.config = config
        settings = trend_settings(config)
        if settings != self.settings:
            self.settings = settings
            self.node_detector = TrendDetector(settings)
            for w in self.engines.values():
                w.detector = TrendDetector(settings)

    def reconfigure(self, specs: tuple[EngineSpec, ...]) -> None:
        """A reload: watch these engines. An engine watched already keeps its readings and
        trend (its spec is the new one); an added one starts with none; a removed one is
        forgotten. Sync."""
        engines = {}
        for spec in specs:
            w = self.engines.get(spec.name)
            if w is None:
                w = _Watched(spec, TrendDetector(self.settings),
                             Part(f"engine {spec.name}: memory", logger=log),
                             Part(f"engine {spec.name}: memory restart", logger=log))
            else:
                w.spec = spec
            engines[spec.name] = w
        self.engines = engines

    def exit_explainer(self, name: str) -> partial[str | None]:
        """``explain_exit`` for one engine, as the lifecycle calls it (``code`` only)."""
        return partial(self.explain_exit, name)
