"""Closing httpx2's body iterators early without leaking their inner async generators.

``Response.aiter_raw()`` is a stack of async generators. Closing the outer one leaves the
inner ones suspended until garbage collection (a ResourceWarning, and a connection held
until then). An exception raised from the innermost read instead unwinds and finishes every
layer, so to close early we read once more inside an already-cancelled scope.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx2
import trio


async def close_early(iterator: AsyncIterator[bytes]) -> None:
    """Finish ``iterator`` and every generator under it; never raises, never blocks."""
    with trio.CancelScope(shield=True):
        for _ in range(1000):  # buffered chunks come back without a checkpoint
            with trio.CancelScope() as scope:
                scope.cancel(reason="closing the body early")
                try:
                    await iterator.__anext__()
                except (StopAsyncIteration, httpx2.HTTPError, RuntimeError):
                    return
            if scope.cancelled_caught:
                return
        aclose = getattr(iterator, "aclose", None)
        if aclose is not None:
            await aclose()
