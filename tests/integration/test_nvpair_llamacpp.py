"""nvpair against a real llama.cpp llama-server, with the built-in ``llamacpp`` manifest.

* adopted: nvpair probes a llama-server it did not start: the model is listed under its
  alias, the engine is ``ready``, the identity (model, build_info) comes from ``/props``, and
  the probes run at the configured intervals (the real server keeps no request counts, so the
  counts are nvpair's own probe stats, bounded by the clock);
* managed: nvpair starts llama-server from the manifest's start template (``llama-server``
  found on PATH), reports ``starting`` while the engine answers 503 "Loading model", then
  ``ready``; a SIGKILL leads to ``down`` and a restart with a new pid; a stop through the API
  leaves no process.

The cancelled-stream test (a client cancelling a streamed chat sent straight to the engine
frees the slot) is ``test_cancelled_stream_frees_slot`` in test_llamacpp_surface.py.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import httpx2
import pytest
import trio
from tests.integration.llamacpp_conformance import LOADING_BODY
from tests.integration.llamacpp_process import DEFAULT_ALIAS, LlamaAssets, LlamaServer
from tests.managed import alive, free_port, group_members, wait_state

from nvpair import service
from nvpair.config.settings import load_settings
from nvpair.state.snapshot import EngineState

pytestmark = pytest.mark.integration

HEALTH_INTERVAL_S = 0.5
JITTER = 0.05  # nvpair's probe jitter: up to 5 % of the interval per tick


def _config(tmp: Path, engine: str) -> Path:
    path = tmp / "nvpair.toml"
    path.write_text(f"listen = '127.0.0.1:0'\nlog_dir = '{tmp / 'logs'}'\n{engine}")
    return path


def _probes(ready_s: float = 0.2) -> str:
    return (f"[engines.probes.ready]\ninterval_s = {ready_s}\ntimeout_s = {ready_s}\n"
            f"[engines.probes.health]\ninterval_s = {HEALTH_INTERVAL_S}\n"
            f"timeout_s = {HEALTH_INTERVAL_S}\n"
            "[engines.probes.identity]\ninterval_s = 2\ntimeout_s = 2\n"
            "[engines.probes.models]\ninterval_s = 1\ntimeout_s = 1\n")


def _requests(e: EngineState, probe: str) -> int:
    stats = e.probe(probe)
    return 0 if stats is None else stats.requests


async def _props(url: str) -> dict[str, object]:
    async with httpx2.AsyncClient(base_url=url, timeout=10) as client:
        resp = await client.get("/props")
        assert resp.status_code == 200, resp.text
        props: dict[str, object] = resp.json()
        return props


async def test_adopted_llama_server_listed_ready_with_identity_and_probe_rates(
    real_llama_server: LlamaServer, nursery: trio.Nursery, tmp_path: Path
) -> None:
    server = real_llama_server
    props = await _props(server.base_url)
    engine = (f"[[engines]]\nname = 'g'\nkind = 'llamacpp'\nport = {server.port}\n"
              f"model = '{DEFAULT_ALIAS}'\n{_probes()}")
    settings = load_settings(str(_config(tmp_path, engine)))
    with trio.fail_after(60):
        began = trio.current_time()
        running = await nursery.start(service.run, settings)
        e = await wait_state(running.board, "g", "ready", where=lambda e: bool(e.models),
                             within=30)
        assert [m.id for m in e.models] == [DEFAULT_ALIAS]
        assert e.identity is not None
        assert e.identity.model == DEFAULT_ALIAS  # /model_alias
        assert e.identity.version == props["build_info"]
        assert e.mismatch is None and e.error is None and not e.managed and e.pid is None
        async with httpx2.AsyncClient(base_url=running.url, timeout=10) as client:
            listed = (await client.get("/v1/models")).json()["data"]
            assert [m["id"] for m in listed] == [DEFAULT_ALIAS]
            assert listed[0]["nvpair"]["engine"] == "g"
            status = (await client.get("/v1/engines/g")).json()
            assert status["state"] == "ready"
            assert status["identity"] == {"model": DEFAULT_ALIAS,
                                          "version": props["build_info"]}

        # Probe rate: the next N health probes take N intervals (plus jitter), no more,
        # no fewer; the ready probe stops once ready. Event-driven: no sleeping.
        n = 6
        before = running.board.current.engine("g")
        assert before is not None
        ready_before, health_before = _requests(before, "ready"), _requests(before, "health")
        start = trio.current_time()
        after = await wait_state(
            running.board, "g", "ready",
            where=lambda e: _requests(e, "health") >= health_before + n, within=20)
        took = trio.current_time() - start
    assert _requests(after, "health") == health_before + n
    assert {name: stats.path for name, stats in after.probes} == {
        "ready": "/health", "health": "/props", "identity": "/props",
        "models": "/v1/models"}  # never the queued /slots or /metrics; /props: is it asleep
    assert (n - 1) * HEALTH_INTERVAL_S * 0.9 <= took, took
    assert took <= n * HEALTH_INTERVAL_S * (1 + JITTER) + 1.0, took
    assert _requests(after, "ready") == ready_before
    health = after.probe("health")
    assert health is not None and health.failures == 0 and health.timeouts == 0
    assert health.http_status == 200
    # identity on becoming ready and then every 2 s; models every 1 s
    ran = trio.current_time() - began
    assert 1 <= _requests(after, "identity") <= ran / 2 + 2, (ran, after.probes)
    assert 1 <= _requests(after, "models") <= ran / 1 + 2, (ran, after.probes)


async def _cmdline(pid: int) -> list[str]:
    """The process's argv, once it has exec'd (right after the spawn it may not have yet)."""
    while True:
        raw = await trio.Path(f"/proc/{pid}/cmdline").read_bytes()
        argv = raw.decode().split("\0")[:-1]
        if argv[:1] == ["llama-server"]:
            return argv
        await trio.sleep(0.005)  # external process: poll until its exec


async def test_managed_llama_server_from_the_manifest_template(
    llama_assets: LlamaAssets, nursery: trio.Nursery, tmp_path: Path
) -> None:
    port = free_port()
    path_env = f"{llama_assets.binary.parent}{os.pathsep}{os.environ.get('PATH', '')}"
    engine = (f"[[engines]]\nname = 'g'\nkind = 'llamacpp'\nmanaged = true\nport = {port}\n"
              f"model = {json.dumps(str(llama_assets.model))}\nstop_grace_s = 10\n"
              f"env = {{ PATH = {json.dumps(path_env)} }}\n"
              f"[engines.args]\nserved_name = '{DEFAULT_ALIAS}'\nctx = 1024\nthreads = 2\n"
              f"slots = 2\n{_probes()}")
    settings = load_settings(str(_config(tmp_path, engine)))
    url = f"http://127.0.0.1:{port}"
    with trio.fail_after(100):
        running = await nursery.start(service.run, settings)
        first = await wait_state(running.board, "g", "starting", where=lambda e: bool(e.pid))
        assert first.pid is not None
        with trio.fail_after(10):
            argv = await _cmdline(first.pid)
        assert argv == ["llama-server", "-m", str(llama_assets.model), "--host", "127.0.0.1",
                        "--port", str(port), "--alias", DEFAULT_ALIAS, "-c", "1024", "-np", "2",
                        "-t", "2"], argv

        # While it loads, the engine answers 503 "Loading model" and nvpair says starting
        # (its ready probe sees the 503 too, unless the load is over within one interval).
        seen_loading = nvpair_saw_503 = False
        loading_since: float | None = None
        async with httpx2.AsyncClient(base_url=url, timeout=5) as client:
            while True:
                try:
                    resp = await client.get("/health")
                except httpx2.ConnectError:
                    await trio.sleep(0.005)  # external process: poll for its listening socket
                    continue
                if resp.status_code == 200:
                    break
                assert resp.status_code == 503 and resp.json() == LOADING_BODY, resp.text
                e = running.board.current.engine("g")
                assert e is not None and e.state == "starting", e
                probe = e.probe("ready")
                nvpair_saw_503 |= probe is not None and probe.http_status == 503
                seen_loading = True
                if loading_since is None:
                    loading_since = trio.current_time()
                await trio.sleep(0.02)  # external process: poll until it has loaded
        loaded_after = trio.current_time() - (loading_since or trio.current_time())
        ready = await wait_state(running.board, "g", "ready", where=lambda e: bool(e.models),
                                 within=60)
        assert ready.pid == first.pid and ready.restarts == 0
        assert [m.id for m in ready.models] == [DEFAULT_ALIAS]
        assert ready.identity is not None and ready.identity.model == DEFAULT_ALIAS
        props = await _props(url)
        assert ready.identity.version == props["build_info"]
        assert props["total_slots"] == 2
        if loaded_after > 1.0:
            assert nvpair_saw_503, "nvpair's ready probe never saw the 503 while loading"

        # SIGKILL: down (killed), then a restart with a new pid, ready again.
        os.kill(first.pid, signal.SIGKILL)
        down = await wait_state(running.board, "g", "down")
        assert down.exit_code == -signal.SIGKILL and "SIGKILL" in (down.error or ""), down
        again = await wait_state(running.board, "g", "ready",
                                 where=lambda e: bool(e.models) and e.pid != first.pid,
                                 within=60)
        assert again.pid is not None and alive(again.pid) and not alive(first.pid)
        assert again.restarts == 1
        assert [m.id for m in again.models] == [DEFAULT_ALIAS]

        # Stop through the API: no process left, the port refuses, the model is unlisted.
        async with httpx2.AsyncClient(base_url=running.url, timeout=10) as client:
            resp = await client.post("/v1/engines/g/stop")
            assert resp.status_code == 202, resp.text
            stopped = await wait_state(running.board, "g", "stopped", within=30)
            assert stopped.pid is None
            assert not alive(again.pid) and group_members(again.pid) == []
            assert (await client.get("/v1/models")).json()["data"] == []
        with pytest.raises(OSError):
            await trio.open_tcp_stream("127.0.0.1", port)
    if not seen_loading:  # everything else was checked; only this part could not be
        pytest.xfail("the model loaded before the first /health answer: no 503 seen")


async def test_managed_llama_server_that_sleeps_is_listed_sleeping_and_never_woken_by_probes(
    llama_assets: LlamaAssets, nursery: trio.Nursery, tmp_path: Path
) -> None:
    """``sleep = true`` with ``idle_sleep_s``: nvpair starts llama-server with
    ``--sleep-idle-seconds``, lists it ``sleeping`` once it sleeps, and its probes (health on
    ``/props`` every 0.5 s, identity, the model list) never wake it: the server logs each
    wake ("exiting sleeping state"), and none comes until a routed request."""
    port = free_port()
    path_env = f"{llama_assets.binary.parent}{os.pathsep}{os.environ.get('PATH', '')}"
    engine = (f"[[engines]]\nname = 'g'\nkind = 'llamacpp'\nmanaged = true\nport = {port}\n"
              f"model = {json.dumps(str(llama_assets.model))}\nstop_grace_s = 10\n"
              f"sleep = true\nidle_sleep_s = 1\n"
              f"env = {{ PATH = {json.dumps(path_env)} }}\n"
              f"[engines.args]\nserved_name = '{DEFAULT_ALIAS}'\nctx = 1024\nthreads = 2\n"
              f"slots = 1\n{_probes()}")
    settings = load_settings(str(_config(tmp_path, engine)))
    log = tmp_path / "logs" / "g.log"
    with trio.fail_after(100):
        running = await nursery.start(service.run, settings)
        first = await wait_state(running.board, "g", "starting", where=lambda e: bool(e.pid))
        assert first.pid is not None
        argv = await _cmdline(first.pid)
        assert argv[-2:] == ["--sleep-idle-seconds", "1"], argv
        await wait_state(running.board, "g", "sleeping", where=lambda e: bool(e.models),
                         within=60)
        before = _requests(running.board.current.engine("g"), "health")  # type: ignore[arg-type]
        await trio.sleep(3.0)  # probes at work for a while: 6 health probes at 0.5 s
        e = running.board.current.engine("g")
        assert e is not None and e.state == "sleeping", e
        assert _requests(e, "health") - before >= 4
        assert e.probe("health").path == "/props"  # type: ignore[union-attr]
        assert "exiting sleeping state" not in log.read_text(errors="replace")
        assert (await _props(f"http://127.0.0.1:{port}"))["is_sleeping"] is True
        async with httpx2.AsyncClient(base_url=running.url, timeout=60) as client:
            listed = (await client.get("/v1/models")).json()["data"]
            assert [(m["id"], m["nvpair"]["state"]) for m in listed] == [
                (DEFAULT_ALIAS, "sleeping")]
            answer = await client.post("/v1/chat/completions", json={
                "model": DEFAULT_ALIAS, "max_tokens": 2,
                "messages": [{"role": "user", "content": "hi"}]})
            assert answer.status_code == 200, answer.text
        assert "exiting sleeping state" in log.read_text(errors="replace")
