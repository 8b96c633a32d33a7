"""nvpair's HTTP server: hypercorn's trio worker with connection hygiene and limits.

hypercorn does the HTTP (h11, h2, ASGI); this module replaces the two pieces of its trio
worker that decide how long a client connection lives:

* ``Connection`` subclasses hypercorn's ``TCPServer`` (one per client connection).

  - **Upstream bug (hypercorn 0.18, trio worker): a connection its client closed stays open
    until its idle timer fires.** ``TCPServer.run`` reads the end of file and leaves
    ``_read_data``, but the connection's task group still holds the idle-timer task
    (``_idle_timeout``, ``keep_alive_timeout`` long), so ``_close`` runs only when that
    timer ends. Meanwhile the socket sits in CLOSE-WAIT and holds a file descriptor: with
    3,000 connections closed by their clients nvpair held 330 CLOSE-WAIT sockets 3 s later,
    and with a long keep-alive it would hold every one of them for that long. The asyncio
    worker does not have this. ``Connection`` stops the idle timer as soon as the read loop
    ends (end of file, reset, deadline), so the socket is closed at once; a request still in
    flight is handled exactly as hypercorn does (its app is told the client disconnected).
  - **Deadlines.** A request's head must arrive within ``header_timeout_s`` of its first
    byte (of the connection's start, for the first request), and its body within
    ``body_timeout_s`` of the head; a slow-loris trickle is cut there. Between requests
    only the keep-alive timer runs, and no deadline applies while the app answers (a long
    stream is not cut). HTTP/2 and WebSocket connections get the keep-alive timer only.
  - **Per-path keep-alive.** A connection whose last request went to one of
    ``Limits.keep_alive_paths`` (peers' adverts) idles that long instead of
    ``keep_alive_s``, so steady peer pushes keep their connection without stretching
    every client's.
  - **One keep-alive timer task per connection** (``IdleTimer``), whose deadline moves.
    hypercorn starts a new timer task each time a connection turns idle and takes a lock
    to start or stop it: at every request a task spawned and three more trips through the
    scheduler. Moving a deadline is a sync assignment (``docs/benchmarks.md``, "The
    server's own cost").

* ``serve`` replaces ``hypercorn.trio.serve``'s accept loop (``trio.serve_listeners``):

  - **A cap on connections** (``max_connections``, also at most the fd limit minus
    ``FD_RESERVE``). At the cap, when a new client is waiting, the connection idle the
    longest is closed to admit it (as nginx reuses keep-alive connections); when none is
    idle, accepting waits until one is (the kernel's backlog holds new clients).
  - **Limits changed live** (a reload, ``Connections.change``): every deadline a
    connection sets from then on (its next read, its next idle period) takes the new
    limits; an idle period already under way keeps the deadline it began with. A cap
    lowered below the connections open closes none of them: new clients are held (or
    admitted by closing idle ones) as at the cap, until the count is under it.
  - **Out of file descriptors** (EMFILE and kin on accept): the oldest idle connection is
    closed to make room; with none idle, accepting backs off (0.1 s doubling to 2 s). It is
    logged as one line at most once a minute (trio's own loop logs a traceback every 0.1 s).

``raise_fd_limit`` lifts ``RLIMIT_NOFILE`` to its hard limit (``nvpair serve`` calls it at
start).
"""

from __future__ import annotations

import errno
import logging
import math
import os
import resource
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import h11
import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.events import Closed, Event, RawData, Updated
from hypercorn.trio.lifespan import Lifespan
from hypercorn.trio.statsd import StatsdLogger
from hypercorn.trio.tcp_server import MAX_RECV, TCPServer
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import AppWrapper, ConnectionState, LifespanState
from hypercorn.utils import ShutdownError, raise_shutdown, repr_socket_addr, wrap_app

log = logging.getLogger("nvpair.server")

#: file descriptors kept for everything but client connections (engines' pipes, probe and
#: router clients, log files): the connection cap is at most the fd limit minus this.
FD_RESERVE = 256
#: accept errors that mean "out of resources", not "this client failed".
CAPACITY_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})
#: accept backs off this long after such an error, doubling up to ``ACCEPT_BACKOFF_MAX_S``.
ACCEPT_BACKOFF_S = 0.1
ACCEPT_BACKOFF_MAX_S = 2.0
#: running out of descriptors is logged (one line) at most this often.
CAPACITY_WARNING_EVERY_S = 60.0


