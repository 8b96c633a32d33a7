"""What a simulator is told: its kind and knobs.

Defaults here are the Python API's and are fast for tests (no load, no warm-up). The CLI
(:mod:`nvpair.sim.cli`) uses the spec's slower defaults for ``load_s``, ``warmup_s``,
``startup_s`` and ``stop_s``; everything else is the same.
"""

from __future__ import annotations

from typing import Literal, NamedTuple, get_args

import msgspec

from nvpair.sim.faults import Fault

Kind = Literal["sglang", "vllm", "llamacpp", "ollama", "tgi", "openai"]
KINDS: tuple[str, ...] = get_args(Kind)

#: ``cold`` (no process yet) is not a phase a running simulator can be in.
Phase = Literal["loading", "warming", "ready", "busy", "unhealthy", "hung", "dead", "stopping"]
PHASES: tuple[str, ...] = get_args(Phase)

#: SGLang surface versions: 0.5.2x, mid-2025 (generating /health, no /ready), legacy (2025h1).
Profile = Literal["current", "mid-2025", "legacy"]
PROFILES: tuple[str, ...] = get_args(Profile)

WorkerLoss = Literal["hung", "dead", "ignore"]


class KindDefaults(NamedTuple):
    port: int
    model: str
    version: str


KIND_DEFAULTS: dict[str, KindDefaults] = {
    "sglang": KindDefaults(30000, "Qwen/Qwen2.5-7B-Instruct", "0.5.23"),
    "vllm": KindDefaults(8000, "Qwen/Qwen2.5-7B-Instruct", "0.33.0"),
    "llamacpp": KindDefaults(8080, "/models/qwen2.5-7b-instruct-q4_k_m.gguf", "b6000-0c1e5709"),
    "ollama": KindDefaults(11434, "llama3.2:latest", "0.33.0"),
    "tgi": KindDefaults(3000, "meta-llama/Llama-3.1-8B-Instruct", "3.3.7"),
    "openai": KindDefaults(8000, "sim-model", "1.0.0"),
}


