"""The service: one nursery that owns the engines' supervisors, the sweep and the API server."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from pathlib import Path

import msgspec
import trio
from hypercorn.config import Config as HypercornConfig

from nvpair import __version__
from nvpair.base import logsetup
from nvpair.base.boundary import Part
from nvpair.base.logs import RateCap
from nvpair.config.cluster import ClusterSettings
from nvpair.config.diff import ConfigDiff, diff
from nvpair.config.settings import EngineSpec, Settings, load_settings, url_host
from nvpair.errors import ConfigError, NvpairError
from nvpair.http.api import RELOAD_PATH, Api
from nvpair.http.asgi import Mount, Receive, Scope, Send, error_doc, send_json, send_wrong_method
from nvpair.http.control import Control
from nvpair.http.dashboard import Dashboard, HistoryView
from nvpair.http.groups import GroupsView
from nvpair.http.keys import Keyring
from nvpair.http.metrics import Metrics
from nvpair.http.server import Connections, Limits, connection_cap
from nvpair.http.server import serve as serve_http
from nvpair.openapi import document_json
from nvpair.peers.broker import Broker
from nvpair.peers.feed import PeerFeed
from nvpair.peers.groups import Groups
from nvpair.peers.push import keep_alive_for
from nvpair.peers.receiver import ADVERTS_PATH
from nvpair.peers.status import PEERS_PATH
from nvpair.probing.prober import node_probe_rate
from nvpair.probing.sweep import Sweep
from nvpair.router import ROUTED_PATHS, Router, Traffic
from nvpair.router.activation import Activator
from nvpair.router.counters import TrafficView
from nvpair.router.queueview import QueueView
from nvpair.router.tracing import Tracer
from nvpair.runtime import looplag
from nvpair.runtime.collector import Collector, left_alone
from nvpair.runtime.spanexport import SpanExport, SpanExporter
from nvpair.state.events import Journal
from nvpair.state.history import History
from nvpair.state.snapshot import Board, EngineState
from nvpair.state.transitions import initial_state, rescheduled
from nvpair.supervision import orphans
from nvpair.supervision.fleet import Fleet
from nvpair.supervision.lifecycle import EngineRunner
from nvpair.supervision.memwatch import MemoryWatch
from nvpair.supervision.sleeper import Sleepers

log = logging.getLogger("nvpair")


class Running(msgspec.Struct, frozen=False):
    """Started value of ``run``: where the API listens, and the live parts (for tests)."""

    url: str
    board: Board
    sweep: Sweep
    runners: dict[str, EngineRunner]
    traffic: Traffic
    stop: Callable[[], None]
    #: the peers broker of the start (a reload turning peers on or off: ``reloader.peers``)
    peers: Broker | None = None
    procs: orphans.EngineProcs | None = None
    #: the API's open client connections (nvpair.http.server).
    connections: Connections | None = None
    #: the change journal of GET /v1/events
    events: Journal | None = None
    #: this node's parts of multi-node groups
    groups: Groups | None = None
    #: the memory watch (docs/memory.md)
    memory: MemoryWatch | None = None
    #: the trace export nvpair started with, where tracing is on (docs/observability.md;
    #: a reload that changes [tracing] starts another: ``reloader.export.current``)
    spans: SpanExporter | None = None
    #: reloads of the config (docs/lifecycle.md, "Reload")
    reloader: Reloader | None = None


def limits(settings: Settings) -> Limits:
    """How long the API's client connections live, and how many there may be."""
    paths = {}
    if settings.cluster is not None:  # steady peer pushes keep their connection (only they)
        paths[ADVERTS_PATH] = max(settings.keep_alive_s,
                                  keep_alive_for(settings.cluster.interval_s))
    return Limits(keep_alive_s=settings.keep_alive_s, max_connections=settings.max_connections,
                  header_timeout_s=settings.header_timeout_s,
                  body_timeout_s=settings.body_timeout_s, keep_alive_paths=paths)


def exporter_for(settings: Settings) -> SpanExporter | None:
    """The trace export of ``settings`` (None: tracing is off)."""
    tracing = settings.tracing
    if tracing is None:
        return None
    return SpanExporter(tracing.endpoint, [
        ("service.name", tracing.service_name), ("service.version", __version__),
        ("service.instance.id", settings.node)], headers=tracing.headers,
        timeout_s=tracing.timeout_s)


def tracer_for(settings: Settings, export: SpanExport) -> Tracer | None:
    """Whether and how routed requests are traced (None: they are not)."""
    if settings.tracing is None:
        return None
    return Tracer(export, settings.tracing.sample_ratio, node=settings.node)


def hypercorn_config(settings: Settings) -> HypercornConfig:
    cfg = HypercornConfig()
    cfg.bind = [f"{url_host(settings.listen_host)}:{settings.listen_port}"]
    cfg.keep_alive_timeout = settings.keep_alive_s
    cfg.graceful_timeout = 5.0
    cfg.accesslog = None
    cfg.errorlog = logging.getLogger("hypercorn.error")
    cfg.include_server_header = False
    return cfg


