"""``GET /metrics``: the Prometheus text format (version 0.0.4), written by hand.

Everything comes from what nvpair already holds: the snapshot (engine states, probe
counters), the router's traffic (``nvpair.state.traffic``), the API's request counts (counted
by ``nvpair.http.api``), the peer table's states and the sweep's durations. No client library:
``prometheus_client``'s renderer costs tens of milliseconds a scrape on the event loop.

The body is cached per (snapshot version, peer table version) and per second
(``CACHE_S``): probe counters move the snapshot's version many times a second, so the
time bucket bounds the work to one render a second whatever the scrape rate; a scrape
sees counters at most ``CACHE_S`` old. Names follow Prometheus' rules (base units,
``_total`` on counters, ``_info``, timestamps rather than ages); label values are
escaped and nothing an engine reports ever becomes a label name (docs/metrics.md).
"""

from __future__ import annotations

import platform
import time
from collections.abc import Callable, Mapping
from typing import NamedTuple, Protocol

import trio

from nvpair import __version__
from nvpair.base.histogram import Histogram
from nvpair.http.keys import Keyring
from nvpair.state.listing import model_state
from nvpair.state.memory import trend_level
from nvpair.state.snapshot import Board, EngineState, Snapshot, shown_state
from nvpair.state.traffic import Traffic

CONTENT_TYPE = b"text/plain; version=0.0.4; charset=utf-8"
#: a rendered body serves every scrape of the same second (and content versions)
CACHE_S = 1.0
#: every state an engine can be in (``nvpair.state.snapshot.State``), each a series of 0 or 1
ENGINE_STATES = ("starting", "ready", "stale", "unhealthy", "down", "stopped", "cold",
                 "sleeping", "waking")
MODEL_STATES = ("cold", "loading", "ready", "sleeping")
#: every state of a peer (``nvpair.peers.table.PeerState``)
PEER_STATES = ("fresh", "one-way", "stale", "gone", "left")


class PeerStates(Protocol):
    """The peer table as ``/metrics`` reads it (``nvpair.peers.table.PeerTable``)."""

    @property
    def version(self) -> int: ...

    def states(self, now: float) -> Mapping[str, str]: ...


def escape(value: str) -> str:
    """A label value as the text format writes it between double quotes."""
    if "\\" in value or '"' in value or "\n" in value:
        value = value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return value


def number(value: float) -> str:
    """A sample value or a bucket bound in the text format (``+Inf``, ``NaN``)."""
    if isinstance(value, int):
        return str(value)
    if value != value:
        return "NaN"
    if value in (float("inf"), float("-inf")):
        return "+Inf" if value > 0 else "-Inf"
    return repr(value)


class SpanCounts(Protocol):
    """What /metrics shows of the trace export (``nvpair.runtime.spanexport.SpanExport``)."""

    @property
    def used(self) -> bool: ...

    @property
    def exported(self) -> int: ...

    @property
    def dropped(self) -> int: ...


