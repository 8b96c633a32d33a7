"""The report's pollers and N back-to-back clients, as a process of its own.

``python -m benchmarks.pollers --target LABEL=URL#ENGINE [--target ...] --clients N
--duration S``

* periodic pollers of the engine's status (``--poll 5,5,10,1``: the broker's advertiser and
  the loaded-model watcher every 5 s, the desktop's remote status every 10 s, a status poll
  at 1/s); each is sequential, like a Go ticker loop: a tick that comes while its call is
  still running is skipped;
* ``--clients`` back-to-back clients, each alternating ``/v1/models`` and the status; with
  several targets each client goes round them in turn (client i starting at target i), so
  targets compared with each other get the same load at interleaved moments;
* ``--healthz S``: per target, a sequential ``GET /healthz`` every S seconds (series
  ``healthz``: the loop's own latency under the load, nothing behind it);
* every request has ``--timeout`` (a poller's is at most its interval); a timed-out request
  is an error and its connection is closed (as a client that gives up does). Requests
  still running when the window ends are reported as ``unfinished`` with how long they had
  waited.

The pollers run per target. Prints one JSON document on stdout: per target and series
(``models``, ``status``, ``poller_status``, ``status_all``) the count, errors by kind,
unfinished, and latency p50/p99/max in milliseconds.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

import msgspec
import trio

from benchmarks.httpc import Connection, HttpError


class Series:
    def __init__(self) -> None:
        self.latencies: list[float] = []
        self.errors: dict[str, int] = {}
        self.unfinished: list[float] = []

    def error(self, kind: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1

    def summary(self) -> dict[str, Any]:
        return summarize(self.latencies, self.errors, self.unfinished)


def quantile(ordered: Sequence[float], q: float) -> float | None:
    """Nearest-rank quantile of sorted values (None when empty)."""
    if not ordered:
        return None
    rank = max(1, math.ceil(q * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def summarize(latencies: list[float], errors: dict[str, int],
              unfinished: list[float]) -> dict[str, Any]:
    ordered = sorted(latencies)
    worst = max([*ordered[-1:], *unfinished], default=None)

    def ms(v: float | None) -> float | None:
        return None if v is None else round(v * 1000, 3)

    return {
        "ok": len(ordered),
        "errors": sum(errors.values()),
        "error_kinds": errors,
        "unfinished": len(unfinished),
        "p50_ms": ms(quantile(ordered, 0.50)),
        "p99_ms": ms(quantile(ordered, 0.99)),
        "max_ms": ms(ordered[-1] if ordered else None),
        # the longest wait seen, counting requests that never got an answer
        "worst_wait_ms": ms(worst),
        "unfinished_max_ms": ms(max(unfinished, default=None)),
    }


class Target:
    """One manager under load: its address, the engine whose status is read, its series."""

    def __init__(self, label: str, url: str, engine: str) -> None:
        split = urlsplit(url)
        assert split.hostname and split.port, url
        self.label = label
        self.host = split.hostname
        self.port = split.port
        self.status_path = f"/v1/engines/{engine}"
        self.series = {"models": Series(), "status": Series(), "poller_status": Series(),
                       "healthz": Series()}

    def connect(self) -> Connection:
        return Connection(self.host, self.port)

    def result(self) -> dict[str, Any]:
        out = {name: s.summary() for name, s in self.series.items()}
        status_all = Series()
        for name in ("status", "poller_status"):
            s = self.series[name]
            status_all.latencies += s.latencies
            status_all.unfinished += s.unfinished
            for kind, n in s.errors.items():
                status_all.errors[kind] = status_all.errors.get(kind, 0) + n
        out["status_all"] = status_all.summary()
        return out


class Load:
    def __init__(self, targets: list[Target], timeout: float) -> None:
        self.targets = targets
        self.timeout = timeout
        self.in_flight: dict[int, tuple[Series, float]] = {}
        self._next_id = 0

    async def one(self, conn: Connection, path: str, s: Series,
                  limit_s: float | None = None) -> None:
        rid = self._next_id
        self._next_id += 1
        started = trio.current_time()
        self.in_flight[rid] = (s, started)
        try:
            with trio.move_on_after(limit_s or self.timeout) as scope:
                try:
                    status, _ = await conn.get(path)
                except HttpError as exc:
                    s.error(f"http: {str(exc)[:40]}")
                    await conn.aclose()
                    return
            if scope.cancelled_caught:
                s.error("timeout")
                await conn.aclose()
                return
            if status != 200:
                s.error(f"status {status}")
                return
            s.latencies.append(trio.current_time() - started)
        finally:
            self.in_flight.pop(rid, None)

    async def client(self, first: int) -> None:
        """Back to back: /v1/models then the status, on each target in turn."""
        n = len(self.targets)
        order = [self.targets[(first + i) % n] for i in range(n)]
        conns = {t.label: t.connect() for t in order}
        try:
            while True:
                for t in order:
                    await self.one(conns[t.label], "/v1/models", t.series["models"])
                    await self.one(conns[t.label], t.status_path, t.series["status"])
        finally:
            with trio.CancelScope(shield=True):
                for conn in conns.values():
                    await conn.aclose()

    async def poller(self, target: Target, interval: float, phase: float) -> None:
        conn = target.connect()
        try:
            tick = trio.current_time() + phase
            while True:
                await trio.sleep_until(tick)
                # a poll not answered by its next tick is given up (and logged "unavailable")
                await self.one(conn, target.status_path, target.series["poller_status"],
                               min(interval, self.timeout))
                now = trio.current_time()
                tick += interval
                while tick < now:  # missed ticks are dropped, as a Go ticker does
                    tick += interval
        finally:
            with trio.CancelScope(shield=True):
                await conn.aclose()


    async def healthz(self, target: Target, interval: float) -> None:
        conn = target.connect()
        try:
            tick = trio.current_time()
            while True:
                await trio.sleep_until(tick)
                await self.one(conn, "/healthz", target.series["healthz"])
                tick = max(tick + interval, trio.current_time())
        finally:
            with trio.CancelScope(shield=True):
                await conn.aclose()


async def run(args: argparse.Namespace) -> dict[str, Any]:
    targets = []
    for spec in args.target:
        label, _, rest = spec.partition("=")
        url, _, engine = rest.partition("#")
        targets.append(Target(label, url, engine))
    load = Load(targets, args.timeout)
    cpu0 = time.process_time()
    intervals = [float(x) for x in args.poll.split(",") if x]
    started = trio.current_time()
    async with trio.open_nursery() as nursery:
        for target in targets:
            for i, interval in enumerate(intervals):
                # the pollers' first ticks spread over their interval (independent services)
                nursery.start_soon(load.poller, target, interval,
                                   interval * i / max(len(intervals), 1))
            if args.healthz > 0:
                nursery.start_soon(load.healthz, target, args.healthz)
        for i in range(args.clients):
            nursery.start_soon(load.client, i)
        await trio.sleep(args.duration)
        ended = trio.current_time()
        for s, since in load.in_flight.values():
            s.unfinished.append(ended - since)
        nursery.cancel_scope.cancel()
    return {"duration_s": round(ended - started, 3), "clients": args.clients,
            "pollers": intervals, "cpu_s": round(time.process_time() - cpu0, 3),
            "targets": {t.label: t.result() for t in targets}}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.pollers")
    p.add_argument("--target", action="append", required=True, metavar="LABEL=URL#ENGINE",
                   help="a manager to load (repeat: clients alternate between them)")
    p.add_argument("--clients", type=int, default=1)
    p.add_argument("--poll", default="5,5,10,1", help="poller intervals in seconds")
    p.add_argument("--duration", type=float, default=30.0)
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--healthz", type=float, default=0.0,
                   help="GET /healthz every S seconds per target (0: never)")
    args = p.parse_args(argv)
    result = trio.run(run, args)
    sys.stdout.write(msgspec.json.encode(result).decode() + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
