"""``python -m benchmarks.chaos`` (``nox -s chaos``): a suite that proves containment.

It drives a real ``nvpair serve`` process from outside: real simulators (SGLang, vLLM, a
managed llama.cpp), hostile servers of its own (``benchmarks/chaos_hostile.py``: an engine,
a peer and an etcd answering garbage), misbehaving clients (``benchmarks/chaos_clients.py``)
and a SIGKILL of nvpair followed by a restart. A poller process
(``benchmarks/chaos_poll.py``) reads ``/v1/models`` and ``/healthz`` all along.

After each case: is nvpair alive (crashes), how many tracebacks its log got since the case
began, whether its CLOSE-WAIT sockets and fds came back to the baseline within
``SETTLE_S``, the read p99 during the case, and the case's own check (what nvpair promises
under that fault), and the engines left running that no live nvpair runs or knows. Some
cases run on an nvpair of their own (a flooding engine, on-demand engines, a group of
three nodes, signals). Prints a table; the exit status is 1 if any case failed. Loopback
only; about four minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import http.client
import json
import os
import resource
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks import chaos_clients as clients
from benchmarks.__main__ import git_commit
from benchmarks.chaos_hostile import PEER_MODEL
from benchmarks.collector import Collector
from benchmarks.procs import (
    PY,
    ROOT,
    Procs,
    env,
    fd_count,
    free_port,
    machine,
    rss_mb,
    sockets,
    start_sim,
    tcp_states,
    wait_http,
)
from benchmarks.report import Table, render_markdown, render_text
from nvpair.router.relay import REAP_EVERY_S

HOST = "127.0.0.1"
POLITE = clients.Polite()
request = POLITE.request
get_json = POLITE.get_json
#: how long CLOSE-WAIT and fds get to come back to the baseline after a case: the router
#: closes a pool at most two reaper ticks after its last request (a burst of 32 requests
#: leaves 32 kept-alive connections to the engine until then), and a second to spare
SETTLE_S = 2 * REAP_EVERY_S + 1.0
#: fds above the baseline still counted as back (probe connections come and go)
FD_SLACK = 8
#: a read p99 above this during a case fails it
P99_MAX_MS = 300.0
#: the soft RLIMIT_NOFILE nvpair is started with (a shell's usual default)
NVPAIR_NOFILE = 1024
#: how long each hostile mode is served
MODE_S = 3.0
ENGINE_KINDS = ("deep_json", "huge", "many", "not_utf8", "odd_models", "redirect", "not_http",
                "drip", "big_headers", "reset_after_headers")
PEER_MODES = ("deep_json", "not_utf8", "redirect", "not_http", "big_headers",
              "reset_after_headers", "drip")
ETCD_MODES = ("html", "truncated", "not_json", "wrong_types", "bad_base64", "deep_json",
              "not_http")
GOOD_MODELS = ("chaos-sglang", "chaos-vllm")
TRACEBACK = "Traceback (most recent call last)"
#: in the environment of every nvpair the suite starts, and so of every engine they start:
#: a process with it whose nvpair is gone (or does not know it) is an engine left behind
MARK = "NVPAIR_CHAOS_RUN"
RUN_ID = secrets.token_hex(8)
#: how long the engines of a case get to be gone after it (a stop grace, then SIGKILL)
LEFT_SETTLE_S = 8.0
#: the quiet reads of a case's own nvpair, before its fault (its reference p99)
QUIET_S = 2.0
#: an idle nvpair's read p99 moves between about 2 and 6 ms from run to run on 2 shared
#: cores (the baseline rows of the runs in docs/reliability.md): "2x the quiet p99" counts
#: the quiet p99 as at least this, so that noise alone does not fail a case
QUIET_FLOOR_MS = 5.0
#: an engine floods its output this long; reads then: p99 within 2x quiet and under
#: FLOOD_P99_MS, none over FLOOD_MAX_MS
FLOOD_S = 4.0
FLOOD_P99_MS = 20.0
FLOOD_MAX_MS = 50.0
#: an engine's log files (NAME.log and NAME.log.1, each rotated at 16 MiB) and some slack
LOG_CAP_BYTES = 2 * 16 * 2**20 + 2**20
#: requests at once for a cold on-demand engine, and their queue_wait_s
BURST = 32
BURST_WAIT_S = 8
#: tokens of the stream an eviction must not cut (20 a second: 5 s)
EVICT_TOKENS = 100
#: a peer's adverts flap this often, for this long; its RSS may grow this much over the
#: second half, and in all (a leak per advert grows with the count)
FLAP_EVERY_S = 0.1
FLAP_S = 6.0
FLAP_RSS_HALF_MB = 8.0
FLAP_RSS_MB = 32.0
#: docs/api.md: "A send the client has not taken in 30 s closes its connection"
SSE_DROP_S = 30.0
SSE_SLACK_S = 10.0
SSE_RSS_MB = 32.0
#: a stream through a group's head ends this soon after a rank dies (not a hang)
GROUP_END_S = 10.0
#: reads of the cases that only ask that reads stay fast
READ_FAST_MS = 50.0
#: the stop grace of the engine that ignores SIGTERM
SIGNAL_GRACE_S = 3
#: routed requests in each half of the hung-collector case (the collector answering, then
#: hung), and how long each export may wait (the hung half lasts several of them)
TRACED_REQUESTS = 300
TRACE_TIMEOUT_S = 1
#: the hung half's routed p50 may exceed the answering half's by this at most; its p99
#: by this factor (of at least QUIET_FLOOR_MS)
TRACED_P50_MS = 1.0
TRACED_P99_X = 2.0
#: the request head and body deadlines the suite configures (when this nvpair has them), so
#: that the slow-client case is bounded; the defaults are 10 s and 60 s
DEADLINE_S = 4.0


def deadlines() -> str:
    """The config lines for short head and body deadlines, if this nvpair knows them."""
    from nvpair.config.settings import Config

    fields = Config.__struct_fields__
    if "header_timeout_s" in fields and "body_timeout_s" in fields:
        return f"header_timeout_s = {DEADLINE_S}\nbody_timeout_s = {DEADLINE_S}\n"
    return ""


# -- nvpair as a process ---------------------------------------------------------------------


class Nvpair:
    """``python -m nvpair serve`` with its log in a file, started with a soft
    RLIMIT_NOFILE of ``nofile`` (nvpair must raise its own)."""

    def __init__(self, name: str, config: Path, log: Path, state: Path, nofile: int) -> None:
        self.name, self.config, self.log, self.state, self.nofile = name, config, log, state, nofile
        self.popen: subprocess.Popen[bytes] | None = None
        self.host, self.port = HOST, 0
        for line in config.read_text().splitlines():
            if line.startswith("listen"):
                self.host, _, port = line.split("=", 1)[1].strip(" '").rpartition(":")
                self.port = int(port)
        self.url = f"http://{self.host}:{self.port}"
        #: every pid this nvpair ran as (a restart is a new process, the same name)
        self.pids: list[int] = []

    def start(self) -> None:
        # MARK: its engines inherit it, so that an engine left behind is found in /proc
        e = env() | {"XDG_STATE_HOME": str(self.state), MARK: RUN_ID}
        soft = self.nofile

        def limit() -> None:
            hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

        with open(self.log, "ab") as out:
            self.popen = subprocess.Popen(
                [PY, "-m", "nvpair", "serve", "--config", str(self.config)], cwd=ROOT, env=e,
                stdout=out, stderr=out, stdin=subprocess.DEVNULL, preexec_fn=limit)
        self.pids.append(self.popen.pid)

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def offset(self) -> int:
        return self.log.stat().st_size if self.log.exists() else 0

    def since(self, offset: int) -> str:
        with open(self.log, "rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")

    def kill(self) -> None:
        if self.alive():
            assert self.popen is not None
            self.popen.send_signal(signal.SIGKILL)
            self.popen.wait(10)

    def stop(self) -> None:
        """One SIGTERM (a second would be a fault of its own), then up to 30 s."""
        if self.alive():
            assert self.popen is not None
            self.popen.terminate()
        self.wait_exit()

    def wait_exit(self, within: float = 30.0) -> None:
        """Wait for the exit a signal asked for; SIGKILL after ``within``."""
        if self.popen is not None and self.popen.poll() is None:
            try:
                self.popen.wait(within)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)


def close_wait(pid: int) -> int:
    return tcp_states(pid)[pid].get("CLOSE-WAIT", 0)


def api_close_wait(pid: int, port: int) -> int:
    """nvpair's sockets in CLOSE-WAIT on its API port (clients that closed)."""
    return sum(1 for st, local, _ in sockets(pid)
               if st == "CLOSE-WAIT" and local.endswith(f":{port}"))


def fds(pid: int) -> int:
    try:
        return fd_count(pid)
    except OSError:
        return -1


def healthz(url: str, timeout: float = 2.0) -> bool:
    with contextlib.suppress(Exception):
        return request("GET", f"{url}/healthz", timeout=timeout)[0] == 200
    return False


