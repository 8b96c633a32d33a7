"""Listing pollers in their own process, so that the latencies they measure are nvpair's and
not the test process's (which also polls, parses and runs ss):

``python -m tests.peers.pollers --every 0.05 URL [URL ...]``

One poller per URL reads it every ``--every`` seconds until stdin closes, then prints one
JSON line: ``{"latencies": {url: [...]}, "errors": N}``.
"""

from __future__ import annotations

import argparse
import sys

import httpx2
import msgspec
import trio


async def run(urls: list[str], every: float) -> None:
    latencies: dict[str, list[float]] = {url: [] for url in urls}
    errors = 0

    async def poll(client: httpx2.AsyncClient, url: str) -> None:
        nonlocal errors
        while True:
            start = trio.current_time()
            try:
                r = await client.get(url)
                ok = r.status_code == 200
            except httpx2.HTTPError:
                ok = False
            latencies[url].append(trio.current_time() - start)
            errors += not ok
            await trio.sleep(every)

    async def until_stdin_closes() -> None:
        await trio.to_thread.run_sync(sys.stdin.read)

    limits = httpx2.Limits(max_connections=len(urls), max_keepalive_connections=len(urls))
    async with httpx2.AsyncClient(timeout=10, limits=limits, trust_env=False) as client, \
            trio.open_nursery() as nursery:
        for url in urls:
            nursery.start_soon(poll, client, url)
        await until_stdin_closes()
        nursery.cancel_scope.cancel()
    sys.stdout.write(msgspec.json.encode({"latencies": latencies, "errors": errors}).decode())
    sys.stdout.write("\n")
    sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--every", type=float, default=0.05)
    parser.add_argument("urls", nargs="+")
    args = parser.parse_args()
    trio.run(run, args.urls, args.every)


if __name__ == "__main__":
    main()
