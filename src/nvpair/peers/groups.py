"""The peer table as a group reads it: what each node last said about a group, and how
fresh that is (``nvpair.supervision.group.GroupPeers``)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any
from urllib.parse import urlsplit

import msgspec
import trio

from nvpair.base.boundary import Part
from nvpair.base.logs import RateCap
from nvpair.config.diff import EngineChange
from nvpair.config.settings import EngineSpec, Settings
from nvpair.http.asgi import Mount
from nvpair.http.groups import PREFIX, GroupsView, doc
from nvpair.peers.advert import Advertiser
from nvpair.peers.broker import Broker
from nvpair.peers.epochkey import EpochKey, EpochWatch
from nvpair.peers.table import PeerTable
from nvpair.state.snapshot import Board
from nvpair.state.traffic import Traffic
from nvpair.supervision.group import GroupRunner, Heard, Reports, Status
from nvpair.supervision.orphans import EngineProcs

log = logging.getLogger("nvpair.group")


def _host(url: str | None) -> str | None:
    if url is None:
        return None
    try:
        return urlsplit(url).hostname
    except ValueError:
        return None


class GroupLink:
    """Implements ``GroupPeers`` over this node's peer table and advertiser."""

    def __init__(self, table: PeerTable, advertiser: Advertiser) -> None:
        self.table = table
        self.advertiser = advertiser

    @property
    def version(self) -> int:
        return self.table.version

    async def wait_changed(self, since_version: int) -> int:
        return await self.table.wait_changed(since_version)

    def heard(self, node: str, group: str, now: float) -> Heard:
        e = self.table.entries.get(node)
        if e is None:
            return Heard(None, "none")
        report = next((r for r in e.advert.groups if r.name == group), None)
        return Heard(report, self.table.state(e, now), max(now - e.received_at, 0.0),
                     _host(e.advert.url), e.advert.boot_id)

    def own_host(self) -> str | None:
        return _host(self.advertiser.url)


@dataclass
class _Part:
    """One group's runner (and, on an etcd rank, its epoch key's watch) in a cancel scope
    of its own: a reload adds or removes it without touching the others."""

    runner: GroupRunner
    watch: EpochWatch | None = None
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    ended: trio.Event = field(default_factory=trio.Event)


