"""The configuration a user writes (TOML), decoded strictly, and the engines it resolves to."""

from __future__ import annotations

import ipaddress
import logging
import os
import re
import socket
import tomllib
from pathlib import Path
from typing import Annotated, Literal
from urllib.parse import urlsplit

import msgspec

from nvpair.base.decoding import SIZE_HELP, convert, one_line, parse_size
from nvpair.config.cluster import ClusterConfig, ClusterSettings, resolve_cluster
from nvpair.config.group import GroupConfig, GroupSettings, resolve_group
from nvpair.config.keys import KeyConfig, KeySpec, resolve_keys, token_digest
from nvpair.config.manifest import (
    BUILTIN_KINDS,
    PROBE_NAMES,
    Base,
    Manifest,
    Port,
    ProbeOverride,
    ProbeOverrides,
    Probes,
    ProbeSpec,
    Seconds,
    SleepManifest,
    check_probes,
    load_manifest,
)
from nvpair.errors import ConfigError, ManifestError

DEFAULT_LISTEN = "127.0.0.1:14322"
EngineName = Annotated[str, msgspec.Meta(pattern=r"^[a-z0-9][a-z0-9_-]{0,62}$")]
ArgValue = str | int | float | bool


class EngineConfig(Base, frozen=True):
    name: EngineName
    kind: str
    model: str | None = None
    host: str = "127.0.0.1"
    port: Port | None = None
    managed: bool = False
    command: tuple[str, ...] | None = None
    api_key_file: str | None = None
    args: dict[str, ArgValue] = {}
    env: dict[str, str] = {}
    probes: ProbeOverrides = ProbeOverrides()
    #: opt in to probes that run a generation on the engine (see the manifest reference).
    allow_generating_probes: bool = False
    #: other names clients may use for this engine's models.
    aliases: tuple[str, ...] = ()
    #: hide this engine while nothing answers (used by the embedded default config).
    optional: bool = False
    #: one engine run across several nodes (docs/groups.md).
    group: GroupConfig | None = None
    #: how long a managed engine may take to become ready (default: the manifest's).
    startup_budget_s: Seconds | None = None
    #: seconds between SIGTERM and SIGKILL when stopping (default: the manifest's).
    stop_grace_s: Seconds | None = None
    #: adopted engines: a file holding the engine's pid, for the memory watch (docs/memory.md).
    pid_file: str | None = None
    #: adopted engines: the engine's cgroup v2 (a path under /sys/fs/cgroup), instead.
    cgroup: str | None = None
    #: "always" runs it from the start; "on_demand" starts it for a request (docs/on-demand.md).
    activation: Literal["always", "on_demand"] = "always"
    #: managed engines: what nvpair's own exit does to it (default: the top-level on_exit).
    on_exit: Literal["stop", "keep"] | None = None
    #: on demand: stop after this long with no routed request (0: never).
    idle_unload_s: Annotated[float, msgspec.Meta(ge=0, le=30 * 86400)] = 0.0
    #: on demand: a higher priority survives eviction longer.
    priority: Annotated[int, msgspec.Meta(ge=-1000, le=1000)] = 0
    #: on demand: never evicted (neither slept nor stopped to make room for another).
    pin: bool = False
    #: on demand: the footprint evictions are planned with ("measured": the memory watch's).
    memory_bytes: Literal["measured"] | Annotated[int, msgspec.Meta(ge=0)] = "measured"
    #: on demand: requests its queue sends at once (default: what the engine says, else all).
    max_in_flight: Annotated[int, msgspec.Meta(ge=1, le=100_000)] | None = None
    #: read the engine's KV-cache use this often, from its /metrics (opt in; docs/metrics.md).
    kv_cache_probe_s: Annotated[float, msgspec.Meta(ge=1, le=3600)] | None = None
    #: it can sleep (docs/sleep.md): nvpair probes its sleep, wakes it and puts it to sleep,
    #: and starts a managed one with the kind's sleep flags
    sleep: bool = False
    #: llama-server: sleep after this long without a task (``--sleep-idle-seconds``)
    idle_sleep_s: Annotated[int, msgspec.Meta(ge=1, le=30 * 86400)] | None = None
    #: vLLM: 1 keeps the weights in host RAM, 2 drops them
    sleep_level: Literal[1, 2] = 1


