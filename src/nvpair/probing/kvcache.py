"""An engine's KV-cache use, read from its own ``/metrics``: opt in, per engine.

An inference gateway's endpoint picker weighs servers by their KV-cache use
(docs/metrics.md). Where the engine exports it as a Prometheus gauge (the manifest's
``kv_cache``: vLLM ``vllm:kv_cache_usage_perc``, SGLang ``sglang:token_usage`` with
``--enable-metrics``, llama-server ``llamacpp:kv_cache_usage_ratio`` with ``--metrics``),
``watch_kv_cache`` reads it every ``kv_cache_probe_s`` seconds on a connection of its own
and puts it on the board (``EngineState.kv_cache_usage``, a ratio 0-1).

It is never a health signal: an answer that fails, times out or has no such gauge makes
the reading unknown (None) and nothing else; the engine's state is its probes'. A reading
is one GET of a bounded body (``MAX_BODY``); vLLM's ``/metrics`` is 20-60 KB.
"""

from __future__ import annotations

import logging
import math
from functools import partial

import msgspec
import trio

from nvpair.config.settings import EngineSpec
from nvpair.probing.oneshot import ExchangeError, Target, exchange
from nvpair.state.snapshot import Board, EngineState

log = logging.getLogger("nvpair.probing")

#: the largest /metrics body read (an engine's with many models or LoRA adapters is bigger
#: than vLLM's usual 20-60 KB; past this the reading is unknown)
MAX_BODY = 4 * 1024 * 1024


def gauge_value(body: bytes, name: str) -> float | None:
    """The value of gauge ``name`` in a Prometheus text exposition, the largest of its
    series (an engine with several data-parallel ranks exports one each: the fullest one
    limits it); None when it has none, or none that is a finite number."""
    want = name.encode()
    best: float | None = None
    for line in body.split(b"\n"):
        if not line.startswith(want):
            continue
        rest = line[len(want):]
        if rest[:1] == b"{":
            end = rest.rfind(b"}")
            if end < 0:
                continue
            rest = rest[end + 1:]
        elif rest[:1] not in (b" ", b"\t"):
            continue  # (another metric whose name begins with this one's)
        fields = rest.split()
        if not fields:
            continue
        try:
            value = float(fields[0])
        except ValueError:
            continue
        if math.isfinite(value) and (best is None or value > best):
            best = value
    return best


async def read_kv_cache(spec: EngineSpec) -> float | None:
    """One reading of the engine's KV-cache use (a ratio, 0-1), or None (unknown)."""
    kv = spec.manifest.kv_cache
    if kv is None:
        return None
    host = f"[{spec.host}]" if ":" in spec.host else spec.host
    try:
        status, body = await exchange(Target(spec.host, spec.port), "GET", kv.path,
                                      [(b"host", f"{host}:{spec.port}".encode())],
                                      max_body=MAX_BODY)
    except (ExchangeError, OSError) as exc:
        log.debug("engine %s: cannot read %s: %s", spec.name, kv.path, exc)
        return None
    if status != 200:
        return None
    # parsed off the loop: a walk of every line of a 4 MiB exposition took 7 ms (vLLM's
    # usual 20-60 KB: under 0.1 ms), and the thread's hop is paid once a reading
    value = await trio.to_thread.run_sync(gauge_value, body, kv.gauge)
    return None if value is None else min(max(value, 0.0), 1.0)


async def watch_kv_cache(spec: EngineSpec, board: Board, every_s: float) -> None:
    """Read the engine's KV-cache use every ``every_s`` (each read bounded by the same
    time) and publish it when it changes, until cancelled. Raises: nothing but
    Cancelled (a failed read is an unknown reading)."""
    timeout = min(every_s, 5.0)
    while True:
        began = trio.current_time()
        value = None
        with trio.move_on_after(timeout):
            value = await read_kv_cache(spec)
        board.update(spec.name, partial(_with, value=value))
        await trio.sleep_until(began + every_s)


def _with(e: EngineState, value: float | None) -> EngineState:
    if e.kv_cache_usage == value:
        return e  # (the same reading: no new snapshot)
    return msgspec.structs.replace(e, kv_cache_usage=value)
