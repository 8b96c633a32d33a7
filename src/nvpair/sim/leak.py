"""Memory a simulator holds on purpose: a baseline footprint, a steady leak, a leak per request.

The memory is really allocated and touched (one byte written per page), so the process's
``RssAnon`` grows as a real engine's would: the memory watch's tests and the on-demand
tests read it from ``/proc`` like any engine's. Only the baseline is ever freed before the
process ends: a sleeping engine drops it (``release_resident``) and holds it again on waking.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import trio

PAGE = 4096
#: the steady leak allocates this often
TICK_S = 0.1


class Leak:
    """What a simulator holds: ``resident_mb`` at start, ``mb_per_s`` more each second,
    ``bytes_per_request`` more per request answered."""

    def __init__(self, *, resident_mb: float = 0.0, mb_per_s: float = 0.0,
                 bytes_per_request: int = 0) -> None:
        if resident_mb < 0 or mb_per_s < 0 or bytes_per_request < 0:
            raise ValueError("resident_mb, leak_mb_per_s and leak_bytes_per_request must be >= 0")
        self.resident_mb = resident_mb
        self.mb_per_s = mb_per_s
        self.bytes_per_request = bytes_per_request
        self.held: list[bytearray] = []
        self.bytes = 0
        self._owed = 0.0  # bytes of the steady leak not yet allocated (less than a page)
        #: the baseline block while it is held (a sleeping engine frees it)
        self.resident: bytearray | None = None

    @property
    def active(self) -> bool:
        return bool(self.resident_mb or self.mb_per_s or self.bytes_per_request)

    def allocate(self, n: int) -> None:
        """Hold ``n`` more bytes, every page of them touched (so resident)."""
        if n <= 0:
            return
        block = bytearray(n)
        pages = len(range(0, n, PAGE))
        block[::PAGE] = b"\x01" * pages
        self.held.append(block)
        self.bytes += n

    def hold_resident(self) -> None:
        """Hold the baseline (at start, and when a sleeping engine wakes)."""
        n = int(self.resident_mb * 1024 * 1024)
        if self.resident is None and n > 0:
            self.allocate(n)
            self.resident = self.held[-1]

    def release_resident(self) -> None:
        """Free the baseline (a sleeping engine's weights and KV cache)."""
        block, self.resident = self.resident, None
        if block is not None:
            self.held = [b for b in self.held if b is not block]
            self.bytes -= len(block)

    async def run(self) -> None:
        """The baseline at once, then the steady leak until cancelled."""
        self.hold_resident()
        if not self.mb_per_s:
            return
        rate = self.mb_per_s * 1024 * 1024
        last = trio.current_time()
        while True:
            await trio.sleep(TICK_S)
            now = trio.current_time()
            self._owed += rate * (now - last)
            last = now
            n = int(self._owed) // PAGE * PAGE
            if n:
                self._owed -= n
                self.allocate(n)

    def wrap(self, handler: Callable[[Any, Any], Awaitable[None]]
             ) -> Callable[[Any, Any], Awaitable[None]]:
        """``handler`` leaking ``bytes_per_request`` after each request (probes too)."""
        if not self.bytes_per_request:
            return handler

        async def leaking(request: Any, reply: Any) -> None:
            try:
                await handler(request, reply)
            finally:
                self.allocate(self.bytes_per_request)

        return leaking