class ActivationConfig(Base, frozen=True):
    """The ``[activation]`` table: what on-demand engines share (docs/on-demand.md)."""

    #: what on-demand engines may use together ("auto": headroom minus the reserve).
    memory_budget_bytes: Literal["auto"] | Annotated[int, msgspec.Meta(ge=0)] = "auto"
    #: requests waiting per engine from each key (requests without a key are one key), then
    #: 429: one busy key cannot fill an engine's queue.
    queue_max: Annotated[int, msgspec.Meta(ge=1, le=100_000)] = 64
    #: a waiting request gets 503 with Retry-After after this long.
    queue_wait_s: Seconds = 300.0
    #: a waiting request rises one priority level for every this many seconds it waits
    #: (up to the highest priority waiting): none starves (docs/on-demand.md).
    priority_age_s: Seconds = 10.0
    #: swap batching: a loaded engine with work of its own serves this many requests
    #: before it is evicted for another (0: no hold).
    swap_batch: Annotated[int, msgspec.Meta(ge=0, le=100_000)] = 0
    #: swap batching: ... and stays loaded at least this long (0: no hold).
    min_residency_s: Annotated[float, msgspec.Meta(ge=0, le=86400)] = 0.0
    #: swap batching: a request waiting this long for the other engine ends the hold.
    max_swap_wait_s: Seconds = 60.0


#: hours, fractions allowed (a test watches windows of seconds)
Hours = Annotated[float, msgspec.Meta(gt=0, le=24 * 366)]


class MemoryConfig(Base, frozen=True):
    """The ``[memory]`` table: the memory watch and what it does (docs/memory.md)."""

    #: seconds between readings of the engines' processes and the node.
    interval_s: Seconds = 15.0
    #: the trend is judged over this many hours of readings.
    window_h: Hours = 6.0
    #: an engine whose headroom runs out within this many hours is leaking.
    horizon_h: Hours = 24.0
    #: what the OOM killers keep free: "auto" is earlyoom's, max(10 % of MemAvailable +
    #: AnonPages, 2 GiB); or a number of bytes.
    reserve_bytes: Literal["auto"] | Annotated[int, msgspec.Meta(ge=0)] = "auto"
    #: "warn" (log, event, metric), or "restart_when_quiet" (managed engines).
    action: Literal["warn", "restart_when_quiet"] = "warn"
    #: restart_when_quiet: no routed request in flight for this long first.
    quiet_s: Annotated[float, msgspec.Meta(ge=0, le=86400)] = 300.0
    #: restart_when_quiet: the longest wait for that quiet moment; then it drains anyway.
    quiet_max_s: Annotated[float, msgspec.Meta(ge=0, le=86400)] = 3600.0
    #: restart_when_quiet: at most one memory restart of an engine in this many hours.
    min_restart_interval_h: Annotated[float, msgspec.Meta(ge=0, le=24 * 366)] = 6.0


class PeerConfig(Base, frozen=True):
    url: str
    token_file: str | None = None
    name: str | None = None


class RouterConfig(Base, frozen=True):
    """The OpenAI front door (POST /v1/chat/completions and friends)."""

    enabled: bool = True
    #: request bodies above this are refused with 413.
    max_body_bytes: Annotated[int, msgspec.Meta(ge=1024, le=1 << 30)] = 16 * 1024 * 1024
    connect_timeout_s: Seconds = 2.0
    #: time allowed until the engine answers with its status line (prefill can be long).
    first_byte_timeout_s: Seconds = 600.0
    #: longest silence between two chunks of a response; there is no total timeout.
    idle_timeout_s: Seconds = 120.0
    #: consecutive failed requests (refused or 5xx) that make an engine suspect.
    suspect_after: Annotated[int, msgspec.Meta(ge=1, le=100)] = 3
    #: how long a suspect engine gets no traffic while others can serve.
    cooldown_s: Seconds = 5.0


class TracingConfig(Base, frozen=True):
    """The ``[tracing]`` table: OpenTelemetry traces of routed requests, opt in
    (docs/observability.md)."""

    #: the collector's OTLP/HTTP traces URL (protobuf), e.g. http://127.0.0.1:4318/v1/traces;
    #: unset: no tracing.
    otlp_endpoint: str | None = None
    #: the share of requests that start a trace (a client's traceparent decides for its own).
    sample_ratio: Annotated[float, msgspec.Meta(ge=0, le=1)] = 1.0
    #: the resource's service.name.
    service_name: Annotated[str, msgspec.Meta(min_length=1, max_length=256)] = "nvpair"
    #: a file of HTTP headers sent with every export, "Name: value" a line (a token).
    headers_file: str | None = None
    #: the longest wait for the collector's answer to one export.
    timeout_s: Seconds = 10.0


class TracingSettings(msgspec.Struct, frozen=True):
    """``[tracing]`` resolved: the endpoint checked, the headers read."""

    endpoint: str
    sample_ratio: float
    service_name: str
    timeout_s: float
    #: (name, value): never logged, never on a command line
    headers: tuple[tuple[str, str], ...] = ()

    def __repr__(self) -> str:  # (the headers hold a collector's token)
        return (f"TracingSettings(endpoint={self.endpoint!r}, sample_ratio={self.sample_ratio}, "
                f"service_name={self.service_name!r}, headers={len(self.headers)})")


