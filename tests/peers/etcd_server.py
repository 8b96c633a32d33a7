"""A real etcd (Debian's ``etcd-server``) on loopback for the etcd backend's tests: random
ports, a temporary data dir, and the faults the tests need (freeze, restart)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import BinaryIO

import httpx2
import pytest
import trio
from tests.managed import free_port

ETCD = shutil.which("etcd")
SKIP_REASON = "etcd-server is not installed (CI: apt-get install -y etcd-server)"


class EtcdServer:
    def __init__(self, tmp: Path) -> None:
        self.client_port, self.peer_port = free_port(), free_port()
        self.data = tmp / "etcd-data"
        self.log = tmp / "etcd.log"
        self.proc: trio.Process | None = None
        self._log_file: BinaryIO | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.client_port}"

    async def start(self) -> None:
        assert ETCD is not None
        peer = f"http://127.0.0.1:{self.peer_port}"
        cmd = [ETCD, "--name", "t", "--data-dir", str(self.data),
               "--listen-client-urls", self.url, "--advertise-client-urls", self.url,
               "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
               "--initial-cluster", f"t={peer}", "--log-level", "warn"]
        self._log_file = self.log.open("ab")
        # etcd 3.4 refuses to start on arm64 unless told that it may
        env = {**os.environ, "ETCD_UNSUPPORTED_ARCH": "arm64"}
        self.proc = await trio.lowlevel.open_process(cmd, stdout=self._log_file,
                                                     stderr=subprocess.STDOUT, env=env)
        async with httpx2.AsyncClient(base_url=self.url, timeout=1, trust_env=False) as client:
            with trio.fail_after(20):
                while True:
                    try:
                        r = await client.post("/v3/maintenance/status", content=b"{}")
                        if r.status_code == 200:
                            return
                    except httpx2.TransportError:
                        pass
                    assert self.proc.returncode is None, self.log.read_text()[-2000:]
                    await trio.sleep(0.05)

    def freeze(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)

    async def stop(self) -> None:
        if self.proc is None:
            return
        os.kill(self.proc.pid, signal.SIGCONT)
        self.proc.terminate()
        with trio.move_on_after(10, shield=True):
            await self.proc.wait()
        if self.proc.returncode is None:
            self.proc.kill()
            with trio.move_on_after(5, shield=True):
                await self.proc.wait()
        if self._log_file is not None:
            self._log_file.close()
        self.proc = None


@asynccontextmanager
async def open_etcd(tmp: Path) -> AsyncIterator[EtcdServer]:
    if ETCD is None:
        pytest.skip(SKIP_REASON)
    server = EtcdServer(tmp)
    try:
        await server.start()
        yield server
    finally:
        with trio.move_on_after(30, shield=True):
            await server.stop()
