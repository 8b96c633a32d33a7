"""Commands that talk to a running nvpair, run as a person runs them (a real subprocess)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import httpx2
import trio
from tests.managed import free_port, log_until, managed_config

from nvpair import service
from nvpair.sim import SimOptions, serve_sim

# An "engine" whose output repeats itself, as engines do (`GET /health 200` every few
# seconds): one identical line per SIGUSR1.
TICKER = """
import signal, sys
signal.signal(signal.SIGUSR1, lambda *_: print("tick", flush=True))
print("ticker ready", flush=True)
while True:
    signal.pause()
"""


async def next_lines(client: httpx2.AsyncClient, after: int) -> dict:  # type: ignore[type-arg]
    r = await client.get(f"/v1/engines/e/logs?after={after}&wait_s=10")
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


async def test_logs_follow_prints_each_repeated_line_once(nursery, tmp_path) -> None:
    settings = managed_config(tmp_path, "e", free_port(), [sys.executable, "-c", TICKER])
    with trio.fail_after(30):
        running = await nursery.start(service.run, settings)
        async with httpx2.AsyncClient(base_url=running.url) as client:
            seen, doc = await log_until(client, "e", "ticker ready")  # its handler is set
            pid = (await client.get("/v1/engines/e")).json()["pid"]
            assert seen[0].startswith("[nvpair] starting:") and doc["missed"] == 0

            follower = await trio.lowlevel.open_process(
                [sys.executable, "-m", "nvpair", "logs", "e", "-f", "-n", "1",
                 "--url", running.url], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                env={**os.environ, "NO_COLOR": "1"})
            try:
                out = b""
                assert follower.stdout is not None
                while b"ticker ready\n" not in out:  # the tail of one line
                    out += await follower.stdout.receive_some()
                for i in range(1, 4):
                    os.kill(pid, signal.SIGUSR1)
                    doc = await next_lines(client, doc["next"])
                    assert doc["lines"] == ["tick"]  # the same text, a new line, once
                    while out.count(b"tick\n") < i:  # the follower shows it too
                        out += await follower.stdout.receive_some()
                # What it printed, in order, and nothing twice: a follower that found its
                # place by the last line's text would print the first tick and no other.
                assert out == b"ticker ready\ntick\ntick\ntick\n"

                # `nvpair logs -f | head -4`: the reader goes; the next line ends the
                # follower quietly (exit 141, as for SIGPIPE), without a traceback.
                await follower.stdout.aclose()
                os.kill(pid, signal.SIGUSR1)
                assert await follower.wait() == 141
                assert follower.stderr is not None
                err = b""
                while chunk := await follower.stderr.receive_some():
                    err += chunk
                assert err == b""
            finally:
                follower.kill()
                with trio.move_on_after(5, shield=True):  # reap it even when failing
                    await follower.wait()


async def test_a_url_that_is_not_nvpair_is_one_line_not_a_traceback(nursery) -> None:
    sim = await nursery.start(serve_sim, SimOptions(kind="vllm", model="m"))
    engine_url = f"http://127.0.0.1:{sim.port}"
    with trio.fail_after(30):
        for argv, expected in (
                (["models", "--url", engine_url],
                 f"nvpair: error: {engine_url} does not answer like nvpair (an engine's URL?)"),
                (["status", "--url", engine_url], "nvpair: error: GET /v1/engines: 404"),
                (["status", "--url", "http://[::1"], "nvpair: error: GET http://[::1/v1/engines")):
            r = await trio.run_process([sys.executable, "-m", "nvpair", *argv],
                                       capture_stdout=True, capture_stderr=True, check=False)
            err = r.stderr.decode()
            assert r.returncode == 2 and err.startswith(expected), (argv, err)
            assert err.count("\n") == 1 and "Traceback" not in err, err