class Poller:
    """The read poller process and what it recorded."""

    def __init__(self, procs: Procs, name: str, url: str) -> None:
        self.out = procs.workdir / f"{name}.lines"
        self.proc = procs.start(name, [PY, "-m", "benchmarks.chaos_poll", url, str(self.out)])

    def window(self, t0: float, t1: float) -> dict[str, Any]:
        lat: list[float] = []
        errors = 0
        with contextlib.suppress(OSError):
            for line in self.out.read_text().splitlines():
                f = line.split()
                if len(f) != 4 or not t0 <= float(f[0]) <= t1:
                    continue
                lat.append(float(f[2]))
                errors += f[3] != "200"
        lat.sort()
        p99 = lat[min(len(lat) - 1, int(0.99 * len(lat)))] if lat else None
        return {"reads": len(lat), "errors": errors, "p99_ms": p99,
                "max_ms": lat[-1] if lat else None}


# -- the hostile servers ---------------------------------------------------------------------


class Hostile:
    def __init__(self, procs: Procs, role: str) -> None:
        self.port, self.control = free_port(), free_port()
        self.proc = procs.start(f"hostile-{role}", [
            PY, "-m", "benchmarks.chaos_hostile", "--role", role, "--port", str(self.port),
            "--control-port", str(self.control)])
        wait_http(f"http://{HOST}:{self.control}/stats", self.proc)

    def mode(self, mode: str) -> None:
        status, body = request("GET", f"http://{HOST}:{self.control}/mode/{mode}")
        if status != 200:
            raise RuntimeError(f"hostile mode {mode}: {status} {body[:100]!r}")

    def served(self) -> dict[str, int]:
        doc: dict[str, int] = get_json(f"http://{HOST}:{self.control}/stats")["served"]
        return doc


# -- cases -----------------------------------------------------------------------------------


class Case:
    """One fault. ``target``: the nvpair it is measured on (a key of ``Suite.targets``);
    ``prepare`` runs before the case's measures begin (it may start that nvpair and take
    its baseline), ``finish`` after its reads and sockets are measured, before its engines
    are counted (it may stop an nvpair of its own). ``ends``: the case ends its nvpair on
    purpose (then no crash, and no reads after ``reads_to``)."""

    def __init__(self, name: str, fault: str, run: Callable[[], dict[str, Any]],
                 target: str = "main", prepare: Callable[[], None] | None = None,
                 finish: Callable[[], None] | None = None, ends: bool = False) -> None:
        self.name, self.fault, self.run, self.target = name, fault, run, target
        self.prepare, self.finish, self.ends = prepare, finish, ends


class Target:
    """An nvpair the suite measures, with its own poller (started with it)."""

    def __init__(self, nvpair: Nvpair, poller: Poller) -> None:
        self.nvpair, self.poller = nvpair, poller


def first_exception(log: str) -> str:
    """The exception line of the first traceback in ``log`` (``ValueError: ...``)."""
    after = log[log.index(TRACEBACK):].splitlines()[1:]
    group = ""
    for line in after:
        text = line.strip(" |+-")
        head = text.split(":", 1)[0]
        name = head.rsplit(".", 1)[-1]
        if name and " " not in head and name[0].isupper() and (
                name.endswith(("Error", "Exception", "Group")) or "." in head):
            if not head.endswith("ExceptionGroup"):
                return text
            group = group or text
    return group or (after[-1].strip() if after else "")


def sim_has_garbage() -> bool:
    from nvpair.sim.faults import FAULT_MODES

    return "garbage" in FAULT_MODES


def one_line(text: str) -> bool:
    return bool(text) and "\n" not in text and len(text) <= 400


def errors_in(doc: Any) -> list[str]:
    """Every string under a key that names an error or a reason, anywhere in ``doc``."""
    out: list[str] = []
    if isinstance(doc, dict):
        for k, v in doc.items():
            if ("error" in k or k.endswith("why")) and isinstance(v, str) and v:
                out.append(v)
            else:
                out += errors_in(v)
    elif isinstance(doc, list):
        for v in doc:
            out += errors_in(v)
    return out


def listed(url: str) -> set[str]:
    try:
        return {m["id"] for m in get_json(f"{url}/v1/models", timeout=3)["data"]}
    except Exception:
        return set()