class SimOptions(msgspec.Struct, frozen=True, kw_only=True):
    """Every knob of a simulator. Times are seconds."""

    kind: Kind
    host: str = "127.0.0.1"
    #: engine port; 0 picks a free one (reserved before ``serve_sim`` reports started).
    port: int = 0
    #: control port; 0 picks a free one, None runs no control server.
    control_port: int | None = 0

    # identity
    #: model path or id; None means the kind's default.
    model: str | None = None
    #: the served name (SGLang/vLLM --served-model-name, llama.cpp --alias); default: model.
    served_name: str | None = None
    #: Ollama's installed models; None means just ``model``; () means none installed.
    models: tuple[str, ...] | None = None
    #: engine version (llama.cpp: the build_info string); None means the kind's default.
    version: str | None = None
    api_key: str | None = None
    profile: Profile = "current"

    # lifecycle
    load_s: float = 0.0
    warmup_s: float = 0.0
    #: Ollama: how long until it listens.
    startup_s: float = 0.0
    #: SGLang: how long /health* answer 503 after SIGTERM before the process exits.
    stop_s: float = 0.0
    #: exit with this code when loading ends (None: load succeeds).
    fail_on_load: int | None = None
    crash_after_s: float | None = None
    hang_after_s: float | None = None
    #: vLLM and TGI: how long the dead phase answers 503 before the process exits (code 1).
    exit_after_dead_s: float = 1.0
    #: initial fault, as if set through the control port once the simulator starts.
    fault: Fault | None = None

    # costs
    #: SGLang: one round of the generating health probe (its 1 s sleep).
    health_tick_s: float = 1.0
    #: SGLang: SGLANG_HEALTH_CHECK_TIMEOUT.
    health_timeout_s: float = 20.0
    #: SGLang: SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION.
    health_generation: bool = True
    #: one engine step; queued endpoints wait for its end while busy.
    decode_step_s: float = 0.05
    #: vLLM: extra latency on every request while busy (event-loop starvation).
    loop_lag_s: float = 0.0
    #: TGI: the device health round trip when idle.
    device_probe_s: float = 0.0
    #: time to the first token; also TGI's model-probe latency.
    prefill_s: float = 0.0
    #: streaming speed, tokens per second.
    token_rate: float = 200.0
    #: completion length when the request sets no max_tokens.
    max_tokens: int = 16
    context_length: int = 4096
    embedding_dim: int = 8
    #: Ollama: /api/tags walks the model store this long.
    tags_scan_s: float = 0.0
    #: Ollama: loading a model on first use.
    model_load_s: float = 0.0
    #: Ollama: default keep-alive of a loaded model (OLLAMA_KEEP_ALIVE).
    ollama_keep_alive_s: float = 300.0

    # capacity and switches
    #: llama.cpp: slots (-np); None is llama-server's auto: 4 slots sharing one (unified) KV
    #: cache, so each reports the whole context.
    np: int | None = None
    #: llama.cpp --kv-unified: every slot's n_ctx is the whole context; None: unified only
    #: with the auto slot count (an explicit -np N gives each slot context_length // N).
    kv_unified: bool | None = None
    #: llama.cpp router mode (nvpair.sim.llamacpp_router): --models-dir, whose ``*.gguf``
    #: are its models; None: a single-model server
    models_dir: str | None = None
    #: llama.cpp --models-max: models loaded at once (0: no limit)
    models_max: int = 4
    #: llama.cpp --models-autoload / --no-models-autoload
    models_autoload: bool = True
    #: llama.cpp router: evict the least recently used model by count even with requests in
    #: flight, cutting them, as older builds did (not the build the tests run)
    router_evict_busy: bool = False
    #: llama.cpp --no-slots: /slots answers 501.
    no_slots: bool = False
    #: llama.cpp --embeddings: serve /v1/embeddings (501 without).
    embeddings: bool = False
    #: llama.cpp --pooling; /v1/embeddings answers 400 unless it pools (mean, cls, last, ...).
    pooling: str | None = None
    #: llama.cpp's web UI at / (--no-webui: 404 there, and /props says ``"ui": false``).
    webui: bool = True
    #: SGLang --enable-metrics, llama.cpp --metrics (vLLM and TGI always serve /metrics).
    metrics: bool = False
    #: TGI --max-concurrent-requests (429 beyond).
    max_concurrent: int = 128
    #: Ollama OLLAMA_MAX_QUEUE (503 beyond).
    max_queue: int = 512

    # multi-node
    nnodes: int = 1
    node_rank: int = 0
    #: rank 0 binds this "host:port" for workers to join (port 0 picks); ranks >= 1 connect.
    dist_init_addr: str | None = None
    #: rank 0: workers that must be ready before it is; None means nnodes - 1.
    wait_workers: int | None = None
    #: vLLM --headless: no HTTP listener at all.
    headless: bool = False
    #: rank 0 when a joined worker's link drops after it was ready.
    on_worker_loss: WorkerLoss = "hung"

    # process
    #: child processes (sleepers in the same process group), like SGLang's rank processes.
    spawn_children: int = 0
    #: leave the children running when the simulator exits (for process-group tests; CLI).
    leave_children: bool = False
    children_ignore_sigterm: bool = False
    child_lifetime_s: float = 3600.0
    #: crash with os._exit (the CLI sets this); in-process a crash only ends serve_sim.
    hard_exit: bool = False
    #: idle keep-alive connections are closed after this long; None: the kind's own (llama.cpp
    #: 5 s, the others 30 s).
    idle_timeout_s: float | None = None

    # sleep (nvpair.sim.sleep)
    #: llama.cpp --sleep-idle-seconds: asleep after this long without a task (None: never)
    sleep_idle_s: float | None = None
    #: vLLM --enable-sleep-mode; its routes need ``dev_mode`` too (VLLM_SERVER_DEV_MODE=1)
    enable_sleep_mode: bool = False
    #: vLLM VLLM_SERVER_DEV_MODE=1: the dev routes (/sleep, /wake_up, /is_sleeping) exist
    dev_mode: bool = False
    #: SGLang --enable-memory-saver: release_memory_occupation and resume work
    enable_memory_saver: bool = False
    #: how long waking takes (weights and KV cache back in place)
    wake_s: float = 0.0

    # memory (nvpair.sim.leak: allocated and touched, so resident)
    #: a baseline footprint held from the start, MiB
    resident_mb: float = 0.0
    #: a steady leak, MiB a second
    leak_mb_per_s: float = 0.0
    #: bytes leaked per request answered (probes too)
    leak_bytes_per_request: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown kind {self.kind!r}; one of {', '.join(KINDS)}")
        if self.profile not in PROFILES:
            raise ValueError(f"unknown profile {self.profile!r}; one of {', '.join(PROFILES)}")
        if self.token_rate <= 0:
            raise ValueError("token_rate must be > 0")
        if self.decode_step_s <= 0:
            raise ValueError("decode_step_s must be > 0")
        if self.health_tick_s <= 0:
            raise ValueError("health_tick_s must be > 0")
        if self.np is not None and self.np < 1:
            raise ValueError("np must be >= 1 (None: auto)")
        if not 0 <= self.node_rank < max(self.nnodes, 1):
            raise ValueError("node_rank must be in [0, nnodes)")
        if self.wake_s < 0:
            raise ValueError("wake_s must be >= 0")
        if min(self.resident_mb, self.leak_mb_per_s, self.leak_bytes_per_request) < 0:
            raise ValueError("resident_mb, leak_mb_per_s and leak_bytes_per_request must be >= 0")

    @property
    def model_name(self) -> str:
        return self.model if self.model is not None else KIND_DEFAULTS[self.kind].model

    @property
    def served(self) -> str:
        return self.served_name if self.served_name is not None else self.model_name

    @property
    def engine_version(self) -> str:
        return self.version if self.version is not None else KIND_DEFAULTS[self.kind].version

    @property
    def is_head(self) -> bool:
        return self.nnodes > 1 and self.node_rank == 0

    @property
    def is_worker(self) -> bool:
        return self.nnodes > 1 and self.node_rank >= 1

    @property
    def workers_needed(self) -> int:
        return self.wait_workers if self.wait_workers is not None else max(self.nnodes - 1, 0)
