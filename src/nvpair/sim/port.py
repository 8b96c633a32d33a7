"""The engine's TCP port: reserved (bound but not listening, so connects are refused),
listening, or closed again.

Reserving first is what vLLM's launcher does: the port number is known (and held) while the
model loads, yet nothing accepts. Closing the listener later rebinds a non-listening socket
to keep the number.
"""

from __future__ import annotations

import socket
from collections.abc import Callable

import trio

from nvpair.sim.http import HttpServer
from nvpair.sim.state import SimState

_BACKLOG = 128


async def open_listener(host: str, port: int) -> trio.SocketListener:
    """One listening socket on ``host:port`` (port 0 picks), even for a name with several
    addresses, so that the port number is unambiguous."""
    found = await trio.socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                          flags=socket.AI_PASSIVE)
    family, type_, proto, _, address = found[0]
    sock = trio.socket.socket(family, type_, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        await sock.bind(address)
        sock.listen(_BACKLOG)
    except BaseException:
        sock.close()
        raise
    return trio.SocketListener(sock)


class EnginePort:
    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self._sock: trio.socket.SocketType | None = None
        self._listener: trio.SocketListener | None = None
        self._accepting: trio.CancelScope | None = None

    @property
    def listening(self) -> bool:
        return self._listener is not None

    async def reserve(self) -> int:
        """Bind without listening; returns the port number (a free one for port 0)."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = trio.socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            await sock.bind((self.host, self.port))
        except BaseException:
            sock.close()
            raise
        self.port = sock.getsockname()[1]
        self._sock = sock
        return self.port

    async def listen(self, server: HttpServer, nursery: trio.Nursery) -> None:
        """Start accepting; connections are served in ``nursery``."""
        if self._sock is None:
            await self.reserve()
        assert self._sock is not None
        self._sock.listen(_BACKLOG)
        self._listener = trio.SocketListener(self._sock)
        self._sock = None
        self._accepting = await nursery.start(_accept, self._listener, server, nursery)

    async def unlisten(self) -> None:
        """Stop accepting and keep the port reserved; queued connects get a reset."""
        if self._accepting is not None:
            self._accepting.cancel(reason="engine stopped listening")
            self._accepting = None
        if self._listener is not None:
            await self._listener.aclose()
            self._listener = None
        await self.reserve()

    def close(self) -> None:
        if self._accepting is not None:
            self._accepting.cancel(reason="engine port closed")
        if self._listener is not None:
            self._listener.socket.close()
        if self._sock is not None:
            self._sock.close()
        self._listener = self._sock = self._accepting = None


async def _accept(
    listener: trio.SocketListener, server: HttpServer, nursery: trio.Nursery,
    *, task_status: trio.TaskStatus[trio.CancelScope] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Accept on ``listener`` and serve each connection in ``nursery``.

    Started value: its cancel scope (``EnginePort.unlisten`` cancels it), at once.
    Cancellation stops accepting; the connections stay (they are ``nursery``'s). Raises:
    what ``accept`` raises."""
    with trio.CancelScope() as scope:
        task_status.started(scope)
        while True:
            stream = await listener.accept()
            nursery.start_soon(server.serve_connection, stream)


async def run_port(
    port: EnginePort, server: HttpServer, state: SimState, want_listening: Callable[[], bool],
    *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Keep the port listening exactly while ``want_listening()`` is true.

    Started value: None, once the port is in its first wanted state. Connections are served
    in a nursery of this task. While not listening (for example the ``refuse`` fault) open
    connections are dropped too, since a real engine that stopped listening has gone away.
    Cancellation: stops accepting and closes every connection. Raises: OSError when the
    port cannot be bound again (another process took it while it was released).
    """
    async with trio.open_nursery() as connections:
        started = False
        while True:
            version = state.version
            want = want_listening()
            if want and not port.listening:
                await port.listen(server, connections)
                state.touch()
            elif not want and port.listening:
                await port.unlisten()
                server.drop_all()
                state.touch()
            if not started:
                task_status.started()
                started = True
            await state.wait_changed(version)