class Suite:
    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.procs = Procs(workdir)
        self.rows: list[dict[str, Any]] = []
        self.orphans: list[int] = []
        self.targets: dict[str, Target] = {}
        self.base: dict[str, dict[str, int]] = {}
        #: engines left behind that a case was already failed for (not counted again)
        self.blamed: set[int] = set()
        #: the nodes of the group case, its head first (started by that case)
        self.group_nodes: list[Nvpair] = []
        #: the p99 of each own nvpair's quiet reads (ms), by name
        self.quiet: dict[str, float] = {}

    # -- setup -------------------------------------------------------------------------------

    def setup(self) -> None:
        wd = self.workdir
        # nvpair starts with the common default soft limit (1,024): it must raise its own
        self.nofile0 = min(NVPAIR_NOFILE, resource.getrlimit(resource.RLIMIT_NOFILE)[1])
        self.nofile = clients.raise_nofile(16384)
        _, sg, _ = start_sim(self.procs, "sim-sglang", "sglang", "--no-health-generation",
                             model="chaos-sglang")
        _, vl, _ = start_sim(self.procs, "sim-vllm", "vllm", model="chaos-vllm")
        if sim_has_garbage():
            _, hostile_port, self.hostile_control = start_sim(
                self.procs, "sim-hostile", "openai", model="hostile-model")
            self.own_engine: Hostile | None = None
        else:  # a simulator without the garbage fault: the suite's own hostile engine
            self.own_engine = Hostile(self.procs, "engine")
            hostile_port = self.own_engine.port
        self.peer = Hostile(self.procs, "peer")
        self.etcd = Hostile(self.procs, "etcd")
        self.sg_port = sg
        token = wd / "cluster-token"
        token.write_text(secrets.token_hex(16) + "\n")
        self.cluster_token = token.read_text().strip()
        managed_port = free_port()
        command = [PY, "-m", "nvpair.sim", "llamacpp", "-m", "{model}", "--host", "{host}",
                   "--port", "{port}", "--no-control", "--load-s", "0.2"]
        fast = ("[engines.probes.ready]\ninterval_s = 1\ntimeout_s = 1\n"
                "[engines.probes.health]\ninterval_s = 1\ntimeout_s = 1\n"
                "[engines.probes.models]\ninterval_s = 2\ntimeout_s = 2\n")
        engines = (
            f"[[engines]]\nname = 'sg'\nkind = 'sglang'\nport = {sg}\nmodel = 'chaos-sglang'\n"
            f"[[engines]]\nname = 'vl'\nkind = 'vllm'\nport = {vl}\nmodel = 'chaos-vllm'\n"
            f"[[engines]]\nname = 'hostile'\nkind = 'openai'\nport = {hostile_port}\n"
            f"{fast}"
            f"[[engines]]\nname = 'managed'\nkind = 'llamacpp'\nmanaged = true\n"
            f"port = {managed_port}\nmodel = '/models/chaos-managed.gguf'\n"
            f"command = {json.dumps(command)}\nstop_grace_s = 3\n")
        main = wd / "nvpair-main.toml"
        main.write_text(
            f"listen = '{HOST}:{free_port()}'\nnode = 'chaos'\nlog_dir = '{wd / 'logs'}'\n"
            f"sweep_deadline_s = 2\n{deadlines()}{engines}"
            f"[[peers]]\nurl = 'http://{HOST}:{self.peer.port}'\nname = 'hostile-peer'\n"
            f"[cluster]\ntoken_file = '{token}'\ninterval_s = 1\n")
        etcd_cfg = wd / "nvpair-etcd.toml"
        etcd_cfg.write_text(
            f"listen = '{HOST}:{free_port()}'\nnode = 'chaos-etcd'\n"
            f"log_dir = '{wd / 'logs-etcd'}'\n"
            f"[[engines]]\nname = 'sg'\nkind = 'sglang'\nport = {sg}\nmodel = 'chaos-sglang'\n"
            f"[cluster]\nbackend = 'etcd'\netcd_url = 'http://{HOST}:{self.etcd.port}'\n"
            f"etcd_lease_ttl_s = 3\n")
        state = wd / "state"
        state.mkdir()
        self.main = Nvpair("nvpair-main", main, wd / "nvpair-main.log", state, self.nofile0)
        self.etcdn = Nvpair("nvpair-etcd", etcd_cfg, wd / "nvpair-etcd.log", wd / "state-etcd",
                            self.nofile0)
        for n in (self.main, self.etcdn):
            n.start()
        for n in (self.main, self.etcdn):
            self._wait_up(n)
        self._wait_models(self.main.url, {*GOOD_MODELS}, 30)
        self._wait_engine_ready("managed", 30)
        self.managed_pid = self._engine("managed").get("pid")
        self.targets["main"] = Target(self.main, Poller(self.procs, "poll-main", self.main.url))
        self.targets["etcd"] = Target(self.etcdn,
                                      Poller(self.procs, "poll-etcd", self.etcdn.url))
        time.sleep(2.0)
        self.base = {n.name: self._baseline(n) for n in (self.main, self.etcdn)}

    def _wait_up(self, n: Nvpair, within: float = 30) -> None:
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            if not n.alive():
                raise RuntimeError(f"{n.name} exited:\n{n.since(0)[-2000:]}")
            if healthz(n.url):
                return
            time.sleep(0.1)
        raise RuntimeError(f"{n.name} did not answer /healthz within {within:g} s")

    def _wait_models(self, url: str, want: set[str], within: float) -> None:
        deadline = time.monotonic() + within
        while not want <= listed(url):
            if time.monotonic() > deadline:
                raise RuntimeError(f"models {sorted(want - listed(url))} never listed")
            time.sleep(0.2)

    def _engine(self, name: str, n: Nvpair | None = None) -> dict[str, Any]:
        try:
            doc: dict[str, Any] = get_json(f"{(n or self.main).url}/v1/engines/{name}",
                                           timeout=3)
            return doc
        except Exception:
            return {}

    def _wait_engine_ready(self, name: str, within: float, n: Nvpair | None = None) -> bool:
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            if self._engine(name, n).get("state") == "ready":
                return True
            time.sleep(0.2)
        return False

    def _baseline(self, n: Nvpair) -> dict[str, int]:
        deadline = time.monotonic() + 8.0  # what setup's own connections left to close
        while close_wait(n.pid) and time.monotonic() < deadline:
            time.sleep(0.25)
        samples = []
        for _ in range(5):
            samples.append((close_wait(n.pid), fds(n.pid)))
            time.sleep(0.2)
        return {"close_wait": min(s[0] for s in samples), "fds": min(s[1] for s in samples)}

    # -- one case ------------------------------------------------------------------------------

    def run(self, case: Case) -> None:
        print(f"-- {case.name} ...", flush=True)
        try:
            if case.prepare is not None:
                case.prepare()
        except Exception as exc:  # the case could not be set up: it fails, the suite goes on
            self.rows.append(self._failed_row(case, f"setup: {type(exc).__name__}: {exc}"))
            print(f"   FAIL {self.rows[-1]['why']}", flush=True)
            self._finish(case)
            return
        target = self.targets[case.target]
        n = target.nvpair
        offset = n.offset()
        t0 = time.time()
        try:
            res = case.run()
        except Exception as exc:  # the case's own machinery failed: the case fails
            res = {"ok": False, "why": f"case error: {type(exc).__name__}: {exc}"}
        t1 = time.time()
        n = self.targets[case.target].nvpair  # a restart may replace it
        base = self.base[n.name]
        started = time.monotonic()
        cw = fd = -1
        while n.alive():
            cw, fd = close_wait(n.pid), fds(n.pid)
            if (cw <= base["close_wait"] and fd <= base["fds"] + FD_SLACK) or (
                    time.monotonic() - started > SETTLE_S):
                break
            time.sleep(0.2)
        settled = round(time.monotonic() - started, 1)
        alive = n.alive() and healthz(n.url)
        crashed = not alive and not case.ends
        log = n.since(offset) if n.log.exists() else ""
        tracebacks = log.count(TRACEBACK)
        reads = target.poller.window(res.get("reads_from", t0), res.get("reads_to", t1))
        self._finish(case)
        left = self._engines_left()
        checks = []
        if crashed:
            checks.append(f"{n.name} died (exit {n.popen.poll() if n.popen else '?'})")
        if tracebacks:
            checks.append(f"{tracebacks} traceback(s): {first_exception(log)[:160]}")
        if alive and cw > base["close_wait"]:
            checks.append(f"CLOSE-WAIT {cw} after {SETTLE_S:g} s (baseline {base['close_wait']})")
        if alive and fd > base["fds"] + FD_SLACK:
            checks.append(f"{fd} fds after {SETTLE_S:g} s (baseline {base['fds']})")
        if reads["p99_ms"] is not None and reads["p99_ms"] > P99_MAX_MS:
            checks.append(f"read p99 {reads['p99_ms']:.0f} ms")
        if reads["errors"]:
            checks.append(f"{reads['errors']} failed reads")
        if left:
            checks.append(f"{len(left)} engine process(es) left running: "
                          + ", ".join(left[:4]))
        if not res.get("ok"):
            checks.append(res.get("why") or "its check failed")
        row = {"case": case.name, "fault": case.fault, "target": n.name,
               "seconds": round(t1 - t0, 1), "crashed": crashed, "ended": not alive,
               "tracebacks": tracebacks, "close_wait": cw,
               "close_wait_baseline": base["close_wait"], "fds": fd,
               "fds_baseline": base["fds"], "settled_s": settled, "reads": reads,
               "engines_left": len(left), "left": left,
               "result": res, "passed": not checks, "why": "; ".join(checks)}
        self.rows.append(row)
        print(f"   {'pass' if row['passed'] else 'FAIL'} {row['why']}", flush=True)
        if crashed and case.target == "main" and case.name != "sigkill-restart":
            self._restart_main()

    def _failed_row(self, case: Case, why: str) -> dict[str, Any]:
        return {"case": case.name, "fault": case.fault, "target": case.target, "seconds": 0,
                "crashed": False, "ended": True, "tracebacks": 0, "close_wait": -1,
                "close_wait_baseline": -1, "fds": -1, "fds_baseline": -1, "settled_s": 0,
                "reads": {"reads": 0, "errors": 0, "p99_ms": None, "max_ms": None},
                "engines_left": 0, "left": [], "result": {"ok": False}, "passed": False,
                "why": why}

    def _finish(self, case: Case) -> None:
        if case.finish is not None:
            try:
                case.finish()
            except Exception as exc:  # a stop that failed shows as engines left
                print(f"   (finishing {case.name}: {type(exc).__name__}: {exc})", flush=True)

    def _engines_left(self) -> list[str]:
        """Engines of this run's nvpairs still running that no live nvpair knows, waited for
        up to LEFT_SETTLE_S; each is then killed (and counted once, here)."""
        deadline = time.monotonic() + LEFT_SETTLE_S
        while True:
            nvpairs = [t.nvpair for t in self.targets.values()] + self.extra_nvpairs()
            live = {n.pid for n in nvpairs if n.alive()}
            ours = {pid for n in nvpairs for pid in n.pids}
            known = set()
            for n in nvpairs:
                if n.pid in live:
                    known |= self._known_pids(n)
            left = {pid: argv for pid, argv in left_behind(live, ours, known).items()
                    if pid not in self.blamed}
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.25)
        for pid in left:
            self.blamed.add(pid)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        return [f"{pid} ({argv})" for pid, argv in sorted(left.items())]

    def extra_nvpairs(self) -> list[Nvpair]:
        """nvpairs that are not targets (a group's other nodes)."""
        return list(self.group_nodes[1:])

    def _known_pids(self, n: Nvpair) -> set[int]:
        """The engine pids a live nvpair reports (an engine it adopted is not its child)."""
        out = set()
        with contextlib.suppress(Exception):
            for e in get_json(f"{n.url}/v1/engines", timeout=3).get("engines", []):
                if e.get("pid"):
                    out.add(int(e["pid"]))
        return out

    def _restart_main(self) -> None:
        """After a crash, a fresh nvpair so that the next cases test something."""
        print("   (restarting nvpair for the next cases)", flush=True)
        self.main.stop()
        self.main.start()
        self._wait_up(self.main)
        with contextlib.suppress(RuntimeError):
            self._wait_models(self.main.url, {*GOOD_MODELS}, 20)

    # -- the cases -----------------------------------------------------------------------------

    def case_idle(self) -> dict[str, Any]:
        time.sleep(MODE_S)
        return {"ok": True}

    def _hostile_requests(self) -> int:
        if self.own_engine is not None:
            return sum(self.own_engine.served().values())
        return int(get_json(f"{self.hostile_control}/__sim/stats")["total"]["count"])

    def _hostile_mode(self, kind: str | None) -> None:
        if self.own_engine is not None:
            self.own_engine.mode(kind or "ok")
            return
        if kind is None:
            request("DELETE", f"{self.hostile_control}/__sim/fault")
            return
        status, body = request("POST", f"{self.hostile_control}/__sim/fault",
                               {"mode": "garbage", "kind": kind})
        if status != 200:
            raise RuntimeError(f"garbage {kind}: {status} {body[:200]!r}")

    def case_engine(self, kind: str) -> dict[str, Any]:
        """The simulator's ``garbage`` fault of this kind on every path, for MODE_S."""
        before = self._hostile_requests()
        old = set(errors_in(self._engine("hostile")))
        self._hostile_mode(kind)
        reasons: list[str] = []
        missing: set[str] = set()
        seen: set[str] = set()
        end = time.monotonic() + MODE_S
        # (a list that came back unchanged is asked for again up to 4 intervals later, 8 s
        # here: after a case whose answer repeated, wait for the next asking, within 12 s)
        latest = end + 12
        while time.monotonic() < end or (not reasons and time.monotonic() < latest):
            time.sleep(0.5)
            doc = self._engine("hostile")
            reasons += [e for e in errors_in(doc) if e not in reasons and e not in old]
            ids = listed(self.main.url)
            seen |= ids
            missing |= set(GOOD_MODELS) - ids
        served = self._hostile_requests() - before
        state = self._engine("hostile").get("state")
        self._hostile_mode(None)
        why = []
        if missing:
            why.append(f"other engines' models missing from /v1/models: {sorted(missing)}")
        if not served:
            why.append("nvpair never asked the hostile engine")
        if not reasons:
            why.append("no error published for the hostile engine")
        elif not all(one_line(r) for r in reasons):
            bad = next(r for r in reasons if not one_line(r))
            why.append(f"an error is not one line: {bad[:120]!r}")
        good = {"good-1", "good-2"} if self.own_engine is None else {"odd-ok"}
        if kind == "odd_models" and not good <= seen:
            why.append(f"the good models among the odd ones ({', '.join(sorted(good))}) "
                       "were not listed")
        return {"ok": not why, "why": "; ".join(why), "tried": served, "state": state,
                "reason": reasons[-1] if reasons else None}

    def case_peer(self) -> dict[str, Any]:
        before = self.peer.served()
        reasons: list[str] = []
        for mode in PEER_MODES:
            self.peer.mode(mode)
            time.sleep(1.5)
            with contextlib.suppress(Exception):
                doc = get_json(f"{self.main.url}/v1/peers", timeout=3)
                reasons += [e for e in errors_in(doc) if e not in reasons]
        self.peer.mode("ok")
        after = self.peer.served()
        hit = sorted(m for m in PEER_MODES if after.get(m, 0) > before.get(m, 0))
        tried = sum(after.get(m, 0) - before.get(m, 0) for m in PEER_MODES)
        why = []
        if not hit:
            why.append("nvpair never pushed to the hostile peer")
        if not reasons:
            why.append("no error published in /v1/peers")
        elif not all(one_line(r) for r in reasons):
            why.append("a peer error is not one line")
        return {"ok": not why, "why": "; ".join(why), "modes_hit": hit, "tried": tried,
                "reason": reasons[-1] if reasons else None}

    def case_adverts(self) -> dict[str, Any]:
        """Adverts a broken or hostile peer may send, then a request routed to the model of
        an advert whose URL has port 99999."""
        url = f"{self.main.url}/v1/peers/adverts"
        auth = {"Authorization": f"Bearer {self.cluster_token}",
                "Content-Type": "application/json"}
        p = self.main.port

        def post(body: bytes) -> int:
            return clients.get(HOST, p, "/v1/peers/adverts", method="POST", body=body,
                               headers=auth)[0]

        def advert(node: str, url_: str, model: str) -> bytes:
            return json.dumps({
                "node": node, "boot_id": secrets.token_hex(8), "seq": 1, "ttl_s": 30,
                "url": url_, "engines": [{"name": "e", "kind": "openai", "state": "ready",
                                          "models": [model]}],
                "models": [{"id": model, "engine": "e", "kind": "openai", "state": "ready"}],
            }).encode()

        answers = {
            "deep JSON": post(b"[" * 5000 + b"]" * 5000),
            "not UTF-8": post(b'{"node":"\xff\xfe"}'),
            "not JSON": post(b"<html>"),
            "port 99999": post(advert("bad-port", f"http://{HOST}:99999", "via-bad-port")),
            "scheme ftp": post(advert("bad-scheme", "ftp://127.0.0.1:21", "via-bad-scheme")),
        }
        routed = {}
        for model in ("via-bad-port", "via-bad-scheme"):
            routed[model] = clients.get(
                HOST, p, "/v1/chat/completions", method="POST",
                body=json.dumps({"model": model, "messages": [
                    {"role": "user", "content": "hi"}]}).encode(),
                headers={"Content-Type": "application/json"})[0]
        del url
        why = [f"advert {k}: {v}" for k, v in answers.items() if v >= 500 or v == 0]
        why += [f"routed to {k}: {v}" for k, v in routed.items() if v >= 500 and v != 502
                and v != 503]
        return {"ok": not why, "why": "; ".join(why), "adverts": answers, "routed": routed,
                "tried": len(answers) + len(routed)}

    def _cluster_models(self, url: str) -> set[str]:
        try:
            doc = get_json(f"{url}/v1/models?scope=cluster", timeout=3)
            return {m["id"] for m in doc["data"]}
        except Exception:
            return set()

    def case_etcd(self) -> dict[str, Any]:
        """The etcd stand-in lists one peer, then answers garbage kind after kind; the
        peer stays listed from the last table (it goes stale, then gone, on its clock)."""
        deadline = time.monotonic() + 10
        while PEER_MODEL not in self._cluster_models(self.etcdn.url):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the etcd peer's {PEER_MODEL} was never listed")
            time.sleep(0.3)
        before = self.etcd.served()
        reasons: list[str] = []
        kept = True
        for i, mode in enumerate(ETCD_MODES):
            self.etcd.mode(mode)
            time.sleep(1.5)
            if i == 0:  # within its TTL the last table is served
                kept = PEER_MODEL in self._cluster_models(self.etcdn.url)
            with contextlib.suppress(Exception):
                doc = get_json(f"{self.etcdn.url}/v1/peers", timeout=3)
                reasons += [e for e in errors_in(doc) if e not in reasons]
        self.etcd.mode("ok")
        after = self.etcd.served()
        hit = sorted(m for m in ETCD_MODES if after.get(m, 0) > before.get(m, 0))
        tried = sum(after.get(m, 0) - before.get(m, 0) for m in ETCD_MODES)
        models = listed(self.etcdn.url)
        why = []
        if not hit:
            why.append("nvpair never called the hostile etcd")
        if "chaos-sglang" not in models:
            why.append("its own engine's model is missing from /v1/models")
        if not kept:
            why.append(f"the last table was dropped at once ({PEER_MODEL} gone 1.5 s in)")
        if not reasons:
            why.append("no etcd error published in /v1/peers")
        elif not all(one_line(r) for r in reasons):
            why.append("an etcd error is not one line")
        return {"ok": not why, "why": "; ".join(why), "modes_hit": hit, "tried": tried,
                "reason": reasons[-1] if reasons else None}

    def case_slow_poller(self) -> dict[str, Any]:
        return clients.slow_poller(HOST, self.main.port, every_s=10.0, polls=3)

    def case_half_closed(self) -> dict[str, Any]:
        res = clients.half_closed(HOST, self.main.port, 300)
        time.sleep(1.0)
        cw = api_close_wait(self.main.pid, self.main.port)
        res["api_close_wait_after_1s"] = cw
        if cw:
            res["ok"] = False
            res["why"] = "; ".join(filter(None, [
                res["why"], f"{cw} client connections in CLOSE-WAIT 1 s after their clients "
                "closed them"]))
        return res

    def case_slow_requests(self) -> dict[str, Any]:
        within = DEADLINE_S + 6.0 if deadlines() else 15.0
        return clients.slow_requests(HOST, self.main.port, 20, within_s=within)

    def case_idle_3000(self) -> dict[str, Any]:
        socks, opened = clients.idle_connections(HOST, self.main.port, 3000)
        try:
            time.sleep(0.5)
            status, took = clients.timed_healthz(HOST, self.main.port)
        finally:
            for s in socks:
                s.close()
        why = []
        if opened["opened"] < 3000:
            why.append(f"only {opened['opened']} of 3000 connected")
        if status != 200 or took > 1.0:
            why.append(f"a new client's /healthz: {status or 'no answer'} in {took:.2f} s")
        return {"ok": not why, "why": "; ".join(why), **opened, "tried": opened["opened"],
                "healthz_status": status,
                "healthz_s": round(took, 3)}

    def case_big_headers(self) -> dict[str, Any]:
        return clients.oversized_headers(HOST, self.main.port)

    def case_browser(self) -> dict[str, Any]:
        res = clients.browser(HOST, self.main.port, "managed")
        time.sleep(1.0)
        state = self._engine("managed").get("state")
        if state not in ("ready", "busy"):
            res["ok"] = False
            res["why"] = "; ".join(filter(None, [res["why"], f"the managed engine is {state}"]))
            # start it again for the next case
            request("POST", f"{self.main.url}/v1/engines/managed/start", {})
            self._wait_engine_ready("managed", 20)
        res["managed_state"] = state
        return res

    def case_sigkill(self) -> dict[str, Any]:
        """SIGKILL nvpair with a managed engine, start it again: the orphan is stopped or
        adopted, never left running unknown."""
        old = self._engine("managed").get("pid")
        self.main.kill()
        time.sleep(0.5)
        orphan_alive = bool(old) and _alive(old)
        if orphan_alive:
            self.orphans.append(old)
        self.main.start()
        self._wait_up(self.main)
        up = time.time()
        deadline = time.monotonic() + 20
        reclaimed = False
        pid = None
        while time.monotonic() < deadline:
            doc = self._engine("managed")
            pid = doc.get("pid")
            gone = not old or not _alive(old)
            if doc.get("state") == "ready" and (gone or pid == old):
                reclaimed = True
                break
            time.sleep(0.3)
        why = []
        if not old:
            why.append("the managed engine had no pid before the kill")
        elif not reclaimed:
            why.append(f"after the restart the old engine (pid {old}) is "
                       f"{'still running, unknown' if _alive(old) else 'gone'}; "
                       f"managed is {self._engine('managed').get('state')} pid {pid}")
        return {"ok": not why, "why": "; ".join(why), "old_pid": old,
                "orphan_alive_after_kill": orphan_alive, "pid_after": pid,
                "adopted": pid == old, "reads_from": up, "tried": 1}

    # -- nvpairs of a case's own ---------------------------------------------------------------

    def _start_own(self, key: str, name: str, body: str, host: str = HOST,
                   port: int | None = None) -> Target:
        """An nvpair of its own for a case (``body``: its config after listen, node and
        log_dir), up, with its poller and its baseline, as target ``key``."""
        wd = self.workdir
        cfg = wd / f"{name}.toml"
        cfg.write_text(f"listen = '{host}:{port or free_port()}'\nnode = '{name}'\n"
                       f"log_dir = '{wd / f'logs-{name}'}'\n{body}")
        n = Nvpair(name, cfg, wd / f"{name}.log", wd / f"state-{name}", self.nofile0)
        n.start()
        self._wait_up(n)
        target = Target(n, Poller(self.procs, f"poll-{name}", n.url))
        self.targets[key] = target
        return target

    def _settle_own(self, target: Target) -> None:
        """The baseline of a fresh nvpair, and the p99 of its quiet reads (2 s of them)."""
        time.sleep(QUIET_S)
        self.base[target.nvpair.name] = self._baseline(target.nvpair)
        quiet = target.poller.window(time.time() - QUIET_S - 1.0, time.time())
        self.quiet[target.nvpair.name] = quiet["p99_ms"] or 0.0

    def _stop_own(self, key: str) -> None:
        target = self.targets.get(key)
        if target is not None:
            target.nvpair.stop()
            target.poller.proc.stop()

    def _managed(self, name: str, model: str, command: list[str], extra: str = "") -> str:
        return (f"[[engines]]\nname = '{name}'\nkind = 'openai'\nmanaged = true\n"
                f"port = {free_port()}\nmodel = '{model}'\ncommand = {json.dumps(command)}\n"
                f"{extra}")

    @staticmethod
    def _sim_openai(*extra: str) -> list[str]:
        return [PY, "-m", "nvpair.sim", "openai", "--model", "{model}", "--host", "{host}",
                "--port", "{port}", "--no-control", "--warmup-s", "0", *extra]

    # -- an engine that floods its output --------------------------------------------------------

    def prepare_flood(self) -> None:
        if "flood" in self.targets and self.targets["flood"].nvpair.alive():
            return
        od = "activation = 'on_demand'\nmemory_bytes = 1000000\nstop_grace_s = 2\n"
        long_lines = ("import sys\nline = 'x' * 20000 + '\\n'\n"
                      "while True: sys.stdout.write(line)\n")
        body = (f"[activation]\nmemory_budget_bytes = 1000000000\n"
                f"[[engines]]\nname = 'sg'\nkind = 'sglang'\nport = {self.sg_port}\n"
                f"model = 'chaos-sglang'\n"
                + self._managed("flood-yes", "flood-yes", ["yes", "{model}"], od)
                + self._managed("flood-long", "flood-long", [PY, "-c", long_lines], od))
        target = self._start_own("flood", "nvpair-flood", body)
        self._wait_models(target.nvpair.url, {"chaos-sglang"}, 20)
        self._settle_own(target)

    def case_flood(self, engine: str) -> dict[str, Any]:
        """A managed engine that writes output as fast as it can (``yes``, or lines of
        20,000 characters), started for FLOOD_S, then stopped: reads as fast as when quiet."""
        target = self.targets["flood"]
        n = target.nvpair
        logs = n.config.parent / f"logs-{n.name}"
        status, body = request("POST", f"{n.url}/v1/engines/{engine}/start", {})
        if status >= 300:
            return {"ok": False, "why": f"start {engine}: {status} {body[:120]!r}"}
        deadline = time.monotonic() + 10
        while self._engine(engine, n).get("pid") is None and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.5)  # its output under way
        t0 = time.time()
        largest = 0
        for _ in range(int(FLOOD_S / 0.5)):
            time.sleep(0.5)
            largest = max(largest, sum(f.stat().st_size for f in logs.glob(f"{engine}.log*")))
        t1 = time.time()
        lines = 0
        with contextlib.suppress(Exception):
            lines = int(get_json(f"{n.url}/v1/engines/{engine}/logs?tail=1")["next"])
        request("POST", f"{n.url}/v1/engines/{engine}/stop", {})
        deadline = time.monotonic() + 10
        while self._engine(engine, n).get("pid") is not None and time.monotonic() < deadline:
            time.sleep(0.2)
        reads = target.poller.window(t0, t1)
        quiet = self.quiet.get(n.name, 0.0)
        allowed = min(FLOOD_P99_MS, 2 * max(quiet, QUIET_FLOOR_MS))
        why = []
        if not lines:
            why.append(f"{engine} wrote nothing nvpair saw")
        if reads["p99_ms"] is None:
            why.append("no reads during the flood")
        else:
            if reads["p99_ms"] > allowed:
                why.append(f"read p99 {reads['p99_ms']:.0f} ms during the flood (quiet "
                           f"{quiet:.1f} ms; allowed {allowed:.0f} ms)")
            if reads["max_ms"] > FLOOD_MAX_MS:
                why.append(f"read max {reads['max_ms']:.0f} ms (allowed {FLOOD_MAX_MS:g})")
        if largest > LOG_CAP_BYTES:
            why.append(f"{engine}'s log files hold {largest / 2**20:.1f} MiB "
                       f"(cap {LOG_CAP_BYTES / 2**20:.0f} MiB)")
        return {"ok": not why, "why": "; ".join(why), "tried": lines, "lines": lines,
                "log_mib": round(largest / 2**20, 1), "quiet_p99_ms": quiet,
                "max_ms": reads["max_ms"], "reads_from": t0, "reads_to": t1,
                "reason": f"{lines:,} lines in {FLOOD_S + 0.5:g} s; log files "
                          f"{largest / 2**20:.1f} MiB; reads p99 {reads['p99_ms']} ms "
                          f"max {reads['max_ms']} ms (quiet p99 {quiet:.1f})"}

    # -- a burst at a cold on-demand engine ------------------------------------------------------

    def prepare_burst(self) -> None:
        body = (f"[activation]\nmemory_budget_bytes = 1000000000\n"
                f"queue_wait_s = {BURST_WAIT_S}\n"
                + self._managed("od-burst", "od-burst",
                                self._sim_openai("--load-s", "1", "--token-rate", "10",
                                                 "--max-tokens", "10"),
                                "activation = 'on_demand'\nmemory_bytes = 1000000\n"))
        self._settle_own(self._start_own("burst", "nvpair-burst", body))

    def case_burst(self) -> dict[str, Any]:
        """BURST requests at once for a cold on-demand engine (it loads in 1 s, answers in
        1 s, takes them all at once; queue_wait_s BURST_WAIT_S): every one 200."""
        n = self.targets["burst"].nvpair
        got = clients.burst(n.host, n.port, "od-burst", BURST, timeout=BURST_WAIT_S + 20)
        statuses: dict[int, int] = {}
        for _, status in got:
            statuses[status] = statuses.get(status, 0) + 1
        ok = statuses.get(200, 0) == BURST
        last = max((t for t, _ in got), default=0.0)
        return {"ok": ok, "tried": BURST, "statuses": statuses, "last_s": last,
                "why": "" if ok else f"of {BURST}: " + ", ".join(
                    f"{c} answered {s or 'nothing'}" for s, c in sorted(statuses.items()))
                + f" (the last after {last:.1f} s)",
                "reason": ", ".join(f"{s}: {c}" for s, c in sorted(statuses.items()))
                + f"; the last after {last:.1f} s"}

    # -- a trace collector that hangs ------------------------------------------------------------

    def prepare_traced(self) -> None:
        self.collector = Collector()
        body = (f"[tracing]\notlp_endpoint = '{self.collector.url}'\n"
                f"timeout_s = {TRACE_TIMEOUT_S}\n"
                + self._managed("traced", "traced", self._sim_openai(
                    "--token-rate", "100000", "--max-tokens", "4", "--prefill-s", "0")))
        target = self._start_own("traced", "nvpair-traced", body)
        self._wait_models(target.nvpair.url, {"traced"}, 20)
        self._settle_own(target)

    def finish_traced(self) -> None:
        self._stop_own("traced")
        self.collector.close()

    def case_traced(self) -> dict[str, Any]:
        """TRACED_REQUESTS routed requests while the collector answers, then as many while
        it hangs (accepts, reads, never answers; each export waits TRACE_TIMEOUT_S): the
        routed p50 and p99 and the reads' p99 as while it answered, and the spans dropped
        and counted."""
        target = self.targets["traced"]
        n = target.nvpair
        body = clients.chat_body("traced")
        headers = {"Content-Type": "application/json"}

        def routed() -> tuple[list[float], int]:
            times, bad = [], 0
            for _ in range(TRACED_REQUESTS):
                began = time.perf_counter()
                status, _ = clients.get(n.host, n.port, "/v1/chat/completions",
                                        method="POST", body=body, headers=headers)
                times.append((time.perf_counter() - began) * 1000)
                bad += status != 200
            return sorted(times), bad

        def spans() -> dict[str, float]:
            text = request("GET", f"{n.url}/metrics")[1].decode()
            return {k: float(v) for k, _, v in (line.partition(" ") for line in
                    text.splitlines()) if k.startswith("nvpair_trace_spans_")}

        ta = time.time()
        answering, bad_a = routed()
        received = self.collector.received
        self.collector.hang = True
        t0 = time.time()
        hung, bad_h = routed()
        time.sleep(TRACE_TIMEOUT_S + 1.5)  # (the last export's timeout, and /metrics' 1 s)
        t1 = time.time()
        counts = spans()
        # reads while routed requests come: the answering half is the reference
        before = target.poller.window(ta, t0)
        reads = target.poller.window(t0, t1)
        p50 = [statistics.median(answering), statistics.median(hung)]
        p99 = [answering[int(len(answering) * 0.99) - 1], hung[int(len(hung) * 0.99) - 1]]
        why = []
        if bad_a or bad_h:
            why.append(f"{bad_a} and {bad_h} requests not 200")
        if not received:
            why.append("the collector got no span while it answered")
        if p50[1] > p50[0] + TRACED_P50_MS:
            why.append(f"routed p50 {p50[1]:.2f} ms hung against {p50[0]:.2f} ms answering")
        if p99[1] > TRACED_P99_X * max(p99[0], QUIET_FLOOR_MS):
            why.append(f"routed p99 {p99[1]:.1f} ms hung against {p99[0]:.1f} ms answering")
        allowed = 2 * max(before["p99_ms"] or 0.0, QUIET_FLOOR_MS)
        if reads["p99_ms"] is not None and reads["p99_ms"] > allowed:
            why.append(f"read p99 {reads['p99_ms']:.0f} ms hung against "
                       f"{before['p99_ms']} ms answering")
        if counts.get("nvpair_trace_spans_dropped_total", 0) <= 0:
            why.append("no span counted as dropped while the collector hung")
        return {"ok": not why, "why": "; ".join(why), "tried": 2 * TRACED_REQUESTS,
                "p50_ms": [round(x, 2) for x in p50], "p99_ms": [round(x, 2) for x in p99],
                "spans": counts, "reads_from": t0, "reads_to": t1,
                "reason": f"routed p50 {p50[0]:.2f} -> {p50[1]:.2f} ms, p99 {p99[0]:.1f} -> "
                          f"{p99[1]:.1f} ms, read p99 {before['p99_ms']} -> {reads['p99_ms']} "
                          "ms (answering -> hung); dropped "
                          f"{counts.get('nvpair_trace_spans_dropped_total', 0):.0f}, "
                          f"exported {counts.get('nvpair_trace_spans_exported_total', 0):.0f}"}

    # -- an eviction under a long stream ---------------------------------------------------------

    def prepare_evict(self) -> None:
        # room for one: each is planned at its 100 MB (a floor: a simulator holds 20-40 MB
        # of host memory, which the memory watch reads within seconds of its start)
        od = "activation = 'on_demand'\nmemory_bytes = 100000000\nstop_grace_s = 2\n"
        sim = self._sim_openai("--load-s", "0.5", "--token-rate", "20")
        body = ("[activation]\nmemory_budget_bytes = 150000000\nqueue_wait_s = 40\n"
                + self._managed("od-a", "od-a", sim, od) + self._managed("od-b", "od-b", sim, od))
        self._settle_own(self._start_own("evict", "nvpair-evict", body))

    def case_evict(self) -> dict[str, Any]:
        """A stream of EVICT_TOKENS tokens (5 s) from on-demand engine A, room for one
        engine, then a request for B: A's stream ends whole with [DONE], B answers 200."""
        n = self.targets["evict"].nvpair
        stream = clients.Stream(n.host, n.port, "od-a", EVICT_TOKENS, timeout=60)
        stream.start()
        if not stream.chunk.wait(20) or not stream.contents:
            stream.join(5)
            return {"ok": False, "why": f"A's stream never began (status {stream.status}, "
                                        f"{stream.failure or 'no content'})"}
        time.sleep(1.0)
        t_b = time.monotonic()
        try:
            b_status, b_body = clients.get(n.host, n.port, "/v1/chat/completions",
                                           method="POST", body=clients.chat_body("od-b"),
                                           headers={"Content-Type": "application/json"},
                                           timeout=50)
        except (OSError, http.client.HTTPException) as exc:
            b_status, b_body = 0, str(exc).encode()
        b_s = time.monotonic() - t_b
        stream.join(60)
        why = []
        if stream.is_alive():
            why.append("A's stream still open after 60 s")
        elif not stream.done or stream.error or stream.contents < EVICT_TOKENS:
            why.append(f"A's stream was cut after {stream.contents} of {EVICT_TOKENS} chunks"
                       + (f" ({stream.error[:120]})" if stream.error else "")
                       + (f" ({stream.failure})" if stream.failure else ""))
        if b_status != 200:
            why.append(f"B answered {b_status or 'nothing'}: {b_body[:120]!r}")
        return {"ok": not why, "why": "; ".join(why), "tried": 2,
                "a_chunks": stream.contents, "a_done": stream.done, "a_error": stream.error,
                "b_status": b_status, "b_s": round(b_s, 2),
                "reason": f"A: {stream.contents} chunks, "
                          f"{'[DONE]' if stream.done else stream.error[:80] or 'cut'}; "
                          f"B: {b_status} after {b_s:.1f} s"}

    def _slow_reads(self, key: str, t0: float) -> str:
        """Why the reads of target ``key`` since ``t0`` (unix time) were not fast ('')."""
        reads = self.targets[key].poller.window(t0, time.time())
        if reads["p99_ms"] is not None and reads["p99_ms"] > READ_FAST_MS:
            return f"read p99 {reads['p99_ms']:.0f} ms (allowed {READ_FAST_MS:g})"
        return ""

    # -- a peer whose adverts flap ---------------------------------------------------------------

    def _flapper(self) -> clients.Flapper:
        return clients.Flapper(HOST, self.main.port, self.cluster_token, "flapper",
                               f"http://{HOST}:{free_port()}", every_s=FLAP_EVERY_S)

    def case_flap(self) -> dict[str, Any]:
        """A peer's adverts every 100 ms for FLAP_S, its 120 models there and gone in turn,
        a new boot every tenth: listed and unlisted, memory bounded, then it leaves."""
        pid = self.main.pid
        flap = self._flapper()
        probe = flap.ids[0]
        rss0 = rss_mb(pid)
        began = time.time()
        flap.start()
        seen: dict[bool, int] = {True: 0, False: 0}
        mid = end = rss0
        t0 = time.monotonic()
        while time.monotonic() - t0 < FLAP_S:
            time.sleep(0.15)
            seen[probe in self._cluster_models(self.main.url)] += 1
            if time.monotonic() - t0 < FLAP_S / 2:
                mid = rss_mb(pid)
        end = rss_mb(pid)
        flap.stop.set()
        flap.join(10)
        time.sleep(1.0)
        after = self._cluster_models(self.main.url)
        why = [w for w in [self._slow_reads("main", began)] if w]
        bad = {s: c for s, c in flap.answers.items() if s != 204}
        if bad:
            why.append(f"adverts answered {bad}")
        if not seen[True] or not seen[False]:
            why.append(f"the flapping models were listed in {seen[True]} of "
                       f"{seen[True] + seen[False]} looks (expected some and not all)")
        if probe in after:
            why.append("the flapping peer's models still listed 1 s after it left")
        if end - mid > FLAP_RSS_HALF_MB or end - rss0 > FLAP_RSS_MB:
            why.append(f"RSS {rss0:.0f} -> {mid:.0f} -> {end:.0f} MB (allowed +"
                       f"{FLAP_RSS_HALF_MB:g} over the second half, +{FLAP_RSS_MB:g} in all)")
        return {"ok": not why, "why": "; ".join(why), "tried": flap.sent,
                "listed_looks": seen, "rss_mb": [rss0, mid, end],
                "reason": f"{flap.sent} adverts; listed in {seen[True]} of "
                          f"{seen[True] + seen[False]} looks; RSS {rss0:.0f} -> {mid:.0f} -> "
                          f"{end:.0f} MB"}

    # -- an SSE client that never reads ----------------------------------------------------------

    def case_sse_silent(self) -> dict[str, Any]:
        """GET /v1/events from a client that never reads while a peer flaps (events of
        tens of KiB, ten a second): nvpair drops it after docs/api.md's 30 s, its memory
        bounded meanwhile."""
        pid, port = self.main.pid, self.main.port
        rss0 = rss_mb(pid)
        flap = self._flapper()
        sock = clients.silent_events(HOST, port)
        mine = f":{sock.getsockname()[1]}"
        began = time.time()
        flap.start()
        t0 = time.monotonic()
        dropped_s = None
        peak = rss0
        try:
            while time.monotonic() - t0 < SSE_DROP_S + SSE_SLACK_S:
                time.sleep(0.5)
                peak = max(peak, rss_mb(pid))
                if not any(peer.endswith(mine) for _, _, peer in sockets(pid)):
                    dropped_s = round(time.monotonic() - t0, 1)
                    break
        finally:
            flap.stop.set()
            flap.join(10)
            sock.close()
        streams = None
        with contextlib.suppress(Exception):
            for line in request("GET", f"{self.main.url}/metrics")[1].decode().splitlines():
                if line.startswith("nvpair_events_streams "):
                    streams = int(float(line.split()[1]))
        why = [w for w in [self._slow_reads("main", began)] if w]
        if dropped_s is None:
            why.append(f"the client that never reads was still connected after "
                       f"{SSE_DROP_S + SSE_SLACK_S:g} s")
        if peak - rss0 > SSE_RSS_MB:
            why.append(f"RSS {rss0:.0f} -> {peak:.0f} MB with the client held "
                       f"(allowed +{SSE_RSS_MB:g})")
        if dropped_s is not None and streams:
            why.append(f"{streams} event streams still counted after the drop")
        return {"ok": not why, "why": "; ".join(why), "tried": flap.sent,
                "dropped_after_s": dropped_s, "rss_mb": [rss0, peak], "streams_after": streams,
                "reason": f"dropped after {dropped_s} s; RSS {rss0:.0f} -> peak {peak:.0f} MB; "
                          f"{flap.sent} adverts meanwhile"}

    # -- a group rank killed while a request streams through the head ----------------------------

    def prepare_group(self) -> None:
        from tests.group.nodes import sim_manifest

        wd = self.workdir
        manifest = sim_manifest(wd / "group-sim.json", head_extra=("--token-rate", "20"))
        port, engine_port, dist_port = free_port(), free_port(), free_port()
        hosts = [f"127.0.0.{i + 1}" for i in range(3)]
        names = [f"g{i}" for i in range(3)]
        nodes: list[Nvpair] = []
        for i, host in enumerate(hosts):
            peers = "".join(f"[[peers]]\nurl = 'http://{h}:{port}'\nname = '{names[j]}'\n"
                            for j, h in enumerate(hosts) if j != i)
            cfg = wd / f"nvpair-{names[i]}.toml"
            cfg.write_text(
                f"listen = '{host}:{port}'\nnode = '{names[i]}'\n"
                f"log_dir = '{wd / f'logs-{names[i]}'}'\n"
                f"state_dir = '{wd / f'state-{names[i]}'}'\n"
                f"[[engines]]\nname = 'g'\nkind = '{manifest}'\nmanaged = true\n"
                f"model = 'big-model'\nhost = '{host}'\nport = {engine_port}\n"
                f"stop_grace_s = 3\n"
                f"[engines.probes.ready]\ninterval_s = 0.25\ntimeout_s = 0.25\n"
                f"[engines.probes.health]\ninterval_s = 1\ntimeout_s = 1\n"
                f"[engines.group]\nranks = {json.dumps(names)}\ndist_port = {dist_port}\n"
                f"rank_lost_grace_s = 2\nfence_after_s = 4\n"
                f"restart_backoff = {{initial_s = 0.5, max_s = 2}}\n{peers}"
                f"[cluster]\ninterval_s = 1\ntoken_file = '{wd / 'cluster-token'}'\n")
            nodes.append(Nvpair(f"nvpair-{names[i]}", cfg, wd / f"nvpair-{names[i]}.log",
                                wd / f"state-{names[i]}", self.nofile0))
        self.group_nodes = nodes
        for n in nodes:
            n.start()
        for n in nodes:
            self._wait_up(n)
        head = nodes[0]
        self.targets["group"] = Target(head, Poller(self.procs, "poll-group", head.url))
        self._wait_group(head, lambda d: d.get("state") == "ready", 60, "the group ready")
        self._settle_own(self.targets["group"])

    def _wait_group(self, head: Nvpair, predicate: Callable[[dict[str, Any]], bool],
                    within: float, what: str) -> dict[str, Any]:
        deadline = time.monotonic() + within
        doc: dict[str, Any] = {}
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                doc = get_json(f"{head.url}/v1/groups/g", timeout=3)
                if predicate(doc):
                    return doc
            time.sleep(0.1)
        raise RuntimeError(f"{what} not within {within:g} s (last: state "
                           f"{doc.get('state')}, epoch {doc.get('epoch')}, {doc.get('error')})")

    def case_group(self) -> dict[str, Any]:
        """A stream through the group's head (20 s of tokens), then kill -9 of rank 2's
        process: the stream ends with an error event at once, the group is ready again in a
        new epoch, and no process of the old epoch is left."""
        head = self.group_nodes[0]
        doc = get_json(f"{head.url}/v1/groups/g")
        epoch, pid = doc["epoch"], doc["ranks"][2]["pid"]
        stream = clients.Stream(head.host, head.port, "big-model", 400, timeout=60)
        stream.start()
        if not stream.chunk.wait(15) or not stream.contents:
            stream.join(5)
            return {"ok": False, "why": f"the stream never began (status {stream.status}, "
                                        f"{stream.failure or 'no content'})"}
        time.sleep(0.5)
        began = time.time()
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        stream.join(GROUP_END_S)
        ended = None if stream.ended_at is None else round(stream.ended_at - killed, 2)
        why = []
        if stream.is_alive():
            why.append(f"the stream was still open {GROUP_END_S:g} s after the rank died")
        elif stream.done:
            why.append("the stream ended with [DONE], as if whole")
        elif not stream.error:
            why.append(f"the stream ended with no error event ({stream.failure or 'closed'})")
        recovered = None
        try:
            self._wait_group(head, lambda d: d.get("state") == "ready" and d["epoch"] > epoch,
                             40, "ready again in a new epoch")
            recovered = round(time.monotonic() - killed, 1)
        except RuntimeError as exc:
            why.append(str(exc))
        old = epoch_processes(epoch)
        deadline = time.monotonic() + 10
        while old and time.monotonic() < deadline:
            time.sleep(0.2)
            old = epoch_processes(epoch)
        if old:
            why.append(f"{len(old)} process(es) of epoch {epoch} still running")
        if slow := self._slow_reads("group", began):
            why.append(slow)
        return {"ok": not why, "why": "; ".join(why), "tried": 1, "stream_ended_s": ended,
                "error_event": stream.error, "ready_again_s": recovered,
                "reason": f"the stream ended {ended} s after the kill"
                          + (f" with: {stream.error[:60]}" if stream.error else "")
                          + f"; ready again after {recovered} s"}

    def finish_group(self) -> None:
        for n in self.group_nodes:
            if n.alive():
                assert n.popen is not None
                n.popen.terminate()
        began = time.monotonic()
        for n in self.group_nodes:
            n.wait_exit()
        codes = [n.popen.returncode if n.popen else None for n in self.group_nodes]
        print(f"   (the group's nodes exited {codes} within "
              f"{time.monotonic() - began:.1f} s of SIGTERM)", flush=True)
        self._stop_own("group")

    # -- signals ---------------------------------------------------------------------------------

    def prepare_signals(self) -> None:
        target = self.targets.get("signals")
        if target is not None and target.nvpair.alive():
            return
        if target is None:
            command = [PY, "-m", "nvpair.sim", "llamacpp", "-m", "{model}", "--host", "{host}",
                       "--port", "{port}", "--no-control", "--load-s", "0.2",
                       "--ignore-sigterm"]
            body = (f"[[engines]]\nname = 'stubborn'\nkind = 'llamacpp'\nmanaged = true\n"
                    f"port = {free_port()}\nmodel = '/models/chaos-stubborn.gguf'\n"
                    f"command = {json.dumps(command)}\nstop_grace_s = {SIGNAL_GRACE_S}\n")
            target = self._start_own("signals", "nvpair-signals", body)
        else:  # the last case ended it: the same config again
            target.nvpair.start()
            self._wait_up(target.nvpair)
        if not self._wait_engine_ready("stubborn", 20, target.nvpair):
            raise RuntimeError("the engine that ignores SIGTERM was not ready within 20 s")
        self._settle_own(target)

    def case_sighup(self) -> dict[str, Any]:
        """SIGHUP (a closed terminal): nvpair keeps running, and so does its engine."""
        n = self.targets["signals"].nvpair
        pid = self._engine("stubborn", n).get("pid")
        t0 = time.time()
        os.kill(n.pid, signal.SIGHUP)
        time.sleep(2.0)
        why = []
        if not n.alive():
            why.append(f"nvpair exited on SIGHUP (exit {n.popen.poll() if n.popen else '?'})")
        if not pid or not _alive(pid):
            why.append(f"its engine (pid {pid}) is gone")
        elif n.alive() and self._engine("stubborn", n).get("state") != "ready":
            why.append(f"its engine is {self._engine('stubborn', n).get('state')}")
        return {"ok": not why, "why": "; ".join(why), "engine_pid": pid, "reads_from": t0,
                "reason": "alive after SIGHUP" if n.alive() else "nvpair gone"}

    def case_double_term(self) -> dict[str, Any]:
        """SIGTERM, then SIGTERM again 1 s later, while the engine (which ignores SIGTERM)
        is in its stop grace: nvpair exits only after its engine is gone."""
        n = self.targets["signals"].nvpair
        assert n.popen is not None
        pid = self._engine("stubborn", n).get("pid")
        t0 = time.time()
        n.popen.send_signal(signal.SIGTERM)
        time.sleep(1.0)
        n.popen.send_signal(signal.SIGTERM)
        start = time.monotonic()
        try:
            code = n.popen.wait(SIGNAL_GRACE_S + 10)
        except subprocess.TimeoutExpired:
            code = None
        took = round(time.monotonic() - start + 1.0, 1)
        engine_alive = bool(pid) and _alive(int(pid))
        why = []
        if not pid:
            why.append("the engine had no pid before the signals")
        if code is None:
            why.append(f"nvpair still running {SIGNAL_GRACE_S + 11:g} s after the first SIGTERM")
        elif engine_alive:
            why.append(f"nvpair exited ({code}) while its engine (pid {pid}) still ran")
        return {"ok": not why, "why": "; ".join(why), "tried": 2, "exit_code": code,
                "exit_s": took, "engine_alive_at_exit": engine_alive, "reads_to": t0,
                "reason": f"nvpair exited {code} after {took} s; engine "
                          f"{'still running' if engine_alive else 'gone'}"}

    def cases(self) -> list[Case]:
        out = [Case("baseline", "nothing (the poller alone)", self.case_idle)]
        out += [Case(f"engine:{k}", f"an engine answers {k.replace('_', ' ')}",
                     lambda k=k: self.case_engine(k)) for k in ENGINE_KINDS]
        out += [
            Case("peer:garbage", "a peer answers pushes with garbage", self.case_peer),
            Case("peer:adverts", "adverts: deep, not UTF-8, not JSON, bad URLs; routed",
                 self.case_adverts),
            Case("etcd:garbage", "etcd answers HTML, truncated, wrong types, bad base64",
                 self.case_etcd, target="etcd"),
            Case("client:slow-poller", "one keep-alive connection polled every 10 s",
                 self.case_slow_poller),
            Case("client:half-closed", "900 clients that half-close or close",
                 self.case_half_closed),
            Case("client:slow-requests", "20 slow headers + 20 slow bodies",
                 self.case_slow_requests),
            Case("client:idle-3000", "3,000 idle connections, then a new client",
                 self.case_idle_3000),
            Case("client:big-headers", "100 KiB header, 200 headers, 64 KiB URL",
                 self.case_big_headers),
            Case("browser", "cross-site stop, rebound Host, router POST not JSON",
                 self.case_browser),
            Case("sigkill-restart", "SIGKILL of nvpair with a managed engine, restart",
                 self.case_sigkill),
            Case("flood:yes", "a managed engine runs `yes`", lambda: self.case_flood("flood-yes"),
                 target="flood", prepare=self.prepare_flood),
            Case("flood:long-lines", "a managed engine writes lines of 20,000 characters",
                 lambda: self.case_flood("flood-long"), target="flood",
                 prepare=self.prepare_flood, finish=lambda: self._stop_own("flood")),
            Case("on-demand:burst", f"{BURST} requests at once at a cold on-demand engine",
                 self.case_burst, target="burst", prepare=self.prepare_burst,
                 finish=lambda: self._stop_own("burst")),
            Case("on-demand:evict", "a request for B while A streams (room for one)",
                 self.case_evict, target="evict", prepare=self.prepare_evict,
                 finish=lambda: self._stop_own("evict")),
            Case("tracing:hung-collector", "the OTLP collector accepts and never answers",
                 self.case_traced, target="traced", prepare=self.prepare_traced,
                 finish=self.finish_traced),
            Case("peer:flapping", "a peer's adverts flap every 100 ms", self.case_flap),
            Case("client:sse-silent", "a /v1/events client that never reads",
                 self.case_sse_silent),
            Case("group:rank-killed", "kill -9 of a rank while a request streams via the head",
                 self.case_group, target="group", prepare=self.prepare_group,
                 finish=self.finish_group),
            Case("signal:hup", "SIGHUP of nvpair (a closed terminal)", self.case_sighup,
                 target="signals", prepare=self.prepare_signals),
            Case("signal:double-term", "SIGTERM twice, the engine ignoring SIGTERM",
                 self.case_double_term, target="signals", prepare=self.prepare_signals,
                 ends=True),
        ]
        return out

    def close(self) -> None:
        nvpairs = [getattr(self, "main", None), getattr(self, "etcdn", None),
                   *(t.nvpair for t in self.targets.values()), *self.group_nodes]
        for n in dict.fromkeys(nvpairs):
            if n is not None:
                with contextlib.suppress(Exception):
                    n.stop()
        self.procs.close()
        POLITE.close()
        for pid in self.orphans:  # an engine our killed nvpair left behind
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
        for pid in left_behind(set(), set(), set()):  # whatever else of this run is left
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie is not running
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    return False


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, parent pid, process group) of ``pid``; None when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return fields[0], int(fields[1]), int(fields[2])


