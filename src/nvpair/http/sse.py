"""``GET /v1/events``: the journal's changes as server-sent events, one stream per request.

A stream starts with ``retry:`` (a random 1-3 s, so clients do not all come back in the
same millisecond after a restart) and a ``snapshot`` (or, resuming with ``Last-Event-ID``,
the events it missed), then sends each key's newest change, at most ``batches_per_s``
batches in any second; a ``:`` comment when nothing was sent for ``heartbeat_s``; ``bye``
when nvpair shuts down or a reload turns keys on. A send the client does not take for
``drop_after_s`` closes its connection: nvpair never queues for a slow client
(``nvpair.state.events.Stream``).
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable
from urllib.parse import parse_qs

import trio

from nvpair.http.asgi import Receive, Scope, Send, encoder, header, send_error, send_wrong_method
from nvpair.state.events import TYPES, Event, Full, Journal, Stream, Timing

HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"),
           (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]
#: the scope extension nvpair's server gives each request: closes its connection now
CLOSE_EXTENSION = "nvpair.close"




def frame(event_id: str, type_: str, data: bytes) -> bytes:
    return b"id: %s\nevent: %s\ndata: %s\n\n" % (event_id.encode(), type_.encode(), data)


def frames(events: list[Event]) -> bytes:
    return b"".join(e.wire for e in events)


def stream_query(raw: bytes) -> tuple[frozenset[str], str | None]:
    """``?types=engine,peer&engine=NAME``; a ValueError names what is wrong."""
    query = parse_qs(raw.decode("latin-1"))
    types = TYPES
    if "types" in query:
        asked = frozenset(t for v in query["types"] for t in v.split(",") if t)
        if not asked or asked - TYPES:
            raise ValueError(f"types: expected some of {', '.join(sorted(TYPES))}, got "
                             f"{','.join(query['types'])[:100]!r}")
        types = asked
    engines = query.get("engine", [])
    if len(engines) > 1:
        raise ValueError("engine: give one engine name")
    return types, engines[0] if engines else None


async def serve_events(journal: Journal, scope: Scope, receive: Receive, send: Send) -> None:
    """Answer one ``GET /v1/events`` (the caller has checked the token)."""
    timing = journal.timing
    if scope["method"] != "GET":
        await send_wrong_method(send, "GET", "/v1/events")
        return
    try:
        types, engine = stream_query(scope.get("query_string", b""))
    except ValueError as exc:
        await send_error(send, 400, str(exc))
        return
    if engine is not None and journal.board.current.engine(engine) is None:
        await send_error(send, 404, f"no engine named {engine!r}", "engine_not_found")
        return
    raw_id = header(scope, b"last-event-id")
    try:
        stream, missed = journal.subscribe(types, engine,
                                           None if raw_id is None else raw_id.decode("latin-1"))
    except Full as exc:
        await send_error(send, 503, f"{exc}; try again later", "too_many_streams",
                         [(b"retry-after", b"%d" % random.randint(1, 3))])
        return
    try:
        retry = random.randint(*timing.retry_ms)
        first = [b"retry: %d\n\n" % retry]
        if missed is None:
            first.append(frame(journal.event_id(), "snapshot", journal.snapshot(stream)))
        else:
            first.append(frames(missed))
        close = scope.get("extensions", {}).get(CLOSE_EXTENSION)
        sender = Sender(send, timing, close)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_until_disconnect, receive, nursery.cancel_scope)
            nursery.start_soon(sender.watchdog)
            await _stream(journal, stream, sender, b"".join(first), timing)
            nursery.cancel_scope.cancel()
    finally:
        journal.unsubscribe(stream)


async def _until_disconnect(receive: Receive, scope: trio.CancelScope) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    scope.cancel()


async def _stream(journal: Journal, stream: Stream, sender: Sender, first: bytes,
                  timing: Timing) -> None:
    await sender.send({"type": "http.response.start", "status": 200, "headers": HEADERS})
    if not await sender.body(first):
        return
    last = trio.current_time()
    sent: deque[float] = deque(maxlen=timing.batches_per_s)
    while True:
        with trio.move_on_at(last + timing.heartbeat_s):
            await stream.wait()
        if len(sent) == sent.maxlen and not stream.closed:  # at most so many a second
            await trio.sleep_until(sent[0] + 1.0)
        events = stream.take()
        if stream.closed:
            body = frames(events) + frame(
                journal.event_id(), "bye",
                b'{"node":%s,"reason":%s}' % (encoder.encode(journal.node),
                                              encoder.encode(stream.reason)))
            if await sender.body(body):
                await sender.send({"type": "http.response.body", "body": b""})
            return
        if events:
            sent.append(trio.current_time())
        if not await sender.body(frames(events) if events else b":\n\n"):
            return
        last = trio.current_time()


class Sender:
    """Sends a stream's bytes; closes the connection when a send is not taken in time.

    The server's send does not give up on its own (it is shielded), so a send that the
    client has not taken for ``drop_after_s`` is ended by closing the connection (looked
    at every quarter of that: dropped after 1-1.25 times it), and so is one still blocked
    when the stream is cancelled (else it would hold its connection forever)."""

    def __init__(self, send: Send, timing: Timing, close: Callable[[], None] | None) -> None:
        self.send = send
        self.timing = timing
        self.close = close
        self.since: float | None = None  # when the send in progress began
        self.dropped = False

    async def body(self, data: bytes) -> bool:
        """Send ``data``; False when the client was dropped."""
        self.since = trio.current_time()
        try:
            await self.send({"type": "http.response.body", "body": data, "more_body": True})
        finally:
            self.since = None
        return not self.dropped

    async def watchdog(self) -> None:
        try:
            while True:
                await trio.sleep(self.timing.drop_after_s / 4)
                if (self.since is not None
                        and trio.current_time() - self.since >= self.timing.drop_after_s):
                    self._drop()
        finally:
            if self.since is not None:  # cancelled while a send is blocked
                self._drop()

    def _drop(self) -> None:
        self.dropped = True
        if self.close is not None:
            self.close()
