"""Spans to an OTLP/HTTP collector, from a bounded buffer drained by a thread of its own.

The event loop only appends finished spans to the buffer (``SpanExporter.add``: a few
microseconds for a request's spans). A worker thread takes up to ``BATCH`` at a time,
encodes them (``nvpair.base.otlp``) and POSTs them, ``application/x-protobuf``, to the
collector, once ``BATCH`` spans wait or every ``FLUSH_S``. It encodes ``YIELD_EVERY`` spans
at a time and then lets the loop have the interpreter (``time.sleep(0)``): Python hands
the GIL over to a waiting thread only every 5 ms otherwise, and a loop made to wait that
long would show it in every read.

A collector that is slow, hung (accepts, never answers: each POST waits ``timeout_s``) or
gone costs the loop nothing: the buffer fills, and spans that find it full are dropped and
counted (``dropped``), as are the spans of a POST that failed. The collector's trouble is
logged once when it begins and once when it ends; the headers (a token) never are.

A reload that changes ``[tracing]`` swaps the exporter (``SpanExport.switch``): the next
spans go to the new one while the old one sends what it holds and its thread ends.
"""

from __future__ import annotations

import http.client
import logging
import ssl
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from urllib.parse import urlsplit

import trio

from nvpair.base.boundary import Part
from nvpair.base.otlp import Attrs, Span, encode_request, encode_span

log = logging.getLogger("nvpair.tracing")

#: spans held at most while the collector is slow; more are dropped and counted
CAPACITY = 8192
#: spans in one POST at most
BATCH = 512
#: the longest a span waits in the buffer while fewer than BATCH do
FLUSH_S = 0.5
#: spans encoded before the worker lets the loop have the interpreter
YIELD_EVERY = 16
#: how long shutdown waits for the last POST
CLOSE_S = 2.0


class SpanExporter:
    """The buffer, its worker thread, and the counts (``exported``, ``dropped``)."""

    def __init__(self, url: str, resource: Attrs, *,
                 headers: Sequence[tuple[str, str]] = (), scope: str = "nvpair",
                 timeout_s: float = 10.0, capacity: int = CAPACITY,
                 flush_s: float = FLUSH_S) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        self.url = url
        self._tls = parts.scheme == "https"
        self._host = parts.hostname
        self._port = parts.port or (443 if self._tls else 80)
        self._path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        self._headers = {"Content-Type": "application/x-protobuf", **dict(headers)}
        self._resource = resource
        self._scope = scope
        self._timeout_s = timeout_s
        self._capacity = capacity
        self._flush_s = flush_s
        self._buffer: deque[Span] = deque()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: notified after each POST, whatever its end (``wait``)
        self._posted = threading.Condition()
        self._conn: http.client.HTTPConnection | None = None
        #: spans that found the buffer full (written by the loop's thread only)
        self._overflowed = 0
        #: spans of failed POSTs, and spans sent (written by the worker only)
        self._failed = 0
        self.exported = 0
        #: the collector's trouble now, in one line (None: it answers)
        self.trouble: str | None = None

    @property
    def dropped(self) -> int:
        """Spans never delivered: the buffer was full, or their POST failed."""
        return self._overflowed + self._failed

    @property
    def ended(self) -> bool:
        """Its worker was told to stop and has ended: its counts no longer move."""
        thread = self._thread
        return self._stop.is_set() and (thread is None or not thread.is_alive())

    def wait(self, done: Callable[[SpanExporter], bool], timeout_s: float) -> bool:
        """Block the calling thread (never the loop's: ``trio.to_thread``) until ``done``
        holds after a POST, or ``timeout_s`` passed: whether it holds (tests, benchmarks)."""
        with self._posted:
            return self._posted.wait_for(lambda: done(self), timeout_s)

    def add(self, spans: list[Span]) -> None:
        """Hand a request's finished spans over (the loop's side; never waits)."""
        room = self._capacity - len(self._buffer)
        if room < len(spans):
            self._overflowed += len(spans) - max(room, 0)
            spans = spans[:max(room, 0)]
        self._buffer.extend(spans)
        if len(self._buffer) >= BATCH and not self._wake.is_set():
            self._wake.set()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        """Run the worker until cancelled. Started value: None, once spans may be added.
        Cancellation: the worker sends what is left for CLOSE_S at most, and stops at the
        first failed POST (the rest is dropped); it is waited for CLOSE_S at most (a hung
        collector's last POST ends on its own, in timeout_s). Raises: nothing but
        Cancelled."""
        thread = self._thread = threading.Thread(target=self._work, name="nvpair-otlp",
                                                 daemon=True)
        thread.start()
        task_status.started()
        try:
            await trio.sleep_forever()
        finally:
            self._stop.set()
            self._wake.set()
            with trio.CancelScope(shield=True):  # (a hung collector: the thread is left
                await trio.to_thread.run_sync(thread.join, CLOSE_S)  # to end on its own)

    # -- the worker thread ----------------------------------------------------------------

    def _work(self) -> None:
        try:
            while True:
                self._wake.wait(self._flush_s)
                self._wake.clear()
                stopping = self._stop.is_set()
                until = time.monotonic() + CLOSE_S  # (at shutdown: what is left, briefly)
                while self._buffer:
                    if not self._send(self._take()) and stopping:
                        break
                    if self._stop.is_set() and not stopping:
                        break  # (shutdown came meanwhile: one more pass, then out)
                    if stopping and time.monotonic() > until:
                        break
                if stopping:
                    self._failed += len(self._buffer)  # (never to be sent: dropped)
                    self._buffer.clear()
                    return
        finally:
            if self._conn is not None:
                self._conn.close()

    def _take(self) -> list[bytes]:
        encoded: list[bytes] = []
        while self._buffer and len(encoded) < BATCH:
            encoded.append(encode_span(self._buffer.popleft()))
            if len(encoded) % YIELD_EVERY == 0:
                time.sleep(0)  # (the loop's thread gets the GIL now, not in 5 ms)
        return encoded

    def _send(self, spans: list[bytes]) -> bool:
        """POST ``spans``: whether the collector took them."""
        try:
            return self._deliver(spans)
        finally:
            with self._posted:
                self._posted.notify_all()

    def _deliver(self, spans: list[bytes]) -> bool:
        body = encode_request(self._resource, self._scope, spans)
        try:
            status = self._post(body)
        except (OSError, http.client.HTTPException) as exc:
            self._failing(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__,
                          len(spans))
            return False
        if not 200 <= status < 300:
            self._failing(f"it answered HTTP {status}", len(spans))
            return False
        self.exported += len(spans)
        if self.trouble is not None:
            log.info("tracing: the collector at %s answers again", self.url)
            self.trouble = None
        return True

    def _post(self, body: bytes) -> int:
        if self._conn is None:
            if self._tls:
                self._conn = http.client.HTTPSConnection(
                    self._host, self._port, timeout=self._timeout_s,
                    context=ssl.create_default_context())
            else:
                self._conn = http.client.HTTPConnection(self._host, self._port,
                                                        timeout=self._timeout_s)
        try:
            self._conn.request("POST", self._path, body, self._headers)
            response = self._conn.getresponse()
            response.read()
        except BaseException:
            self._conn.close()
            self._conn = None
            raise
        if response.will_close:
            self._conn.close()
            self._conn = None
        return response.status

    def _failing(self, why: str, lost: int) -> None:
        self._failed += lost
        if self.trouble is None:
            log.warning("tracing: the collector at %s failed (%s): spans are dropped and "
                        "counted until it answers", self.url, why)
        self.trouble = why