def left_behind(live: set[int], ours: set[int], known: set[int]) -> dict[int, str]:
    """Processes of this run's engines (MARK in their environment) that no live nvpair
    runs: not a descendant of a live nvpair (``live``), not an engine (or in the process
    group of one) that a live nvpair reports (``known``: adopted after a restart), and not
    an nvpair itself (``ours``). pid -> the start of its command line."""
    mark = f"{MARK}={RUN_ID}".encode()
    out: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in ours:
            continue
        pid = int(entry)
        try:
            if mark not in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                continue
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        stat = _stat(pid)
        if stat is None or stat[0] == "Z" or pid in known or stat[2] in known:
            continue
        up, seen = stat[1], 0
        while up > 1 and up not in live and seen < 64:
            parent = _stat(up)
            up, seen = (parent[1] if parent else 0), seen + 1
        if up in live:
            continue
        out[pid] = " ".join(a.decode(errors="replace") for a in argv if a)[:60]
    return out


def epoch_processes(epoch: int) -> list[int]:
    """This run's processes of a group's ``epoch`` (NVPAIR_GROUP_EPOCH in their
    environment), zombies aside."""
    mark, want = f"{MARK}={RUN_ID}".encode(), f"NVPAIR_GROUP_EPOCH={epoch}".encode()
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                env_ = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            stat = _stat(int(entry))
            if mark in env_ and want in env_ and stat is not None and stat[0] != "Z":
                out.append(int(entry))
    return out