async def run(settings: Settings, *, procs: orphans.EngineProcs | None = None,
              load: Callable[[], Settings] | None = None,
              task_status: trio.TaskStatus[Running] = trio.TASK_STATUS_IGNORED) -> None:
    """Run nvpair until ``stop()`` is called (or cancelled).

    Started value: ``Running``, once the engines' runners and the sweep have started, the
    API listens and the peers broker (if any) has started; ``Running.url`` is where.

    ``stop()`` (sync) shuts down in order and ``run`` returns when it is done: the API stops
    accepting and drains its requests (event streams get ``bye`` and end at once; the
    broker leaves the cluster meanwhile), then every
    engine stops (each its stop signal, grace period and SIGKILL, in parallel), then the
    router's connections close. Cancellation ends it all at once, without the drain or a
    leave; managed engines still stop gracefully (shielded and bounded).

    ``procs``: the engine processes' records (``nvpair serve`` passes its own, to kill them
    at once on a second signal); None: one of its own, in ``settings.state_dir``.
    ``load``: how a reload reads the config again (``Reloader``; None: from
    ``settings.source``).

    Raises: an OSError when the API cannot listen (a taken or forbidden address), before
    the started value, in Trio's exception groups (the CLI unwraps it into one line).
    Nothing an engine, a peer or a client does ends it: those are their parts' state.
    """
    groups = Groups(settings)  # this node's parts of multi-node groups (docs/groups.md)
    settings = groups.local(settings)  # a group's engine: adopted on its head, not on ranks
    board = Board(tuple(initial_state(spec) for spec in settings.engines))
    sweep = Sweep(board, settings.sweep_deadline_s)
    traffic = Traffic(settings.router)
    procs = orphans.EngineProcs(settings.state_dir) if procs is None else procs
    rate = node_probe_rate(settings.engines)  # (the probes' wake grid: nvpair.runtime.wakes)

    def runner_for(spec: EngineSpec, settings: Settings, rate: float) -> EngineRunner:
        log_rate = RateCap(settings.log_lines_per_s, settings.log_bytes_per_s)
        return EngineRunner(spec, board, sweep, settings.log_dir, traffic, procs,
                            log_rate=log_rate, probe_rate=rate,
                            api_address=(settings.listen_host, settings.listen_port))

    runners = {spec.name: runner_for(spec, settings, rate) for spec in settings.engines}
    fleet = Fleet(runners)
    memory = MemoryWatch(settings.memory, board, settings.engines, traffic=traffic,
                         runners=runners)
    for name, runner in runners.items():  # an exit while memory ran out: said so
        runner.explain_exit = memory.exit_explainer(name)
    peers = None if settings.cluster is None else Broker(settings.cluster, board, settings.node)
    cluster_token = None if settings.cluster is None else settings.cluster.token
    groups.attach(board, peers, procs)
    groups.traffic = traffic  # (a group's restart or removal waits for its head's requests)
    sleepers = Sleepers(settings.engines, board, traffic)  # wake and sleep (docs/sleep.md)
    # engines on demand (docs/on-demand.md): made with none too, so that a reload may add
    # the first (inert without one: everything it does is for an on-demand engine)
    activator = Activator(board, settings.engines, runners, traffic, settings.activation,
                          settings.memory, sleepers)
    # traces of routed requests (docs/observability.md); a reload may switch them
    export, exporter = SpanExport(), exporter_for(settings)
    export.switch(exporter)
    tracer = tracer_for(settings, export)
    router = Router(board, settings.engines, settings.router, traffic, node=settings.node,
                    peers=None if peers is None else peers.table, cluster_token=cluster_token,
                    activator=activator, sleepers=sleepers, queue=settings.activation,
                    tracer=tracer)
    keys = Keyring(settings.keys)  # (docs/keys.md; none in it: no token, a reload may add)
    mounts = [Mount(handler=TrafficView(traffic, keys), paths=frozenset({"/v1/router"})),
              Mount(handler=QueueView(activator), paths=QueueView.paths)]
    history = History(board)  # the dashboard's charts (docs/dashboard.md)
    dashboard = Dashboard(token_set=keys.on, allowed_hosts=frozenset(settings.allowed_hosts))
    mounts += [Mount(handler=dashboard, paths=Dashboard.paths, prefix=Dashboard.prefix,
                     own_auth=True),
               Mount(handler=HistoryView(history, settings.node, mounts),
                     paths=frozenset({HistoryView.path}))]
    reloader = Reloader(settings, fleet=fleet, board=board, router=router, traffic=traffic,
                        memory=memory, sleepers=sleepers, activator=activator, keys=keys,
                        sweep=sweep, groups=groups, runner_for=runner_for,
                        load=load)
    reloader.export, reloader.dashboard = export, dashboard
    mounts.append(Mount(handler=ReloadRoute(reloader), paths=frozenset({RELOAD_PATH})))
    if settings.router.enabled:
        mounts.append(Mount(handler=router, paths=ROUTED_PATHS, peer_auth=True,
                            routed=True))
    if peers is not None:
        mounts.extend(peers.mounts)
    mounts.extend(groups.mounts)
    events = Journal(board, node=settings.node, max_streams=settings.max_streams,
                     peers=PeerFeed(None if peers is None else peers.table),
                     groups=groups)  # (a reload may add the first group)
    reloader.events, reloader.peers = events, peers
    api = reloader.api = Api(board, node=settings.node, keys=keys, events=events,
              spec=api_document(settings, peers is not None, bool(groups.mounts)),
              controller=Control(runners, board, settings.node, sleepers), mounts=mounts,
              cluster=None if peers is None else peers.table, cluster_token=cluster_token,
              allowed_hosts=settings.allowed_hosts,
              metrics=Metrics(board, traffic, node=settings.node, sweep=sweep.durations,
                              peers=None if peers is None else peers.table,
                              streams=lambda: len(events.streams), keys=keys,
                              spans=export))
    shutdown = trio.Event()

    async def drain() -> None:  # event streams say bye and end, so the drain waits for none
        await shutdown.wait()
        events.close()

    # What a killed nvpair left running (a group rank's too: not in the local settings).
    # Shielded, as an engine's stop is: a signal meanwhile never leaves one half-stopped
    # (bounded by the grace periods; a second signal kills them at once: procs.kill_now).
    with trio.CancelScope(shield=True):
        await orphans.reclaim(procs, groups.settings.engines)
    # Lifetimes, outermost last to end: the router's engine clients, the engines, the API.
    # On shutdown the API drains first, then engines stop, then the clients close.
    async with trio.open_nursery() as outer:
        outer.start_soon(looplag.from_env)  # opt-in: NVPAIR_LOOP_LAG_FILE (benchmarks)
        await outer.start(export.run)
        await outer.start(router.run)
        await outer.start(activator.run)
        outer.start_soon(Part("events journal").supervise, events.run)  # a bug: retried
        outer.start_soon(Part("history").supervise, history.run)
        # a changed key file is read again (rotation); none: a look costs nothing
        outer.start_soon(Part("keys: token files").supervise, keys.watch)
        async with trio.open_nursery() as engines:
            await engines.start(sweep.run)
            await engines.start(groups.run)
            await engines.start(memory.run)
            await engines.start(sleepers.run)
            await engines.start(fleet.run)
            async with trio.open_nursery() as http:
                connections = Connections(connection_cap(settings.max_connections))
                reloader.connections = connections
                binds = await http.start(
                    lambda task_status: serve_http(api, hypercorn_config(settings),
                                                   limits(settings),
                                                   shutdown_trigger=drain,
                                                   connections=connections,
                                                   task_status=task_status)
                )
                # where peers a reload turns on run (docs/peers.md, "Reload")
                reloader.start_peers = partial(start_broker, http, binds[0], shutdown)
                # The engines start once the API listens, a few at a time (see
                # start_engines). Until its runner runs, reads show an engine as it
                # starts ("starting").
                engines.start_soon(start_engines, fleet, list(runners.values()))
                if peers is not None:  # until shutdown, then a graceful leave (<= 1.5 s)
                    await http.start(peers.run, binds[0], shutdown)
                task_status.started(Running(url=binds[0], board=board, sweep=sweep,
                                            runners=runners, traffic=traffic,
                                            stop=shutdown.set, peers=peers, procs=procs,
                                            connections=connections, events=events,
                                            groups=groups,
                                            memory=memory, spans=exporter,
                                            reloader=reloader))
            # hypercorn has stopped accepting and drained in-flight requests; engines stop
            # with their grace periods (each SIGTERM, wait, SIGKILL, in parallel).
            engines.cancel_scope.cancel(reason="nvpair is shutting down")
        outer.cancel_scope.cancel(reason="nvpair is shutting down")

