"""llama.cpp RPC stand-ins: ``rpc-server`` on the ranks, and a head that needs them.

``python -m nvpair.sim.rpc serve -H HOST -p PORT`` stands for ``rpc-server``: after
``--listen-after-s`` (loading the backend) it listens and serves one client at a time, as
ggml-rpc's accept loop does; every connection it accepts is counted in ``--count-file`` (so
a test can tell that nothing but the head ever connected to it).

``python -m nvpair.sim.rpc head --rpc H:P,H:P -- ARGV...`` stands for ``llama-server
--rpc``: it connects to every rpc-server first and exits 1 if one refuses (the real head
aborts), then keeps those connections and becomes ``ARGV`` (``nvpair sim llamacpp ...``).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
from pathlib import Path

import trio


def _write(count_file: Path | None, count: int) -> None:
    if count_file is not None:
        count_file.write_text(f"{count}\n")


async def serve(host: str, port: int, listen_after_s: float, count_file: Path | None) -> None:
    await trio.sleep(listen_after_s)
    listeners = await trio.open_tcp_listeners(port, host=host)
    print(f"rpc-server listening on {host}:{port}", flush=True)
    count = 0
    _write(count_file, count)
    lock = trio.Lock()  # one client at a time: the next waits in the backlog

    async def one(stream: trio.SocketStream) -> None:
        nonlocal count
        count += 1
        _write(count_file, count)
        async with lock, stream:
            print(f"client {count} connected", flush=True)
            while await stream.receive_some(65536):
                pass
            print(f"client {count} left", flush=True)

    await trio.serve_listeners(one, listeners)


def head(addrs: str, argv: list[str]) -> int:
    kept = []
    for addr in (a for a in addrs.split(",") if a):
        host, _, port = addr.rpartition(":")
        try:
            sock = socket.create_connection((host.strip("[]"), int(port)), timeout=2)
        except OSError as exc:
            print(f"failed to connect to rpc server {addr}: {exc}", flush=True)
            return 1
        sock.set_inheritable(True)  # held for the life of the head, past the exec
        kept.append(sock)
        print(f"connected to rpc server {addr}", flush=True)
    if not argv:
        print("head: no command after --", flush=True)
        return 2
    os.execv(argv[0], argv)
    return 0  # (not reached)


def main(args: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m nvpair.sim.rpc")
    sub = p.add_subparsers(dest="role", required=True)
    s = sub.add_parser("serve", help="an rpc-server")
    s.add_argument("-H", "--host", default="127.0.0.1")
    s.add_argument("-p", "--port", type=int, default=50052)
    s.add_argument("--listen-after-s", type=float, default=0.0)
    s.add_argument("--count-file", type=Path, default=None)
    h = sub.add_parser("head", help="a head that connects to its rpc-servers, then runs ARGV")
    h.add_argument("--rpc", required=True, metavar="H:P,H:P")
    h.add_argument("argv", nargs=argparse.REMAINDER)
    ns = p.parse_args(args)
    if ns.role == "head":
        argv = ns.argv[1:] if ns.argv[:1] == ["--"] else ns.argv
        return head(ns.rpc, argv)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    try:
        trio.run(serve, ns.host, ns.port, ns.listen_after_s, ns.count_file)
    except KeyboardInterrupt:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