# -- report ----------------------------------------------------------------------------------


def table(rows: list[dict[str, Any]]) -> Table:
    out = []
    for r in rows:
        rd = r["reads"]
        gone = r["crashed"] or r.get("ended", False)
        out.append((
            r["case"], r["fault"], f"{r['result'].get('tried', 1):,}",
            "1" if r["crashed"] else "0", str(r["tracebacks"]),
            "-" if gone else f"{r['close_wait']} / {r['close_wait_baseline']}",
            "-" if gone else f"{r['settled_s']:g}",
            "-" if gone else
            f"{r['fds']} / {r['fds_baseline']} ({r['fds'] - r['fds_baseline']:+d})",
            "-" if rd["p99_ms"] is None else f"{rd['p99_ms']:.1f}",
            str(r.get("engines_left", 0)),
            "pass" if r["passed"] else "FAIL"))
    return Table("Chaos: containment", (
        "case", "fault", "tried", "crashes", "tracebacks", "CLOSE-WAIT / baseline", "settled s",
        "fds / baseline", "read p99 ms", "engines left", "result"), out,
        f"After each case nvpair gets {SETTLE_S:g} s for CLOSE-WAIT and fds to come back to "
        f"the baseline (fds within {FD_SLACK}); reads are /v1/models and /healthz, each "
        f"polled every 50 ms on a keep-alive connection during the case; engines left are "
        f"processes of the run's engines that no live nvpair runs or knows, "
        f"{LEFT_SETTLE_S:g} s after the case; a case fails on a crash, a traceback, a p99 "
        f"over {P99_MAX_MS:g} ms, a failed read, an engine left, or its own check. Cases "
        f"that end their nvpair on purpose (signals) show no sockets after it.")


