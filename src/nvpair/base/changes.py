"""A version number that moves with each change, and a way to wait for it to move.

Writers call ``bump()`` (sync: it never waits, so it can run between any two checkpoints);
readers remember the version they acted on and ``await wait_changed(since)``. A waiter
that started late misses nothing: it returns at once when the version has already moved.
This is the "swap an Event when it changes" idiom, written once (trio-util's
``AsyncValue`` idea, without the dependency).
"""

from __future__ import annotations

import trio


class Changes:
    """``version`` grows by one on each ``bump()``; ``wait_changed`` waits for that."""

    def __init__(self, version: int = 0) -> None:
        self.version = version
        self._event = trio.Event()

    def bump(self) -> int:
        """Record a change and wake every waiter; returns the new version."""
        self.version += 1
        self._event.set()
        self._event = trio.Event()
        return self.version

    @property
    def event(self) -> trio.Event:
        """An event set at the next ``bump()`` (for ``trio.Event``-shaped callers)."""
        return self._event

    async def wait(self) -> int:
        """Wait for the next ``bump()``; return the version then."""
        return await self.wait_changed(self.version)

    async def wait_changed(self, since: int) -> int:
        """Wait until the version differs from ``since``; return the version then.

        Returns at once (without a checkpoint) when it already differs. Cancellation: a
        plain wait, cancelled like any other; nothing is consumed.
        """
        while self.version == since:
            await self._event.wait()
        return self.version
