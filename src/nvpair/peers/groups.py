"""The peer table as a group reads it: what each node last said about a group, and how
fresh that is (``nvpair.supervision.group.GroupPeers``)."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

import msgspec
import trio

from nvpair.base.logs import RateCap
from nvpair.config.settings import Settings
from nvpair.http.asgi import Mount
from nvpair.http.groups import PREFIX, GroupsView, doc
from nvpair.peers.advert import Advertiser
from nvpair.peers.broker import Broker
from nvpair.peers.epochkey import EpochKey, EpochWatch
from nvpair.peers.table import PeerTable
from nvpair.state.snapshot import Board
from nvpair.supervision.group import GroupRunner, Heard, Reports, Status
from nvpair.supervision.orphans import EngineProcs


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


class Groups:
    """This node's parts of every multi-node group in the config (docs/groups.md): built
    before the board (``local``), attached to the peers once they exist, run with the
    engines."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.link: GroupLink | None = None
        self.specs = [s for s in settings.engines if s.group is not None]
        self.reports = Reports()
        self.runners: dict[str, GroupRunner] = {}
        #: with the etcd backend, on a rank: each group's epoch key watch
        self.watches: list[EpochWatch] = []

    def local(self, settings: Settings) -> Settings:
        """The settings the rest of nvpair runs: a group's engine is adopted on its head
        (the group runner starts its process; the engine's runner probes and lists it),
        and absent on its ranks (never listed or routed to)."""
        if not self.specs:
            return settings
        engines = tuple(msgspec.structs.replace(s, managed=False) if s.group is not None
                        else s for s in settings.engines
                        if s.group is None or s.group.rank == 0)
        return msgspec.structs.replace(settings, engines=engines)

    def attach(self, board: Board, broker: Broker | None, procs: EngineProcs) -> None:
        if not self.specs:
            return
        assert broker is not None  # (a group without peers is a config error)
        advertiser = broker.advertiser
        advertiser.groups = self.reports

        def refresh() -> None:
            advertiser.refresh(trio.current_time())

        self.reports.listeners.append(refresh)
        link = GroupLink(broker.table, advertiser)
        self.link = link
        for spec in self.specs:
            runner = self.runners[spec.name] = GroupRunner(
                spec, board, link, self.reports, self.settings.node, self.settings.log_dir,
                procs, self.settings.state_dir,
                RateCap(self.settings.log_lines_per_s, self.settings.log_bytes_per_s))
            if broker.etcd is not None and runner.group.rank == 0:
                runner.claim = EpochKey(broker.etcd, spec.name, self.settings.node).claim
            elif broker.etcd is not None:  # a rank runs only the epoch held under the key
                watch = EpochWatch(broker.etcd, spec.name)
                watch.on_change = runner.poke
                runner.key_view = lambda watch=watch: watch.view
                self.watches.append(watch)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        """Run every group runner until cancelled.

        Started value: None, once each runner has started. Cancellation: each runner stops
        its process (its stop signal, grace period, SIGKILL, shielded). Raises: nothing but
        Cancelled (a runner's failure is its group's ``error``, retried with backoff)."""
        async with trio.open_nursery() as nursery:
            for watch in self.watches:
                nursery.start_soon(watch.run)
            for runner in self.runners.values():
                await nursery.start(runner.run)
            task_status.started()
            await trio.sleep_forever()

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