def reasons(rows: list[dict[str, Any]]) -> Table:
    out = []
    for r in rows:
        res = r["result"]
        seen = res.get("reason") or res.get("answers") or res.get("adverts") or ""
        if isinstance(seen, dict):
            seen = ", ".join(f"{k}: {v}" for k, v in seen.items())
        out.append((r["case"], str(seen)[:160], r["why"][:240] or "-"))
    return Table("What nvpair said, and why a case failed",
                 ("case", "nvpair's answer or published error", "failed because"), out)


BEGIN = "<!-- chaos:begin (written by python -m benchmarks.chaos --doc; do not edit) -->"
END = "<!-- chaos:end -->"


def update_doc(path: Path, section: str) -> None:
    text = path.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{path}: no {BEGIN} ... {END} markers")
    head, rest = text.split(BEGIN, 1)
    path.write_text(head + BEGIN + "\n" + section + END + rest.split(END, 1)[1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.chaos",
                                description=__doc__.split("\n")[0])
    p.add_argument("--keep", action="store_true", help="keep the work folder (configs, logs)")
    p.add_argument("--only", default="", help="comma-separated case names (prefixes)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "chaos.json"))
    p.add_argument("--doc", action="store_true",
                   help="write the table into docs/reliability.md (between its markers)")
    args = p.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="nvpair-chaos-"))
    print(f"nvpair chaos suite; work folder {workdir}", flush=True)
    started = time.monotonic()
    box = machine()  # the load average at the start
    suite = Suite(workdir)
    try:
        suite.setup()
        wanted = [w for w in args.only.split(",") if w]
        for case in suite.cases():
            if not wanted or any(case.name.startswith(w) for w in wanted):
                suite.run(case)
    finally:
        suite.close()
    rows = suite.rows
    ts = [table(rows), reasons(rows)]
    sys.stdout.write(render_text(ts))
    meta = {"date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "command": "nox -s chaos", "quick": False, "machine": box,
            "nvpair_commit": git_commit(), "loadavg_at_end": [round(x, 2)
                                                              for x in os.getloadavg()],
            "elapsed_s": round(time.monotonic() - started, 1)}
    out = Path(args.out).resolve()
    meta["json"] = str(out.relative_to(ROOT)) if out.is_relative_to(ROOT) else str(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    if args.doc:
        update_doc(ROOT / "docs" / "reliability.md", render_markdown(ts, meta))
        print("wrote docs/reliability.md (results section)")
    failed = [r["case"] for r in rows if not r["passed"]]
    print(f"\n{len(rows)} cases, {len(failed)} failed"
          + (f": {', '.join(failed)}" if failed else "") + f"; {meta['elapsed_s']:.0f} s")
    if failed or args.keep:
        print(f"work folder kept: {workdir}")
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