class Reloader:
    """Reads the config again and applies what changed to the running parts
    (docs/lifecycle.md, "Reload"): ``nvpair reload``, SIGHUP, ``POST /v1/admin/reload``
    and ``--watch-config`` all call ``reload``.

    Reloads run one at a time: a reload asked while one runs waits for it, then reads
    the file itself (so it sees the newest edit). An engine whose config did not change is
    not touched; one being drained for a change goes on draining while the reload
    returns (``nvpair.supervision.fleet``)."""

    def __init__(self, settings: Settings, *, fleet: Fleet, board: Board, router: Router,
                 traffic: Traffic, memory: MemoryWatch, sleepers: Sleepers,
                 activator: Activator, keys: Keyring | None, sweep: Sweep,
                 groups: Groups,
                 runner_for: Callable[[EngineSpec, Settings, float], EngineRunner],
                 load: Callable[[], Settings] | None = None) -> None:
        self.settings = settings
        self.fleet, self.board, self.router, self.traffic = fleet, board, router, traffic
        self.memory, self.sleepers, self.activator = memory, sleepers, activator
        self.keys, self.sweep, self.groups = keys, sweep, groups
        self.runner_for = runner_for
        self.load = load or partial(_load_again, settings.source)
        self.events: Journal | None = None
        self.api: Api | None = None
        #: the peers broker (None: peers are not enabled)
        self.peers: Broker | None = None
        #: runs a broker a reload made (peers turned on), once the API listens
        self.start_peers: Callable[[Broker], None] | None = None
        self._lock = trio.Lock()
        #: reloads applied, and refused, since nvpair started
        self.applied = self.refused = 0
        #: the trace export, switched when [tracing] changes; the dashboard (its auth)
        self.export: SpanExport | None = None
        self.dashboard: Dashboard | None = None
        #: the API's client connections, whose limits a reload changes (``apply_limits``)
        self.connections: Connections | None = None

    async def reload(self, why: str) -> ConfigDiff:
        """Read the config, check it and apply what changed; returns what changed.
        Raises ConfigError (one line, as ``nvpair check`` says it) for a config that is
        bad or changes what a reload cannot: nothing is changed then. ``why``: what asked
        (for the log line)."""
        async with self._lock:
            try:
                new = await trio.to_thread.run_sync(self.load)
                change = self.check(new)
            except NvpairError as exc:
                self.refused += 1
                log.error("reload (%s) refused, the running config kept: %s", why, exc)
                raise ConfigError(str(exc)) from None
            self.apply(new, change)
            self.applied += 1
            line = change.summary()
            log.info("%s (%s)", line, why, extra={"event": "reload"})
            if self.events is not None:
                self.events.reloaded(change.doc())
            return change

    def check(self, new: Settings) -> ConfigDiff:
        """What ``new`` changes; raises ConfigError for what a reload cannot change.

        Judged on the whole config (a group's part on a rank is no engine of the local
        settings, yet its change is named as an engine's)."""
        change = diff(self.groups.settings, new)
        refused = list(change.refused)
        refused += group_refusals(self.groups, new)
        if "peers" in change.sections:
            refused += peers_refusals(self, new)
        refused += log_dir_refusals(self, change)
        if refused:
            raise ConfigError(f"{new.source}: {'; '.join(refused)}")
        return change

    def apply(self, new: Settings, change: ConfigDiff) -> None:
        """Apply ``change`` (from ``check``): sync, so no reader sees half of it; the drains
        of restarted and removed engines go on in the fleet."""
        whole = new
        new = self.groups.local(new)
        # the engines as this node runs them (a group's head: adopted; a rank's: none)
        full, change = change, diff(self.settings, new)
        heads = {e.name for e in self.groups.specs if e.group is not None
                 and e.group.rank == 0}
        specs = {e.name: e for e in new.engines}
        rate = node_probe_rate(new.engines)
        moved = [e.name for e in change.engines if e.verdict in ("restart", "removed")]
        added = [specs[e.name] for e in change.engines if e.verdict == "added"]
        # on the board first: a runner writes to its engine's entry (one removed and still
        # draining has its entry: the new runner takes it over once the old one is out)
        fresh = [spec for spec in added if self.board.current.engine(spec.name) is None]
        if fresh:
            self.board.publish(self.board.current.engines
                               + tuple(initial_state(spec) for spec in fresh))
        for e in change.engines:
            spec = specs.get(e.name)
            if e.verdict == "update" and self.fleet.leaving(e.name):
                # a restart under way from an earlier reload: it starts this spec instead
                assert spec is not None
                self.fleet.replace(e.name, partial(self._runner, spec, new, rate),
                                   then=self._restarted)
            elif e.verdict == "update":
                assert spec is not None
                self.fleet.runners[e.name].update(spec)
                self.board.update(e.name, partial(_updated, spec=spec))
            elif e.verdict == "restart":
                assert spec is not None
                self.fleet.replace(e.name, partial(self._runner, spec, new, rate),
                                   then=self._restarted)
            elif e.verdict == "removed" and e.name in heads:
                pass  # (once its group has stopped: the head drains first, Groups.apply)
            elif e.verdict == "removed":
                self.fleet.remove(e.name, then=partial(self._forget, e.name))
        for spec in added:
            if self.fleet.leaving(spec.name):  # removed, and back before its drain ended
                self.fleet.replace(spec.name, partial(self._runner, spec, new, rate),
                                   then=self._restarted)
            else:
                self.fleet.start(self._runner(spec, new, rate))
        self.router.reconfigure(new.engines, new.router, moved)
        self.traffic.config = new.router
        self.memory.reconfigure(new.engines)
        self.memory.set_config(new.memory)
        self.sleepers.specs = {s.name: s for s in new.engines if s.sleep is not None}
        self.sleepers.engines = {s.name: s for s in new.engines}
        self.router.models.queue = new.activation  # (a model slot's queue limits)
        self.activator.reconfigure(new.engines, new.activation, new.memory)
        if "peers" in change.sections:  # turned on or off, and the token's readers
            switch_peers(self, new.cluster)
        if self.peers is not None and new.cluster is not None and "peers" in change.sections:
            self.peers.reconfigure(new.cluster)
        self.groups.apply(whole, list(full.engines), self.peers, removed=self._group_removed)
        if self.api is not None and self.groups.runners and not any(
                isinstance(m.handler, GroupsView) for m in self.api.mounts):
            remount(self.api, (*self.api.mounts, *self.groups.mounts))  # (the first group)
        if self.keys is not None and "keys" in change.sections:
            self.keys.replace(new.keys)
        if self.api is not None:
            self.api.allowed_hosts = frozenset(h.lower() for h in new.allowed_hosts)
        self._apply_access(new)
        if "tracing" in change.sections:
            self._apply_tracing(new)
        self.sweep.deadline_s = new.sweep_deadline_s
        if "log_rate" in change.sections:
            for runner in self.fleet.runners.values():
                if runner.log is not None:
                    runner.log.set_rate(RateCap(new.log_lines_per_s, new.log_bytes_per_s))
        if {"http", "peers"} & set(change.sections):
            apply_limits(self, new)
        if "log" in change.sections:
            apply_logs(self.settings, new)
        if "log_dir" in change.sections:
            for runner in self.fleet.runners.values():
                runner.move_log(new.log_dir)
        if not full.empty:
            apply_routes(self, new)
        self.settings = new

    def _apply_access(self, new: Settings) -> None:
        """Keys turned on or off (``Keyring.on``: the API asks for a key from the next
        request on, or asks for none and lets only this machine in) and allowed_hosts, at
        the dashboard too. Keys turned on end the event streams opened without one: their
        clients come back with a key (a long-poll or a log follow ends in <= 30 s)."""
        if self.dashboard is not None:
            self.dashboard.token_set = bool(new.keys)
            self.dashboard.allowed_hosts = frozenset(h.lower() for h in new.allowed_hosts)
        if new.keys and not self.settings.keys and self.events is not None:
            self.events.end_streams("keys")

    def _apply_tracing(self, new: Settings) -> None:
        """[tracing] changed: new requests are traced by a new tracer (its sample ratio)
        into a new exporter (its collector, headers, service name), or not at all; the
        exporter before sends what it holds and ends (``SpanExport.switch``)."""
        if self.export is None:
            return
        self.export.switch(exporter_for(new))
        self.router.tracer = tracer_for(new, self.export)

    def _runner(self, spec: EngineSpec, settings: Settings, rate: float) -> EngineRunner:
        runner = self.runner_for(spec, settings, rate)
        runner.explain_exit = self.memory.exit_explainer(spec.name)
        return runner

    def _restarted(self, runner: EngineRunner) -> None:
        """A changed engine's new runner, about to run: the board shows it as a new
        engine starting (its address, kind and counters are the new spec's), and the
        router's pool of the old one is gone."""
        spec = runner.spec
        self.board.update(spec.name, lambda _old: initial_state(spec))
        self.router.reconfigure(self.settings.engines, self.settings.router, (spec.name,))

    def _group_removed(self, name: str) -> None:
        """A removed group's part has stopped here: on its head, its engine (adopted)
        leaves the fleet and the board, as any removed engine."""
        if name in self.fleet.runners and all(e.name != name for e in self.settings.engines):
            self.fleet.remove(name, then=partial(self._forget, name))

    def _forget(self, name: str) -> None:
        """A removed engine, once stopped: off the board (unless added back meanwhile)."""
        if all(e.name != name for e in self.settings.engines):
            self.board.publish(tuple(e for e in self.board.current.engines if e.name != name))