@dataclass(frozen=True)
class Limits:
    """How long client connections live and how many there may be (docs/api.md)."""

    #: idle keep-alive connections are closed after this long.
    keep_alive_s: float = 75.0
    #: at most this many client connections are open at once.
    max_connections: int = 1024
    #: a request's head must arrive within this long of its first byte.
    header_timeout_s: float = 10.0
    #: a request's body must arrive within this long of its head.
    body_timeout_s: float = 60.0
    #: paths whose connections idle longer (path -> keep-alive in seconds).
    keep_alive_paths: Mapping[str, float] = field(default_factory=dict)


def raise_fd_limit() -> int:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard limit; the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = hard
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):  # e.g. macOS refuses RLIM_INFINITY; keep what we have
            target = soft
        soft = target
    log.debug("file descriptor limit (RLIMIT_NOFILE): %s (hard %s)", soft, hard)
    return soft


def connection_cap(max_connections: int) -> int:
    """``max_connections``, lowered to fit the process's fd limit (minus ``FD_RESERVE``)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return max_connections
    room = max(8, soft - FD_RESERVE)
    if room < max_connections:
        log.warning("max_connections %d lowered to %d to fit the fd limit (%d)",
                    max_connections, room, soft)
        return room
    return max_connections


class Connections:
    """The open client connections: counted, and the idle ones ordered oldest first; and
    the limits each of them reads at every deadline it sets (``change``)."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        #: what every connection's deadlines are read from (``serve`` sets its own)
        self.limits = Limits(max_connections=cap)
        #: the most connections open at once so far.
        self.high_water = 0
        self._open: set[Connection] = set()
        self._idle: dict[Connection, None] = {}  # insertion order: idle the longest first
        self._changed = trio.Event()

    def __len__(self) -> int:
        return len(self._open)

    def change(self, limits: Limits) -> None:
        """The limits from now on (a reload; docs/api.md, "Connections"). Each connection
        reads them at its next read or its next idle period; the cap is ``connection_cap``
        of the new ``max_connections``. A cap lowered below the open count closes nothing now:
        new clients wait, or idle connections make room for them, as at the cap. A raised
        one admits a client waiting at once."""
        self.limits = limits
        self.cap = connection_cap(limits.max_connections)
        self._wake()

    def opened(self, conn: Connection) -> None:
        self._open.add(conn)
        self._idle[conn] = None
        self.high_water = max(self.high_water, len(self._open))

    def closed(self, conn: Connection) -> None:
        self._open.discard(conn)
        self._idle.pop(conn, None)
        self._wake()

    def idle(self, conn: Connection, idle: bool) -> None:
        if conn not in self._open:
            return
        self._idle.pop(conn, None)
        if idle:
            self._idle[conn] = None
            self._wake()

    def evict_oldest_idle(self) -> bool:
        """Close the connection idle the longest; False if none is idle."""
        for conn in self._idle:
            self.closed(conn)
            conn.evict()
            return True
        return False

    async def make_room(self) -> None:
        """Wait until one more connection fits, closing the oldest idle one if need be."""
        while len(self._open) >= self.cap:
            if not self.evict_oldest_idle():
                await self._changed.wait()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()


class _WatchPath:
    """The ASGI app, noting each request's path on its connection (per-path keep-alive)."""

    def __init__(self, app: AppWrapper, conn: Connection) -> None:
        self.app = app
        self.conn = conn

    async def __call__(self, scope: Any, receive: Any, send: Any, sync_spawn: Any,
                       call_soon: Any) -> None:
        if scope.get("type") == "http":
            self.conn.last_path = scope.get("path")
            # a long answer (GET /v1/events) closes a client that stopped reading with it
            scope["extensions"] = {**(scope.get("extensions") or {}),
                                   "nvpair.close": self.conn.evict}
        await self.app(scope, receive, send, sync_spawn, call_soon)


class IdleTimer:
    """A connection's keep-alive timer, in place of hypercorn's ``TrioSingleTask`` (same
    two methods): one task for the connection's life, waiting under a cancel scope whose
    deadline ``restart`` sets (idle from now) and ``stop`` lifts (a request is running).
    When the deadline passes, or the server shuts down while the connection is idle, the
    connection is closed (``close``). ``end`` stops the task without closing anything
    (the connection is ending anyway). Neither method waits."""

    __slots__ = ("_close", "_closing", "_ended", "_idle", "_keep_alive", "_scope", "_started",
                 "_terminated")

    def __init__(self, keep_alive: Callable[[], float], terminated: Callable[[], Awaitable[None]],
                 close: Callable[[], Awaitable[None]]) -> None:
        self._keep_alive, self._terminated, self._close = keep_alive, terminated, close
        self._scope = trio.CancelScope()
        self._idle = self._started = self._ended = self._closing = False

    async def restart(self, task_group: Any, action: object = None) -> None:
        """Idle from now (``task_group``: the connection's, where the task starts the first
        time; ``action``, hypercorn's timer coroutine, is not used)."""
        if self._ended:
            return
        self._idle = True
        self._scope.deadline = trio.current_time() + (0.0 if self._closing
                                                      else self._keep_alive())
        if not self._started:
            self._started = True
            task_group.spawn(self._run)

    async def stop(self) -> None:
        """Busy from now: no deadline."""
        self._idle = False
        self._scope.deadline = math.inf

    def end(self) -> None:
        self._ended = True
        self._scope.cancel()

    async def _run(self) -> None:
        with self._scope:
            await self._terminated()
            # shutting down: an idle connection closes now; a busy one when its answer
            # has ended (``restart``, then the deadline passes at once)
            self._closing = True
            if not self._idle:
                await trio.sleep_forever()
        if not self._ended:
            with trio.CancelScope(shield=True):
                await self._close()