class SpanExport:
    """Where routed requests' spans go while reloads change ``[tracing]`` (the tracers'
    sink): the current exporter, the ones still ending, and the counts of all of them.

    ``switch`` makes another exporter current (None: tracing is off). Spans handed over
    from then on go to it, whichever tracer made them: a request traced before a reload
    that ends after it has its spans sent to the collector of now (with tracing turned
    off, nowhere: they are counted as dropped). The exporter it replaces sends what it
    already holds (``SpanExporter.run``'s end: CLOSE_S at most) and its thread ends.
    ``exported`` and ``dropped`` add up every exporter's counts, so the counters in
    /metrics never go back at a reload.
    """

    def __init__(self) -> None:
        self.current: SpanExporter | None = None
        #: tracing was on at some time since nvpair started (/metrics shows the counts)
        self.used = False
        #: the exporters whose run was asked for and has not ended, each with its scope
        self._runs: dict[SpanExporter, trio.CancelScope] = {}
        #: exporters whose counts may still move (the current one, those ending)
        self._live: list[SpanExporter] = []
        #: the counts of the exporters that ended, and the spans with nowhere to go
        self._exported = self._dropped = 0
        self._nursery: trio.Nursery | None = None

    def add(self, spans: list[Span]) -> None:
        """Hand a request's finished spans to the current exporter (never waits)."""
        if self.current is not None:
            self.current.add(spans)
        else:
            self._dropped += len(spans)

    def switch(self, exporter: SpanExporter | None) -> None:
        """From now on spans go to ``exporter`` (None: nowhere); the one before sends what
        it holds and ends. Sync: a reload applies it at once. Each exporter runs in a task
        of its own in ``run``'s nursery (from ``run``'s start, when called before it)."""
        self._fold()  # (those that ended since: let go of them)
        old, self.current = self.current, exporter
        if exporter is not None:
            self.used = True
            self._live.append(exporter)
            self._runs[exporter] = trio.CancelScope()
            if self._nursery is not None:
                self._nursery.start_soon(self._run, exporter)
        if old is not None and old in self._runs:
            self._runs[old].cancel(reason="tracing changed in a reload")

    @property
    def exported(self) -> int:
        self._fold()
        return self._exported + sum(e.exported for e in self._live)

    @property
    def dropped(self) -> int:
        self._fold()
        return self._dropped + sum(e.dropped for e in self._live)

    def _fold(self) -> None:
        """The exporters that ended: their counts into the totals, and let go of them."""
        for e in [e for e in self._live if e is not self.current and e.ended]:
            self._live.remove(e)
            self._exported += e.exported
            self._dropped += e.dropped

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        """Run every exporter switched to until cancelled, each in a task of its own.
        Started value: None, at once (spans handed over before an exporter's thread runs
        wait in its buffer). Cancellation: each exporter ends as in its own ``run``
        (CLOSE_S at most). Raises: nothing but Cancelled."""
        for never in [e for e in self._runs if e is not self.current]:
            del self._runs[never]  # (replaced before the start: it never ran, holds nothing)
            self._live.remove(never)
        async with trio.open_nursery() as nursery:
            if self.current is not None:
                nursery.start_soon(self._run, self.current)
            self._nursery = nursery
            task_status.started()
            try:
                await trio.sleep_forever()
            finally:
                self._nursery = None

    async def _run(self, exporter: SpanExporter) -> None:
        """Run ``exporter`` until the switch that replaced it, or cancellation. A failure
        of it (its thread could not start, a bug) is the trace export's, logged; spans
        handed to it meanwhile are counted as dropped, and nvpair goes on."""
        try:
            with self._runs[exporter], Part("tracing: export", logger=log).guard():
                await exporter.run()
        finally:
            del self._runs[exporter]
            if exporter is self.current:  # (its buffer is no longer read)
                self.current = None