def api_document(settings: Settings, peers: bool, groups: bool) -> bytes:
    """``/openapi.json``: the routes this node serves (the router's, the peers', the
    groups'), its engines' names and its models (at a start, and again at each reload)."""
    parts = frozenset({"router"} if settings.router.enabled else set()) | (
        frozenset({"peers"}) if peers else frozenset()) | (
        frozenset({"groups"}) if groups else frozenset())
    return document_json(parts, tuple(spec.name for spec in settings.engines),
                         tuple(dict.fromkeys(m for spec in settings.engines
                                             for m in (spec.model, *spec.aliases) if m)))


def remount(api: Api, mounts: tuple[Mount, ...]) -> None:
    """The API's routes from now on, and the dashboard's view of them (its history
    says which optional routes there are, so the page asks only for those)."""
    api.mounts = mounts
    for mount in mounts:
        if isinstance(mount.handler, HistoryView):
            mount.handler.mounts = mounts


def apply_routes(reloader: Reloader, new: Settings) -> None:
    """The API's routes as ``new`` has them: the router's mounted or taken away with
    ``[router] enabled`` (a request already routed goes on: only the next one is not
    matched), and ``/openapi.json`` made again (engines, models, peers and groups)."""
    api = reloader.api
    if api is None:
        return
    routed = any(m.handler is reloader.router for m in api.mounts)
    if new.router.enabled and not routed:
        remount(api, (*api.mounts, Mount(handler=reloader.router, paths=ROUTED_PATHS,
                                         peer_auth=True, routed=True)))
    elif routed and not new.router.enabled:
        remount(api, tuple(m for m in api.mounts if m.handler is not reloader.router))
    api.spec = api_document(new, reloader.peers is not None, bool(reloader.groups.runners))


