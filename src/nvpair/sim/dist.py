"""Multi-node rendezvous: rank 0 hosts it on ``dist_init_addr``, ranks >= 1 join it.

It stands in for torch.distributed's store: one TCP connection per worker carrying lines.
A worker sends ``join R`` once connected and ``ready R`` once loaded; rank 0 sends ``bye``
when it shuts down gracefully. Rank 0 stays loading (port closed) until ``wait_workers``
workers are ready. A link that drops without ``bye`` means the peer died: a worker then
exits with code 1; rank 0 reacts per ``on_worker_loss`` (hung by default, as a collective
with a dead peer hangs).
"""

from __future__ import annotations

import contextlib
import logging

import trio

from nvpair.sim.http import receive_or_eof
from nvpair.sim.options import WorkerLoss
from nvpair.sim.port import open_listener
from nvpair.sim.state import SERVING, SimState

log = logging.getLogger("nvpair.sim")

#: a worker retries connecting to rank 0 this often (rank 0 may start later).
_RETRY_S = 0.1


def split_addr(addr: str) -> tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    if not sep or not (port.isascii() and port.isdigit()):
        raise ValueError(f"dist_init_addr must be HOST:PORT, got {addr!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


async def _lines(stream: trio.SocketStream) -> list[str] | None:
    """The next complete lines, or None at end of file."""
    buffer = b""
    while True:
        data = await receive_or_eof(stream)
        if not data:
            return None
        buffer += data
        if buffer.endswith(b"\n"):
            return [line.decode().strip() for line in buffer.split(b"\n") if line.strip()]


class Rendezvous:
    """Rank 0's side: which workers joined and which are ready."""

    def __init__(self, state: SimState, on_loss: WorkerLoss) -> None:
        self._state = state
        self._on_loss = on_loss
        self.joined: set[int] = set()
        self.ready: set[int] = set()
        self._links: dict[int, trio.SocketStream] = {}
        self._closing = False

    async def serve(
        self, host: str, port: int, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Take the workers of a multi-node group until cancelled.

        Started value: the port workers connect to, once it listens. Cancellation closes
        the listener and every worker's link. Raises: OSError when the port cannot be
        bound, before the started value (a worker's lost link is ``on_loss``, not raised).
        """
        listener = await open_listener(host, port)
        task_status.started(listener.socket.getsockname()[1])
        await trio.serve_listeners(self._serve_worker, [listener])

    async def _serve_worker(self, stream: trio.SocketStream) -> None:
        rank: int | None = None
        async with stream:
            try:
                while (lines := await _lines(stream)) is not None:
                    for line in lines:
                        command, _, arg = line.partition(" ")
                        if command == "join" and arg.isascii() and arg.isdigit():
                            rank = int(arg)
                            self.joined.add(rank)
                            self._links[rank] = stream
                            log.info("worker %d joined", rank)
                        elif command == "ready" and rank is not None:
                            self.ready.add(rank)
                            log.info("worker %d ready", rank)
                        self._state.touch()
            finally:
                if rank is not None:
                    self._drop(rank)

    def _drop(self, rank: int) -> None:
        was_ready = rank in self.ready
        self.joined.discard(rank)
        self.ready.discard(rank)
        self._links.pop(rank, None)
        self._state.touch()
        if self._closing or not was_ready:
            return
        log.info("worker %d lost", rank)
        state = self._state
        if self._on_loss == "hung" and state.phase in SERVING | {"warming"}:
            state.set_phase("hung")
        elif self._on_loss == "dead" and state.phase != "stopping":
            state.set_phase("dead")

    async def farewell(self) -> None:
        """Tell every worker that rank 0 shuts down (they exit with code 0)."""
        self._closing = True
        await trio.lowlevel.checkpoint()
        for stream in list(self._links.values()):
            with trio.move_on_after(1.0), contextlib.suppress(
                trio.BrokenResourceError, trio.ClosedResourceError
            ):
                await stream.send_all(b"bye\n")


class WorkerLink:
    """A worker's side: join rank 0, say when loaded, and follow rank 0's fate."""

    def __init__(self, state: SimState, host: str, port: int, rank: int) -> None:
        self._state = state
        self._host = host
        self._port = port
        self._rank = rank
        self._stream: trio.SocketStream | None = None
        self.joined = trio.Event()

    async def run(self) -> None:
        """Connect (retrying until rank 0 listens), then watch the link until it ends."""
        while True:
            try:
                stream = await trio.open_tcp_stream(self._host, self._port)
            except OSError:
                await trio.sleep(_RETRY_S)
                continue
            break
        async with stream:
            await stream.send_all(f"join {self._rank}\n".encode())
            self._stream = stream
            self.joined.set()
            self._state.touch()
            farewell = False
            while (lines := await _lines(stream)) is not None:
                farewell = farewell or "bye" in lines
            self._stream = None
        if farewell:
            log.info("rank 0 shut down")
            self._state.request_stop()
        else:
            log.info("rank 0 lost")
            self._state.request_exit(1)

    async def send_ready(self) -> None:
        await self.joined.wait()
        if self._stream is not None:
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                await self._stream.send_all(f"ready {self._rank}\n".encode())
