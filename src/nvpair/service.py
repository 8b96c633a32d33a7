"""The service: one nursery that owns the engines' supervisors, the sweep and the API server."""

from __future__ import annotations

import logging
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial

import msgspec
import trio
from hypercorn.config import Config as HypercornConfig

from nvpair import __version__
from nvpair.base.boundary import Part
from nvpair.base.logs import RateCap
from nvpair.config.settings import Settings, url_host
from nvpair.http.api import Api
from nvpair.http.asgi import Mount
from nvpair.http.control import Control
from nvpair.http.dashboard import Dashboard, HistoryView
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
from nvpair.probing.prober import node_probe_rate
from nvpair.probing.sweep import Sweep
from nvpair.router import ROUTED_PATHS, Router, Traffic
from nvpair.router.activation import Activator
from nvpair.router.counters import TrafficView
from nvpair.router.queueview import QueueView
from nvpair.router.tracing import Tracer
from nvpair.runtime import looplag
from nvpair.runtime.collector import Collector, left_alone
from nvpair.runtime.spanexport import SpanExporter
from nvpair.state.events import Journal
from nvpair.state.history import History
from nvpair.state.snapshot import Board
from nvpair.state.transitions import initial_state
from nvpair.supervision import orphans
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
    #: the trace export, where tracing is on (docs/observability.md)
    spans: SpanExporter | None = None


def limits(settings: Settings) -> Limits:
    """How long the API's client connections live, and how many there may be."""
    paths = {}
    if settings.cluster is not None:  # steady peer pushes keep their connection (only they)
        paths[ADVERTS_PATH] = max(settings.keep_alive_s,
                                  keep_alive_for(settings.cluster.interval_s))
    return Limits(keep_alive_s=settings.keep_alive_s, max_connections=settings.max_connections,
                  header_timeout_s=settings.header_timeout_s,
                  body_timeout_s=settings.body_timeout_s, keep_alive_paths=paths)


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
    log_rate = RateCap(settings.log_lines_per_s, settings.log_bytes_per_s)
    rate = node_probe_rate(settings.engines)  # (the probes' wake grid: nvpair.runtime.wakes)
    runners = {spec.name: EngineRunner(spec, board, sweep, settings.log_dir, traffic, procs,
                                       log_rate=log_rate, probe_rate=rate,
                                       api_address=(settings.listen_host,
                                                    settings.listen_port))
               for spec in settings.engines}
    memory = MemoryWatch(settings.memory, board, settings.engines, traffic=traffic,
                         runners=runners)
    for name, runner in runners.items():  # an exit while memory ran out: said so
        runner.explain_exit = memory.exit_explainer(name)
    peers = None if settings.cluster is None else Broker(settings.cluster, board, settings.node)
    cluster_token = None if settings.cluster is None else settings.cluster.token
    groups.attach(board, peers, procs)
    sleepers = Sleepers(settings.engines, board, traffic)  # wake and sleep (docs/sleep.md)
    activator = None  # engines on demand (docs/on-demand.md)
    if any(spec.activation == "on_demand" for spec in settings.engines):
        activator = Activator(board, settings.engines, runners, traffic, settings.activation,
                              settings.memory, sleepers)
    exporter = tracer = None  # traces of routed requests (docs/observability.md)
    if settings.tracing is not None:
        exporter = SpanExporter(settings.tracing.endpoint, [
            ("service.name", settings.tracing.service_name), ("service.version", __version__),
            ("service.instance.id", settings.node)], headers=settings.tracing.headers,
            timeout_s=settings.tracing.timeout_s)
        tracer = Tracer(exporter, settings.tracing.sample_ratio, node=settings.node)
    router = Router(board, settings.engines, settings.router, traffic, node=settings.node,
                    peers=None if peers is None else peers.table, cluster_token=cluster_token,
                    activator=activator, sleepers=sleepers, queue=settings.activation,
                    tracer=tracer)
    keys = Keyring(settings.keys) if settings.keys else None  # (docs/keys.md)
    mounts = [Mount(handler=TrafficView(traffic, keys), paths=frozenset({"/v1/router"})),
              Mount(handler=QueueView(activator), paths=QueueView.paths)]
    history = History(board)  # the dashboard's charts (docs/dashboard.md)
    mounts += [Mount(handler=Dashboard(token_set=keys is not None,
                                       allowed_hosts=frozenset(settings.allowed_hosts)),
                     paths=Dashboard.paths, prefix=Dashboard.prefix, own_auth=True),
               Mount(handler=HistoryView(history, settings.node, mounts),
                     paths=frozenset({HistoryView.path}))]
    if settings.router.enabled:
        mounts.append(Mount(handler=router, paths=ROUTED_PATHS, peer_auth=True,
                            routed=True))
    if peers is not None:
        mounts.extend(peers.mounts)
    mounts.extend(groups.mounts)
    events = Journal(board, node=settings.node, max_streams=settings.max_streams,
                     peers=None if peers is None else PeerFeed(peers.table),
                     groups=groups if groups.runners else None)
    parts = frozenset({"router"} if settings.router.enabled else set()) | (
        frozenset() if peers is None else {"peers"}) | (
        frozenset({"groups"}) if groups.mounts else frozenset())
    api = Api(board, node=settings.node, keys=keys, events=events,
              spec=document_json(parts, tuple(spec.name for spec in settings.engines),
                                 tuple(dict.fromkeys(m for spec in settings.engines
                                                     for m in (spec.model, *spec.aliases)
                                                     if m))),
              controller=Control(runners, board, settings.node, sleepers), mounts=mounts,
              cluster=None if peers is None else peers.table, cluster_token=cluster_token,
              allowed_hosts=settings.allowed_hosts,
              metrics=Metrics(board, traffic, node=settings.node, sweep=sweep.durations,
                              peers=None if peers is None else peers.table,
                              streams=lambda: len(events.streams), keys=keys,
                              spans=exporter))
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
        if exporter is not None:
            await outer.start(exporter.run)
        await outer.start(router.run)
        if activator is not None:
            await outer.start(activator.run)
        outer.start_soon(Part("events journal").supervise, events.run)  # a bug: retried
        outer.start_soon(Part("history").supervise, history.run)
        if keys is not None:  # a changed key file is read again (rotation)
            outer.start_soon(Part("keys: token files").supervise, keys.watch)
        async with trio.open_nursery() as engines:
            await engines.start(sweep.run)
            await engines.start(groups.run)
            await engines.start(memory.run)
            await engines.start(sleepers.run)
            async with trio.open_nursery() as http:
                connections = Connections(connection_cap(settings.max_connections))
                binds = await http.start(
                    lambda task_status: serve_http(api, hypercorn_config(settings),
                                                   limits(settings),
                                                   shutdown_trigger=drain,
                                                   connections=connections,
                                                   task_status=task_status)
                )
                # The engines start once the API listens, a few at a time (see
                # start_engines). Until its runner runs, reads show an engine as it
                # starts ("starting").
                engines.start_soon(start_engines, engines, list(runners.values()))
                if peers is not None:  # until shutdown, then a graceful leave (<= 1.5 s)
                    await http.start(peers.run, binds[0], shutdown)
                task_status.started(Running(url=binds[0], board=board, sweep=sweep,
                                            runners=runners, traffic=traffic,
                                            stop=shutdown.set, peers=peers, procs=procs,
                                            connections=connections, events=events,
                                            groups=groups,
                                            memory=memory, spans=exporter))
            # hypercorn has stopped accepting and drained in-flight requests; engines stop
            # with their grace periods (each SIGTERM, wait, SIGKILL, in parallel).
            engines.cancel_scope.cancel(reason="nvpair is shutting down")
        outer.cancel_scope.cancel(reason="nvpair is shutting down")

