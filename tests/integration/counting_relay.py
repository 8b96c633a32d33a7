"""A TCP relay on 127.0.0.1 that counts the HTTP requests sent through it.

The real llama-server logs no line for a request that generates nothing (``/health``,
``/props``, ``/v1/models``: checked at ``-lv 5``), and its ``/metrics`` count generation only,
so the engine cannot say how many requests nvpair sent it. Put in front of it (nvpair's
engine ``port`` is the relay's, the server's ``--port`` another), the relay counts every
request line on the way in, whoever sent it, and passes the bytes on untouched both ways.
"""

from __future__ import annotations

import re
from collections import Counter

import trio

#: the start of a request: "GET /health HTTP/1.1" and its line end
REQUEST_LINE = re.compile(rb"(GET|HEAD|POST|PUT|DELETE|PATCH|OPTIONS) (\S+) HTTP/1\.[01]\r\n")
#: kept of a client's bytes between reads, so a request line split by a read is still seen
CARRY = 4096
CHUNK = 65536


class CountingRelay:
    """Relays ``127.0.0.1:<listen>`` to ``127.0.0.1:<target>``; ``requests`` counts what came
    in, per (method, path)."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.requests: Counter[tuple[str, str]] = Counter()

    def count(self, *, besides: str = "") -> Counter[tuple[str, str]]:
        """The requests so far, those to the path ``besides`` left out."""
        return Counter({key: n for key, n in self.requests.items() if key[1] != besides})

    async def serve(self, port: int, *,
                    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(port, host="127.0.0.1")
        task_status.started()
        await trio.serve_listeners(self._relay, listeners)

    async def _relay(self, client: trio.SocketStream) -> None:
        async with client:
            try:
                upstream = await trio.open_tcp_stream("127.0.0.1", self.target)
            except OSError:
                return  # the server is not up: the client sees its connection closed
            async with upstream, trio.open_nursery() as nursery:
                # either side closing ends both (HTTP/1.1 never half-closes here)
                nursery.start_soon(self._pump, client, upstream, nursery.cancel_scope, True)
                nursery.start_soon(self._pump, upstream, client, nursery.cancel_scope, False)

    async def _pump(self, source: trio.SocketStream, sink: trio.SocketStream,
                    both: trio.CancelScope, counted: bool) -> None:
        seen = b""
        try:
            while chunk := await source.receive_some(CHUNK):
                if counted:
                    seen += chunk
                    end = 0
                    for match in REQUEST_LINE.finditer(seen):
                        self.requests[(match[1].decode(), match[2].decode())] += 1
                        end = match.end()
                    seen = seen[end:][-CARRY:]
                await sink.send_all(chunk)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the other side went: the connection is over
        finally:
            both.cancel(reason="one side of the relay closed")
