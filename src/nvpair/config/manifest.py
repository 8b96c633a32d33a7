"""Engine manifests: what each kind of engine is, how to start it and how to probe it.

Manifests are JSON files (``engines/<kind>.json`` for the built-in kinds, or any path).
They are decoded strictly: unknown keys, wrong types and out-of-range values are errors
that name the file and the key.
"""

from __future__ import annotations

import re
from importlib import resources
from pathlib import Path
from typing import Annotated, Literal, get_args

import msgspec

from nvpair.base.decoding import one_line, where_and_what
from nvpair.errors import ManifestError

Cost = Literal["cheap", "queued", "generating"]
ProbeName = Literal["ready", "health", "identity", "models"]
PROBE_NAMES: tuple[ProbeName, ...] = get_args(ProbeName)
ModelsFormat = Literal["openai", "ollama_tags"]

Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]
Seconds = Annotated[float, msgspec.Meta(gt=0, le=86400)]
Count = Annotated[int, msgspec.Meta(ge=1, le=1000)]

#: A generating probe costs the engine a real generation; nvpair never runs one more often.
GENERATING_MIN_INTERVAL_S = 30.0

BUILTIN_KINDS = ("sglang", "vllm", "llamacpp", "ollama", "tgi", "openai")


class Base(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """Frozen, strict: a typo in a key is an error, not a silently ignored default."""


class ProbeSpec(Base, frozen=True):
    """One HTTP probe: where, what answer counts as success, what it costs and how often."""

    path: str
    method: Literal["GET", "HEAD", "POST"] = "GET"
    expect_status: Annotated[tuple[int, ...], msgspec.Meta(min_length=1)] = (200,)
    cost: Cost = "cheap"
    interval_s: Seconds = 5.0
    timeout_s: Seconds = 2.0
    failure_threshold: Count = 3
    success_threshold: Count = 1
    needs_api_key: bool = False
    #: Tried once when ``path`` answers 404 (an older build of the engine); cost of that path.
    fallback_path: str | None = None
    fallback_cost: Cost = "cheap"
    #: identity: JSON pointers tried in order for the served model name.
    model_pointers: tuple[str, ...] = ()
    #: identity: JSON pointer of the engine's version or build.
    version_pointer: str | None = None
    #: identity: keys the body must have for the engine to be of this kind.
    require_keys: tuple[str, ...] = ()
    #: identity: JSON pointer of how many requests the engine serves at once (its slots).
    slots_pointer: str | None = None
    #: identity: JSON pointer whose value "router" marks a multi-model router (llama-server
    #: in router mode): it has no slots of its own (``slots_pointer``'s key is not required)
    #: and names no model of its own; then how many models it loads at once, and whether it
    #: loads a model on request
    router_pointer: str | None = None
    models_max_pointer: str | None = None
    autoload_pointer: str | None = None
    #: models: the body's format.
    format: ModelsFormat = "openai"

    def __post_init__(self) -> None:
        if not self.path.startswith("/"):
            raise ValueError(f"path must start with '/', got {self.path!r}")
        if self.timeout_s > self.interval_s:
            # A timeout longer than the interval would make probes overlap if we let it.
            raise ValueError("timeout_s must not exceed interval_s")


class ProbeOverride(Base, frozen=True):
    """Per-engine overrides of a manifest's probe; every key optional."""

    path: str | None = None
    method: Literal["GET", "HEAD", "POST"] | None = None
    expect_status: Annotated[tuple[int, ...], msgspec.Meta(min_length=1)] | None = None
    cost: Cost | None = None
    interval_s: Seconds | None = None
    timeout_s: Seconds | None = None
    failure_threshold: Count | None = None
    success_threshold: Count | None = None
    needs_api_key: bool | None = None



class ProbeOverrides(Base, frozen=True):
    """An engine's changes to its manifest's probes (a typo in a name is an error)."""

    ready: ProbeOverride | None = None
    health: ProbeOverride | None = None
    identity: ProbeOverride | None = None
    models: ProbeOverride | None = None

class Probes(Base, frozen=True):
    ready: ProbeSpec
    health: ProbeSpec
    identity: ProbeSpec | None = None
    models: ProbeSpec | None = None

    def named(self) -> list[tuple[ProbeName, ProbeSpec]]:
        """The probes this engine has, by name, in PROBE_NAMES order."""
        return [(n, p) for n in PROBE_NAMES if (p := getattr(self, n)) is not None]


class StartSpec(Base, frozen=True):
    #: argv template; placeholders such as {model}, {host}, {port}, {tp} fill whole arguments.
    argv: tuple[str, ...] = ()
    env: dict[str, str] = {}
    #: argv fragments added only when every placeholder in them has a value.
    optional: tuple[tuple[str, ...], ...] = ()
    #: environment variables set only when every placeholder in the value has one (how a
    #: secret reaches an engine that reads it from its environment: never in argv).
    optional_env: dict[str, str] = {}
    #: default values of placeholders (e.g. tp = 1).
    defaults: dict[str, str | int | float | bool] = {}


class StopSpec(Base, frozen=True):
    signal: Literal["SIGTERM", "SIGINT", "SIGQUIT", "SIGKILL"] = "SIGTERM"
    grace_s: Seconds = 30.0


class RestartSpec(Base, frozen=True):
    """Exponential backoff between restarts of a managed engine that exited."""

    initial_s: Seconds = 1.0
    max_s: Seconds = 60.0
    #: the backoff resets once the engine has been ready this long.
    reset_after_s: Seconds = 60.0


StartOrder = Literal["together", "head_first", "ranks_first"]
#: how a rank's nvpair knows its process is ready: an HTTP probe, the process alone, or the
#: process and its listening socket (never a connection: llama.cpp's rpc-server serves one
#: client at a time).
RankReady = Literal["probe", "process", "listen"]


class GroupRole(Base, frozen=True):
    """How one role of a multi-node group starts and is watched (docs/groups.md)."""

    #: placeholders besides the engine's: {rank}, {nnodes}, {dist_addr}, {dist_host},
    #: {dist_port}, and on the head {rank_addrs} (every rank's host:dist_port, comma-joined).
    start: StartSpec
    ready: RankReady = "probe"
    #: the rank's readiness probe (ready = "probe"); the head uses the engine's probes.
    probe: ProbeSpec | None = None
    stop_grace_s: Seconds | None = None


class GroupRoles(Base, frozen=True):
    head: GroupRole
    rank: GroupRole


class GroupManifest(Base, frozen=True):
    """``group``: the roles of one engine run across several nodes, and their start order."""

    roles: GroupRoles
    start_order: StartOrder = "together"


NOTES = ("For people reading the manifest, since JSON has no comments: why these probes and "
         "paths were chosen. nvpair never reads it.")


class KvCacheSpec(Base, frozen=True):
    """Where the engine exports its KV-cache use, as a ratio 0-1 (docs/metrics.md); read
    only for engines that opt in (``kv_cache_probe_s``)."""

    #: the gauge's name in the engine's Prometheus text (its largest series is taken)
    gauge: Annotated[str, msgspec.Meta(pattern=r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")]
    path: str = "/metrics"


class EngineCall(Base, frozen=True):
    """One request nvpair sends an engine to put it to sleep or wake it. ``path`` may hold
    ``{sleep_level}``; ``body`` is JSON text (None: no body)."""

    path: str
    method: Literal["GET", "POST"] = "POST"
    body: str | None = None
    #: how long it may take to answer (a wake loads the weights again)
    timeout_s: Seconds = 300.0

    def __post_init__(self) -> None:
        if not self.path.startswith("/"):
            raise ValueError(f"path must start with '/', got {self.path!r}")


class SleepManifest(Base, frozen=True):
    """How a kind of engine sleeps (frees its weights and KV cache, keeps its process) and
    wakes (docs/sleep.md). Used only for an engine configured with ``sleep = true``."""

    #: the cheap request that tells whether it sleeps and never wakes it (None: the kind
    #: has none, and nvpair knows only what it did itself)
    probe_path: str | None = None
    #: the JSON pointer of the probe answer's ``true`` while it sleeps
    sleeping_pointer: str = "/is_sleeping"
    probe_needs_api_key: bool = False
    #: the calls that put it to sleep, in order, once nvpair has drained it (none: it
    #: sleeps only by itself, as llama-server after ``--sleep-idle-seconds``)
    sleep: tuple[EngineCall, ...] = ()
    #: the calls that wake it, in order
    wake: tuple[EngineCall, ...] = ()
    #: the calls that wake it from a sleep of this level (``sleep_level``), in place of
    #: ``wake``: vLLM's level 2 discards the weights, which must be loaded again before
    #: it serves
    wake_by_level: dict[Literal["1", "2"], tuple[EngineCall, ...]] = {}
    #: what a managed engine with ``sleep = true`` is started with besides: argv
    #: fragments (each only when its placeholders have values) and environment
    argv: tuple[tuple[str, ...], ...] = ()
    env: dict[str, str] = {}
    #: whether a routed request wakes it by itself (llama-server); else nvpair wakes it
    #: before sending one (vLLM answers 503 while it sleeps)
    request_wakes: bool = False


class Manifest(Base, frozen=True):
    """A kind of engine."""

    kind: str
    display_name: str
    default_port: Port
    probes: Probes
    start: StartSpec = StartSpec()
    #: the start template of a multi-model router (llama-server without ``-m``), used in
    #: place of ``start`` when the engine's args give ``models_dir`` or ``models_preset``
    router_start: StartSpec | None = None
    stop: StopSpec = StopSpec()
    restart: RestartSpec = RestartSpec()
    #: how long a managed engine may take to first answer ready.
    startup_budget_s: Seconds = 600.0
    #: opt in to probes whose cost is "generating" (they run a real generation on the engine).
    allow_generating_probes: bool = False
    #: how the engine runs across several nodes (``[engines.group]``); None: it cannot.
    group: GroupManifest | None = None
    #: where it exports its KV-cache use (None: nowhere nvpair knows).
    kv_cache: KvCacheSpec | None = None
    #: how it sleeps and wakes (None: it cannot)
    sleep: SleepManifest | None = None
    #: for people reading the manifest (JSON has no comments): why these probes; never read.
    notes: Annotated[str, msgspec.Meta(description=NOTES)] = ""


#: keys that earlier manifests had and nvpair never read: a clear error, not a silent skip.
REMOVED_KEYS = {
    "port_open_while_loading": "a managed engine whose port is refused is starting, any kind",
    "deprecated_paths": "put old paths in notes, or in a probe's fallback_path if it answers",
}


_KIND = re.compile(r"^[a-z0-9][a-z0-9_-]*$")


def check_probes(probes: Probes, *, allow_generating: bool, where: str) -> None:
    """Reject generating probes without the opt-in, and too-frequent generating probes."""
    for name, spec in probes.named():
        # A generating fallback path is checked when it is used (see probes.py): the
        # primary path is what runs on every current engine.
        if spec.cost == "generating" and not allow_generating:
            raise ManifestError(
                f"{where}: probes.{name}: cost 'generating' runs a real generation on the engine "
                "on every probe; set allow_generating_probes = true to opt in"
            )
        if spec.cost == "generating" and spec.interval_s < GENERATING_MIN_INTERVAL_S:
            raise ManifestError(
                f"{where}: probes.{name}: a generating probe needs interval_s >= "
                f"{GENERATING_MIN_INTERVAL_S:g}, got {spec.interval_s:g}"
            )
        if name in ("identity", "models") and spec.cost == "generating":
            raise ManifestError(f"{where}: probes.{name}: must not be a generating probe")


def decode_manifest(data: bytes, source: str) -> Manifest:
    """Decode and check one manifest; raise ManifestError with one line."""
    try:
        manifest = msgspec.json.decode(data, type=Manifest)
    except msgspec.ValidationError as exc:
        path, what = where_and_what(exc)
        if path in REMOVED_KEYS and what.startswith("unknown key"):
            raise ManifestError(f"{source}: {path}: no longer a manifest key "
                                f"({REMOVED_KEYS[path]}); remove it") from None
        raise ManifestError(one_line(source, exc)) from None
    except msgspec.DecodeError as exc:
        raise ManifestError(f"{source}: not valid JSON: {_json_where(data, exc)}") from None
    if not _KIND.match(manifest.kind):
        raise ManifestError(f"{source}: kind: expected lower-case letters, digits, '-' or '_'")
    check_probes(manifest.probes, allow_generating=manifest.allow_generating_probes, where=source)
    if manifest.group is not None:
        _check_group(manifest.group, source)
    restart = manifest.restart
    if restart.initial_s > restart.max_s:
        raise ManifestError(f"{source}: restart.initial_s ({restart.initial_s:g}) is above "
                            f"restart.max_s ({restart.max_s:g})")
    return manifest


def _check_group(group: GroupManifest, source: str) -> None:
    for name in ("head", "rank"):
        role: GroupRole = getattr(group.roles, name)
        where = f"{source}: group.roles.{name}"
        if not role.start.argv:
            raise ManifestError(f"{where}.start.argv: empty; a role needs a command")
        if name == "head" and role.ready != "probe":
            raise ManifestError(f"{where}.ready: the head is ready by the engine's own "
                                "probes; only a rank may be ready by 'process' or 'listen'")
        if name == "rank" and role.ready == "probe" and role.probe is None:
            raise ManifestError(f"{where}: ready = 'probe' needs a probe")
        if role.probe is not None and role.probe.cost != "cheap":
            raise ManifestError(f"{where}.probe: a rank's probe must be cheap")


def _json_where(data: bytes, exc: Exception) -> str:
    text = str(exc)
    m = re.search(r"\(byte (\d+)\)", text)
    if not m:
        return text
    offset = int(m[1])
    line = data.count(b"\n", 0, offset) + 1
    col = offset - (data.rfind(b"\n", 0, offset) + 1) + 1
    return f"{text.split(' (byte')[0]} at line {line}, column {col}"


def builtin_dir() -> Path:
    """Where the built-in manifests live: inside the installed package, or the source tree."""
    packaged = Path(str(resources.files("nvpair"))) / "engines"
    if packaged.is_dir():
        return packaged
    return Path(__file__).resolve().parents[3] / "engines"


#: other names people give the built-in kinds (the engine's program, its project's name)
_OTHER_NAMES = {"llamaserver": "llamacpp", "llama": "llamacpp",
                "textgenerationinference": "tgi", "openaicompatible": "openai"}


def kind_meant(kind: str) -> str | None:
    """The built-in kind that ``kind`` is another spelling of (``llama.cpp``, ``vLLM``,
    ``llama-server``: case, dots, dashes and spaces aside), else None."""
    folded = re.sub(r"[^a-z0-9]", "", kind.lower())
    if folded in BUILTIN_KINDS and folded != kind:
        return folded
    return _OTHER_NAMES.get(folded)


def load_manifest(kind_or_path: str, *, base: Path | None = None) -> Manifest:
    """A built-in kind's manifest, or the manifest JSON file at a path (relative to ``base``)."""
    named = Path(kind_or_path).expanduser()
    if base is not None and not named.is_absolute():
        named = base / named
    # a word that is no file is a kind: "vLLM" and "llama.cpp" get "did you mean", not
    # "cannot read manifest"
    if not kind_or_path.endswith(".json") and (
            _KIND.match(kind_or_path) or ("/" not in kind_or_path and not named.is_file())):
        path = builtin_dir() / f"{kind_or_path}.json"
        if not _KIND.match(kind_or_path) or not path.is_file():
            known = ", ".join(sorted(p.stem for p in builtin_dir().glob("*.json")))
            guess = kind_meant(kind_or_path)
            hint = f": did you mean {guess!r}?" if guess else ""
            raise ManifestError(f"unknown engine kind {kind_or_path!r}{hint} (built-in: "
                                f"{known}; a manifest of your own is a path to a .json file)")
        source = f"engines/{kind_or_path}.json"
    else:
        path = named
        source = str(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ManifestError(f"{source}: cannot read manifest: {exc.strerror}") from None
    # Manifests are frozen: a config with 1,000 engines of one kind shares one decoded
    # manifest (about 4.4 KB each when every engine decoded its own). Keyed by the bytes,
    # so an edited file is decoded again.
    key = (source, data)
    manifest = _DECODED.get(key)
    if manifest is None:
        manifest = decode_manifest(data, source)
        if len(_DECODED) >= _DECODED_MAX:
            _DECODED.pop(next(iter(_DECODED)))
        _DECODED[key] = manifest
    return manifest


#: manifests decoded so far, by (source, bytes): a few kinds in practice, bounded anyway.
_DECODED: dict[tuple[str, bytes], Manifest] = {}
_DECODED_MAX = 64