#: engines are started this many at a time, STARTED_EVERY_S apart, once the API listens
STARTED_AT_ONCE = 16
STARTED_EVERY_S = 0.01


async def start_engines(nursery: trio.Nursery, runners: list[EngineRunner]) -> None:
    """Start every runner in ``nursery``, STARTED_AT_ONCE each STARTED_EVERY_S (1,024 in
    0.64 s). All at once, their first probes came in one burst that held the loop: at
    1,024 engines the API answered 3.3 s after nvpair started (the runners were started
    before it), or reads waited up to 1.1 s (after it). A runner is started at once (its
    started value), so ``start_soon`` loses nothing. Cancellation: at any sleep."""
    for at in range(0, len(runners), STARTED_AT_ONCE):
        if at:
            await trio.sleep(STARTED_EVERY_S)
        for runner in runners[at:at + STARTED_AT_ONCE]:
            nursery.start_soon(runner.run)


class Signals:
    """What ``nvpair serve`` does on a signal.

    SIGINT or SIGTERM shuts down (``asked``), leaving the engines with ``on_exit = "keep"``
    running (the next nvpair adopts them); while it does (or while an error ends the
    service), another SIGINT or SIGTERM kills the engines now (``EngineProcs.kill_now``):
    their stop skips the rest of its grace period, and nvpair still waits for each to be
    reaped. SIGHUP is logged and ignored (a closed terminal or ssh session sends it; its
    default action would end nvpair at once and leave every managed engine running, in its
    own session).
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

    async def handle(self, signals: AsyncIterator[int]) -> None:
        async for signum in signals:
            name = signal.Signals(signum).name
            if signum == signal.SIGHUP:
                log.warning("got SIGHUP: ignored (nvpair cannot reload its config yet; "
                            "restart it to apply a change)")
            elif not self.ending:
                log.info("got %s, shutting down", name)
                self.ending = True
                self.asked.set()
                self.starting.cancel(reason=f"got {name} while starting")
            elif not self.procs.kill_now.is_set():
                log.warning("got %s: second signal: killing engines now", name)
                self.procs.kill_now.set()


async def main(settings: Settings, *, announce: Callable[[str], None] = print,
               watch: Callable[[Board], Awaitable[None]] | None = None) -> None:
    """``nvpair serve``: run until SIGINT or SIGTERM, then shut down cleanly (``Signals``).

    ``watch(board)`` runs beside it (the CLI prints engine state changes with it). However
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
                await _serve(settings, procs, signals, announce, watch)
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
                 watch: Callable[[Board], Awaitable[None]] | None) -> None:
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
                running = await nursery.start(partial(run, settings, procs=procs))
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