class Groups:
    """This node's parts of every multi-node group in the config (docs/groups.md): built
    before the board (``local``), attached to the peers once they exist, run with the
    engines, and changed by a reload (``apply``)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.link: GroupLink | None = None
        self.specs = [s for s in settings.engines if s.group is not None]
        self.reports = Reports()
        self.runners: dict[str, GroupRunner] = {}
        #: with the etcd backend, on a rank: each group's epoch key watch
        self.watches: list[EpochWatch] = []
        self._parts: dict[str, _Part] = {}
        #: groups a reload removed whose part is still stopping (the head drains first)
        self.leaving: set[str] = set()
        self._board: Board | None = None
        self._broker: Broker | None = None
        self._procs: EngineProcs | None = None
        #: the router's counts: a head's restart or removal waits for its requests
        self.traffic: Traffic | None = None
        self._nursery: trio.Nursery | None = None

    def local(self, settings: Settings) -> Settings:
        """The settings the rest of nvpair runs: a group's engine is adopted on its head
        (the group runner starts its process; the engine's runner probes and lists it),
        and absent on its ranks (never listed or routed to)."""
        if all(s.group is None for s in settings.engines):
            return settings
        engines = tuple(msgspec.structs.replace(s, managed=False) if s.group is not None
                        else s for s in settings.engines
                        if s.group is None or s.group.rank == 0)
        return msgspec.structs.replace(settings, engines=engines)

    def attach(self, board: Board, broker: Broker | None, procs: EngineProcs) -> None:
        self._board, self._procs = board, procs
        if not self.specs:
            return
        self._link(broker)
        for spec in self.specs:
            self._make(spec)

    def _link(self, broker: Broker | None) -> None:
        """Group reports go into ``broker``'s adverts; its table is what groups read."""
        assert broker is not None  # (a group without peers is a config error)
        if self._broker is broker:
            return
        self._broker = broker
        advertiser = broker.advertiser
        advertiser.groups = self.reports

        def refresh() -> None:
            advertiser.refresh(trio.current_time())

        self.reports.listeners[:] = [refresh]
        self.link = GroupLink(broker.table, advertiser)

    def _make(self, spec: EngineSpec) -> _Part:
        assert self._board is not None and self._procs is not None
        assert self.link is not None and self._broker is not None
        broker = self._broker
        runner = GroupRunner(
            spec, self._board, self.link, self.reports, self.settings.node,
            self.settings.log_dir, self._procs, self.settings.state_dir,
            RateCap(self.settings.log_lines_per_s, self.settings.log_bytes_per_s))
        runner.in_flight = partial(self._in_flight, spec.name)
        part = _Part(runner)
        if broker.etcd is not None and runner.group.rank == 0:
            runner.claim = EpochKey(broker.etcd, spec.name, self.settings.node).claim
        elif broker.etcd is not None:  # a rank runs only the epoch held under the key
            watch = part.watch = EpochWatch(broker.etcd, spec.name)
            watch.on_change = runner.poke
            runner.key_view = lambda watch=watch: watch.view
            self.watches.append(watch)
        self.runners[spec.name] = runner
        self._parts[spec.name] = part
        return part

    def _in_flight(self, name: str) -> int:
        entry = None if self.traffic is None else self.traffic.engines.get(name)
        return 0 if entry is None else entry.in_flight

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        """Run every group runner until cancelled (and those a reload adds).

        Started value: None, once each runner has started. Cancellation: each runner stops
        its process (its stop signal, grace period, SIGKILL, shielded). Raises: nothing but
        Cancelled (a runner's failure is its group's ``error``, retried with backoff)."""
        try:
            async with trio.open_nursery() as nursery:
                for part in self._parts.values():
                    await nursery.start(self._run, part)
                self._nursery = nursery
                task_status.started()
                await trio.sleep_forever()
        finally:
            self._nursery = None  # (a reload after the shutdown began starts nothing)

    @staticmethod
    async def _run(part: _Part, *, task_status: trio.TaskStatus[None]
                   = trio.TASK_STATUS_IGNORED) -> None:
        """Run one group's part (its runner, and its key watch) until its scope or the
        whole is cancelled. Started value: None, once its runner has started.
        Cancellation: as ``GroupRunner.run`` (its process stopped, unless kept). Raises:
        nothing but Cancelled."""
        try:
            with part.scope:
                async with trio.open_nursery() as nursery:
                    if part.watch is not None:
                        nursery.start_soon(part.watch.run)
                    await nursery.start(part.runner.run)
                    task_status.started()
        finally:
            part.ended.set()

    # -- a reload (docs/groups.md, "Reload") -------------------------------------------------

    def apply(self, settings: Settings, changes: list[EngineChange], broker: Broker | None,
              removed: Callable[[str], None]) -> None:
        """A reload's ``settings`` (the whole config, not ``local``'s) and its verdicts:
        a group added starts its part here; one removed stops it (``retire``: the head
        drains its engine first) and then calls ``removed(name)``; a changed one takes
        its spec, with a new epoch for ``restart``; an unchanged one is not touched.
        Sync: the stops go on in tasks of their own."""
        self.settings = settings
        self.specs = [s for s in settings.engines if s.group is not None]
        specs = {s.name: s for s in self.specs}
        for c in changes:
            spec = specs.get(c.name)
            if c.name in self._parts and spec is None:
                self._remove(c.name, removed)
            elif c.name in self._parts and spec is not None and c.verdict in (
                    "restart", "update"):
                self.runners[c.name].respec(spec, restart=c.verdict == "restart")
            elif c.name not in self._parts and spec is not None:
                self._link(broker)
                part = self._make(spec)
                if self._nursery is not None:
                    self._nursery.start_soon(self._run, part)

    def _remove(self, name: str, removed: Callable[[str], None]) -> None:
        part = self._parts.pop(name)  # (listed until it has stopped: GET /v1/groups)
        if part.watch is not None:
            self.watches.remove(part.watch)
        self.leaving.add(name)
        if self._nursery is None:
            return
        self._nursery.start_soon(self._retire, name, part, removed)

    async def _retire(self, name: str, part: _Part, removed: Callable[[str], None]) -> None:
        with Part(f"group {name}: reload").guard():  # (a bug: logged, never the service's)
            await part.runner.retire()
        part.scope.cancel(reason="removed from the config (reload)")
        await part.ended.wait()
        self.reports.drop(name)
        if self.runners.get(name) is part.runner:
            del self.runners[name]
        self.leaving.discard(name)
        log.info("group %s: removed (reload): this node's part has stopped", name)
        with Part(f"group {name}: reload").guard():
            removed(name)

    # -- GroupSource (nvpair.http.groups) ---------------------------------------------------

    def names(self) -> list[str]:
        return list(self.runners)

    def status(self, name: str, now: float) -> Status | None:
        runner = self.runners.get(name)
        return None if runner is None else runner.status(now)

    def request(self, name: str, action: str) -> str | None:
        return self.runners[name].request(action)

    def hold(self, name: str, held: bool) -> str | None:
        return self.runners[name].hold(held)

    def head_url(self, name: str) -> str | None:
        runner = self.runners.get(name)
        if runner is None or self.link is None:
            return None
        e = self.link.table.entries.get(runner.group.head_node)
        return None if e is None else e.advert.url

    # -- GET /v1/events' group events (nvpair.state.events.GroupSource) -------------------------

    @property
    def version(self) -> int:
        return self.reports.steps.version

    async def wait_changed(self, since: int) -> int:
        return await self.reports.steps.wait_changed(since)

    def contents(self, now: float) -> dict[str, dict[str, Any]]:
        return {name: doc(s, now, str(self.settings.log_dir)) for name in self.runners
                if (s := self.status(name, now)) is not None}

    @property
    def mounts(self) -> list[Mount]:
        if not self.runners:
            return []
        token = None if self.settings.cluster is None else self.settings.cluster.token
        view = GroupsView(self, self.settings.node, token, str(self.settings.log_dir))
        return [Mount(handler=view, paths=frozenset({PREFIX}), prefix=PREFIX + "/",
                      peer_auth=True)]