class Metrics:
    """Renders ``/metrics`` and keeps the API's request counts (``api``), which
    ``nvpair.http.api.Api`` increments per (route, status code)."""

    def __init__(self, board: Board, traffic: Traffic | None = None, *, node: str,
                 peers: PeerStates | None = None, sweep: Histogram | None = None,
                 streams: Callable[[], int] | None = None,
                 wall: Callable[[], float] = time.time, keys: Keyring | None = None,
                 spans: SpanCounts | None = None) -> None:
        self.board = board
        self.traffic = traffic
        self.node = node
        self.peers = peers
        self.sweep = sweep
        #: open event streams (``/v1/events``), when that part is wired in
        self.streams = streams
        self.wall = wall
        #: the API's keys (docs/keys.md): their requests, refusals and queue waits
        self.keys = keys
        #: the trace export's counts, once tracing was on (docs/observability.md)
        self.spans = spans
        #: (route, status code) -> requests answered (the API counts them)
        self.api: dict[tuple[str, int], int] = {}
        self._cache: tuple[tuple[int, int, int], bytes] | None = None
        #: per engine name: its lines as of the last render (see ``_lines``)
        self._frags: dict[str, _Engine] = {}
        self._offset = 0.0
        self._build = (f'nvpair_build_info{{version="{escape(__version__)}",'
                       f'python="{escape(platform.python_version())}",'
                       f'node="{escape(node)}"}} 1\n')

    def body(self) -> bytes:
        """The exposition, from the cache when the content and the second are the same."""
        snap = self.board.current
        now = trio.current_time()
        key = (snap.version, self.peers.version if self.peers else 0, int(now / CACHE_S))
        if self._cache is not None and self._cache[0] == key:
            return self._cache[1]
        body = self.render(snap, now, self.wall())
        self._cache = (key, body)
        return body

    def render(self, snap: Snapshot, now: float, wall_now: float) -> bytes:
        """The whole exposition at trio time ``now`` (``wall_now``: the same moment in
        Unix time, for the timestamps)."""
        out: list[str] = []
        add = out.append
        engines = snap.engines
        offset = self._offset  # trio time to Unix time, kept while it moves under 10 ms
        if abs(wall_now - now - offset) > 0.01:  # (the clocks' jitter, a wall clock step)
            offset = self._offset = wall_now - now
        old, frags = self._frags, {}
        for e in engines:  # an engine unchanged since the last render: its lines as they were
            state = shown_state(e, now)
            hit = old.get(e.name)
            if hit is None or hit.engine is not e or hit.state != state or hit.offset != offset:
                hit = _lines(e, state, offset)
            frags[e.name] = hit
        self._frags = frags
        parts = list(frags.values())
        names = [f.label for f in parts]

        def family(name: str, kind: str, text: str) -> None:
            add(f"# HELP {name} {text}\n# TYPE {name} {kind}\n")

        family("nvpair_build_info", "gauge", "nvpair's version, Python's and the node name.")
        add(self._build)
        family("nvpair_engine_up", "gauge",
               "1 when the engine is listed as serving (ready or stale), else 0.")
        out += [f.up for f in parts]
        family("nvpair_engine_state", "gauge",
               "1 for the state the engine is in, 0 for the others.")
        out += [f.states for f in parts]
        if any(f.models for f in parts):
            family("nvpair_model_state", "gauge", "1 for the state a model of a multi-model "
                   "engine is in (cold, loading, ready, sleeping), 0 for the others.")
            out += [f.models for f in parts]
        family("nvpair_engine_last_ok_timestamp_seconds", "gauge",
               "Unix time of the engine's last good health or ready probe.")
        out += [f.last_ok for f in parts]
        family("nvpair_engine_restarts_total", "counter",
               "Times nvpair restarted the engine's process.")
        out += [f.restarts for f in parts]
        family("nvpair_engine_log_dropped_lines_total", "counter",
               "Lines of a managed engine's output dropped above the log rate cap.")
        out += [f.dropped for f in parts]
        family("nvpair_probe_requests_total", "counter",
               "Probe requests nvpair sent the engine, by probe and outcome "
               "(ok, error, timeout; error and timeout once they happened).")
        out += [f.probes for f in parts]
        by_kind: dict[tuple[str, str], list[float]] = {}
        for f in parts:
            for key, total_ms, count in f.durations:
                acc = by_kind.setdefault(key, [0.0, 0])
                acc[0] += total_ms
                acc[1] += count
        family("nvpair_probe_duration_seconds", "summary",
               "Time of probe requests, answered or not, by engine kind and probe.")
        for (kind, probe), (ms, n) in sorted(by_kind.items()):
            lbl = f'kind="{escape(kind)}",probe="{escape(probe)}"'
            add(f"nvpair_probe_duration_seconds_sum{{{lbl}}} {number(ms / 1000)}\n"
                f"nvpair_probe_duration_seconds_count{{{lbl}}} {int(n)}\n")
        self._sweep(family, add)
        self._peers(now, family, add)
        self._router(engines, names, now, family, add)
        if self.keys is not None and self.keys.on:
            key_families(self.keys, family, add)
        memory_families(snap, names, family, add)
        self._api(family, add)
        if self.streams is not None:
            family("nvpair_events_streams", "gauge", "Open /v1/events streams.")
            add(f"nvpair_events_streams {self.streams()}\n")
        if self.spans is not None and self.spans.used:
            family("nvpair_trace_spans_exported_total", "counter",
                   "Spans the OTLP collector took.")
            add(f"nvpair_trace_spans_exported_total {self.spans.exported}\n")
            family("nvpair_trace_spans_dropped_total", "counter",
                   "Spans never delivered: the export buffer was full (a slow, hung or gone "
                   "collector) or their export failed.")
            add(f"nvpair_trace_spans_dropped_total {self.spans.dropped}\n")
        return "".join(out).encode()

    def _sweep(self, family: Callable[[str, str, str], None],
               add: Callable[[str], None]) -> None:
        if self.sweep is None:
            return
        family("nvpair_sweep_duration_seconds", "histogram",
               "Time of each model-list sweep, to its last answer or its deadline.")
        histogram(add, "nvpair_sweep_duration_seconds", "", self.sweep)

    def _peers(self, now: float, family: Callable[[str, str, str], None],
               add: Callable[[str], None]) -> None:
        if self.peers is None:
            return
        family("nvpair_peer_state", "gauge", "1 for the state the peer is in, 0 for the others.")
        for peer, state in sorted(self.peers.states(now).items()):
            head = f'nvpair_peer_state{{peer="{escape(peer)}",state="'
            for s in PEER_STATES:
                add(f'{head}{s}"}} {int(s == state)}\n')

    def _router(self, engines: tuple[EngineState, ...], names: list[str], now: float,
                family: Callable[[str, str, str], None], add: Callable[[str], None]) -> None:
        traffic = self.traffic
        if traffic is None:
            return
        family("nvpair_router_requests_total", "counter",
               "Answers the router sent for the engine (or \"peer NODE\"), by status code.")
        for (name, code), n in sorted(traffic.codes.items()):
            add(f'nvpair_router_requests_total{{engine="{escape(name)}",code="{code}"}} {n}\n')
        family("nvpair_router_in_flight", "gauge", "Requests the router is relaying now.")
        for e, lbl in zip(engines, names, strict=True):
            entry = traffic.engines.get(e.name)
            add(f"nvpair_router_in_flight{{{lbl}}} {entry.in_flight if entry else 0}\n")
        family("nvpair_router_first_byte_seconds", "histogram",
               "Time from a routed request's arrival (a queue's wait included) to the "
               "first byte of its answer's body.")
        histogram(add, "nvpair_router_first_byte_seconds", "", traffic.first_byte)
        family("nvpair_router_request_duration_seconds", "histogram",
               "Time from a routed request's arrival (a queue's wait included) to the end "
               "of its answer.")
        histogram(add, "nvpair_router_request_duration_seconds", "", traffic.duration)
        family("nvpair_router_queue_wait_seconds", "histogram",
               "Time routed requests waited in an on-demand engine's queue.")
        histogram(add, "nvpair_router_queue_wait_seconds", "", traffic.queue_wait)
        family("nvpair_router_activation_seconds", "histogram",
               "Time of each on-demand start requests waited for, to the engine ready.")
        histogram(add, "nvpair_router_activation_seconds", "", traffic.activation)
        # The gauges an inference gateway's endpoint picker reads (docs/metrics.md)
        models = [f'{lbl},model="{escape(served_model(e))}"' for e, lbl in
                  zip(engines, names, strict=True)]
        family("nvpair_requests_waiting", "gauge",
               "Requests waiting in nvpair's queue for the engine (on-demand engines).")
        for e, lbl in zip(engines, models, strict=True):
            add(f"nvpair_requests_waiting{{{lbl}}} {e.queued}\n")
        queue_families(engines, now, family, add)
        family("nvpair_requests_running", "gauge",
               "Requests nvpair is relaying to the engine now.")
        for e, lbl in zip(engines, models, strict=True):
            entry = traffic.engines.get(e.name)
            add(f"nvpair_requests_running{{{lbl}}} {entry.in_flight if entry else 0}\n")
        read = [(e, lbl) for e, lbl in zip(engines, models, strict=True)
                if e.kv_cache_usage is not None]
        if read:
            family("nvpair_kv_cache_usage_ratio", "gauge",
                   "The engine's KV-cache use, 0-1, from its own /metrics (opt in).")
            for e, lbl in read:
                add(f"nvpair_kv_cache_usage_ratio{{{lbl}}} {number(e.kv_cache_usage or 0.0)}\n")

    def _api(self, family: Callable[[str, str, str], None], add: Callable[[str], None]) -> None:
        family("nvpair_api_requests_total", "counter",
               "Requests nvpair's API answered, by route and status code.")
        for (route, code), n in sorted(self.api.items()):
            add(f'nvpair_api_requests_total{{route="{escape(route)}",code="{code}"}} {n}\n')


