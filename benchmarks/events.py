"""Scenario "events": what 64 ``GET /v1/events`` streams cost nvpair, and how soon a change
reaches them.

nvpair runs as a process (this module's ``serve``: ``nvpair.service.run`` beside a task that
changes one engine's content ``RATE`` times a second, writing the wall time of the change
into the engine's ``exit_code`` (microseconds, modulo 1,000 s), which every ``engine`` event
carries and probes of an adopted engine never touch) with four simulated
engines, each its own process. The orchestrator holds 64 streams open and reads
``/v1/models`` 20 times a second beside them; a change's latency is the time its event
arrived on a stream minus the time it was published (one machine, one clock). The same
window without streams gives nvpair's CPU and the read latency as they are without them.

``python -m benchmarks.events [--quick]`` runs it alone and prints the numbers.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import httpx2
import msgspec
import trio

from benchmarks.config import BenchConfig, run_alone
from benchmarks.procs import PY, CpuMeter, Procs, engine_toml, free_port, start_sim, wait_http

STREAMS = 64
ENGINES = 4
#: content changes a second, spread over the engines
RATE = 10.0
READS_PER_S = 20.0
WRAP_S = 1000.0


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(len(xs) * q))] * 1000, 2)


async def _window(url: str, seconds: float, streams: int) -> dict[str, Any]:
    delays: list[float] = []
    reads: list[float] = []
    events = 0
    opened = trio.Event()
    open_count = 0

    async def stream(client: httpx2.AsyncClient) -> None:
        nonlocal events, open_count
        async with client.stream("GET", "/v1/events?types=engine") as r:
            buffer = b""
            async for chunk in r.aiter_raw():
                if open_count != streams and b"snapshot" in chunk:
                    open_count += 1
                    if open_count == streams:
                        opened.set()
                now = time.time()
                buffer += chunk
                *frames, buffer = buffer.split(b"\n\n")
                for frame in frames:
                    data = frame.rpartition(b"data: ")[2]
                    if b"event: engine\n" not in frame:
                        continue
                    stamp = msgspec.json.decode(data).get("exit_code")
                    if stamp is None:
                        continue
                    events += 1
                    delays.append((now % WRAP_S - stamp / 1e6) % WRAP_S)

    async def reader(client: httpx2.AsyncClient, until: float) -> None:
        while trio.current_time() < until:
            t0 = time.perf_counter()
            r = await client.get("/v1/models")
            reads.append(time.perf_counter() - t0)
            assert r.status_code == 200
            await trio.sleep(1 / READS_PER_S)

    limits = httpx2.Limits(max_connections=STREAMS + 8)
    async with httpx2.AsyncClient(base_url=url, limits=limits, timeout=30.0,
                                  trust_env=False) as client, trio.open_nursery() as nursery:
        for _ in range(streams):
            nursery.start_soon(stream, client)
        if streams:
            with trio.fail_after(30):
                await opened.wait()
        meter = pid_meter()
        await reader(client, trio.current_time() + seconds)
        cpu = meter.read() if meter else {}
        nursery.cancel_scope.cancel()
    return {"streams": streams, "seconds": seconds, **cpu,
            "reads": len(reads), "read_p50_ms": _pct(reads, 0.5),
            "read_p99_ms": _pct(reads, 0.99), "events": events,
            "change_to_wire_p50_ms": _pct(delays, 0.5),
            "change_to_wire_p99_ms": _pct(delays, 0.99),
            "change_to_wire_max_ms": _pct(delays, 1.0)}


_PID: int | None = None


def pid_meter() -> CpuMeter | None:
    return None if _PID is None else CpuMeter(_PID)


def run(cfg: BenchConfig, workdir: Path) -> dict[str, Any]:
    """The scenario: a window without streams, then one with ``STREAMS``."""
    global _PID
    window = 2.5 if cfg.quick else 20.0
    with Procs(workdir) as procs:
        engines = ""
        for i in range(ENGINES):
            _, port, _ = start_sim(procs, f"sim-{i}", "vllm", model=f"m{i}")
            engines += engine_toml(f"e{i}", "vllm", port)
        port = free_port()
        config = workdir / "events.toml"
        config.write_text(f"listen = '127.0.0.1:{port}'\nnode = 'bench'\n"
                          f"log_dir = '{workdir / 'logs'}'\n{engines}")
        proc = procs.start("nvpair-events", [PY, "-m", "benchmarks.events", "serve",
                                             str(config)])
        url = f"http://127.0.0.1:{port}"
        wait_http(f"{url}/healthz", proc)
        _PID = proc.pid
        time.sleep(1.0)  # the first probes and listings are in
        try:
            quiet = trio.run(_window, url, window, 0)
            busy = trio.run(_window, url, window, STREAMS)
        finally:
            _PID = None
    return {"rate_per_s": RATE, "engines": ENGINES, "without_streams": quiet,
            "with_streams": busy,
            "stream_cpu_pct": round(busy.get("cpu_pct", 0.0) - quiet.get("cpu_pct", 0.0), 2)}


def stamped(e: Any) -> Any:
    return msgspec.structs.replace(e, exit_code=int(time.time() % WRAP_S * 1e6))


async def serve(config: str) -> None:
    """nvpair, and a change of one engine's content ``RATE`` times a second."""
    from nvpair import service
    from nvpair.config.settings import load_settings

    settings = load_settings(config)
    async with trio.open_nursery() as nursery:
        running: service.Running = await nursery.start(service.run, settings)
        names = [e.name for e in settings.engines]
        i = 0
        start = trio.current_time()
        while True:
            i += 1
            await trio.sleep_until(start + i / RATE)
            running.board.update(names[i % len(names)], stamped)


def main(argv: list[str]) -> int:
    if argv[:1] == ["serve"]:
        trio.run(serve, argv[1])
        return 0
    return run_alone("python -m benchmarks.events", run, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

