"""``nvpair sim KIND`` (also ``python -m nvpair.sim KIND``): one simulated engine as a process.

Prints one line once the ports are known, for example
``sim sglang listening on 127.0.0.1:30000 control 127.0.0.1:40000``
(the engine port may still refuse connects while the simulated model loads), and then one
log line per phase change on stderr. SIGTERM and SIGINT shut down the way the engine does
(SGLang: 503 on /health* for ``--stop-s``) and exit 0; a second signal exits at once.
CLI defaults follow the spec (load 2 s, warm-up 1 s, Ollama start 0.2 s); the Python API's
defaults are 0 so tests are fast.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import AsyncIterator, Sequence

import trio

from nvpair.sim.faults import FAULT_MODES, GARBAGE_KINDS, Fault
from nvpair.sim.handle import SimHandle
from nvpair.sim.options import KIND_DEFAULTS, KINDS, PROFILES, SimOptions
from nvpair.sim.serve import serve_sim

log = logging.getLogger("nvpair.sim")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="nvpair sim", description="Run a simulated inference engine.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("kind", choices=KINDS)
    add = p.add_argument_group("ports").add_argument
    add("--host", "--hostname", default="127.0.0.1")
    add("--port", type=int, default=None, help="engine port (default: the kind's; 0 picks)")
    add("--control-port", type=int, default=0, help="control port (0 picks)")
    add("--no-control", action="store_true", help="run no control server")

    add = p.add_argument_group("identity").add_argument
    add("--model", "--model-path", "--model-id", "-m", default=None)
    add("--served-model-name", "--alias", "-a", dest="served_name", default=None)
    add("--models", default=None,
        help="Ollama: installed models, comma-separated ('' for none)")
    add("--engine-version", "--version", dest="engine_version", default=None,
        help="the version the engine reports (llama.cpp: its build_info)")
    add("--api-key", default=None,
        help="key(s), comma-separated (vLLM: also VLLM_API_KEY from the environment)")
    add("--api-key-file", default=None, metavar="FNAME",
        help="llama.cpp: a file of keys, one a line")
    add("--profile", choices=PROFILES, default="current", help="SGLang surface version")

    add = p.add_argument_group("lifecycle").add_argument
    add("--load-s", type=float, default=2.0)
    add("--warmup-s", type=float, default=1.0)
    add("--skip-server-warmup", action="store_true", help="SGLang: warm-up of 0 s")
    add("--startup-s", type=float, default=0.2, help="Ollama: time until it listens")
    add("--stop-s", type=float, default=0.5, help="SGLang: 503 on /health* before exiting")
    add("--fail-on-load", type=int, default=None, metavar="CODE")
    add("--crash-after-s", type=float, default=None)
    add("--hang-after-s", type=float, default=None)
    add("--exit-after-dead-s", type=float, default=1.0)
    add("--ignore-sigterm", action="store_true",
        help="log SIGTERM and keep running (as an SGLang rank >= 1 does); SIGINT still stops")

    add = p.add_argument_group("costs").add_argument
    add("--health-tick-s", type=float, default=1.0)
    add("--health-timeout-s", type=float,
        default=float(os.environ.get("SGLANG_HEALTH_CHECK_TIMEOUT", "20")))
    add("--no-health-generation", action="store_true",
        help="SGLang: cheap /health (also SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=0)")
    add("--decode-step-s", type=float, default=0.05)
    add("--loop-lag-s", type=float, default=0.0)
    add("--device-probe-s", type=float, default=0.0)
    add("--prefill-s", type=float, default=0.0)
    add("--token-rate", type=float, default=50.0)
    add("--max-tokens", type=int, default=16)
    add("--context-length", "-c", "--ctx-size", dest="context_length", type=int, default=4096)
    add("--embedding-dim", type=int, default=8, help="length of an embedding vector")
    add("--tags-scan-s", type=float, default=0.05)
    add("--model-load-s", type=float, default=0.5)
    add("--keep-alive-s", type=float, default=300.0, help="Ollama: OLLAMA_KEEP_ALIVE")

    add = p.add_argument_group("capacity").add_argument
    add("-np", "--np", "--parallel", dest="np", type=int, default=None,
        help="llama.cpp slots (default, or -1: auto, 4 slots with a unified KV cache)")
    add("--kv-unified", "-kvu", dest="kv_unified", action="store_true", default=None)
    add("--no-kv-unified", "-no-kvu", dest="kv_unified", action="store_false")
    add("--models-dir", default=None, help="llama.cpp: router mode over this dir's *.gguf")
    add("--models-max", type=int, default=4, help="llama.cpp router: models loaded at once")
    add("--models-autoload", dest="models_autoload", action="store_true", default=True)
    add("--no-models-autoload", dest="models_autoload", action="store_false",
        help="llama.cpp router: load only on POST /models/load")
    add("--router-evict-busy", action="store_true",
        help="llama.cpp router: evict by count with requests in flight (older builds)")
    add("--no-slots", action="store_true")
    add("--slots", action="store_false", dest="no_slots", help="llama.cpp: the default")
    add("--embeddings", "--embedding", action="store_true", help="llama.cpp: /v1/embeddings")
    add("--pooling", default=None, help="llama.cpp: embeddings pooling (mean, cls, last, ...)")
    add("--no-webui", "--no-ui", dest="webui", action="store_false", help="llama.cpp: no / UI")
    add("--webui", "--ui", dest="webui", action="store_true", default=True)
    # llama-server flags a manifest template passes: accepted and ignored.
    add("-t", "--threads", type=int, default=None, help="ignored (llama.cpp)")
    add("-ngl", "--n-gpu-layers", "--gpu-layers", type=str, default=None,
        help="ignored (llama.cpp)")
    add("--metrics", "--enable-metrics", action="store_true")
    add("--max-concurrent-requests", type=int, default=128)
    add("--max-queue", type=int, default=512)

    add = p.add_argument_group("multi-node").add_argument
    add("--nnodes", type=int, default=1)
    add("--node-rank", type=int, default=0)
    add("--dist-init-addr", "--nccl-init-addr", default=None, metavar="HOST:PORT")
    add("--master-addr", default=None, help="vLLM: with --master-port, the dist address")
    add("--master-port", type=int, default=None)
    add("--wait-workers", type=int, default=None)
    add("--headless", action="store_true")
    add("--on-worker-loss", choices=("hung", "dead", "ignore"), default="hung")

    add = p.add_argument_group("faults").add_argument
    add("--fault", choices=FAULT_MODES, default=None, help="initial fault")
    add("--fault-paths", default="", help="comma-separated paths (default: all)")
    add("--fault-seconds", type=float, default=None)
    add("--fault-status", type=int, default=None)
    add("--fault-exit-code", type=int, default=None)
    add("--fault-model", default=None)
    add("--fault-kind", choices=GARBAGE_KINDS, default=None, help="what the garbage fault sends")

    add = p.add_argument_group("processes").add_argument
    add("--spawn-children", type=int, default=0, metavar="N")
    add("--leave-children", action="store_true", help="children outlive the simulator")
    add("--children-ignore-sigterm", action="store_true")
    add("--child-lifetime-s", type=float, default=3600.0)
    add("--idle-timeout-s", type=float, default=None,
        help="close idle keep-alive connections (default: the kind's, llama.cpp 5 s, else 30 s)")
    add("--log-level", default="INFO")

    add = p.add_argument_group("sleep").add_argument
    add("--sleep-idle-seconds", type=float, default=-1.0,
        help="llama.cpp: sleep after this long without a task (-1: never)")
    add("--enable-sleep-mode", action="store_true",
        help="vLLM: /sleep, /wake_up, /is_sleeping (with VLLM_SERVER_DEV_MODE=1)")
    add("--enable-memory-saver", action="store_true",
        help="SGLang: release_memory_occupation and resume_memory_occupation")
    add("--wake-s", type=float, default=0.0, help="how long waking takes")

    add = p.add_argument_group("memory").add_argument
    add("--resident-mb", type=float, default=0.0, help="a baseline footprint held from the start")
    add("--leak-mb-per-s", type=float, default=0.0, help="leak this many MiB a second")
    add("--leak-bytes-per-request", type=int, default=0, help="leak this much per request")
    return p


def options_from_args(args: argparse.Namespace) -> SimOptions:
    kind = args.kind
    port = args.port
    if port is None and kind == "ollama" and "OLLAMA_HOST" in os.environ:
        host, _, port_text = os.environ["OLLAMA_HOST"].rpartition(":")
        args.host, port = host or args.host, int(port_text)
    dist = args.dist_init_addr
    if dist is None and args.master_port is not None:
        dist = f"{args.master_addr or '127.0.0.1'}:{args.master_port}"
    fault = None
    if args.fault is not None:
        fault = Fault(
            args.fault, paths=tuple(p for p in args.fault_paths.split(",") if p),
            seconds=args.fault_seconds, status=args.fault_status,
            exit_code=args.fault_exit_code, model=args.fault_model, kind=args.fault_kind,
        )
    generation_env = os.environ.get("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "true")
    api_key = api_keys(kind, args.api_key, args.api_key_file)
    return SimOptions(
        kind=kind, host=args.host,
        port=KIND_DEFAULTS[kind].port if port is None else port,
        control_port=None if args.no_control else args.control_port,
        model=args.model, served_name=args.served_name,
        models=None if args.models is None else tuple(m for m in args.models.split(",") if m),
        version=args.engine_version, api_key=api_key, profile=args.profile,
        # (a router has no model of its own to load: it answers at once)
        load_s=0.0 if args.models_dir else args.load_s,
        warmup_s=0.0 if args.skip_server_warmup or args.models_dir else args.warmup_s,
        startup_s=args.startup_s, stop_s=args.stop_s, fail_on_load=args.fail_on_load,
        crash_after_s=args.crash_after_s, hang_after_s=args.hang_after_s,
        exit_after_dead_s=args.exit_after_dead_s, fault=fault,
        health_tick_s=args.health_tick_s, health_timeout_s=args.health_timeout_s,
        health_generation=not args.no_health_generation
        and generation_env.lower() not in ("0", "false", "no"),
        decode_step_s=args.decode_step_s, loop_lag_s=args.loop_lag_s,
        device_probe_s=args.device_probe_s, prefill_s=args.prefill_s,
        token_rate=args.token_rate, max_tokens=args.max_tokens,
        context_length=args.context_length, embedding_dim=args.embedding_dim,
        tags_scan_s=args.tags_scan_s,
        model_load_s=args.model_load_s, ollama_keep_alive_s=args.keep_alive_s,
        np=None if args.np is None or args.np < 0 else args.np, kv_unified=args.kv_unified,
        models_dir=args.models_dir, models_max=args.models_max,
        models_autoload=args.models_autoload, router_evict_busy=args.router_evict_busy,
        no_slots=args.no_slots, embeddings=args.embeddings, pooling=args.pooling,
        webui=args.webui, metrics=args.metrics,
        max_concurrent=args.max_concurrent_requests, max_queue=args.max_queue,
        nnodes=args.nnodes, node_rank=args.node_rank, dist_init_addr=dist,
        wait_workers=args.wait_workers, headless=args.headless,
        on_worker_loss=args.on_worker_loss,
        spawn_children=args.spawn_children, leave_children=args.leave_children,
        children_ignore_sigterm=args.children_ignore_sigterm,
        child_lifetime_s=args.child_lifetime_s, hard_exit=True,
        idle_timeout_s=args.idle_timeout_s,
        resident_mb=args.resident_mb, leak_mb_per_s=args.leak_mb_per_s,
        leak_bytes_per_request=args.leak_bytes_per_request,
        sleep_idle_s=None if args.sleep_idle_seconds < 0 else args.sleep_idle_seconds,
        enable_sleep_mode=args.enable_sleep_mode,
        dev_mode=os.environ.get("VLLM_SERVER_DEV_MODE", "0") not in ("", "0"),
        enable_memory_saver=args.enable_memory_saver, wake_s=args.wake_s,
    )


def api_keys(kind: str, given: str | None, key_file: str | None) -> str | None:
    """The keys the engine takes, as the real one reads them (comma-joined: the simulator
    splits them on commas, as llama-server's ``--api-key`` does).

    vLLM: ``--api-key``, else ``VLLM_API_KEY``. llama-server: ``--api-key`` and each
    non-empty line of ``--api-key-file``, as it is (only the newline ends it). No other
    kind reads a key from a file or from its environment. Raises ValueError (one line)."""
    keys = [k for k in (given or "").split(",") if k]
    if kind == "vllm" and not keys:
        keys = [k for k in [os.environ.get("VLLM_API_KEY", "")] if k]
    if key_file is not None:
        if kind != "llamacpp":
            raise ValueError("--api-key-file: only llama.cpp's llama-server takes a key file")
        try:
            with open(key_file, "rb") as f:
                keys += [line.decode() for line in f.read().split(b"\n") if line]
        except (OSError, UnicodeDecodeError):
            raise ValueError(f"error: failed to open file '{key_file}'") from None
    return ",".join(keys) or None


def banner(handle: SimHandle) -> str:
    host = handle.options.host
    where = "headless (no port)" if handle.port == 0 else f"listening on {host}:{handle.port}"
    control = "none" if handle.control_port is None else f"{host}:{handle.control_port}"
    line = f"sim {handle.kind} {where} control {control}"
    if handle.dist_port is not None:
        line += f" dist {host}:{handle.dist_port}"
    return line


async def _run(options: SimOptions, ignore_sigterm: bool) -> int:
    code = 0
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:
            handle: SimHandle = await nursery.start(serve_sim, options)
            print(banner(handle), flush=True)
            nursery.start_soon(_on_signals, signals, handle, ignore_sigterm, nursery.cancel_scope)
            code = await handle.wait_exited()
            nursery.cancel_scope.cancel(reason="simulator exited")
    return code


async def _on_signals(
    signals: AsyncIterator[int], handle: SimHandle, ignore_sigterm: bool,
    scope: trio.CancelScope,
) -> None:
    stopping = False
    async for signum in signals:
        if signum == signal.SIGTERM and ignore_sigterm:
            log.info("SIGTERM received: ignored (--ignore-sigterm)")
            continue
        if stopping:
            log.info("second signal: exiting now")
            scope.cancel(reason="second signal")
            return
        log.info("%s received: shutting down", signal.Signals(signum).name)
        stopping = True
        handle.stop()


def main(argv: Sequence[str] | None = None) -> int:
    if argv is not None and list(argv[:1]) == ["farm"]:  # many engines in one process
        from nvpair.sim import farm
        return farm.main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        options = options_from_args(args)
    except ValueError as exc:
        print(f"nvpair sim: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=args.log_level.upper(), stream=sys.stderr,
        format=f"%(asctime)s sim {args.kind}: %(message)s",
    )
    try:
        return trio.run(_run, options, args.ignore_sigterm)
    except KeyboardInterrupt:
        return 130
