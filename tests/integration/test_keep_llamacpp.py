"""A loaded real llama-server survives nvpair: its exit with ``on_exit = "keep"``, and a reload.

* keep: ``nvpair serve`` (a real process) starts llama-server from the ``llamacpp`` manifest
  and is SIGTERMed, then (the next one) SIGKILLed: each time the server keeps its pid and
  answers a chat sent to it directly while nvpair is down; the next nvpair adopts it ready
  within one probe interval, with no restart, and ``nvpair logs`` shows the line the server
  wrote about that chat while nvpair was down; ``nvpair stop-engines`` then ends it. The
  model is loaded once in all.
* reload: nvpair (in-process) with the server as its only engine; a reload that adds a
  simulator engine and changes ``[router]`` leaves the server alone (its pid, its state
  and its ``since``, no request of any kind: counted by a relay in front of it, since the
  server itself neither logs nor counts a request that generates nothing), and a stream
  in flight on it through nvpair's router across the reload comes whole.

Real only: these run what tests/supervision/test_keep.py and tests/test_reload.py run
against simulators; what the simulators cannot show is the real server's own behaviour
(a process nvpair does not own, writing its own output file; a real stream).
"""

from __future__ import annotations

import itertools
import json
import os
import signal
from pathlib import Path

import httpx2
import msgspec
import pytest
import trio
from tests.integration.counting_relay import CountingRelay
from tests.integration.llamacpp_process import DEFAULT_ALIAS, LlamaAssets
from tests.managed import alive, fast_manifest, free_port, group_members, wait_state
from tests.supervision.test_keep import cli, kill_all, log_shows, serving
from tests.test_reload import engine as sim_engine
from tests.test_reload import sim

from nvpair import service
from nvpair.config.settings import load_settings

pytestmark = pytest.mark.integration

#: the probes' interval: an adopted engine is ready within one of nvpair's start
PROBE_S = 1.0
STEP_S = 90  # the ceiling of each step on a loaded, shared 2-core machine
CHAT = "/v1/chat/completions"
#: what llama-server writes once per load of its model
LOADED = "llama_server: model loaded"


def keep_config(tmp: Path, assets: LlamaAssets, port: int) -> Path:
    """One managed llama-server from the manifest's start template, kept at nvpair's exit."""
    path_env = f"{assets.binary.parent}{os.pathsep}{os.environ.get('PATH', '')}"
    path = tmp / "nvpair.toml"
    path.write_text(
        f"listen = '127.0.0.1:0'\nstate_dir = '{tmp / 'state'}'\nlog_dir = '{tmp / 'logs'}'\n"
        "on_exit = 'keep'\n"
        f"[[engines]]\nname = 'e'\nkind = 'llamacpp'\nmanaged = true\nport = {port}\n"
        f"model = {json.dumps(str(assets.model))}\nstop_grace_s = 10\n"
        f"env = {{ PATH = {json.dumps(path_env)} }}\n"
        f"[engines.args]\nserved_name = '{DEFAULT_ALIAS}'\nctx = 1024\nthreads = 1\nslots = 2\n"
        f"[engines.probes.ready]\ninterval_s = {PROBE_S}\ntimeout_s = {PROBE_S}\n"
        f"[engines.probes.health]\ninterval_s = {PROBE_S}\ntimeout_s = {PROBE_S}\n")
    return path


async def chat_directly(port: int, words: str) -> None:
    """A short chat sent to the server itself, not through nvpair."""
    async with httpx2.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
        r = await client.post(CHAT, json={"model": DEFAULT_ALIAS, "max_tokens": 3,
                                          "messages": [{"role": "user", "content": words}]})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3, r.text


async def line_written(out: Path, since: int, text: str) -> str:
    """The first line the server wrote to ``out`` past byte ``since`` holding ``text``."""
    while True:
        data = (await trio.Path(out).read_bytes())[since:]
        for line in data.decode(errors="replace").splitlines():
            if text in line:
                return line.strip()
        await trio.sleep(0.05)  # an outside process writes it: polled