def apply_limits(reloader: Reloader, new: Settings) -> None:
    """The API's connection limits of ``new`` (docs/api.md, "Connections"), from now on:
    every deadline a connection sets from here on takes them (``Connections.change``: a cap
    lowered below the open count closes none), and new event streams count against the
    new ``max_streams`` (the open ones stay). The advert route's longer keep-alive
    follows ``[cluster]``'s interval, so peers turned on or off change it too."""
    if reloader.connections is not None:
        reloader.connections.change(limits(new))
    if reloader.events is not None:
        reloader.events.max_streams = new.max_streams


def log_dir_refusals(reloader: Reloader, change: ConfigDiff) -> list[str]:
    """Why a reload cannot move the engines' logs (none: it can). A multi-node group's
    epoch logs are named after the directory of the start in what the groups' status
    tells, epoch by epoch: they move with a restart only."""
    if "log_dir" in change.sections and reloader.groups.runners:
        return ["log_dir changed: a multi-node group's epoch logs stay where nvpair "
                "started; restart nvpair"]
    return []


def apply_logs(old: Settings, new: Settings) -> None:
    """``log_format`` and ``access_log`` of ``new``, from the next line on
    (``nvpair.base.logsetup``: only the handlers nvpair itself installed are switched)."""
    if new.log_format != old.log_format:
        logsetup.switch_format(new.log_format)
    if new.access_log != old.access_log:
        logsetup.switch_access(new.access_log)


