"""The chaos suite's read poller: ``python -m benchmarks.chaos_poll URL OUT``.

Two keep-alive connections, one polling ``/v1/models`` and one ``/healthz``, each a request
every ``--every`` seconds (sequential: the next waits for the answer). Each answer is one
line in OUT, flushed at once: ``<unix time> <path> <ms> <status>`` (status 0: no answer
within ``--timeout`` or a broken connection). Runs until SIGTERM.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from typing import TextIO

import trio

from benchmarks.httpc import Connection, HttpError


async def poll(host: str, port: int, path: str, every: float, limit_s: float,
               out: TextIO) -> None:
    conn = Connection(host, port)
    while True:
        t0 = time.time()
        start = time.perf_counter()
        status = 0
        with trio.move_on_after(limit_s):
            try:
                status, _ = await conn.get(path)
            except HttpError:
                status = 0
        if status == 0:
            await conn.aclose()
            conn = Connection(host, port)
        ms = (time.perf_counter() - start) * 1000
        out.write(f"{t0:.4f} {path} {ms:.2f} {status}\n")
        out.flush()
        await trio.sleep(max(0.0, every - (time.perf_counter() - start)))


async def main_async(url: str, out_path: str, every: float, limit_s: float) -> None:
    hostport = url.removeprefix("http://").rstrip("/")
    host, _, port = hostport.rpartition(":")
    with open(out_path, "a") as out:  # noqa: ASYNC230 (one open at start)
        async with trio.open_nursery() as nursery:
            for path in ("/v1/models", "/healthz"):
                nursery.start_soon(poll, host, int(port), path, every, limit_s, out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.chaos_poll")
    p.add_argument("url")
    p.add_argument("out")
    p.add_argument("--every", type=float, default=0.05)
    p.add_argument("--timeout", type=float, default=5.0)
    args = p.parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt):
        trio.run(main_async, args.url, args.out, args.every, args.timeout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
