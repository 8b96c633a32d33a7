"""``nvpair status`` says what is true (newuser-3.md findings 4, 9, 10): the ERROR column
names the engine's own last meaningful line, RESTARTS counts only restarts nvpair made, a
draining engine shows ``draining`` and a request waiting for an engine shows in QUEUE.
A real nvpair with managed child processes; the table read by running ``nvpair status``."""

from __future__ import annotations

import os
import sys

import httpx2
import trio
from tests.managed import free_port, managed_config, sim_command, wait_state
from tests.router.script_engine import JSON

from nvpair import service
from nvpair.cli.client import STATUS_HEADER
from nvpair.supervision.lifecycle import last_said

# what llama-server 11434 printed with a -m that does not exist (measured with the cached
# build), then its exit code 1
LLAMA_NO_MODEL = r"""
import os
import sys
for line in (
    "0.00.028.729 I srv    load_model: loading model '/m/x.gguf'",
    "0.00.028.802 E gguf_init_from_file: failed to open GGUF file '/m/x.gguf' (No such file "
    "or directory)",
    "0.00.028.984 E srv    load_model: failed to load model, '/m/x.gguf'",
    "0.00.028.985 I srv    operator(): operator(): cleaning up before exit...",
    "0.00.054.692 E srv  llama_server: exiting due to model loading error",
    "",
):
    print(line, flush=True)
sys.exit(1)
"""


async def status(url: str) -> dict[str, str]:
    """The one engine's row of ``nvpair status``, by column."""
    r = await trio.run_process([sys.executable, "-m", "nvpair", "status", "--url", url],
                               capture_stdout=True, capture_stderr=True, check=False,
                               env={**os.environ, "NO_COLOR": "1"})
    assert r.returncode == 0, r.stderr
    header, row = r.stdout.decode().splitlines()[:2]
    starts = [header.index(name) for name in STATUS_HEADER]
    assert tuple(header.split()) == STATUS_HEADER
    cells = [row[a:b].strip() for a, b in zip(starts, [*starts[1:], None], strict=True)]
    return dict(zip(STATUS_HEADER, cells, strict=True))


def test_the_last_meaningful_line_is_the_engines_not_nvpairs() -> None:
    assert last_said(["loading", "sim vllm: exit 3", "[nvpair] process 8107 ended: exited "
                      "with code 3"]) == "sim vllm: exit 3"
    assert last_said(["Traceback (most recent call last):", '  File "x.py", line 1',
                      "ValueError: bad tp", ""]) == "ValueError: bad tp"
    assert last_said(["[nvpair] starting: x", "  "]) is None


async def test_the_error_column_names_the_engines_own_cause(nursery, tmp_path) -> None:
    settings = managed_config(tmp_path, "small", free_port(),  # down long enough to read
                              [sys.executable, "-c", LLAMA_NO_MODEL], initial_s=60, max_s=60)
    with trio.fail_after(30):
        running = await nursery.start(service.run, settings)
        await wait_state(running.board, "small", "down")
        row = await status(running.url)
    assert row["STATE"] == "down"
    assert row["ERROR"] == ("engine process exited with code 1 (its last line: 0.00.028.984 "
                            "E srv    load_model: failed to load model, '/m/x.gguf')")


async def test_restarts_count_only_restarts_nvpair_made(nursery, tmp_path) -> None:
    """An operator's stop and start is no restart; a restart asked for and a crash are."""
    settings = managed_config(tmp_path, "e", free_port(), sim_command("vllm"))
    with trio.fail_after(60):
        running = await nursery.start(service.run, settings)
        board = running.board
        first = await wait_state(board, "e", "ready")
        async with httpx2.AsyncClient(base_url=running.url, timeout=10) as client:
            assert (await client.post("/v1/engines/e/stop")).status_code == 202
            await wait_state(board, "e", "stopped")
            assert (await client.post("/v1/engines/e/start")).status_code == 202
            again = await wait_state(board, "e", "ready", where=lambda e: e.pid != first.pid)
            assert again.restarts == 0
            assert (await status(running.url))["RESTARTS"] == "0"
            assert (await client.post("/v1/engines/e/restart")).status_code == 202
            third = await wait_state(board, "e", "ready", where=lambda e: e.pid != again.pid)
            assert third.restarts == 1


async def test_a_draining_engine_shows_draining_and_a_waiting_request_its_queue(
        nursery, tmp_path) -> None:
    settings = managed_config(
        tmp_path, "e", free_port(), sim_command("vllm", "--token-rate", "20", "--load-s", "4"),
        extra="activation = 'on_demand'\n")
    payload = (b'{"model": "sim-model", "max_tokens": 120, "stream": true, '
               b'"messages": [{"role": "user", "content": "hi"}]}')
    with trio.fail_after(60):
        running = await nursery.start(service.run, settings)
        board = running.board
        await wait_state(board, "e", "cold")
        streaming = trio.Event()
        async with httpx2.AsyncClient(headers=JSON, base_url=running.url, timeout=30) as client:

            async def stream() -> None:  # 120 tokens at 20 a second: 6 s (time to read)
                async with client.stream("POST", "/v1/chat/completions", content=payload) as r:
                    assert r.status_code == 200
                    async for _chunk in r.aiter_bytes():
                        streaming.set()

            async with trio.open_nursery() as n:
                n.start_soon(stream)
                # the sim's port refuses while it loads (4 s): the probe says so
                await wait_state(board, "e", "starting", where=lambda e: e.queued == 1 and (
                    e.error or "").startswith("cannot connect"))
                row = await status(running.url)
                assert row["STATE"] == "starting" and row["QUEUE"].startswith("1 ("), row
                assert row["ERROR"] == "not listening yet (loading)", row
                await streaming.wait()
                assert (await client.post("/v1/engines/e/drain")).status_code == 202
                row = await status(running.url)
                assert row["STATE"] == "draining" and row["QUEUE"] == "-", row
            await wait_state(board, "e", "cold")


async def test_a_failed_on_demand_start_keeps_its_reason_while_cold(nursery, tmp_path) -> None:
    """The 503 and then the status table (cold) say why the start failed, in the engine's
    own words (newuser-3.md findings 6 and 10)."""
    settings = managed_config(
        tmp_path, "broken", free_port(),
        sim_command("vllm", "--fail-on-load", "3", "--load-s", "0.2"),
        extra="activation = 'on_demand'\n")
    payload = b'{"model": "sim-model", "messages": [{"role": "user", "content": "hi"}]}'
    with trio.fail_after(60):
        running = await nursery.start(service.run, settings)
        await wait_state(running.board, "broken", "cold")
        async with httpx2.AsyncClient(headers=JSON, base_url=running.url, timeout=30) as client:
            r = await client.post("/v1/chat/completions", content=payload)
        assert r.status_code == 503
        assert ("engine broken failed to start: engine process exited with code 3 (its last "
                "line: ") in r.text and "sim vllm: exit 3)" in r.text, r.text
        assert "[nvpair]" not in r.text, r.text  # (nvpair's own end-of-process line)
        cold = await wait_state(running.board, "broken", "cold")
        row = await status(running.url)
    assert cold.restarts == 0
    assert (row["STATE"], row["RESTARTS"]) == ("cold", "0")
    assert row["ERROR"].startswith("engine process exited with code 3 (its last line: ")
    assert row["ERROR"].endswith("sim vllm: exit 3)"), row