def group_refusals(groups: Groups, new: Settings) -> list[str]:
    """What of ``new``'s groups a reload cannot take (none: it can): an engine that turns
    from a group's into a single node's or back, or whose node turns from the group's head
    into a rank or back, under the same name (its old part must be gone before the new
    one binds its ports: remove it in one reload, add it in the next), and a group added
    back while its removal still drains."""
    out = []
    before = {e.name: e for e in groups.settings.engines}
    for spec in new.engines:
        old = before.get(spec.name)
        if spec.group is not None and spec.name in groups.leaving:
            out.append(f"group {spec.name} is still being removed (its head drains): "
                       "reload again once it is gone from /v1/groups")
        if old is None or (old.group is None and spec.group is None):
            continue
        if (old.group is None) != (spec.group is None):
            out.append(f"engine {spec.name} turns {'into' if old.group is None else 'from'} "
                       "a multi-node group: remove it in one reload and add it in the next")
        elif old.group is not None and spec.group is not None and (
                (old.group.rank == 0) != (spec.group.rank == 0)):
            out.append(f"group {spec.name}: this node turns from its "
                       f"{old.group.role} into a {spec.group.role}: remove the group in one "
                       "reload and add it in the next")
    return out


#: the API's routes of the peers broker
PEER_PATHS = frozenset({PEERS_PATH, ADVERTS_PATH})


def peers_refusals(reloader: Reloader, new: Settings) -> list[str]:
    """Why a reload cannot take ``new``'s ``[cluster]`` table (none: it can)."""
    if reloader.peers is None or new.cluster is None:  # turned on or off: always live
        return []
    why = reloader.peers.refusal(new.cluster, groups=bool(reloader.groups.runners))
    return [] if why is None else [why]


def switch_peers(reloader: Reloader, cluster: ClusterSettings | None) -> None:
    """A reload's ``[cluster]`` table, applied (docs/peers.md, "Reload"). Sync, so every
    reader switches at once and none waits. Peers turned off: the broker leaves the
    cluster and stops, and the readers (the router's peer routes, the cluster's
    /v1/models, /metrics, the event journal, the peers' routes of the API) drop it;
    turned on: a new broker starts and the readers take its table. A broker that runs
    on takes the rest in place (``Broker.reconfigure``, its table kept). The cluster
    token goes to everything that presents or checks it (routed requests, requests
    passed on, a group's head). (The advert route's longer keep-alive follows in
    ``apply_limits``, the OpenAPI document in ``apply_routes``.)"""
    broker, api = reloader.peers, reloader.api
    if (broker is None) != (cluster is None):
        if broker is not None:
            broker.stop()
        broker = None if cluster is None else Broker(cluster, reloader.board,
                                                     reloader.settings.node)
        if broker is not None and reloader.start_peers is not None:
            reloader.start_peers(broker)
        reloader.peers = broker
        table = None if broker is None else broker.table
        reloader.router.peers = table
        if reloader.events is not None and isinstance(reloader.events.peers, PeerFeed):
            reloader.events.peers.switch(table)
        if api is not None:
            api.cluster = table
            if api.metrics is not None:
                api.metrics.peers = table
            remount(api, tuple(m for m in api.mounts if not m.paths & PEER_PATHS)
                    + tuple(() if broker is None else broker.mounts))
    token = None if cluster is None else cluster.token
    reloader.router.cluster_token = token
    if api is not None:
        api.cluster_token = token.encode() if token else None
        for mount in api.mounts:
            if isinstance(mount.handler, GroupsView):
                mount.handler.token = token


def start_broker(nursery: trio.Nursery, bound_url: str, shutdown: trio.Event,
                 broker: Broker) -> None:
    """Run a broker a reload made beside the API, until nvpair shuts down or a reload
    turns peers off (``Broker.stop``)."""
    nursery.start_soon(broker.run, bound_url, shutdown)