class Config(Base, frozen=True):
    listen: str = DEFAULT_LISTEN
    node: str | None = None
    #: one admin key (named ``token_file``), as before ``[[keys]]``
    token_file: str | None = None
    #: the API's keys: a name, a token file, a role and limits each (docs/keys.md)
    keys: tuple[KeyConfig, ...] = ()
    #: without token_file: host names besides loopback and localhost that clients may use
    #: to reach the API (the Host header; docs/api.md, browsers and cross-site requests).
    allowed_hosts: tuple[str, ...] = ()
    engines: tuple[EngineConfig, ...] = ()
    peers: tuple[PeerConfig, ...] = ()
    #: the one deadline that a model-list sweep over all engines shares.
    sweep_deadline_s: Seconds = 5.0
    #: idle keep-alive connections to nvpair's API are closed after this long (docs/api.md).
    keep_alive_s: Seconds = 75.0
    #: at most this many client connections to the API at once (at the cap, the one idle
    #: the longest is closed to admit a new one).
    max_connections: Annotated[int, msgspec.Meta(ge=8, le=1_000_000)] = 1024
    #: at most this many GET /v1/events streams at once (then 503 with Retry-After).
    max_streams: Annotated[int, msgspec.Meta(ge=0, le=100_000)] = 64
    #: a request's head must arrive within this long of its first byte.
    header_timeout_s: Seconds = 10.0
    #: a request's body must arrive within this long of its head.
    body_timeout_s: Seconds = 60.0
    #: where managed engines' log files go (default: a per-user state directory).
    log_dir: str | None = None
    #: a managed engine's output kept at most: lines above either rate are dropped and
    #: counted (docs/lifecycle.md); the defaults are nvpair.base.logs.LINES_PER_S, BYTES_PER_S.
    log_lines_per_s: Annotated[int, msgspec.Meta(ge=10, le=10_000_000)] = 5000
    log_bytes_per_s: Annotated[int, msgspec.Meta(ge=4096, le=1 << 34)] = 2 * 1024 * 1024
    #: where nvpair keeps a state file per managed engine process (docs/deploy.md).
    state_dir: str | None = None
    #: managed engines when nvpair exits: "stop" them, or "keep" them running for the next
    #: nvpair to adopt (docs/lifecycle.md); an engine's own on_exit overrides it.
    on_exit: Literal["stop", "keep"] = "stop"
    #: nvpair's own log lines: "text" for people, "json" one object per line (journald, Loki).
    log_format: Literal["text", "json"] = "text"
    #: one line per routed request: true (in nvpair's log), or a file's path; docs/observability.md.
    access_log: bool | str = False
    router: RouterConfig = RouterConfig()
    #: the peers broker: cluster token, advertised URL, backend (push or etcd); docs/peers.md.
    cluster: ClusterConfig = ClusterConfig()
    #: the memory watch: readings, trend windows, the reserve and the action (docs/memory.md).
    memory: MemoryConfig = MemoryConfig()
    #: engines started on demand: the memory budget and the queues (docs/on-demand.md).
    activation: ActivationConfig = ActivationConfig()
    #: traces of routed requests to an OpenTelemetry collector (docs/observability.md).
    tracing: TracingConfig = TracingConfig()


log = logging.getLogger("nvpair.config")

#: an engine's host: a name or an IPv4/IPv6 address (no scheme, port, path or spaces)
_HOST = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*|[0-9A-Fa-f:.]*:[0-9A-Fa-f:.%A-Za-z]*")


def url_host(host: str) -> str:
    """``host`` as it stands in a URL or a bind address: IPv6 literals in brackets."""
    return f"[{host}]" if ":" in host else host


class EngineSpec(msgspec.Struct, frozen=True):
    """One engine, with its manifest and the config's overrides merged: what the core runs."""

    name: str
    kind: str
    manifest: Manifest
    probes: Probes
    host: str
    port: int
    managed: bool
    model: str | None = None
    command: tuple[str, ...] | None = None
    api_key: str | None = None
    #: the file ``api_key`` was read from (absolute): ``{api_key_file}`` in a command, for an
    #: engine that reads its key from a file (llama-server ``--api-key-file``)
    api_key_file: str | None = None
    args: dict[str, ArgValue] = {}
    env: dict[str, str] = {}
    aliases: tuple[str, ...] = ()
    optional: bool = False
    allow_generating: bool = False
    startup_budget_s: float = 600.0
    stop_grace_s: float = 30.0
    #: adopted engines: where the memory watch finds its pid, or its cgroup (None: its socket)
    pid_file: str | None = None
    cgroup: str | None = None
    #: this node's part of a multi-node group (None: a single-node engine).
    group: GroupSettings | None = None
    activation: str = "always"  # or "on_demand"
    #: a managed engine at nvpair's exit: "stop" it, or "keep" it running to be adopted
    on_exit: str = "stop"
    idle_unload_s: float = 0.0
    priority: int = 0
    #: on demand: never a victim of an eviction
    pin: bool = False
    #: the configured footprint (None: "measured", from the memory watch only)
    memory_bytes: int | None = None
    #: on demand: requests the queue sends at once (None: what the engine says, else all)
    max_in_flight: int | None = None
    #: how often its KV-cache use is read (None: never)
    kv_cache_probe_s: float | None = None
    #: how it sleeps and wakes, with ``sleep = true`` or a kind whose sleep is always
    #: probed (None: nvpair never sees it asleep, never sleeps or wakes it)
    sleep: SleepManifest | None = None
    #: ``sleep = true``: a managed engine is started with the kind's sleep flags
    sleep_flags: bool = False
    idle_sleep_s: int | None = None
    sleep_level: int = 1

    @property
    def url(self) -> str:
        return f"http://{url_host(self.host)}:{self.port}"