def served_model(e: EngineState) -> str:
    """The ``model`` label of an engine's gateway gauges: the one model it lists (or, before
    its list is read, the one its identity names); empty when it lists several, whose
    requests share its one queue and slots."""
    if len(e.models) == 1:
        return e.models[0].id
    if not e.models and e.identity is not None and e.identity.model:
        return e.identity.model
    return ""


class _Engine(NamedTuple):
    """One engine's lines of each family, kept while the engine's state is the same."""

    engine: EngineState
    state: str
    offset: float
    label: str
    up: str
    states: str
    last_ok: str
    restarts: str
    dropped: str
    probes: str
    #: ((kind, probe), latency ms in total, requests) per probe
    durations: tuple[tuple[tuple[str, str], float, int], ...]
    #: the state of each model with one of its own (a multi-model router's)
    models: str = ""


def _lines(e: EngineState, state: str, offset: float) -> _Engine:
    lbl = f'engine="{escape(e.name)}"'
    head = f'nvpair_engine_state{{{lbl},kind="{escape(e.kind)}",state="'
    probes = []
    for probe, stats in e.probes:
        ph = f'nvpair_probe_requests_total{{{lbl},probe="{escape(probe)}",outcome="'
        probes.append(f'{ph}ok"}} {stats.requests - stats.failures}\n')
        if stats.failures > stats.timeouts:
            probes.append(f'{ph}error"}} {stats.failures - stats.timeouts}\n')
        if stats.timeouts:
            probes.append(f'{ph}timeout"}} {stats.timeouts}\n')
    return _Engine(
        e, state, offset, lbl,
        f"nvpair_engine_up{{{lbl}}} {int(state in ('ready', 'stale'))}\n",
        "".join(f'{head}{s}"}} {int(s == state)}\n' for s in ENGINE_STATES),
        "" if e.checked_at is None else
        f"nvpair_engine_last_ok_timestamp_seconds{{{lbl}}} {e.checked_at + offset:.3f}\n",
        f"nvpair_engine_restarts_total{{{lbl}}} {e.restarts}\n",
        f"nvpair_engine_log_dropped_lines_total{{{lbl}}} {e.log_dropped}\n" if e.managed else "",
        "".join(probes),
        tuple(((e.kind, p), st.latency_ms_total, st.requests) for p, st in e.probes),
        _model_lines(e, lbl, state))