def _updated(engine: EngineState, spec: EngineSpec) -> EngineState:
    """An engine's state once its spec is updated in place: what the board shows of the
    spec (optional, aliases, overdue after the health probe's new schedule)."""
    health = spec.probes.health
    return rescheduled(msgspec.structs.replace(engine, optional=spec.optional,
                                               aliases=spec.aliases),
                       health.interval_s, health.timeout_s)


def _load_again(source: str) -> Settings:
    """The config read again from where it was read at the start."""
    if source.startswith("("):  # the embedded default: what nvpair would find now
        return load_settings(None)
    return load_settings(source)


class ReloadRoute:
    """``POST /v1/admin/reload``: 200 with what changed (``ConfigDiff.doc``), or 400 with
    the config's one-line error (nothing changed). A reload under way is waited for."""

    def __init__(self, reloader: Reloader) -> None:
        self.reloader = reloader

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["method"] != "POST":
            await send_wrong_method(send, "POST", RELOAD_PATH)
            return
        try:
            change = await self.reloader.reload("POST " + RELOAD_PATH)
        except ConfigError as exc:
            await send_json(send, 400, error_doc(400, str(exc), "invalid_config"))
            return
        await send_json(send, 200, change.doc())


#: how often ``--watch-config`` looks at the config file (a change is seen within 2 s)
WATCH_EVERY_S = 1.0