class Connection(TCPServer):
    """One client connection: hypercorn's, closed when its client closes it (see module)."""

    def __init__(self, app: AppWrapper, config: HypercornConfig, context: WorkerContext,
                 state: LifespanState, stream: trio.SocketStream, *,
                 connections: Connections) -> None:
        super().__init__(_WatchPath(app, self), config, context, state,
                         stream)  # type: ignore[arg-type]
        self.connections = connections
        self.last_path: str | None = None
        self._opened = trio.current_time()
        self._requests = 0
        self._head_from: float | None = None  # first byte of a request head not yet parsed
        self._body_from: float | None = None  # when the head of a request with a body ended
        self._timer = IdleTimer(self._keep_alive, context.terminated.wait,
                                self._initiate_server_close)
        self.idle_task = self._timer  # type: ignore[assignment]  # (hypercorn calls it too)

    @property
    def limits(self) -> Limits:
        """The limits now (a reload may change them: ``Connections.change``)."""
        return self.connections.limits

    def evict(self) -> None:
        """Close the socket now (the connection's task then ends on its own)."""
        self.stream.socket.close()

    async def run(self) -> None:
        try:
            await super().run()
        finally:
            self.connections.closed(self)

    async def _close(self) -> None:
        try:
            await super()._close()
        finally:  # also when cancelled in send_eof (hypercorn's close then never runs)
            self.stream.socket.close()

    async def protocol_send(self, event: Event) -> None:
        if isinstance(event, Updated):
            self.connections.idle(self, event.idle)
        await super().protocol_send(event)

    async def _read_data(self) -> None:
        # hypercorn's loop with deadlines, and one change: the idle timer is stopped at the
        # end, so that the task group (and then ``_close``) ends now, not when it fires.
        while True:
            try:
                with trio.fail_at(self._read_deadline()):
                    data = await self.stream.receive_some(MAX_RECV)
            except (trio.ClosedResourceError, trio.BrokenResourceError, trio.TooSlowError):
                break
            state = self._their_state()
            # (DONE: the last request is in and its answer pending; these bytes begin the next)
            if data and self._head_from is None and state in (h11.IDLE, h11.DONE):
                self._head_from = trio.current_time()
                self.connections.idle(self, False)  # a request is arriving: not evictable
                if self._requests:  # a new request on a kept-alive connection
                    await self._timer.stop()
            h11_before = state is not None
            await self.protocol.handle(RawData(bytes(data)))
            if state is h11.DONE and self._head_from is not None and (
                    self._their_state() is h11.IDLE):
                # the answer's end made the connection idle, but the next head is arriving
                self.connections.idle(self, False)
                await self._timer.stop()
            if h11_before and self._their_state() is None:  # now HTTP/2 (or a WebSocket):
                # idle while it has no stream; its own Updated events say so from here on
                self.connections.idle(self, getattr(self.protocol.protocol, "idle", False))
            if data == b"":
                break
        await self.protocol.handle(Closed())
        self._timer.end()

    def _their_state(self) -> object:
        connection = getattr(self.protocol.protocol, "connection", None)
        return connection.their_state if isinstance(connection, h11.Connection) else None

    def _read_deadline(self) -> float:
        state = self._their_state()
        if state is h11.IDLE:
            if self._head_from is not None:
                return self._head_from + self.limits.header_timeout_s
            if not self._requests:
                return self._opened + self.limits.header_timeout_s
            return math.inf  # between requests: the keep-alive timer decides
        if self._head_from is not None:  # the head has been parsed
            self._head_from = None
            self._requests += 1
        if state is h11.SEND_BODY:
            if self._body_from is None:
                self._body_from = trio.current_time()
            return self._body_from + self.limits.body_timeout_s
        self._body_from = None
        return math.inf  # the app is answering, or HTTP/2, or a WebSocket

    def _keep_alive(self) -> float:
        """How long this connection may idle now (its last request's path decides)."""
        limits = self.limits
        return limits.keep_alive_paths.get(self.last_path or "", limits.keep_alive_s)


