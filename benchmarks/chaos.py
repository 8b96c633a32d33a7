"""``python -m benchmarks.chaos`` (``nox -s chaos``): a suite that proves containment.

It drives a real ``nvpair serve`` process from outside: real simulators (SGLang, vLLM, a
managed llama.cpp), hostile servers of its own (``benchmarks/chaos_hostile.py``: an engine,
a peer and an etcd answering garbage), misbehaving clients (``benchmarks/chaos_clients.py``)
and a SIGKILL of nvpair followed by a restart. A poller process
(``benchmarks/chaos_poll.py``) reads ``/v1/models`` and ``/healthz`` all along.

After each case: is nvpair alive (crashes), how many tracebacks its log got since the case
began, whether its CLOSE-WAIT sockets and fds came back to the baseline within
``SETTLE_S``, the read p99 during the case, and the case's own check (what nvpair promises
under that fault). Prints a table; the exit status is 1 if any case failed. Loopback only;
about three minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import resource
import secrets
import shutil
import signal
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
from benchmarks.procs import (
    PY,
    ROOT,
    Procs,
    env,
    fd_count,
    free_port,
    machine,
    sockets,
    start_sim,
    tcp_states,
    wait_http,
)
from benchmarks.report import Table, render_markdown, render_text

HOST = "127.0.0.1"
POLITE = clients.Polite()
request = POLITE.request
get_json = POLITE.get_json
#: how long CLOSE-WAIT and fds get to come back to the baseline after a case
SETTLE_S = 3.0
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
#: the request head and body deadlines the suite configures (when this nvpair has them), so
#: that the slow-client case is bounded; the defaults are 10 s and 60 s
DEADLINE_S = 4.0


def deadlines() -> str:
    """The config lines for short head and body deadlines, if this nvpair knows them."""
    from nvpair.config import Config

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
        self.url = ""
        self.port = 0
        self.popen: subprocess.Popen[bytes] | None = None
        for line in config.read_text().splitlines():
            if line.startswith("listen"):
                self.port = int(line.split(":")[-1].strip("' "))
        self.url = f"http://{HOST}:{self.port}"

    def start(self) -> None:
        e = env() | {"XDG_STATE_HOME": str(self.state)}
        soft = self.nofile

        def limit() -> None:
            hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

        with open(self.log, "ab") as out:
            self.popen = subprocess.Popen(
                [PY, "-m", "nvpair", "serve", "--config", str(self.config)], cwd=ROOT, env=e,
                stdout=out, stderr=out, stdin=subprocess.DEVNULL, preexec_fn=limit)

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
        if self.alive():
            assert self.popen is not None
            self.popen.terminate()
            try:
                self.popen.wait(30)
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
    def __init__(self, name: str, fault: str, run: Callable[[], dict[str, Any]],
                 target: str = "main") -> None:
        self.name, self.fault, self.run, self.target = name, fault, run, target


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
        self.poller = Poller(self.procs, "poll-main", self.main.url)
        self.poller_etcd = Poller(self.procs, "poll-etcd", self.etcdn.url)
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

    def _engine(self, name: str) -> dict[str, Any]:
        try:
            doc: dict[str, Any] = get_json(f"{self.main.url}/v1/engines/{name}", timeout=3)
            return doc
        except Exception:
            return {}

    def _wait_engine_ready(self, name: str, within: float) -> bool:
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            if self._engine(name).get("state") == "ready":
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
        n = self.etcdn if case.target == "etcd" else self.main
        poller = self.poller_etcd if case.target == "etcd" else self.poller
        offset = n.offset()
        t0 = time.time()
        print(f"-- {case.name} ...", flush=True)
        try:
            res = case.run()
        except Exception as exc:  # the case's own machinery failed: the case fails
            res = {"ok": False, "why": f"case error: {type(exc).__name__}: {exc}"}
        t1 = time.time()
        n = self.etcdn if case.target == "etcd" else self.main  # a restart may replace it
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
        log = n.since(offset) if n.log.exists() else ""
        tracebacks = log.count(TRACEBACK)
        reads = poller.window(res.get("reads_from", t0), t1)
        checks = []
        if not alive:
            checks.append(f"{n.name} died (exit {n.popen.poll() if n.popen else '?'})")
        if tracebacks:
            checks.append(f"{tracebacks} traceback(s): {first_exception(log)[:160]}")
        if cw > base["close_wait"]:
            checks.append(f"CLOSE-WAIT {cw} after {SETTLE_S:g} s (baseline {base['close_wait']})")
        if fd > base["fds"] + FD_SLACK:
            checks.append(f"{fd} fds after {SETTLE_S:g} s (baseline {base['fds']})")
        if reads["p99_ms"] is not None and reads["p99_ms"] > P99_MAX_MS:
            checks.append(f"read p99 {reads['p99_ms']:.0f} ms")
        if reads["errors"]:
            checks.append(f"{reads['errors']} failed reads")
        if not res.get("ok"):
            checks.append(res.get("why") or "its check failed")
        row = {"case": case.name, "fault": case.fault, "target": n.name,
               "seconds": round(t1 - t0, 1), "crashed": not alive, "tracebacks": tracebacks,
               "close_wait": cw, "close_wait_baseline": base["close_wait"], "fds": fd,
               "fds_baseline": base["fds"], "settled_s": settled, "reads": reads,
               "result": res, "passed": not checks, "why": "; ".join(checks)}
        self.rows.append(row)
        print(f"   {'pass' if row['passed'] else 'FAIL'} {row['why']}", flush=True)
        if not alive and case.target == "main" and case.name != "sigkill-restart":
            self._restart_main()

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
        ]
        return out

    def close(self) -> None:
        for n in (getattr(self, "main", None), getattr(self, "etcdn", None)):
            if n is not None:
                with contextlib.suppress(Exception):
                    n.stop()
        self.procs.close()
        POLITE.close()
        for pid in self.orphans:  # an engine our killed nvpair left behind
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)


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


# -- report ----------------------------------------------------------------------------------


def table(rows: list[dict[str, Any]]) -> Table:
    out = []
    for r in rows:
        rd = r["reads"]
        out.append((
            r["case"], r["fault"], f"{r['result'].get('tried', 1):,}",
            "1" if r["crashed"] else "0", str(r["tracebacks"]),
            "-" if r["crashed"] else f"{r['close_wait']} / {r['close_wait_baseline']}",
            "-" if r["crashed"] else f"{r['settled_s']:g}",
            "-" if r["crashed"] else
            f"{r['fds']} / {r['fds_baseline']} ({r['fds'] - r['fds_baseline']:+d})",
            "-" if rd["p99_ms"] is None else f"{rd['p99_ms']:.1f}",
            "pass" if r["passed"] else "FAIL"))
    return Table("Chaos: containment", (
        "case", "fault", "tried", "crashes", "tracebacks", "CLOSE-WAIT / baseline", "settled s",
        "fds / baseline", "read p99 ms", "result"), out,
        f"After each case nvpair gets {SETTLE_S:g} s for CLOSE-WAIT and fds to come back to "
        f"the baseline (fds within {FD_SLACK}); reads are /v1/models and /healthz, each "
        f"polled every 50 ms on a keep-alive connection during the case; a case fails on a "
        f"crash, a traceback, a p99 over {P99_MAX_MS:g} ms, a failed read, or its own check.")


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
