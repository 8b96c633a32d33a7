"""The OpenAI front door: direct to the engine against through nvpair (and LiteLLM).

``python -m benchmarks.router [--quick] [--litellm [--litellm-venv DIR]] [--upstream sim]
[--tracing]``

Three upstreams, each in its own process, are adopted by one ``nvpair serve`` process:

* ``fast``: answers a non-streaming request at once; non-streaming latency (1 client) and
  throughput (8 clients), the CPU nvpair spends per request;
* ``paced``: streams 32 chunks 10 ms apart; streaming time to first byte, total time and
  the largest gap between chunks, at 1 and 8 clients;
* ``burst``: streams ``max_tokens`` chunks back to back; chunks per second one stream gets
  through, and nvpair's CPU per chunk.

The upstream is by default the fast fake of ``benchmarks/upstream.py`` (kind ``openai``),
the same shape as the Go server the router reference measured its targets against: it
costs ~0.1 ms of CPU per request, so on two cores the proxy's own cost is what shows.
``--upstream sim`` uses the vLLM simulator instead (``fast`` is then 2,000 tokens/s x 32,
16 ms a request; ``paced`` 100 tokens/s): closer to an engine, but ~2.5 ms of CPU per
request, which the proxy, the simulators and the load generator then share.

Every measurement runs in rounds that go round the targets in turn (direct, nvpair, and
LiteLLM with ``--litellm``), so the machine's noise falls on all of them; the headline is the
ratio (or the difference) against direct. The load generator is a minimal Trio HTTP/1.1
client (a POST, a Content-Length or a chunked answer), so it costs little CPU.

``--tracing`` adds two more nvpair processes, each with ``[tracing]`` at ``sample_ratio``
1.0: ``traced`` exports to a collector that answers, ``hung`` to one that reads and never
answers (both ``benchmarks/collector.py``, processes of their own); the first nvpair has
tracing off. Their added latency and throughput are against that one, in the same rounds.

``--quick`` takes about 40 s (about 65 s with ``--litellm``, whose start alone takes ~12 s).
Writes ``benchmarks/results/router.json`` (``router-quick.json`` with ``--quick``). Targets
(from the router reference, "Recommended goals") are printed as met or not met.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from benchmarks.procs import (
    PY,
    ROOT,
    CpuMeter,
    Proc,
    Procs,
    engine_toml,
    free_port,
    machine,
    start_nvpair,
    start_sim,
    wait_http,
)

MODELS = {"fast": "bench-fast", "paced": "bench-paced", "burst": "bench-burst"}
FAKE_ARGS = {
    "fast": ("--tokens", "32"),
    "paced": ("--tokens", "32", "--gap-ms", "10"),
    "burst": ("--tokens", "32", "--gap-ms", "0"),
}
SIM_ARGS = {
    "fast": ("--token-rate", "2000", "--max-tokens", "32"),
    "paced": ("--token-rate", "100", "--max-tokens", "32"),
    "burst": ("--token-rate", "1000000", "--max-tokens", "32"),
}
CHAT = "/v1/chat/completions"
LITELLM_VENV = Path(os.environ.get("NVBENCH_LITELLM_VENV", "/tmp/nvbench-litellm"))
LITELLM_KEY = "sk-bench-0123456789abcdef0123456789abcdef"
RESULTS = ROOT / "benchmarks" / "results"


# -- a minimal HTTP/1.1 POST client on Trio --------------------------------------------------


class HttpError(Exception):
    """No complete answer."""


@dataclass
class Answer:
    status: int
    body_bytes: int
    events: int  # SSE "data:" events (streams)
    first_byte: float  # seconds from send to the first body byte
    total: float  # seconds from send to the end of the body
    max_gap: float  # largest gap between two body reads (seconds)


class Client:
    """One keep-alive connection; POSTs JSON and reads a Content-Length or chunked answer."""

    def __init__(self, host: str, port: int, headers: dict[str, str] | None = None) -> None:
        self.host = host
        self.port = port
        self.extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        self._stream: trio.SocketStream | None = None
        self._buf = b""
        self._first = self._last = self._gap = 0.0

    async def aclose(self) -> None:
        if self._stream is not None:
            stream, self._stream = self._stream, None
            with trio.CancelScope(shield=True):
                await stream.aclose()

    async def _recv(self, timed: bool = False) -> bytes:
        """One read; with ``timed``, a body read: note the first byte and the largest gap."""
        assert self._stream is not None
        try:
            data = await self._stream.receive_some(65536)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            raise HttpError(f"io: {exc}") from None
        if not data:
            raise HttpError("eof")
        if timed:
            self._note()
        return data

    def _note(self) -> None:
        now = time.perf_counter()
        if self._last:
            self._gap = max(self._gap, now - self._last)
        self._first = self._first or now
        self._last = now

    async def post(self, path: str, body: bytes) -> Answer:
        for attempt in (1, 2):
            reused = self._stream is not None
            try:
                return await self._post_once(path, body)
            except HttpError:
                self._buf = b""
                await self.aclose()
                if attempt == 2 or not reused:
                    raise
        raise AssertionError("unreachable")

    async def _post_once(self, path: str, body: bytes) -> Answer:
        if self._stream is None:
            try:
                self._stream = await trio.open_tcp_stream(self.host, self.port)
            except OSError as exc:
                raise HttpError(f"connect: {exc}") from None
        head = (f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
                f"{self.extra}\r\n").encode()
        start = time.perf_counter()
        try:
            await self._stream.send_all(head + body)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            raise HttpError(f"io: {exc}") from None
        while (end := self._buf.find(b"\r\n\r\n")) < 0:
            self._buf += await self._recv()
        lines = self._buf[:end].split(b"\r\n")
        self._buf = self._buf[end + 4:]
        status = int(lines[0].split(b" ", 2)[1])
        length: int | None = None
        chunked = close = False
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            key, value = name.strip().lower(), value.strip().lower()
            if key == b"content-length":
                length = int(value)
            elif key == b"transfer-encoding" and b"chunked" in value:
                chunked = True
            elif key == b"connection" and value == b"close":
                close = True
        self._first = self._last = self._gap = 0.0
        if self._buf:
            self._note()
        size = events = 0
        if not chunked:
            if length is None:
                raise HttpError("neither content-length nor chunked")
            while len(self._buf) < length:
                self._buf += await self._recv(timed=True)
            size, events = length, self._buf[:length].count(b"data:")
            self._buf = self._buf[length:]
        else:
            while True:
                while (eol := self._buf.find(b"\r\n")) < 0:
                    self._buf += await self._recv(timed=True)
                n = int(self._buf[:eol].split(b";", 1)[0], 16)
                while len(self._buf) < eol + 2 + n + 2:
                    self._buf += await self._recv(timed=True)
                if n:
                    size += n
                    events += self._buf[eol + 2:eol + 2 + n].count(b"data:")
                self._buf = self._buf[eol + 2 + n + 2:]
                if n == 0:
                    break
        done = time.perf_counter()
        if close:
            await self.aclose()
        return Answer(status, size, events, (self._first or done) - start, done - start,
                      self._gap)


def chat_body(model: str, stream: bool, max_tokens: int | None = None) -> bytes:
    doc: dict[str, Any] = {"model": model, "stream": stream,
                           "messages": [{"role": "user", "content": "hi"}]}
    if max_tokens is not None:
        doc["max_tokens"] = max_tokens
    return json.dumps(doc).encode()


# -- targets and load --------------------------------------------------------------------------


@dataclass
class Target:
    name: str
    ports: dict[str, int]  # model -> port that serves it
    pid: int | None  # the process whose CPU is counted (None: not counted)
    headers: dict[str, str] = field(default_factory=dict)

    def client(self, model: str) -> Client:
        return Client("127.0.0.1", self.ports[model], self.headers)


async def sequential(t: Target, model: str, body: bytes, count: int) -> list[Answer]:
    client = t.client(model)
    out = []
    try:
        for _ in range(count):
            out.append(await client.post(CHAT, body))
    finally:
        await client.aclose()
    return out


async def concurrent(t: Target, model: str, body: bytes, clients: int, *,
                     seconds: float | None = None, each: int | None = None, warm: int = 0
                     ) -> tuple[list[Answer], float, int]:
    """``clients`` back-to-back clients, for ``seconds`` or ``each`` requests apiece, after
    ``warm`` untimed requests each (their keep-alive connections open, as in a steady
    closed loop). (answers, wall seconds, errors)."""
    answers: list[Answer] = []
    errors = 0
    deadline = time.perf_counter() + (seconds or 0.0)

    async def one() -> None:
        nonlocal errors
        client = t.client(model)
        done = 0
        try:
            for _ in range(warm):
                await client.post(CHAT, body)
            while (each is not None and done < each) or (
                    seconds is not None and time.perf_counter() < deadline):
                try:
                    answers.append(await client.post(CHAT, body))
                except HttpError:
                    errors += 1
                done += 1
        finally:
            await client.aclose()

    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for _ in range(clients):
            nursery.start_soon(one)
    return answers, time.perf_counter() - start, errors


def cpu_of(pid: int | None) -> CpuMeter | None:
    return CpuMeter(pid) if pid else None


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


@dataclass
class Plan:
    rounds: int
    lat_n: int  # non-stream c=1 requests per round
    tput_s: float  # non-stream c=8 seconds per round
    stream_n: int  # stream c=1 requests per round
    stream8_each: int  # stream c=8 requests per client per round
    burst_n: int  # bursts per round
    burst_tokens: int


QUICK = Plan(rounds=2, lat_n=40, tput_s=1.5, stream_n=6, stream8_each=2, burst_n=2,
             burst_tokens=4000)
FULL = Plan(rounds=5, lat_n=200, tput_s=4.0, stream_n=20, stream8_each=3, burst_n=3,
            burst_tokens=10000)


def bad(a: Answer) -> bool:
    return a.status != 200


async def measure(targets: list[Target], plan: Plan, log: Callable[[str], None]
                  ) -> dict[str, dict[str, Any]]:
    raw: dict[str, dict[str, list[Any]]] = {
        t.name: {k: [] for k in ("lat", "tput", "tput_cpu", "tput_n", "s1_ttfb", "s1_total",
                                 "s1_gap", "s8_ttfb", "s8_total", "s8_gap", "burst_cps",
                                 "burst_cpu", "burst_chunks", "errors")}
        for t in targets}
    mf, mp, mb = MODELS["fast"], MODELS["paced"], MODELS["burst"]
    fast, paced = chat_body(mf, False), chat_body(mp, True)
    burst = chat_body(mb, True, plan.burst_tokens)
    burst_small = chat_body(mb, True, max(500, plan.burst_tokens // 5))
    for t in targets:  # warm up every path (connections, first-request costs)
        await sequential(t, mf, fast, 5)
        await sequential(t, mp, paced, 1)
        await sequential(t, mb, chat_body(mb, True, 200), 1)
    for r in range(plan.rounds):
        order = targets if r % 2 == 0 else targets[::-1]
        for t in order:
            d = raw[t.name]
            lat_n = plan.lat_n if t.name != "litellm" else max(10, plan.lat_n // 4)
            answers = await sequential(t, mf, fast, lat_n)
            d["errors"].append(sum(map(bad, answers)))
            d["lat"] += [a.total for a in answers]
            meter = cpu_of(t.pid)
            answers, wall, errs = await concurrent(t, mf, fast, 8, seconds=plan.tput_s)
            ok = [a for a in answers if not bad(a)]
            d["errors"].append(errs + len(answers) - len(ok))
            d["tput"].append(len(ok) / wall)
            d["tput_n"].append(len(ok))
            if meter:
                d["tput_cpu"].append(meter.read()["cpu_s"])
            answers = await sequential(t, mp, paced, plan.stream_n)
            d["errors"].append(sum(map(bad, answers)))
            d["s1_ttfb"] += [a.first_byte for a in answers]
            d["s1_total"] += [a.total for a in answers]
            d["s1_gap"] += [a.max_gap for a in answers]
            answers, _, errs = await concurrent(t, mp, paced, 8, each=plan.stream8_each,
                                               warm=1)
            d["errors"].append(errs + sum(map(bad, answers)))
            d["s8_ttfb"] += [a.first_byte for a in answers]
            d["s8_total"] += [a.total for a in answers]
            d["s8_gap"] += [a.max_gap for a in answers]
            meter = cpu_of(t.pid)
            slow = t.name == "litellm"  # ~700 chunks/s: a shorter burst, once
            answers = await sequential(t, mb, burst_small if slow else burst,
                                       1 if slow else plan.burst_n)
            d["errors"].append(sum(map(bad, answers)))
            chunks = sum(a.events for a in answers)
            d["burst_cps"] += [a.events / a.total for a in answers if a.total > 0]
            d["burst_chunks"].append(chunks)
            if meter:
                d["burst_cpu"].append(meter.read()["cpu_s"])
            log(f"  round {r + 1}/{plan.rounds} {t.name}: c=1 p50 "
                f"{1000 * statistics.median(d['lat'][-lat_n:]):.2f} ms, "
                f"c=8 {d['tput'][-1]:.0f} req/s, burst "
                f"{d['burst_cps'][-1]:.0f} chunks/s")
    out: dict[str, dict[str, Any]] = {}
    for t in targets:
        d = raw[t.name]
        ms = 1000.0
        summary: dict[str, Any] = {
            "nonstream_c1_p50_ms": round(ms * pct(d["lat"], 0.5), 3),
            "nonstream_c1_p99_ms": round(ms * pct(d["lat"], 0.99), 3),
            "nonstream_c8_req_s": round(statistics.median(d["tput"]), 1),
            "nonstream_c8_req_s_rounds": [round(x, 1) for x in d["tput"]],
            "stream_c1_ttfb_p50_ms": round(ms * pct(d["s1_ttfb"], 0.5), 3),
            "stream_c1_ttfb_p99_ms": round(ms * pct(d["s1_ttfb"], 0.99), 3),
            "stream_c1_total_p50_ms": round(ms * pct(d["s1_total"], 0.5), 3),
            "stream_c1_max_gap_p50_ms": round(ms * pct(d["s1_gap"], 0.5), 3),
            "stream_c8_ttfb_p50_ms": round(ms * pct(d["s8_ttfb"], 0.5), 3),
            "stream_c8_ttfb_p99_ms": round(ms * pct(d["s8_ttfb"], 0.99), 3),
            "stream_c8_total_p50_ms": round(ms * pct(d["s8_total"], 0.5), 3),
            "stream_c8_max_gap_p50_ms": round(ms * pct(d["s8_gap"], 0.5), 3),
            "burst_chunks_s": round(statistics.median(d["burst_cps"]), 0),
            "errors": sum(d["errors"]),
            "samples": {"nonstream_c1": len(d["lat"]), "nonstream_c8": sum(d["tput_n"]),
                        "stream_c1": len(d["s1_ttfb"]), "stream_c8": len(d["s8_ttfb"]),
                        "burst_chunks": sum(d["burst_chunks"])},
        }
        if d["tput_cpu"] and sum(d["tput_n"]):
            summary["cpu_ms_per_request"] = round(ms * sum(d["tput_cpu"]) / sum(d["tput_n"]), 3)
        if d["burst_cpu"] and sum(d["burst_chunks"]):
            summary["cpu_ms_per_chunk"] = round(
                ms * sum(d["burst_cpu"]) / sum(d["burst_chunks"]), 4)
        out[t.name] = summary
    return out


# -- processes ---------------------------------------------------------------------------------


def wait_chat(url_port: int, model: str, proc: Proc, headers: dict[str, str] | None = None,
              within: float = 60.0) -> None:
    """Wait until a chat request for ``model`` through ``url_port`` answers 200."""
    async def once() -> int:
        client = Client("127.0.0.1", url_port, headers)
        try:
            return (await client.post(CHAT, chat_body(model, False, 1))).status
        finally:
            await client.aclose()

    start = time.monotonic()
    while time.monotonic() - start < within:
        if not proc.alive():
            raise RuntimeError(f"{proc.name} exited:\n{proc.tail()}")
        with contextlib.suppress(HttpError, OSError, ValueError, IndexError):
            if trio.run(once) == 200:
                return
        time.sleep(0.1)
    raise RuntimeError(f"{proc.name}: {model} not served within {within:g} s:\n{proc.tail()}")


def start_fake(procs: Procs, name: str, model: str, *extra: str) -> int:
    """One fast fake upstream (benchmarks/upstream.py), answering. Its port."""
    port = free_port()
    proc = procs.start(name, [PY, "-m", "benchmarks.upstream", "--port", str(port),
                              "--model", model, *extra])
    wait_http(f"http://127.0.0.1:{port}/v1/models", proc)
    return port


def start_litellm(procs: Procs, ports: dict[str, int], venv: Path) -> tuple[Proc, int]:
    exe = venv / "bin" / "litellm"
    if not exe.exists():
        raise RuntimeError(f"{exe} missing: python3 -m venv {venv} && "
                           f"{venv}/bin/pip install 'litellm[proxy]'")
    cfg = procs.workdir / "litellm.yaml"
    cfg.write_text("model_list:\n" + "".join(
        f"  - model_name: {MODELS[k]}\n    litellm_params: {{model: openai/{MODELS[k]}, "
        f"api_base: 'http://127.0.0.1:{ports[k]}/v1', api_key: none}}\n" for k in MODELS))
    port = free_port()
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    os.environ.setdefault("LITELLM_MASTER_KEY", LITELLM_KEY)
    proc = procs.start("litellm", [str(exe), "--config", str(cfg), "--host", "127.0.0.1",
                                   "--port", str(port)])
    wait_http(f"http://127.0.0.1:{port}/health/liveliness", proc, within=120)
    return proc, port


# -- targets to print ----------------------------------------------------------------------------


def verdicts(res: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    d, n = res["direct"], res["nvpair"]
    out: list[dict[str, Any]] = []

    def add(goal: str, value: float, target: str, met: bool) -> None:
        out.append({"goal": goal, "value": round(value, 3), "target": target, "met": met})

    added = n["nonstream_c1_p50_ms"] - d["nonstream_c1_p50_ms"]
    add("non-stream added latency c=1 p50 (ms)", added, "<= 4", added <= 4)
    ttfb = n["stream_c1_ttfb_p50_ms"] - d["stream_c1_ttfb_p50_ms"]
    add("stream TTFB added c=1 p50 (ms)", ttfb, "<= 8", ttfb <= 8)
    ttfb8 = n["stream_c8_ttfb_p50_ms"] - d["stream_c8_ttfb_p50_ms"]
    add("stream TTFB added c=8 p50 (ms)", ttfb8, "<= 8", ttfb8 <= 8)
    for c in ("c1", "c8"):
        ratio = n[f"stream_{c}_total_p50_ms"] / d[f"stream_{c}_total_p50_ms"]
        add(f"stream total {c} vs direct (x)", ratio, "<= 1.05", ratio <= 1.05)
    gap = n["stream_c8_max_gap_p50_ms"] - d["stream_c8_max_gap_p50_ms"]
    add("stream largest gap added c=8 p50 (ms)", gap, "<= 5", gap <= 5)
    if "litellm" in res:
        ratio = n["nonstream_c8_req_s"] / max(res["litellm"]["nonstream_c8_req_s"], 1e-9)
        add("non-stream c=8 throughput vs LiteLLM (x)", ratio, ">= 6", ratio >= 6)
    return out


def table(res: dict[str, dict[str, Any]]) -> str:
    rows = [("non-stream c=1 p50 ms", "nonstream_c1_p50_ms"),
            ("non-stream c=1 p99 ms", "nonstream_c1_p99_ms"),
            ("non-stream c=8 req/s", "nonstream_c8_req_s"),
            ("stream c=1 TTFB p50 ms", "stream_c1_ttfb_p50_ms"),
            ("stream c=1 TTFB p99 ms", "stream_c1_ttfb_p99_ms"),
            ("stream c=1 total p50 ms", "stream_c1_total_p50_ms"),
            ("stream c=1 max gap p50 ms", "stream_c1_max_gap_p50_ms"),
            ("stream c=8 TTFB p50 ms", "stream_c8_ttfb_p50_ms"),
            ("stream c=8 TTFB p99 ms", "stream_c8_ttfb_p99_ms"),
            ("stream c=8 total p50 ms", "stream_c8_total_p50_ms"),
            ("stream c=8 max gap p50 ms", "stream_c8_max_gap_p50_ms"),
            ("burst chunks/s", "burst_chunks_s"),
            ("CPU ms/request (c=8)", "cpu_ms_per_request"),
            ("CPU ms/chunk (burst)", "cpu_ms_per_chunk"),
            ("errors", "errors")]
    names = list(res)
    lines = [f"{'':28}" + "".join(f"{n:>12}" for n in names)
             + "".join(f"{n + '/direct':>16}" for n in names[1:])]
    for label, key in rows:
        vals = [res[n].get(key) for n in names]
        line = f"{label:28}" + "".join(f"{'-' if v is None else v:>12}" for v in vals)
        base = vals[0]
        for v in vals[1:]:
            ok = isinstance(v, (int, float)) and isinstance(base, (int, float)) and base
            line += f"{(f'{v / base:.3f}x' if ok else '-'):>16}"
        lines.append(line)
    return "\n".join(lines)


def say(line: str) -> None:
    print(line, flush=True)


def start_traced(procs: Procs, name: str, engines: str, hang: bool) -> tuple[Proc, int]:
    """An nvpair with tracing at 1.0 to a collector process of its own: (proc, port)."""
    port = free_port()
    procs.start(f"collector-{name}", [PY, "-m", "benchmarks.collector", "--port", str(port),
                                      *(["--hang"] if hang else [])])
    top = (f"[tracing]\notlp_endpoint = 'http://127.0.0.1:{port}/v1/traces'\n"
           "sample_ratio = 1.0\ntimeout_s = 2\n")
    nv, url, _ = start_nvpair(procs, name, engines, top=top)
    return nv, int(url.rsplit(":", 1)[1])


def tracing_verdicts(res: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Tracing's cost against the same nvpair with tracing off, in the same rounds."""
    off = res["nvpair"]
    out: list[dict[str, Any]] = []
    for name, target in (("traced", "<= 0.2"), ("hung", "<= 0.2")):
        if name not in res:
            continue
        added = res[name]["nonstream_c1_p50_ms"] - off["nonstream_c1_p50_ms"]
        out.append({"goal": f"tracing ({name}) added c=1 p50 (ms)", "value": round(added, 3),
                    "target": target, "met": added <= 0.2})
        ratio = res[name]["nonstream_c8_req_s"] / max(off["nonstream_c8_req_s"], 1e-9)
        out.append({"goal": f"tracing ({name}) c=8 throughput vs off (x)",
                    "value": round(ratio, 3), "target": ">= 0.95", "met": ratio >= 0.95})
    return out