class Settings(msgspec.Struct, frozen=True):
    """The whole resolved configuration."""

    source: str
    listen_host: str
    listen_port: int
    node: str
    token: str | None
    engines: tuple[EngineSpec, ...]
    sweep_deadline_s: float
    keep_alive_s: float
    log_dir: Path
    router: RouterConfig = RouterConfig()
    log_lines_per_s: int = 5000
    log_bytes_per_s: int = 2 * 1024 * 1024
    #: None: peers are not enabled.
    cluster: ClusterSettings | None = None
    allowed_hosts: tuple[str, ...] = ()
    #: state files of managed engine processes (None: none kept); nvpair.supervision.orphans.
    state_dir: Path | None = None
    max_connections: int = 1024
    max_streams: int = 64
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    memory: MemoryConfig = MemoryConfig()
    activation: ActivationConfig = ActivationConfig()
    #: the API's keys, ``token_file``'s first (empty: no token; loopback only)
    keys: tuple[KeySpec, ...] = ()
    log_format: Literal["text", "json"] = "text"
    #: the access log: None (off), "log" (nvpair's log), or a file
    access_log: Path | Literal["log"] | None = None
    #: traces (None: off)
    tracing: TracingSettings | None = None


def parse_listen(value: str, source: str) -> tuple[str, int]:
    m = re.fullmatch(r"\[?(?P<host>[^\[\]]+?)\]?:(?P<port>\d{1,5})", value)
    if not m or not 0 <= int(m["port"]) <= 65535:  # 0: any free port
        raise ConfigError(f"{source}: expected HOST:PORT with a port 0-65535, got {value!r}")
    return m["host"], int(m["port"])


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _secret_path(path: str, base: Path) -> Path:
    full = Path(path).expanduser()
    return full if full.is_absolute() else base / full


def read_secret(path: str, source: str, key: str, base: Path) -> str:
    full = _secret_path(path, base)
    try:
        secret = full.read_text().strip()
    except OSError as exc:
        raise ConfigError(f"{source}: {key}: cannot read {full}: {exc.strerror}") from None
    if not secret:
        raise ConfigError(f"{source}: {key}: {full} is empty")
    return secret


