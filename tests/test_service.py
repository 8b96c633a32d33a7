"""nvpair as a whole, over real sockets, against simulators (the core's acceptance tests)."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import httpx2
import pytest
import trio
import trio.testing
from tests.managed import free_port, group_members, wait_state

from nvpair import service
from nvpair.config.settings import load_settings
from nvpair.sim import SimOptions, serve_sim
from nvpair.supervision.fleet import Fleet

FAST_READ_S = 0.1  # generous for a 2-core machine; a read that waited on a probe takes 1 s+


def config(tmp: Path, body: str, **top: object) -> Path:
    head = "listen = '127.0.0.1:0'\n" + "".join(f"{k} = {v!r}\n" for k, v in top.items())
    path = tmp / "nvpair.toml"
    path.write_text(head + body)
    return path


def engine(name: str, kind: str, port: int, extra: str = "") -> str:
    return f"[[engines]]\nname = '{name}'\nkind = '{kind}'\nport = {port}\n{extra}\n"


async def timed_get(client: httpx2.AsyncClient, path: str) -> tuple[float, httpx2.Response]:
    start = trio.current_time()
    r = await client.get(path)
    return trio.current_time() - start, r


async def test_slow_generating_health_never_slows_the_model_list(nursery, tmp_path) -> None:
    quick = await nursery.start(serve_sim, SimOptions(kind="vllm", model="quick"))
    head = await nursery.start(serve_sim, SimOptions(kind="sglang", model="deepseek-v4.1-flash",
                                                     health_tick_s=2.0))
    await head.wait_phase("ready")
    # Opt in to SGLang's generating /health (2 s here) as the readiness probe, so a slow
    # probe is in flight while clients read.
    probes = ("allow_generating_probes = true\n[engines.probes.ready]\npath = '/health'\n"
              "cost = 'generating'\ninterval_s = 30\ntimeout_s = 25\n")
    body = engine("quick", "vllm", quick.port) + engine("head", "sglang", head.port, probes)
    settings = load_settings(str(config(tmp_path, body)))
    with trio.fail_after(30):
        running = await nursery.start(service.run, settings)
        async with httpx2.AsyncClient(base_url=running.url) as client:
            await head.wait_until(lambda s: s.path("/health").in_flight > 0)
            worst, reads, listed = 0.0, 0, set()
            while head.stats().path("/health").in_flight > 0:
                elapsed, r = await timed_get(client, "/v1/models")
                assert r.status_code == 200
                listed |= {m["id"] for m in r.json()["data"]}
                worst, reads = max(worst, elapsed), reads + 1
            await wait_state(running.board, "head", "ready", where=lambda e: bool(e.models))
            ids = {m["id"] for m in (await client.get("/v1/models")).json()["data"]}
    assert reads > 10 and worst < FAST_READ_S, (reads, worst)
    assert "quick" in listed  # the quick engine was listed while the slow probe ran
    assert ids == {"quick", "deepseek-v4.1-flash"}
    assert head.stats().path("/health").count == 1  # once per 30 s, and never in parallel


async def test_default_sglang_manifest_never_calls_generating_endpoints(nursery, tmp_path) -> None:
    sim = await nursery.start(serve_sim, SimOptions(kind="sglang", model="m"))
    await sim.wait_phase("ready")
    settings = load_settings(str(config(tmp_path, engine("head", "sglang", sim.port))))
    with trio.fail_after(30):
        running = await nursery.start(service.run, settings)
        await wait_state(running.board, "head", "ready", where=lambda e: bool(e.models))
    stats = sim.stats()
    for path in ("/health", "/health_generate", "/server_info", "/get_server_info"):
        assert stats.path(path).count == 0, path
    assert stats.path("/ready").count >= 1


async def test_hung_engine_goes_stale_then_unhealthy_while_reads_stay_fast(
        nursery, tmp_path) -> None:
    sim = await nursery.start(serve_sim, SimOptions(kind="vllm", model="m"))
    await sim.wait_phase("ready")
    probes = "[engines.probes.health]\ninterval_s = 0.5\ntimeout_s = 0.5\nfailure_threshold = 3\n"
    settings = load_settings(str(config(tmp_path, engine("e", "vllm", sim.port, probes))))
    with trio.fail_after(30):
        running = await nursery.start(service.run, settings)
        await wait_state(running.board, "e", "ready")
        sim.set_fault("hang", paths=["/health"])
        hung_at = trio.current_time()
        async with httpx2.AsyncClient(base_url=running.url) as client:
            worst = 0.0

            async def poll() -> None:
                nonlocal worst
                while True:
                    elapsed, r = await timed_get(client, "/v1/engines/e")
                    assert r.status_code == 200
                    worst = max(worst, elapsed)
                    await trio.sleep(0.01)

            async with trio.open_nursery() as readers:
                readers.start_soon(poll)
                await wait_state(running.board, "e", "stale")
                stale_after = trio.current_time() - hung_at
                e = await wait_state(running.board, "e", "unhealthy")
                unhealthy_after = trio.current_time() - hung_at
                readers.cancel_scope.cancel()
    # stale within interval + timeout (+ jitter and slack); unhealthy after 3 of those.
    assert stale_after <= 0.5 * 1.05 + 0.5 + 0.5, stale_after
    assert unhealthy_after <= 3 * (0.5 * 1.05 + 0.5) + 1.0, unhealthy_after
    assert e.probe("health").timeouts >= 3  # type: ignore[union-attr]
    assert worst < FAST_READ_S, worst


@pytest.mark.parametrize("readers", [1, 50])
async def test_probe_count_does_not_grow_with_readers(nursery, tmp_path, readers: int) -> None:
    sim = await nursery.start(serve_sim, SimOptions(kind="vllm", model="m"))
    await sim.wait_phase("ready")
    probes = "[engines.probes.health]\ninterval_s = 0.5\ntimeout_s = 0.5\n"
    settings = load_settings(str(config(tmp_path, engine("e", "vllm", sim.port, probes))))
    with trio.fail_after(30):
        running = await nursery.start(service.run, settings)
        await wait_state(running.board, "e", "ready", where=lambda e: bool(e.models))
        sim.reset_stats()
        start = trio.current_time()
        requests = 0
        async with httpx2.AsyncClient(base_url=running.url,
                                      limits=httpx2.Limits(max_connections=64)) as client:

            async def reader() -> None:
                nonlocal requests
                while trio.current_time() - start < 3.0:
                    for path in ("/v1/models", "/v1/engines/e"):
                        assert (await client.get(path)).status_code == 200
                        requests += 1

            async with trio.open_nursery() as n:
                for _ in range(readers):
                    n.start_soon(reader)
        elapsed = trio.current_time() - start
    health = sim.stats().path("/health").count
    # 0.5 s interval over ~3 s: about 6 probes, whatever the number of readers.
    assert health <= elapsed / 0.5 + 2, (health, elapsed)
    assert requests >= readers


async def test_identity_mismatch_is_reported(nursery, tmp_path) -> None:
    sim = await nursery.start(serve_sim, SimOptions(kind="sglang", model="qwen3-8b"))
    await sim.wait_phase("ready")
    body = engine("head", "sglang", sim.port, "model = 'deepseek-v4.1-flash'")
    settings = load_settings(str(config(tmp_path, body)))
    with trio.fail_after(30):
        running = await nursery.start(service.run, settings)
        e = await wait_state(running.board, "head", "unhealthy")
        async with httpx2.AsyncClient(base_url=running.url) as client:
            status = (await client.get("/v1/engines/head")).json()
            models = (await client.get("/v1/models")).json()["data"]
    assert e.error == f"127.0.0.1:{sim.port} serves qwen3-8b, expected deepseek-v4.1-flash"
    assert status["state"] == "unhealthy" and status["error"] == e.error
    assert models == []


async def test_sweep_lists_quick_engines_within_the_deadline(nursery, tmp_path) -> None:
    body = ""
    quick = []
    for i in range(4):
        sim = await nursery.start(serve_sim, SimOptions(kind="vllm", model=f"quick-{i}"))
        quick.append(sim)
        body += engine(f"q{i}", "vllm", sim.port)
    for i in range(2):
        sim = await nursery.start(serve_sim, SimOptions(kind="vllm", model=f"slow-{i}"))
        sim.set_fault("hang", paths=["/v1/models"])
        body += engine(f"s{i}", "vllm", sim.port)
    settings = load_settings(str(config(tmp_path, body, sweep_deadline_s=2.0)))
    start = trio.current_time()
    with trio.fail_after(30):
        running = await nursery.start(service.run, settings)
        async with httpx2.AsyncClient(base_url=running.url) as client:
            while True:
                elapsed, r = await timed_get(client, "/v1/models")
                assert elapsed < FAST_READ_S
                ids = {m["id"] for m in r.json()["data"]}
                if ids >= {f"quick-{i}" for i in range(4)}:
                    break
                await trio.sleep(0.05)
    assert trio.current_time() - start < 2.0 + 1.0
    assert not ids & {"slow-0", "slow-1"}


async def test_idle_keep_alive_connections_are_closed(nursery, tmp_path) -> None:
    settings = load_settings(str(config(tmp_path, "", keep_alive_s=0.5)))
    with trio.fail_after(20):
        running = await nursery.start(service.run, settings)
        port = int(running.url.rsplit(":", 1)[1])
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        await stream.send_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
        received = b""
        while b'"ok"' not in received:
            received += await stream.receive_some(4096)
        opened = trio.current_time()
        # The server must close the idle connection: we read EOF, not a hang.
        while await stream.receive_some(4096):
            pass
        closed_after = trio.current_time() - opened
        await stream.aclose()
    assert closed_after < 0.5 + 1.0


def poll(url: str, gaps: list[float]) -> list[tuple[int, str]]:
    """GET /healthz on one http.client connection (no retry), waiting ``gaps`` in between:
    each answer's local port, or the error."""
    import http.client
    import time

    host, port = url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=5)
    seen: list[tuple[int, str]] = []
    try:
        for gap in [0.0, *gaps]:
            time.sleep(gap)  # the poller's interval (a thread, not the event loop)
            try:
                conn.request("GET", "/healthz")
                response = conn.getresponse()
                response.read()
                seen.append((conn.sock.getsockname()[1], str(response.status)))
            except (OSError, http.client.HTTPException) as exc:
                seen.append((0, type(exc).__name__))
                conn.close()
    finally:
        conn.close()
    return seen