async def serve(app: Any, config: HypercornConfig, limits: Limits, *,
                shutdown_trigger: Callable[[], Awaitable[None]],
                connections: Connections | None = None,
                task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve the ASGI ``app`` like ``hypercorn.trio.serve`` (plain HTTP, one worker), with
    ``Connection`` for each client and the cap of ``limits`` (see the module).

    ``config.keep_alive_timeout`` is set from ``limits``. ``connections`` is the registry to
    count connections in, given its limits (``Connections.change`` changes them live).

    Started value: the bound URLs (``http://HOST:PORT``), once every socket listens.
    Returns once ``shutdown_trigger`` has returned: the listeners close, idle connections
    close at once and requests in flight get ``config.graceful_timeout`` to finish.
    Cancellation ends it at once (connections and requests cancelled with it).

    Raises: OSError when a socket cannot be bound, before the started value; an accept
    error other than running out of descriptors (those are waited out, evicting idle
    connections). A request's failure is never the server's (``Api`` answers it a 500).
    """
    config.keep_alive_timeout = limits.keep_alive_s
    config.set_statsd_logger_class(StatsdLogger)
    wrapped = wrap_app(app, config.wsgi_max_body_size, "asgi")
    registry = (connections if connections is not None
                else Connections(connection_cap(limits.max_connections)))
    registry.limits = limits
    lifespan_state: LifespanState = {}
    lifespan = Lifespan(wrapped, config, lifespan_state)
    context = WorkerContext(None)

    def connection(stream: trio.SocketStream) -> Connection:
        return Connection(wrapped, config, context, ConnectionState(lifespan_state.copy()),
                          stream, connections=registry)

    async with trio.open_nursery() as lifespan_nursery:
        await lifespan_nursery.start(lifespan.handle_lifespan)
        await lifespan.wait_for_startup()
        async with trio.open_nursery() as handlers:
            sockets = config.create_sockets()
            listeners = []
            for sock in sockets.insecure_sockets:
                sock.listen(config.backlog)
                listeners.append(trio.SocketListener(trio.socket.from_stdlib_socket(sock)))
            binds = [f"http://{repr_socket_addr(s.family, s.getsockname())}"
                     for s in sockets.insecure_sockets]
            task_status.started(binds)
            try:
                async with trio.open_nursery() as acceptors:
                    acceptors.start_soon(raise_shutdown, shutdown_trigger)
                    for listener in listeners:
                        acceptors.start_soon(_accept, listener, handlers, connection, registry)
            except* ShutdownError:
                pass  # the shutdown trigger fired
            finally:
                for listener in listeners:
                    listener.socket.close()
                with trio.CancelScope(deadline=trio.current_time() + 1, shield=True):
                    await context.terminated.set()  # idle connections close now
                handlers.cancel_scope.deadline = trio.current_time() + config.graceful_timeout
        await lifespan.wait_for_shutdown()
        lifespan_nursery.cancel_scope.cancel()


async def _accept(listener: trio.SocketListener, handlers: trio.Nursery,
                  connection: Callable[[trio.SocketStream], Connection],
                  registry: Connections) -> None:
    backoff = ACCEPT_BACKOFF_S
    warned = -math.inf
    while True:
        if len(registry) >= registry.cap:
            await trio.lowlevel.wait_readable(listener.socket)  # a client is waiting
            await registry.make_room()
        try:
            stream = await listener.accept()
        except OSError as exc:
            if exc.errno not in CAPACITY_ERRNOS:
                raise
            if trio.current_time() - warned >= CAPACITY_WARNING_EVERY_S:
                warned = trio.current_time()
                log.warning("cannot accept connections: %s (%d open, fd limit %d); closing "
                            "the oldest idle ones to admit new ones", os.strerror(exc.errno),
                            len(registry), resource.getrlimit(resource.RLIMIT_NOFILE)[0])
            if registry.evict_oldest_idle():  # that freed a descriptor: try again at once
                await trio.lowlevel.checkpoint()
            else:
                await trio.sleep(backoff)
                backoff = min(2 * backoff, ACCEPT_BACKOFF_MAX_S)
            continue
        backoff = ACCEPT_BACKOFF_S
        if len(registry) >= registry.cap:  # a reload lowered the cap while accept waited
            try:
                await registry.make_room()
            except BaseException:
                stream.socket.close()
                raise
        conn = connection(stream)
        registry.opened(conn)
        handlers.start_soon(conn.run)