def run(quick: bool, litellm: Path | None, upstream: str = "fake",
        tracing: bool = False) -> dict[str, Any]:
    plan = QUICK if quick else FULL
    started = time.monotonic()
    args = FAKE_ARGS if upstream == "fake" else SIM_ARGS
    doc: dict[str, Any] = {"scenario": "router", "quick": quick, "machine": machine(),
                           "plan": plan.__dict__, "upstream": upstream,
                           "upstream_args": {k: list(v) for k, v in args.items()}}
    workdir = Path(tempfile.mkdtemp(prefix="nvbench-router-"))
    with Procs(workdir) as procs:
        ports: dict[str, int] = {}
        engines = ""
        for key, model in MODELS.items():
            if upstream == "fake":
                port, kind = start_fake(procs, f"upstream-{key}", model, *args[key]), "openai"
            else:
                _, port, _ = start_sim(procs, f"sim-{key}", "vllm", *args[key], model=model)
                kind = "vllm"
            ports[key] = port
            engines += engine_toml(f"e-{key}", kind, port)
        nv, url, took = start_nvpair(procs, "nvpair", engines)
        nv_port = int(url.rsplit(":", 1)[1])
        for model in MODELS.values():
            wait_chat(nv_port, model, nv)
        doc["nvpair_ready_s"] = round(took, 2)
        direct = {MODELS[k]: p for k, p in ports.items()}
        targets = [Target("direct", direct, None),
                   Target("nvpair", dict.fromkeys(direct, nv_port), nv.pid)]
        if tracing:
            for name, hang in (("traced", False), ("hung", True)):
                tp, tport = start_traced(procs, name, engines, hang)
                for model in MODELS.values():
                    wait_chat(tport, model, tp)
                targets.append(Target(name, dict.fromkeys(direct, tport), tp.pid))
        if litellm is not None:
            try:
                lp, lport = start_litellm(procs, ports, litellm)
                headers = {"Authorization": f"Bearer {LITELLM_KEY}"}
                for model in MODELS.values():
                    wait_chat(lport, model, lp, headers, within=60)
                targets.append(Target("litellm", dict.fromkeys(direct, lport), lp.pid, headers))
            except RuntimeError as exc:
                doc["litellm_error"] = str(exc)[:2000]
                print(f"LiteLLM not measured: {str(exc)[:300]}", file=sys.stderr)
        doc["results"] = trio.run(measure, targets, plan, say)
        for t in targets:  # what the traced nvpairs exported and dropped, from /metrics
            if t.name in ("traced", "hung"):
                port = next(iter(t.ports.values()))
                text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics",
                                              timeout=5).read().decode()
                doc["results"][t.name]["spans"] = {
                    k: float(v) for k, _, v in (line.partition(" ") for line in
                                                text.splitlines())
                    if k.startswith("nvpair_trace_spans_")}
    doc["targets"] = verdicts(doc["results"]) + tracing_verdicts(doc["results"])
    doc["wall_s"] = round(time.monotonic() - started, 1)
    doc["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    doc["logs"] = str(workdir)
    return doc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.router")
    p.add_argument("--quick", action="store_true", help="a short run (under 60 s)")
    p.add_argument("--litellm", action="store_true", help="also measure LiteLLM's proxy")
    p.add_argument("--litellm-venv", type=Path, default=LITELLM_VENV,
                   help="the venv LiteLLM is installed in (default: %(default)s)")
    p.add_argument("--upstream", choices=("fake", "sim"), default="fake",
                   help="fake: the fast fake upstream (default); sim: the vLLM simulator")
    p.add_argument("--tracing", action="store_true",
                   help="also measure nvpair with tracing on (a collector that answers, "
                        "and one that hangs)")
    args = p.parse_args(argv)
    doc = run(args.quick, args.litellm_venv if args.litellm else None, args.upstream,
              args.tracing)
    print(table(doc["results"]))
    for v in doc["targets"]:
        print(f"{'met    ' if v['met'] else 'NOT MET'}  {v['goal']}: {v['value']} "
              f"(target {v['target']})")
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = ("router" if args.upstream == "fake" else "router-sim") + (
        "-tracing" if args.tracing else "")
    out = RESULTS / (f"{stem}-quick.json" if args.quick else f"{stem}.json")
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {out.relative_to(ROOT)} ({doc['wall_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