async def test_a_poller_keeps_its_connection_while_it_polls_within_keep_alive(
        nursery, tmp_path) -> None:
    # The mechanism on a small scale: keep-alive 1 s; a poller every 0.7 s keeps one
    # connection and never sees an error; a gap longer than keep-alive meets a closed
    # connection (the error every second request got with the old 5 s and a 10 s poller).
    settings = load_settings(str(config(tmp_path, "", keep_alive_s=1.0)))
    with trio.fail_after(20):
        running = await nursery.start(service.run, settings)
        seen = await trio.to_thread.run_sync(poll, running.url, [0.7, 0.7, 0.7, 1.6])
    steady, after_gap = seen[:4], seen[4]
    assert all(status == "200" for _, status in steady), seen
    assert len({port for port, _ in steady}) == 1, seen
    assert after_gap[1] != "200", seen


def test_the_default_keep_alive_outlasts_a_minute_poller(tmp_path) -> None:
    settings = load_settings(str(config(tmp_path, "")))
    limits = service.limits(settings)
    assert limits.keep_alive_s == 75.0
    assert limits.keep_alive_paths == {}  # without peers: one keep-alive for everyone
    assert service.hypercorn_config(settings).keep_alive_timeout == 75.0
    assert (limits.max_connections, limits.header_timeout_s, limits.body_timeout_s) == (
        1024, 10.0, 60.0)