async def watch_file(path: Path, reloader: Reloader, *, every_s: float = WATCH_EVERY_S,
                     task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Reload whenever ``path``'s content changes (``nvpair serve --watch-config``).

    Each look is a stat off the loop (its mtime and size); the file is read and hashed
    only when they moved, and a reload follows only when the hash did (a save of the
    same bytes reloads nothing). Started value: None, once the file was first looked
    at. Cancellation: at any wait. Raises: nothing but Cancelled (a refused reload is
    logged by the reload)."""
    seen = await trio.to_thread.run_sync(_file_mark, path, None)
    applied = None if seen is None else seen[2]  # the content last read
    task_status.started()
    while True:
        await trio.sleep(every_s)
        seen = await trio.to_thread.run_sync(_file_mark, path, seen)
        if seen is not None and seen[2] != applied:
            applied = seen[2]
            await _reload_quietly(reloader, f"{path.name} changed")


FileMark = tuple[int, int, bytes]


def _file_mark(path: Path, seen: FileMark | None) -> FileMark | None:
    """(mtime in ns, size, sha256 of the content) of ``path``; None when it cannot be read
    (being replaced: the next look sees it). The content is hashed only when the mtime or
    size differ from ``seen``."""
    try:
        st = path.stat()
        if seen is not None and (st.st_mtime_ns, st.st_size) == seen[:2]:
            return seen
        return st.st_mtime_ns, st.st_size, hashlib.sha256(path.read_bytes()).digest()
    except OSError:
        return None


#: engines are started this many at a time, STARTED_EVERY_S apart, once the API listens
STARTED_AT_ONCE = 16
STARTED_EVERY_S = 0.01


async def start_engines(fleet: Fleet, runners: list[EngineRunner]) -> None:
    """Start every runner in ``fleet``, STARTED_AT_ONCE each STARTED_EVERY_S (1,024 in
    0.64 s). All at once, their first probes came in one burst that held the loop: at
    1,024 engines the API answered 3.3 s after nvpair started (the runners were started
    before it), or reads waited up to 1.1 s (after it). A runner is started at once (its
    started value), so ``start_soon`` loses nothing. Cancellation: at any sleep."""
    for at in range(0, len(runners), STARTED_AT_ONCE):
        if at:
            await trio.sleep(STARTED_EVERY_S)
        for runner in runners[at:at + STARTED_AT_ONCE]:
            fleet.start(runner)


class Signals:
    """What ``nvpair serve`` does on a signal.

    SIGINT or SIGTERM shuts down (``asked``), leaving the engines with ``on_exit = "keep"``
    running (the next nvpair adopts them); while it does (or while an error ends the
    service), another SIGINT or SIGTERM kills the engines now (``EngineProcs.kill_now``):
    their stop skips the rest of its grace period, and nvpair still waits for each to be
    reaped. SIGHUP reloads the config (``Reloader``; a bad config is refused and logged,
    the running one kept), once nvpair runs; before that, and while it shuts down, it is
    logged and ignored (its default action would end nvpair at once).
    """

    WATCHED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self, procs: orphans.EngineProcs) -> None:
        self.procs = procs
        #: set by the first SIGINT or SIGTERM
        self.asked = trio.Event()
        #: whether nvpair is shutting down (asked, or an error is ending it)
        self.ending = False
        #: cancelled by the first signal while nvpair starts: the start is abandoned
        self.starting = trio.CancelScope()
        #: what SIGHUP does once nvpair runs (``Reloader.reload``)
        self.reloader: Reloader | None = None

    async def handle(self, signals: AsyncIterator[int]) -> None:
        async with trio.open_nursery() as reloads:  # (a reload never holds up a signal)
            async for signum in signals:
                self._handle(signum, reloads)
            reloads.cancel_scope.cancel(reason="no more signals")

    def _handle(self, signum: int, reloads: trio.Nursery) -> None:
        name = signal.Signals(signum).name
        if signum == signal.SIGHUP:
            if self.reloader is None or self.ending:
                log.warning("got SIGHUP: ignored (nvpair is %s)",
                            "shutting down" if self.ending else "starting")
            else:
                reloads.start_soon(_reload_quietly, self.reloader, "SIGHUP")
        elif not self.ending:
            log.info("got %s, shutting down", name)
            self.ending = True
            self.asked.set()
            self.starting.cancel(reason=f"got {name} while starting")
        elif not self.procs.kill_now.is_set():
            log.warning("got %s: second signal: killing engines now", name)
            self.procs.kill_now.set()


async def _reload_quietly(reloader: Reloader, why: str) -> None:
    """A reload no one waits for the answer of (a signal, a file change): a refusal is
    logged by the reload itself; a failure of nvpair's own while it applies (a bug) is
    the reload's, logged with its traceback, never the service's (an API reload's is its
    500)."""
    with Part(f"reload ({why})", logger=log).guard(), contextlib.suppress(ConfigError):
        await reloader.reload(why)


async def main(settings: Settings, *, announce: Callable[[str], None] = print,
               watch: Callable[[Board], Awaitable[None]] | None = None,
               load: Callable[[], Settings] | None = None,
               watch_config: Path | None = None) -> None:
    """``nvpair serve``: run until SIGINT or SIGTERM, then shut down cleanly (``Signals``).

    ``load``: how a reload reads the config (``run``); ``watch_config``: reload when this
    file changes (``watch_file``). ``watch(board)`` runs beside it (the CLI prints engine
    state changes with it). However
    it ends (a signal, an error while it starts or runs), every managed engine has been
    stopped and reaped before it returns or raises: the signals stay handled until then.
    """
    orphans.become_subreaper()  # what engines double-fork comes back to us, not to init
    procs = orphans.EngineProcs(settings.state_dir)
    signals = Signals(procs)
    with trio.open_signal_receiver(*Signals.WATCHED) as received:
        async with trio.open_nursery() as handling:
            handling.start_soon(signals.handle, received)
            try:
                await _serve(settings, procs, signals, announce, watch, load, watch_config)
            finally:
                with trio.CancelScope(shield=True):
                    await orphans.end_strays(procs)
                if procs.left:  # on_exit = "keep" (docs/lifecycle.md)
                    log.warning("nvpair exits leaving %d engine(s) running (on_exit = keep): "
                                "%s; the next nvpair adopts them, `nvpair stop-engines` stops "
                                "them", len(procs.left), ", ".join(
                                    f"{name} (pid {pid})" for pid, name in procs.left.items()))
            handling.cancel_scope.cancel(reason="nvpair has stopped")


async def _serve(settings: Settings, procs: orphans.EngineProcs, signals: Signals,
                 announce: Callable[[str], None],
                 watch: Callable[[Board], Awaitable[None]] | None,
                 load: Callable[[], Settings] | None = None,
                 watch_config: Path | None = None) -> None:
    watching, collecting = trio.CancelScope(), trio.CancelScope()

    collector, collector_part = Collector(), Part("garbage collector")

    async def keep_collecting() -> None:
        with collecting:  # (ended at shutdown; a bug in it is logged and it runs again)
            await collector_part.supervise(collector.keep)

    async def watch_board(board: Board) -> None:
        assert watch is not None
        with watching:
            await watch(board)

    running: Running | None = None
    reaping: trio.CancelScope | None = None
    async with trio.open_nursery() as nursery:
        try:
            with signals.starting:
                running = await nursery.start(partial(run, settings, procs=procs, load=load))
                signals.reloader = running.reloader
                if watch_config is not None and running.reloader is not None:
                    nursery.start_soon(Part("config watch").supervise,
                                       partial(watch_file, watch_config, running.reloader))
                    # (supervised: a bug in it is logged and it runs again)
                # What is alive is frozen out of the cyclic collector's walk, now and after
                # each collection of the young generations, which are held to a size, so
                # that every collection stays short at any size of the node
                # (nvpair.runtime.collector)
                why_not = left_alone()
                if why_not is None:
                    with collector_part.guard():
                        collector.begin()
                    nursery.start_soon(keep_collecting)
                else:
                    log.info("the garbage collector runs as Python's default: %s", why_not)
                announce(running.url)
                if watch is not None:
                    nursery.start_soon(watch_board, running.board)
                reaping = await nursery.start(orphans.reap_strays, procs)
            await signals.asked.wait()
        except BaseException:  # an error ends it all: engines stop; a signal hurries them
            signals.ending = True
            raise
        if running is None:  # the signal came while it started: whatever started stops
            nursery.cancel_scope.cancel(reason="shutting down while starting")
        else:
            running.stop()
            watching.cancel(reason="shutting down")
            collecting.cancel(reason="shutting down")
            if reaping is not None:
                reaping.cancel(reason="shutting down")