def _model_lines(e: EngineState, lbl: str, state: str) -> str:
    out = []
    for m in e.models:
        if m.state is not None:
            shown = model_state(state, m.state)
            head = f'nvpair_model_state{{{lbl},model="{escape(m.id)}",state="'
            out += [f'{head}{s}"}} {int(s == shown)}\n' for s in MODEL_STATES]
    return "".join(out)


def queue_families(engines: tuple[EngineState, ...], now: float,
                   family: Callable[[str, str, str], None], add: Callable[[str], None]) -> None:
    """Per key, over every on-demand engine's queue: requests waiting, and the longest
    wait of one of them now (``"(no key)"``: requests without a key)."""
    waiting: dict[str, int] = {}
    since: dict[str, float] = {}
    for e in engines:
        for key, n, at in e.queued_keys:
            waiting[key] = waiting.get(key, 0) + n
            since[key] = min(since.get(key, at), at)
    family("nvpair_queue_waiting", "gauge",
           "Requests of the key waiting in on-demand engines' queues.")
    for key, n in sorted(waiting.items()):
        add(f'nvpair_queue_waiting{{key="{escape(key)}"}} {n}\n')
    family("nvpair_queue_oldest_wait_seconds", "gauge",
           "How long the key's longest-waiting request in a queue has waited.")
    for key, at in sorted(since.items()):
        add(f'nvpair_queue_oldest_wait_seconds{{key="{escape(key)}"}} '
            f"{number(max(now - at, 0.0))}\n")


