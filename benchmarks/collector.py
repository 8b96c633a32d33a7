"""An OTLP/HTTP trace collector stand-in for the benchmarks and the chaos suite.

``python -m benchmarks.collector --port P [--hang]``: serves until killed (the router
benchmark runs it as a process of its own, so that its work is not the load generator's).
In-process, ``Collector()`` runs in threads (the chaos suite switches it to ``hang``).
It reads each POST and answers 200 without decoding it, or, hung, reads it and never
answers; the connection stays open until the client gives up or ``close``.
"""

from __future__ import annotations

import argparse
import contextlib
import socket
import threading


class Collector:
    """An OTLP/HTTP collector stand-in on 127.0.0.1, in threads of this process: it reads
    each POST and answers 200, or, once ``hang`` is set, reads and never answers (the
    connection stays open until ``close``). ``received``: the POSTs it answered."""

    def __init__(self, port: int = 0) -> None:
        self.hang = False
        self.received = 0
        self._sock = socket.create_server(("127.0.0.1", port))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}/v1/traces"
        self._held: list[socket.socket] = []
        self._closed = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            self._held.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        buffer = b""
        with contextlib.suppress(OSError):
            while True:
                while b"\r\n\r\n" not in buffer:
                    data = conn.recv(65536)
                    if not data:
                        return
                    buffer += data
                head, _, buffer = buffer.partition(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value.strip())
                while len(buffer) < length:
                    data = conn.recv(65536)
                    if not data:
                        return
                    buffer += data
                buffer = buffer[length:]
                if self.hang:  # read, never answered: until the client gives up
                    while conn.recv(65536):
                        pass
                    return
                self.received += 1
                conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")

    def close(self) -> None:
        self._closed.set()
        self._sock.close()
        for conn in self._held:
            with contextlib.suppress(OSError):
                conn.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.collector")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--hang", action="store_true", help="read each POST, never answer")
    args = p.parse_args(argv)
    collector = Collector(args.port)
    collector.hang = args.hang
    threading.Event().wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