def processes_on(port: int) -> list[int]:
    """Processes whose command line holds ``--port <port>`` (a llama-server left behind)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0") if entry.name.isdigit() else []
        except OSError:
            continue
        if (b"--port", str(port).encode()) in itertools.pairwise(argv):
            found.append(int(entry.name))
    return found


async def test_a_kept_llama_server_outlives_nvpair_and_is_adopted_each_time(
        llama_assets: LlamaAssets, tmp_path: Path) -> None:
    port = free_port()
    config = keep_config(tmp_path, llama_assets, port)
    out = tmp_path / "state" / "engines" / "e.out"  # the server's own output file
    engines: list[int] = []
    try:
        with trio.fail_after(STEP_S):
            async with serving(config, engines) as first:
                doc = await first.engine()
                pid = int(doc["pid"])  # type: ignore[call-overload]
                engines.append(pid)
                first.proc.send_signal(signal.SIGTERM)
                assert await first.proc.wait() == 0
                said = await first.saw("leaving 1 engine(s) running")
                assert f"e (pid {pid})" in said
        for how in ("SIGTERM", "SIGKILL"):  # how the nvpair before this one ended
            # nvpair is down: the server runs on, answers, and writes its own output
            assert alive(pid), how
            since = out.stat().st_size
            with trio.fail_after(STEP_S):
                await chat_directly(port, f"nvpair ended by {how}")
                # llama-server's line per request served: "slot print_timing: id  1 |
                # task 7 |       total time =      41.07 ms /    28 tokens" (its timings
                # make it this request's)
                written = await line_written(out, since, "total time =")
            with trio.fail_after(STEP_S):
                async with serving(config, engines) as serve:
                    listening = trio.current_time()
                    doc = await serve.engine()
                    took = trio.current_time() - listening
                    assert doc["pid"] == pid and doc["restarts"] == 0, doc  # adopted
                    assert took < PROBE_S, f"ready {took:.2f} s after nvpair listened"
                    lines = await log_shows(serve.url, written)
                    assert any(f"adopted process {pid}" in line for line in lines), lines
                    shown = await trio.to_thread.run_sync(
                        cli, "logs", "e", "--url", serve.url, "-n", "2000")
                    assert shown.returncode == 0 and written in shown.stdout, shown
                    if how == "SIGKILL":  # the last: stop-engines with nvpair running
                        done = await trio.to_thread.run_sync(
                            cli, "stop-engines", "--config", str(config), "--url", serve.url)
                        assert done.returncode == 0, done
                        assert "stopped 1 engine(s): e" in done.stdout, done
                        break
                    serve.proc.kill()  # the next nvpair comes after a SIGKILL
                    await serve.proc.wait()
        assert not alive(pid) and group_members(pid) == [] and processes_on(port) == []
        assert list((tmp_path / "state" / "engines").glob("*.json")) == []
        log = (tmp_path / "logs" / "e.log").read_text(errors="replace")
        assert log.count("[nvpair] starting:") == 1, log  # one start in three nvpairs
        assert log.count(LOADED) == 1, log  # the model was loaded once
    finally:
        kill_all(engines)


async def test_a_reload_leaves_a_running_llama_server_alone(
        llama_assets: LlamaAssets, nursery: trio.Nursery, tmp_path: Path) -> None:
    front, port = free_port(), free_port()  # nvpair's address of the server, and its own
    relay = CountingRelay(port)
    argv = [str(llama_assets.binary), "-m", "{model}", "--host", "{host}", "--port", str(port),
            "--alias", DEFAULT_ALIAS, "-c", "1024", "-np", "2", "-t", "1"]
    # probes a minute apart: in the few seconds of the reload none is due, so any request
    # the server gets then, besides the stream's, is one the reload made
    quiet = "".join(f"[engines.probes.{p}]\ninterval_s = 60\ntimeout_s = 5\n"
                    for p in ("health", "identity", "models"))
    head = (f"listen = '127.0.0.1:0'\nlog_dir = '{tmp_path / 'logs'}'\n"
            f"state_dir = '{tmp_path / 'state'}'\n"
            f"[[engines]]\nname = 'e'\nkind = 'llamacpp'\nmanaged = true\nport = {front}\n"
            f"model = {json.dumps(str(llama_assets.model))}\nstop_grace_s = 10\n"
            f"command = {json.dumps(argv)}\n"
            "[engines.probes.ready]\ninterval_s = 0.2\ntimeout_s = 0.2\n" + quiet)
    sim_port, sim_control = free_port(), free_port()
    added = sim_engine("s", fast_manifest(tmp_path, "vllm"), sim_port,
                       sim(sim_port, sim_control))
    path = tmp_path / "nvpair.toml"
    path.write_text(head)
    tokens = 300  # at 11-30 ms a token on one thread: 3-9 s, well past the reload
    chat = msgspec.json.encode({
        "model": DEFAULT_ALIAS, "max_tokens": tokens, "stream": True, "ignore_eos": True,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": "Count to a thousand."}]})
    with trio.fail_after(STEP_S):
        running = await nursery.start(service.run, load_settings(str(path)))
        # the relay listens once nvpair has looked at the port (free) and started the server
        await wait_state(running.board, "e", "starting", where=lambda e: bool(e.pid))
        await nursery.start(relay.serve, front)
        before = await wait_state(running.board, "e", "ready",
                                  where=lambda e: bool(e.models) and e.identity is not None,
                                  within=60)
        runner = running.runners["e"]
        sent = relay.count()
        # the counter sees nvpair's probes: ready, health (/props, as the manifest says),
        # identity and the model list
        assert {path for _, path in sent} == {"/health", "/props", "/v1/models"}, sent
        body = b""
        streaming, streamed = trio.Event(), trio.Event()
        async with httpx2.AsyncClient(base_url=running.url, timeout=60) as client:

            async def stream() -> None:
                nonlocal body
                async with client.stream("POST", CHAT, content=chat,
                                         headers={"content-type": "application/json"}) as r:
                    assert r.status_code == 200
                    async for chunk in r.aiter_bytes():
                        body += chunk
                        streaming.set()
                streamed.set()

            async with trio.open_nursery() as n:
                n.start_soon(stream)
                await streaming.wait()
                path.write_text(head + added + "[router]\nmax_body_bytes = 2048\n"
                                "idle_timeout_s = 30\n")
                r = await client.post("/v1/admin/reload")
                assert r.status_code == 200, r.text
                assert not streamed.is_set(), "the stream ended before the reload: lengthen it"
                await wait_state(running.board, "s", "ready", within=60)
            big = await client.post(CHAT, headers={"content-type": "application/json"},
                                    content=chat + b" " * 4096)
    assert r.json()["summary"] == ("reload: 1 added (s), 1 unchanged; "
                                    "router applied"), r.text
    assert r.json()["sections"] == ["router"], r.text
    assert big.status_code == 413 and "2048" in big.text  # the router's change is in use
    now = running.board.current.engine("e")
    assert running.runners["e"] is runner
    assert now is not None and now.pid == before.pid and alive(now.pid), now
    assert now.since == before.since and now.restarts == 0
    # the same state, no probe since (its memory aside: the watch reads /proc, never it)
    assert msgspec.structs.replace(now, memory=None) == msgspec.structs.replace(
        before, memory=None), (before, now)
    assert relay.count(besides=CHAT) == sent, (sent, relay.requests)  # no request at all
    assert relay.requests[("POST", CHAT)] == 1  # the stream's (the 413 never reached it)
    events = [e.removeprefix("data: ") for e in body.decode().split("\n\n") if e.strip()]
    assert events[-1] == "[DONE]", events[-3:]
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["usage"]["completion_tokens"] == tokens, chunks[-1]  # every token
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]
            ][-1] == "length"
    log = (tmp_path / "logs" / "e.log").read_text(errors="replace")
    assert log.count(LOADED) == 1 and log.count("[nvpair] starting:") == 1, log