def decode_config(data: bytes, source: str) -> Config:
    try:
        raw = tomllib.loads(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise ConfigError(f"{source}: not valid TOML: not UTF-8 text") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{source}: not valid TOML: {exc}") from None
    except RecursionError:  # tomllib recurses per nested array or inline table
        raise ConfigError(f"{source}: not valid TOML: arrays or tables nested too deeply"
                          ) from None
    return convert(_sizes(raw, source), Config, source, ConfigError)


#: the keys that hold a number of bytes (each also takes one word: "auto" or "measured")
_SIZE_KEYS = (("activation", "memory_budget_bytes", "auto"), ("memory", "reserve_bytes", "auto"))
_ENGINE_SIZE_KEYS = (("memory_bytes", "measured"),)


def size_keys() -> list[tuple[str, str]]:
    """(struct name, key) of each size in the config, for its JSON Schema."""
    tables = {"activation": "ActivationConfig", "memory": "MemoryConfig"}
    return ([(tables[section], key) for section, key, _word in _SIZE_KEYS]
            + [("EngineConfig", key) for key, _word in _ENGINE_SIZE_KEYS])


def _sizes(raw: dict[str, object], source: str) -> dict[str, object]:
    """``raw`` with sizes written with a unit ("90GB", "80 MiB") turned into bytes."""
    def size(table: object, key: str, word: str, where: str) -> None:
        if not isinstance(table, dict) or not isinstance(table.get(key), str):
            return
        text = table[key]
        if text == word:
            return
        value = parse_size(text)
        if value is None:
            raise ConfigError(f"{source}: {where}{key}: expected {SIZE_HELP}, or "
                              f"{word!r}; got {text!r}")
        table[key] = value

    for section, key, word in _SIZE_KEYS:
        size(raw.get(section), key, word, f"{section}.")
    engines = raw.get("engines")
    if isinstance(engines, list):
        for i, table in enumerate(engines):
            for key, word in _ENGINE_SIZE_KEYS:
                size(table, key, word, f"engines[{i}].")
    return raw


def default_config() -> Config:
    """Adopt any built-in engine answering on its default port on 127.0.0.1."""
    engines = []
    for kind in BUILTIN_KINDS:
        if kind == "openai":  # shares vLLM's default port 8000; vllm's identity covers it
            continue
        engines.append(EngineConfig(name=kind, kind=kind, optional=True))
    return Config(engines=tuple(engines))


def find_config_path(explicit: str | None) -> Path | None:
    """--config, else $NVPAIR_CONFIG, else ./nvpair.toml, else None (the embedded default)."""
    if explicit:
        return Path(explicit)
    env = os.environ.get("NVPAIR_CONFIG")
    if env:
        return Path(env)
    local = Path("nvpair.toml")
    return local if local.is_file() else None


def load_settings(explicit: str | None = None, *, listen: str | None = None) -> Settings:
    """Find, read, decode and resolve the configuration; raise ConfigError/ManifestError."""
    path = find_config_path(explicit)
    if path is None:
        return resolve(default_config(), "(embedded default)", Path.cwd(), listen=listen)
    source = str(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{source}: cannot read config: {exc.strerror}") from None
    return resolve(decode_config(data, source), source, path.parent, listen=listen)


def resolve(config: Config, source: str, base: Path, *, listen: str | None = None) -> Settings:
    where = "--listen" if listen else f"{source}: listen"
    host, port = parse_listen(listen or config.listen, where)
    keys = resolve_keys(config.keys, config.token_file or None, source, base)
    token = keys[0].token if config.token_file else None
    if not keys and not is_loopback(host):
        raise ConfigError(
            f"{where}: {host} is not a loopback address; set token_file (or [[keys]]) in "
            "the config so that the API requires a bearer token"
        )
    for i, name in enumerate(config.allowed_hosts):
        if not re.fullmatch(r"[A-Za-z0-9_]([A-Za-z0-9._-]*[A-Za-z0-9_])?", name):
            raise ConfigError(f"{source}: allowed_hosts[{i}]: expected a host name (no "
                              f"scheme, port or path), got {name!r}")
    names: set[str] = set()
    engines: list[EngineSpec] = []
    for i, eng in enumerate(config.engines):
        where = f"{source}: engines[{i}]"
        if eng.name in names:
            raise ConfigError(f"{where}.name: duplicate engine name {eng.name!r}")
        names.add(eng.name)
        spec = _resolve_engine(eng, where, base)
        if spec.managed:  # (a group's: kept on its ranks only, docs/groups.md)
            spec = msgspec.structs.replace(spec, on_exit=eng.on_exit or config.on_exit)
        twin = next((e for e in engines if (e.host, e.port) == (spec.host, spec.port)), None)
        # two adopted engines at one address: a mistake as a rule; a load test may mean it.
        # (With a managed one it is two processes on one port: nvpair.cli.preflight's error.)
        if twin is not None and not (spec.managed or twin.managed):
            log.warning("%s: %s:%d is engine %r already: one engine, probed twice", where,
                        spec.host, spec.port, twin.name)
        engines.append(spec)
    cluster = resolve_cluster(config.cluster, config.peers, source=source, base=base,
                              node=config.node or socket.gethostname(), api_token=token,
                              read_secret=read_secret)
    if cluster is not None and cluster.token is not None:
        same = next((k for k in keys if token_digest(k.token.encode())
                     == token_digest(cluster.token.encode())), None)
        if same is not None:
            raise ConfigError(f"{source}: cluster.token_file: must differ from every key's "
                              f"token (it is key {same.name!r}'s)")
    engines = [_grouped(eng, spec, f"{source}: engines[{i}]", config.node or socket.gethostname(),
                        cluster is not None and bool(cluster.etcd or cluster.peers))
               for i, (eng, spec) in
               enumerate(zip(config.engines, engines, strict=True))]
    state_dir = Path(config.state_dir).expanduser() if config.state_dir else default_state_dir()
    if not state_dir.is_absolute():
        state_dir = base / state_dir
    log_dir = Path(config.log_dir).expanduser() if config.log_dir else state_dir / "logs"
    if not log_dir.is_absolute():
        log_dir = base / log_dir
    return Settings(
        source=source,
        listen_host=host,
        listen_port=port,
        node=config.node or socket.gethostname(),
        token=token,
        engines=tuple(engines),
        sweep_deadline_s=config.sweep_deadline_s,
        keep_alive_s=config.keep_alive_s,
        log_dir=log_dir,
        log_lines_per_s=config.log_lines_per_s,
        log_bytes_per_s=config.log_bytes_per_s,
        router=config.router,
        cluster=cluster,
        allowed_hosts=tuple(h.lower() for h in config.allowed_hosts),
        state_dir=state_dir,
        max_connections=config.max_connections,
        max_streams=config.max_streams,
        header_timeout_s=config.header_timeout_s,
        body_timeout_s=config.body_timeout_s,
        memory=_checked_memory(config.memory, source),
        activation=config.activation,
        keys=keys,
        log_format=config.log_format,
        access_log=_access_log(config.access_log, source, base),
        tracing=resolve_tracing(config.tracing, source, base),
    )


#: an HTTP header's name (RFC 9110's token)
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")


def resolve_tracing(config: TracingConfig, source: str, base: Path) -> TracingSettings | None:
    """The ``[tracing]`` table checked (None: no ``otlp_endpoint``, tracing is off)."""
    where = f"{source}: tracing"
    if config.otlp_endpoint is None:
        if config.headers_file is not None:
            raise ConfigError(f"{where}.headers_file: set otlp_endpoint too (headers for "
                              "which collector?)")
        return None
    url = config.otlp_endpoint
    try:
        parts = urlsplit(url)
        usable = (parts.scheme in ("http", "https") and bool(parts.hostname)
                  and parts.port != 0 and parts.username is None and not parts.fragment
                  and not any(c.isspace() for c in url))
    except ValueError:  # (a port that is no number, or over 65535)
        usable = False
    if not usable:
        shown = repr(url) if "@" not in url else "a URL with a user or password (not shown)"
        raise ConfigError(f"{where}.otlp_endpoint: expected an http:// or https:// URL with a "
                          "host, an optional port and path and no user or password (a "
                          f"token goes in headers_file), e.g. http://127.0.0.1:4318/v1/traces; "
                          f"got {shown}")
    headers: list[tuple[str, str]] = []
    if config.headers_file is not None:
        full = _secret_path(config.headers_file, base)
        try:
            text = full.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            why = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
            raise ConfigError(f"{where}.headers_file: cannot read {full}: {why}") from None
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            name, colon, value = line.partition(":")
            value = value.strip()
            if (not colon or not _HEADER_NAME.fullmatch(name.strip()) or not value
                    or any(ord(c) < 0x20 or ord(c) == 0x7F for c in value)):
                # (the line itself is never shown: it holds a token)
                raise ConfigError(f"{where}.headers_file: {full} line {number}: expected "
                                  "'Name: value' (a header name, a colon, a value)")
            headers.append((name.strip(), value))
    return TracingSettings(endpoint=url, sample_ratio=config.sample_ratio,
                           service_name=config.service_name, timeout_s=config.timeout_s,
                           headers=tuple(headers))


def _access_log(value: bool | str, source: str, base: Path) -> Path | Literal["log"] | None:
    """The ``access_log`` key: off, nvpair's own log, or a file (relative to the config)."""
    if value is False:
        return None
    if value is True:
        return "log"
    if not value.strip() or "\n" in value or "\0" in value:
        raise ConfigError(f"{source}: access_log: expected true, false or a file's path, "
                          f"got {value!r}")
    path = Path(value).expanduser()
    return path if path.is_absolute() else base / path


def default_state_dir() -> Path:
    """systemd's StateDirectory= ($STATE_DIRECTORY), else $XDG_STATE_HOME/nvpair, else
    ~/.local/state/nvpair."""
    if systemd := os.environ.get("STATE_DIRECTORY"):
        return Path(systemd.split(":")[0])
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "nvpair"


def _check_process_text(eng: EngineConfig, where: str) -> None:
    """What becomes a managed engine's argv or environment must be something the OS can
    take: environment names that are not empty and hold no ``=`` or NUL, and no NUL in any
    value or argument (the spawn would fail at start, with no line in ``nvpair check``)."""
    for key in eng.env:
        if not key:
            raise ConfigError(f"{where}.env: an environment variable name is empty")
        bad = "=" if "=" in key else "a NUL byte" if "\0" in key else None
        if bad:
            raise ConfigError(f"{where}.env: the name {key!r} contains {bad}; environment "
                              "variable names cannot")
        if "\0" in eng.env[key]:
            raise ConfigError(f"{where}.env.{key}: the value contains a NUL byte")
    fields: list[tuple[str, object]] = [("model", eng.model)]
    fields += [(f"command[{i}]", part) for i, part in enumerate(eng.command or ())]
    fields += [(f"args.{k}", v) for k, v in eng.args.items()]
    for name, value in fields:
        if isinstance(value, str) and "\0" in value:
            raise ConfigError(f"{where}.{name}: contains a NUL byte, which no program "
                              "argument can hold")


def _resolve_engine(eng: EngineConfig, where: str, base: Path) -> EngineSpec:
    _check_process_text(eng, where)
    if not _HOST.fullmatch(eng.host):
        raise ConfigError(f"{where}.host: expected an IP address or a host name, "
                          f"got {eng.host!r}")
    try:
        manifest = load_manifest(eng.kind, base=base)
    except ManifestError as exc:
        raise ConfigError(f"{where}.kind: {exc}") from None
    probes = _merge_probes(manifest.probes, eng.probes, where)
    # (a kind whose engines may sleep however they were started, llama-server's
    # --sleep-idle-seconds, is probed for its sleep and woken whether sleep = true or not)
    sleeps = eng.sleep or (manifest.sleep is not None and manifest.sleep.always_probed)
    if sleeps and manifest.sleep is not None and manifest.sleep.probe_path is not None:
        probes = sleeping_probes(probes, manifest.sleep)
    check_probes(
        probes,
        allow_generating=manifest.allow_generating_probes or eng.allow_generating_probes,
        where=where,
    )
    if eng.managed and not (eng.command or manifest.start.argv):
        raise ConfigError(
            f"{where}: managed = true but neither the engine's command nor the "
            f"{manifest.kind} manifest's start.argv says how to start it"
        )
    if eng.on_exit is not None and not eng.managed:
        raise ConfigError(f"{where}.on_exit: needs managed = true (nvpair never stops an "
                          "engine it did not start)")
    if eng.activation == "on_demand" and not eng.managed:
        raise ConfigError(f"{where}.activation: on_demand needs managed = true (nvpair "
                          "starts and stops the engine)")
    pid_file = _memory_source(eng, where, base)
    if eng.sleep and manifest.sleep is None:
        raise ConfigError(f"{where}.sleep: the {manifest.kind} manifest says nothing of how "
                          "it sleeps; remove sleep = true")
    if eng.idle_sleep_s is not None and not eng.sleep:
        raise ConfigError(f"{where}.idle_sleep_s: needs sleep = true")
    if eng.pin and eng.activation != "on_demand":
        raise ConfigError(f"{where}.pin: only an engine with activation = 'on_demand' is "
                          "ever evicted; remove pin = true")
    api_key = key_path = None
    if eng.api_key_file:
        api_key = read_secret(eng.api_key_file, where, "api_key_file", base)
        key_path = str(_secret_path(eng.api_key_file, base))
    spec = EngineSpec(
        name=eng.name,
        kind=manifest.kind,
        manifest=manifest,
        probes=probes,
        host=eng.host,
        port=eng.port or manifest.default_port,
        managed=eng.managed,
        model=eng.model,
        command=eng.command,
        api_key=api_key,
        api_key_file=key_path,
        args=eng.args,
        env=eng.env,
        aliases=eng.aliases,
        optional=eng.optional,
        allow_generating=manifest.allow_generating_probes or eng.allow_generating_probes,
        startup_budget_s=eng.startup_budget_s or manifest.startup_budget_s,
        stop_grace_s=eng.stop_grace_s or manifest.stop.grace_s,
        pid_file=pid_file,
        cgroup=eng.cgroup,
        activation=eng.activation,
        idle_unload_s=eng.idle_unload_s,
        priority=eng.priority,
        pin=eng.pin,
        memory_bytes=None if eng.memory_bytes == "measured" else eng.memory_bytes,
        max_in_flight=eng.max_in_flight,
        kv_cache_probe_s=eng.kv_cache_probe_s,
        sleep=manifest.sleep if sleeps else None,
        sleep_flags=eng.sleep,
        idle_sleep_s=eng.idle_sleep_s,
        sleep_level=eng.sleep_level,
    )
    if spec.managed:
        from nvpair.config.command import CommandError, build_command

        try:
            argv, env = build_command(manifest, spec.command, placeholder_values(spec))
        except CommandError as exc:
            raise ConfigError(f"{where}: {exc}") from None
        # what the manifest or a secret (an api_key placeholder) put there
        if any("\0" in part for part in (*argv, *env.values())):
            raise ConfigError(f"{where}: the command built for this engine contains a NUL "
                              "byte (from the manifest's start template or api_key_file)")
        if spec.api_key_file is not None and any(spec.api_key_file in a for a in argv):
            _check_key_file(spec.api_key_file, spec.api_key, where)
    return spec


def _check_key_file(path: str, key: str | None, where: str) -> None:
    """An engine given the key file itself (llama-server ``--api-key-file``) takes each
    line as a key, as it is: the file must hold nvpair's key (its content, stripped) alone,
    or the engine would refuse the key nvpair sends."""
    try:
        lines = [line for line in Path(path).read_bytes().split(b"\n") if line]
    except OSError as exc:
        raise ConfigError(f"{where}: api_key_file: cannot read {path}: {exc.strerror}") from None
    if key is None or lines != [key.encode()]:
        raise ConfigError(f"{where}: api_key_file: {path} is passed to the engine, which reads "
                          "each line as a key: it must hold the key alone on one line (no "
                          "spaces, no CR)")


def _merge_probes(probes: Probes, overrides: ProbeOverrides, where: str) -> Probes:
    merged: dict[str, ProbeSpec | None] = {n: getattr(probes, n) for n in PROBE_NAMES}
    for name in PROBE_NAMES:
        override: ProbeOverride | None = getattr(overrides, name)
        if override is None:
            continue
        current = merged[name]
        changes = {k: v for k, v in msgspec.structs.asdict(override).items() if v is not None}
        if current is None:
            if "path" not in changes:
                raise ConfigError(
                    f"{where}.probes.{name}: the manifest has no such probe; give a path")
            current = ProbeSpec(path=changes["path"])
        try:
            merged[name] = msgspec.convert(
                {**msgspec.structs.asdict(current), **changes}, ProbeSpec, strict=True
            )
        except msgspec.ValidationError as exc:
            raise ConfigError(one_line(f"{where}.probes.{name}", exc)) from None
    ready, health = merged["ready"], merged["health"]
    assert ready is not None and health is not None
    return Probes(ready=ready, health=health, identity=merged["identity"], models=merged["models"])


def sleeping_probes(probes: Probes, sleep: SleepManifest) -> Probes:
    """The probes of an engine that can sleep: its health probe asks the sleeping probe's
    path, which says whether it sleeps and never wakes it (docs/sleep.md); an engine
    without that path (404: vLLM without VLLM_SERVER_DEV_MODE) falls back to the
    manifest's health path."""
    health = probes.health
    assert sleep.probe_path is not None
    moved = msgspec.structs.replace(
        health, path=sleep.probe_path, cost="cheap",
        needs_api_key=sleep.probe_needs_api_key or health.needs_api_key,
        fallback_path=health.path, fallback_cost=health.cost)
    return msgspec.structs.replace(probes, health=moved)


def placeholder_values(spec: EngineSpec) -> dict[str, object]:
    """Placeholder values for a resolved engine (the same rule as ``_values``)."""
    values: dict[str, object] = dict(spec.manifest.start.defaults)
    values.update(spec.args)
    values.update(host=spec.host, port=spec.port, name=spec.name)
    if spec.model is not None:
        values["model"] = spec.model
    if spec.api_key is not None:
        values["api_key"] = spec.api_key
    if spec.api_key_file is not None:
        values["api_key_file"] = spec.api_key_file
    if spec.sleep is not None and spec.sleep_flags:  # (the kind's sleep argv and env too)
        values.update(sleep=True, sleep_level=spec.sleep_level)
        if spec.idle_sleep_s is not None:
            values["idle_sleep_s"] = spec.idle_sleep_s
    return values


def _grouped(eng: EngineConfig, spec: EngineSpec, where: str, node: str,
             peers: bool) -> EngineSpec:
    """``spec`` with this node's part of its group (``[engines.group]``), if it has one."""
    if eng.group is None:
        return spec
    if eng.activation != "always":
        raise ConfigError(f"{where}.activation: a group runs always; on_demand cannot be "
                          "used with [engines.group]")
    group = resolve_group(eng.group, engine=spec.name, manifest=spec.manifest,
                          managed=spec.managed, command=spec.command,
                          values=placeholder_values(spec), node=node, env=os.environ,
                          peers=peers, where=where)
    return msgspec.structs.replace(spec, group=group)


def _memory_source(eng: EngineConfig, where: str, base: Path) -> str | None:
    """An adopted engine's ``pid_file`` (made absolute) after checking ``cgroup`` too."""
    for key in ("pid_file", "cgroup"):
        value = getattr(eng, key)
        if value is None:
            continue
        if eng.managed:
            raise ConfigError(f"{where}.{key}: only for adopted engines (nvpair knows the "
                              "processes of an engine it starts)")
        if not value.strip() or "\0" in value:
            raise ConfigError(f"{where}.{key}: expected a path, got {value!r}")
    if eng.pid_file is not None and eng.cgroup is not None:
        raise ConfigError(f"{where}: pid_file and cgroup both say where the engine's "
                          "processes are; give one")
    if eng.pid_file is None:
        return None
    path = Path(eng.pid_file).expanduser()
    return str(path if path.is_absolute() else base / path)


#: the trend needs at least this many readings in its window
MIN_READINGS = 8


def _checked_memory(memory: MemoryConfig, source: str) -> MemoryConfig:
    window_s = memory.window_h * 3600
    if window_s < MIN_READINGS * memory.interval_s:
        raise ConfigError(
            f"{source}: memory.window_h: {memory.window_h:g} h ({window_s:g} s) holds fewer "
            f"than {MIN_READINGS} readings of memory.interval_s = {memory.interval_s:g} s")
    return memory