def key_families(keys: Keyring, family: Callable[[str, str, str], None],
                 add: Callable[[str], None]) -> None:
    """Per key: routed requests, refusals by reason, in flight, and queue waits."""
    family("nvpair_key_requests_total", "counter",
           "Routed requests the key made that its limits let through.")
    for k in keys.keys:
        add(f'nvpair_key_requests_total{{key="{escape(k.name)}"}} {k.requests}\n')
    family("nvpair_key_rejections_total", "counter",
           "Routed requests of the key refused by its limits, by reason (in_flight, rate: "
           "429; model: 404, outside its model patterns).")
    for k in keys.keys:
        for reason, n in sorted(k.rejected.items()):
            add(f'nvpair_key_rejections_total{{key="{escape(k.name)}",reason="{reason}"}} '
                f'{n}\n')
    family("nvpair_key_in_flight", "gauge", "Routed requests of the key under way.")
    for k in keys.keys:
        add(f'nvpair_key_in_flight{{key="{escape(k.name)}"}} {k.in_flight}\n')
    family("nvpair_key_queue_wait_seconds", "summary",
           "Time the key's routed requests waited in on-demand engines' queues.")
    for k in keys.keys:
        lbl = f'key="{escape(k.name)}"'
        add(f"nvpair_key_queue_wait_seconds_sum{{{lbl}}} {number(k.queue_wait_s)}\n"
            f"nvpair_key_queue_wait_seconds_count{{{lbl}}} {k.queued}\n")


def memory_families(snap: Snapshot, names: list[str], family: Callable[[str, str, str], None],
                    add: Callable[[str], None]) -> None:
    """The memory watch's gauges (docs/metrics.md), from the snapshot."""
    watched = [(e.memory, lbl) for e, lbl in zip(snap.engines, names, strict=True)
               if e.memory is not None and e.memory.rss_anon_bytes is not None]
    if watched:
        family("nvpair_engine_memory_anon_bytes", "gauge",
               "The engine's processes' anonymous resident memory plus swap (RssAnon + VmSwap).")
        for m, lbl in watched:
            add(f"nvpair_engine_memory_anon_bytes{{{lbl}}} "
                f"{(m.rss_anon_bytes or 0) + (m.swap_bytes or 0)}\n")
        family("nvpair_engine_memory_trend", "gauge",
               "The engine's memory trend: 0 flat, 1 growing, 2 leaking, 3 critical.")
        for m, lbl in watched:
            add(f"nvpair_engine_memory_trend{{{lbl}}} {trend_level(m.trend)}\n")
        family("nvpair_engine_memory_slope_bytes_per_hour", "gauge",
               "The slope of the engine's memory floor over the trend window.")
        for m, lbl in watched:
            add(f"nvpair_engine_memory_slope_bytes_per_hour{{{lbl}}} "
                f"{number(m.slope_bytes_per_h or 0.0)}\n")
    node = snap.memory
    if node is not None and node.mem_available is not None:
        family("nvpair_node_memory_available_bytes", "gauge", "MemAvailable of the node.")
        add(f"nvpair_node_memory_available_bytes {node.mem_available}\n")
        family("nvpair_node_memory_reserve_bytes", "gauge",
               "What the OOM killers keep free (the memory watch's reserve).")
        add(f"nvpair_node_memory_reserve_bytes {node.reserve_bytes or 0}\n")
        family("nvpair_node_memory_trend", "gauge",
               "The node's memory trend: 0 flat, 1 growing, 2 leaking, 3 critical.")
        add(f"nvpair_node_memory_trend {trend_level(node.trend)}\n")
        if node.psi_some_avg10 is not None:
            family("nvpair_node_memory_pressure_some_avg10", "gauge",
                   "PSI: the share (percent) of the last 10 s some task stalled on memory.")
            add(f"nvpair_node_memory_pressure_some_avg10 {number(node.psi_some_avg10)}\n")


def histogram(add: Callable[[str], None], name: str, labels: str, h: Histogram) -> None:
    """A histogram's ``_bucket``, ``_sum`` and ``_count`` lines (``labels``: ``a="b",``)."""
    for bound, total in h.cumulative():
        add(f'{name}_bucket{{{labels}le="{number(bound)}"}} {total}\n')
    tail = f"{{{labels.rstrip(',')}}}" if labels else ""
    add(f"{name}_sum{tail} {number(h.sum)}\n{name}_count{tail} {h.count}\n")
