"""A real Prometheus server scrapes a running nvpair (two simulated engines, a token) and
its HTTP API shows what nvpair exported: ``nvpair_engine_up`` for each engine and a
rising ``nvpair_probe_requests_total``. Skipped where Debian's ``prometheus`` is missing.

Prometheus is held to loopback: it listens on 127.0.0.1, its only target is nvpair's
127.0.0.1 port, and its config has no alerting, remote write or service discovery (it
has no update check or telemetry of its own); the test reads the sockets it holds
from /proc and finds only loopback addresses."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
from functools import partial
from pathlib import Path
from typing import Any

import httpx2
import pytest
import trio
from tests.managed import free_port, wait_state

from nvpair import service
from nvpair.config.settings import load_settings
from nvpair.sim import SimOptions, serve_sim

TOKEN = "prom-test-token"


def prometheus() -> str:
    path = shutil.which("prometheus")
    if path is None:
        pytest.skip("Prometheus is not installed (Debian: apt-get install prometheus; "
                    ".ci/run installs it)")
    return path


def scrape_config(tmp: Path, target: str) -> Path:
    token = tmp / "scrape-token"
    token.write_text(TOKEN + "\n")
    doc = {  # JSON is YAML: no YAML writer needed
        "global": {"scrape_interval": "500ms", "scrape_timeout": "500ms",
                   "evaluation_interval": "500ms"},
        "scrape_configs": [{
            "job_name": "nvpair",
            "metrics_path": "/metrics",
            "authorization": {"type": "Bearer", "credentials_file": str(token)},
            "static_configs": [{"targets": [target]}],
        }],
    }
    path = tmp / "prometheus.yml"
    path.write_text(json.dumps(doc))
    return path


async def query(client: httpx2.AsyncClient, promql: str) -> list[dict[str, Any]]:
    r = await client.get("/api/v1/query", params={"query": promql})
    if r.status_code != 200:
        return []
    doc = r.json()
    assert doc["status"] == "success", doc
    result: list[dict[str, Any]] = doc["data"]["result"]
    return result


async def test_prometheus_scrapes_engine_up_and_rising_probe_counts(nursery, tmp_path) -> None:
    binary = prometheus()
    kinds = ("vllm", "llamacpp")
    sims = [await nursery.start(serve_sim, SimOptions(kind=kind, model=f"m-{kind}"))
            for kind in kinds]
    probes = "[engines.probes.health]\ninterval_s = 0.5\ntimeout_s = 0.5\n"
    body = "".join(f"[[engines]]\nname = 'e-{kind}'\nkind = '{kind}'\nport = {sim.port}\n"
                   f"{probes}\n" for kind, sim in zip(kinds, sims, strict=True))
    (tmp_path / "token").write_text(TOKEN + "\n")
    conf = tmp_path / "nvpair.toml"
    conf.write_text(f"listen = '127.0.0.1:0'\ntoken_file = '{tmp_path / 'token'}'\n" + body)
    settings = load_settings(str(conf))
    with trio.fail_after(60):
        running = await nursery.start(service.run, settings)
        for name in ("e-vllm", "e-llamacpp"):
            await wait_state(running.board, name, "ready")
        target = running.url.removeprefix("http://").rstrip("/")
        web = free_port()
        log = (tmp_path / "prometheus.log").open("wb")
        argv = [binary, f"--config.file={scrape_config(tmp_path, target)}",
                f"--storage.tsdb.path={tmp_path / 'data'}",
                f"--web.listen-address=127.0.0.1:{web}", "--log.level=warn"]
        prom = trio.CancelScope()
        started: list[trio.Process] = []

        async def run_prometheus() -> None:
            with prom:
                async with trio.open_nursery() as inner:
                    started.append(await inner.start(partial(
                        trio.run_process, argv, stdout=log, stderr=log, check=False)))

        nursery.start_soon(run_prometheus)
        try:
            async with httpx2.AsyncClient(base_url=f"http://127.0.0.1:{web}") as client:
                up: dict[str, str] = {}
                first: float | None = None
                while True:
                    try:
                        up = {r["metric"]["engine"]: r["value"][1]
                              for r in await query(client, "nvpair_engine_up")}
                        total = await query(client, "sum(nvpair_probe_requests_total)")
                    except httpx2.TransportError:  # not listening yet
                        await trio.sleep(0.2)
                        continue
                    if total:
                        count = float(total[0]["value"][1])
                        first = count if first is None else first
                        if up == {"e-vllm": "1", "e-llamacpp": "1"} and count > first:
                            break
                    await trio.sleep(0.05)  # Prometheus' own pace: two scrapes a second
                targets = (await client.get("/api/v1/targets")).json()["data"]["activeTargets"]
                sockets = inet_sockets(started[0].pid)
        finally:
            prom.cancel()
            log.close()
    assert [(t["health"], t["scrapeUrl"]) for t in targets] == [
        ("up", f"http://{target}/metrics")]
    assert sockets and all(ip.startswith("127.") or ip in ("0.0.0.0", "::", "::1")
                           for ip in sockets), sockets  # loopback only (0.0.0.0: unconnected)


def _ip(hexaddr: str) -> str:
    raw = bytes.fromhex(hexaddr.split(":")[0])
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, raw[::-1])
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
    ip = socket.inet_ntop(socket.AF_INET6, words)
    return ip.removeprefix("::ffff:")


def inet_sockets(pid: int) -> list[str]:
    """The local and remote addresses of every TCP and UDP socket ``pid`` holds."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            link = os.readlink(fd)
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    found = []
    for table in ("tcp", "tcp6", "udp", "udp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            cols = line.split()
            if cols[9] in inodes:
                found += [_ip(cols[1]), _ip(cols[2])]
    return found
