"""Closing body iterators (httpx2's, httpcore2's) early without leaking inner generators.

``Response.aiter_raw()`` is a stack of async generators. Closing the outer one leaves the
inner ones suspended until garbage collection (a ResourceWarning, and a connection held
until then). An exception raised from the innermost read instead unwinds and finishes every
layer, so to close early we read once more inside an already-cancelled scope.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpcore2
import httpx2
import trio

#: what a read may raise while it is being abandoned.
READ_ERRORS = (StopAsyncIteration, RuntimeError, httpx2.HTTPError, httpcore2.NetworkError,
               httpcore2.ProtocolError, httpcore2.TimeoutException)


async def close_early(iterator: AsyncIterator[bytes]) -> None:
    """Finish ``iterator`` and every generator under it; never raises, never blocks."""
    with trio.CancelScope(shield=True):
        for _ in range(1000):  # buffered chunks come back without a checkpoint
            with trio.CancelScope() as scope:
                scope.cancel(reason="closing the body early")
                try:
                    await iterator.__anext__()
                except READ_ERRORS:
                    return
            if scope.cancelled_caught:
                return
        aclose = getattr(iterator, "aclose", None)
        if aclose is not None:
            await aclose()