async def test_connections_closed_by_clients_leave_no_close_wait(nursery, tmp_path) -> None:
    settings = load_settings(str(config(tmp_path, "")))
    with trio.fail_after(20):
        running = await nursery.start(service.run, settings)
        port = int(running.url.rsplit(":", 1)[1])
        streams = [await trio.open_tcp_stream("127.0.0.1", port) for _ in range(100)]
        for stream in streams:
            await stream.send_all(b"GET /healthz HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n")
            received = b""
            while b'"ok"' not in received:
                received += await stream.receive_some(4096)
        for stream in streams:
            await stream.aclose()
    assert running.connections is not None and running.connections.high_water >= 100
    with trio.fail_after(1.0):
        # /proc has no event to wait for: poll it, within the ceiling above
        while close_wait(port) or len(running.connections):  # noqa: ASYNC110
            await trio.sleep(0.02)


async def test_3000_idle_connections_leave_healthz_answering(nursery, tmp_path) -> None:
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = 3000 + 1024 + 512
    if soft < need:
        if hard != resource.RLIM_INFINITY and hard < need:
            pytest.skip(f"needs {need} file descriptors, the hard limit is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
    settings = load_settings(str(config(tmp_path, "")))
    healthz = b"GET /healthz HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n"
    with trio.fail_after(60):
        running = await nursery.start(service.run, settings)
        port = int(running.url.rsplit(":", 1)[1])
        held = []
        for i in range(3000):
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            if i % 2:  # half of them idle after a request, half before their first
                await stream.send_all(healthz)
                received = b""
                while b'"ok"' not in received:
                    received += await stream.receive_some(4096)
            held.append(stream)
    async with httpx2.AsyncClient(base_url=running.url) as client:
        with trio.fail_after(1.0):
            r = await client.get("/healthz")
    assert r.status_code == 200
    assert running.connections is not None
    assert running.connections.cap == 1024
    assert 1000 <= running.connections.high_water <= 1024
    for stream in held:
        await stream.aclose()


def close_wait(port: int) -> int:
    """Sockets in CLOSE-WAIT whose local port is ``port`` (/proc/net/tcp)."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            count += sum(1 for line in list(f)[1:]
                         if line.split()[3] == "08"
                         and int(line.split()[1].rsplit(":", 1)[1], 16) == port)
    return count


async def test_openai_client_lists_models(nursery, tmp_path) -> None:
    sim = await nursery.start(serve_sim, SimOptions(kind="llamacpp", model="gemma3-270m"))
    await sim.wait_phase("ready")
    settings = load_settings(str(config(tmp_path, engine("g", "llamacpp", sim.port))))
    with trio.fail_after(30):
        running = await nursery.start(service.run, settings)
        await wait_state(running.board, "g", "ready", where=lambda e: bool(e.models))
        url = running.url

        def list_models() -> list[str]:
            import openai

            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
            return [m.id for m in client.models.list()]

        ids = await trio.to_thread.run_sync(list_models)
    assert ids == ["gemma3-270m"]


async def test_serve_sigterm_leaves_no_process_behind(tmp_path) -> None:
    port = free_port()
    command = [sys.executable, "-m", "nvpair.sim", "vllm", "--model", "m", "--port", "{port}",
               "--load-s", "0.2", "--no-control", "--spawn-children", "2",
               "--children-ignore-sigterm"]
    body = engine("e", "vllm", port, f"managed = true\ncommand = {command!r}\n"
                  "[engines.probes.ready]\ninterval_s = 0.1\ntimeout_s = 0.1\n")
    path = config(tmp_path, body, log_dir=str(tmp_path / "logs"))
    api_port = free_port()
    with trio.fail_after(60):
        proc = await trio.lowlevel.open_process(
            [sys.executable, "-m", "nvpair", "serve", "--config", str(path),
             "--listen", f"127.0.0.1:{api_port}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            async with httpx2.AsyncClient(base_url=f"http://127.0.0.1:{api_port}") as client:
                while True:
                    try:
                        doc = (await client.get("/v1/engines/e")).json()
                    except httpx2.ConnectError:
                        doc = {}
                    if doc.get("state") == "ready":
                        break
                    await trio.sleep(0.05)  # an external process: nothing to wait on but it
            pid = doc["pid"]
            members = group_members(pid)
            assert len(members) == 3  # the engine and its two children
            proc.send_signal(signal.SIGTERM)
            code = await proc.wait()
        finally:
            if proc.returncode is None:
                proc.kill()
    assert code == 0
    assert group_members(pid) == []


async def test_engine_that_wants_an_api_key_says_so(nursery, tmp_path) -> None:
    sim = await nursery.start(serve_sim, SimOptions(kind="llamacpp", model="g",
                                                    api_key="engine-key"))
    await sim.wait_phase("ready")
    settings = load_settings(str(config(tmp_path, engine("g", "llamacpp", sim.port))))
    with trio.fail_after(30):
        running = await nursery.start(service.run, settings)
        # Its /health is open, its /props is not: who answers cannot be confirmed, so it
        # is not listed, and the status says what to do.
        await wait_state(running.board, "g", "starting", where=lambda e: e.notice is not None)
        async with httpx2.AsyncClient(base_url=running.url) as client:
            status = (await client.get("/v1/engines/g")).json()
            listed = (await client.get("/v1/models")).json()["data"]
    assert "needs an API key; set api_key_file" in status["error"]
    assert "who answers is not confirmed yet" in status["error"] and listed == []
    (tmp_path / "key").write_text("engine-key")
    fixed = config(tmp_path, engine("g", "llamacpp", sim.port, "api_key_file = 'key'"))
    with trio.fail_after(30):
        running = await nursery.start(service.run, load_settings(str(fixed)))
        e = await wait_state(running.board, "g", "ready", where=lambda e: bool(e.models))
    assert e.notice is None and [m.id for m in e.models] == ["g"]


async def test_engines_start_a_few_at_a_time_and_all_of_them(autojump_clock) -> None:
    """service.start_engines: every runner runs, STARTED_AT_ONCE at a time and
    STARTED_EVERY_S apart (1,024 engines' first probes in one burst held the loop)."""
    class Runner:  # (a stand-in with what start_engines and the fleet use)
        started_at: float | None = None

        def __init__(self, i: int) -> None:
            self.spec = SimpleNamespace(name=f"e{i}")

        async def run(self) -> None:
            self.started_at = trio.current_time()
            await trio.sleep_forever()

    runners = [Runner(i) for i in range(3 * service.STARTED_AT_ONCE + 1)]
    async with trio.open_nursery() as nursery:
        fleet = Fleet({})
        await nursery.start(fleet.run)
        began = trio.current_time()
        await service.start_engines(fleet, runners)  # type: ignore[arg-type]
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()
    waves = [round((r.started_at - began) / service.STARTED_EVERY_S)  # type: ignore[operator]
             for r in runners]
    assert waves == [i // service.STARTED_AT_ONCE for i in range(len(runners))]
