"""Sleep as a state (docs/sleep.md): nvpair, real sockets, simulators in this process.

A sleeping engine is listed ``sleeping`` and probed only by what never wakes it (counted on
the simulator's side); a routed request to a sleeping llama-server wakes it by itself; the
wake and sleep routes drive vLLM's sleep with ``mode=wait``, so a stream in flight ends
whole.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx2
import msgspec
import trio
from tests.managed import wait_state

from nvpair import service
from nvpair.config.settings import load_settings
from nvpair.sim import SimOptions, serve_sim
from nvpair.sim.handle import SimHandle

FAST = """
[engines.probes.health]
interval_s = 0.2
timeout_s = 0.2
[engines.probes.identity]
interval_s = 0.5
timeout_s = 0.5
[engines.probes.models]
interval_s = 0.5
timeout_s = 0.5
"""
CHAT = msgspec.json.encode({"model": "gemma", "max_tokens": 3,
                            "messages": [{"role": "user", "content": "hi"}]})


def config(tmp: Path, sim: SimHandle, kind: str, extra: str = "", *,
           sleep: bool = True) -> Path:
    path = tmp / "nvpair.toml"
    path.write_text(f"listen = '127.0.0.1:0'\nsweep_deadline_s = 1\n[[engines]]\nname = 'e'\n"
                    f"kind = '{kind}'\nport = {sim.port}\nmodel = 'gemma'\n"
                    f"sleep = {str(sleep).lower()}\n{extra}\n{FAST}")
    return path


def health_requests(running: service.Running) -> int:
    e = running.board.current.engine("e")
    stats = None if e is None else e.probe("health")
    return 0 if stats is None else stats.requests


def sleep_counts(sim: SimHandle) -> dict[str, int]:
    return {k: v for k, v in sim.stats().engine["sleep"].items() if k in ("sleeps", "wakes")}


async def test_a_sleeping_llamacpp_is_listed_sleeping_its_probes_never_wake_it_and_a_request_does(
        nursery: trio.Nursery, tmp_path: Path) -> None:
    sim = await nursery.start(serve_sim, SimOptions(
        kind="llamacpp", model="gemma", sleep_idle_s=0.5, wake_s=0.2, max_tokens=3))
    await sim.wait_phase("ready")
    with trio.fail_after(30):
        running = await nursery.start(service.run, load_settings(str(config(tmp_path, sim,
                                                                            "llamacpp"))))
        await wait_state(running.board, "e", "sleeping", where=lambda e: bool(e.models))
        assert sleep_counts(sim) == {"sleeps": 1, "wakes": 0}
        # probes every 0.2 s (health: /props), 0.5 s (identity, models) for 2 s: none wakes it
        await trio.sleep(2.0)
        e = running.board.current.engine("e")
        assert e is not None and e.state == "sleeping"
        health = e.probe("health")
        assert health is not None and health.path == "/props" and health.requests >= 5
        assert sleep_counts(sim) == {"sleeps": 1, "wakes": 0}
        async with httpx2.AsyncClient(base_url=running.url) as client:
            models = (await client.get("/v1/models")).json()["data"]
            assert [(m["id"], m["nvpair"]["state"]) for m in models] == [("gemma", "sleeping")]
            engine = (await client.get("/v1/engines/e")).json()
            assert engine["state"] == "sleeping"
            answer = await client.post("/v1/chat/completions", content=CHAT,
                                       headers={"content-type": "application/json"})
            assert answer.status_code == 200, answer.text
        assert sleep_counts(sim)["wakes"] == 1
        await wait_state(running.board, "e", "ready")


async def test_an_adopted_llamacpp_that_sleeps_without_sleep_true_is_listed_sleeping(
        nursery: trio.Nursery, tmp_path: Path) -> None:
    """Started with --sleep-idle-seconds by someone else, adopted without ``sleep = true``:
    its /props says it sleeps (and /props never wakes it), so it is not shown ready; a
    request wakes it by itself, and ``POST .../wake`` wakes it too."""
    sim = await nursery.start(serve_sim, SimOptions(
        kind="llamacpp", model="gemma", sleep_idle_s=0.5, wake_s=0.1, max_tokens=3))
    await sim.wait_phase("ready")
    with trio.fail_after(30):
        running = await nursery.start(service.run, load_settings(str(config(
            tmp_path, sim, "llamacpp", sleep=False))))
        await wait_state(running.board, "e", "sleeping", where=lambda e: bool(e.models))
        await trio.sleep(1.0)  # probed for a second: still asleep, nothing woke it
        assert running.board.current.engine("e").state == "sleeping"  # type: ignore[union-attr]
        assert sleep_counts(sim) == {"sleeps": 1, "wakes": 0}
        async with httpx2.AsyncClient(base_url=running.url) as client:
            answer = await client.post("/v1/chat/completions", content=CHAT,
                                       headers={"content-type": "application/json"})
            assert answer.status_code == 200, answer.text
            assert sleep_counts(sim)["wakes"] == 1
            await wait_state(running.board, "e", "ready")  # (awake: its probe saw it)
            await wait_state(running.board, "e", "sleeping")  # (idle again: asleep again)
            woken = await client.post("/v1/engines/e/wake")
            assert (woken.status_code, woken.json()["operation"]) == (202, "waking")
            await wait_state(running.board, "e", "ready")
        assert sleep_counts(sim)["wakes"] == 2


async def cli(url: str, *argv: str) -> subprocess.CompletedProcess[bytes]:
    return await trio.run_process([sys.executable, "-m", "nvpair", *argv, "--url", url],
                                  capture_stdout=True, capture_stderr=True, check=False,
                                  env={**os.environ, "NO_COLOR": "1"})


async def test_vllm_sleeps_drained_with_mode_wait_so_a_stream_in_flight_ends_whole(
        nursery: trio.Nursery, tmp_path: Path) -> None:
    """vLLM's own /sleep default (mode=abort) would cut the stream (the simulator's
    tests/sim/test_sleep.py shows it): through nvpair, the stream ends with its [DONE]."""
    sim = await nursery.start(serve_sim, SimOptions(
        kind="vllm", model="gemma", enable_sleep_mode=True, dev_mode=True, token_rate=20,
        wake_s=0.3))
    await sim.wait_phase("ready")
    with trio.fail_after(30):
        running = await nursery.start(service.run, load_settings(str(config(tmp_path, sim,
                                                                            "vllm"))))
        await wait_state(running.board, "e", "ready", where=lambda e: bool(e.models))
        async with httpx2.AsyncClient(base_url=running.url, timeout=20) as client:
            body = {"model": "gemma", "max_tokens": 20, "stream": True,
                    "messages": [{"role": "user", "content": "hi"}]}
            chunks: list[bytes] = []
            async with client.stream("POST", "/v1/chat/completions", json=body) as stream:
                async for chunk in stream.aiter_bytes():
                    if not chunks:  # in flight: put the engine to sleep now
                        asked = await client.post("/v1/engines/e/sleep")
                        assert asked.status_code == 202, asked.text
                        assert asked.json()["operation"] == "going to sleep"
                        assert asked.json()["admitting"] is False
                    chunks.append(chunk)
            assert b"".join(chunks).endswith(b"data: [DONE]\n\n")
            await wait_state(running.board, "e", "sleeping")
            assert sleep_counts(sim) == {"sleeps": 1, "wakes": 0}
            assert sim.stats().engine["last_sleep"] == {"level": "1", "mode": "wait"}
            again = await client.post("/v1/engines/e/sleep")
            assert (again.status_code, again.json()["operation"]) == (202, "sleeping")
            # probes for a second: it stays asleep (/is_sleeping wakes nothing)
            await trio.sleep(1.0)
            assert running.board.current.engine("e").state == "sleeping"  # type: ignore[union-attr]
            assert sleep_counts(sim) == {"sleeps": 1, "wakes": 0}

            # two wakes at once: one wake of the engine
            answers: list[httpx2.Response] = []

            async def wake() -> None:
                answers.append(await client.post("/v1/engines/e/wake"))

            async with trio.open_nursery() as both:
                both.start_soon(wake)
                both.start_soon(wake)
            assert [(a.status_code, a.json()["operation"]) for a in answers] == [
                (202, "waking"), (202, "waking")]
            await wait_state(running.board, "e", "ready")
            assert sleep_counts(sim) == {"sleeps": 1, "wakes": 1}

            # a routed request to a sleeping vLLM: nvpair wakes it first (it answers 503
            # asleep), and the request is answered
            assert (await client.post("/v1/engines/e/sleep")).status_code == 202
            await wait_state(running.board, "e", "sleeping")
            answer = await client.post("/v1/chat/completions", content=CHAT,
                                       headers={"content-type": "application/json"})
            assert answer.status_code == 200, answer.text
            assert sleep_counts(sim) == {"sleeps": 2, "wakes": 2}


async def test_the_cli_wakes_and_sleeps_and_says_why_not_in_one_line(
        nursery: trio.Nursery, tmp_path: Path) -> None:
    sim = await nursery.start(serve_sim, SimOptions(
        kind="vllm", model="gemma", enable_sleep_mode=True, dev_mode=True))
    await sim.wait_phase("ready")
    with trio.fail_after(60):
        running = await nursery.start(service.run, load_settings(str(config(tmp_path, sim,
                                                                            "vllm"))))
        await wait_state(running.board, "e", "ready", where=lambda e: bool(e.models))
        done = await cli(running.url, "sleep", "e")
        assert done.returncode == 0, done.stderr
        assert done.stdout.decode().startswith("e: sleep accepted (going to sleep)")
        await wait_state(running.board, "e", "sleeping")
        done = await cli(running.url, "wake", "e")
        assert done.returncode == 0, done.stderr
        await wait_state(running.board, "e", "ready")
        assert sleep_counts(sim) == {"sleeps": 1, "wakes": 1}
        refused = await cli(running.url, "wake", "nosuch")
        assert refused.returncode != 0 and len(refused.stderr.decode().strip().splitlines()) == 1


async def test_an_engine_that_cannot_be_put_to_sleep_is_a_409_with_why(
        nursery: trio.Nursery, tmp_path: Path) -> None:
    sim = await nursery.start(serve_sim, SimOptions(kind="llamacpp", model="gemma",
                                                    sleep_idle_s=30))
    await sim.wait_phase("ready")
    with trio.fail_after(30):
        running = await nursery.start(service.run, load_settings(str(config(tmp_path, sim,
                                                                            "llamacpp"))))
        await wait_state(running.board, "e", "ready", where=lambda e: bool(e.models))
        async with httpx2.AsyncClient(base_url=running.url) as client:
            refused = await client.post("/v1/engines/e/sleep")
            assert refused.status_code == 409
            assert "sleeps by itself after idle_sleep_s" in refused.json()["error"]["message"]
            awake = await client.post("/v1/engines/e/wake")
            assert (awake.status_code, awake.json()["operation"]) == (202, "awake")
            assert (await client.get("/v1/engines/e/wake")).status_code == 405


async def test_sglang_sleeps_paused_and_released_and_wakes_resumed_and_continued(
        nursery: trio.Nursery, tmp_path: Path) -> None:
    """SGLang has no call that says it sleeps: nvpair's own record holds while its health
    probe (/ping) answers 200 as usual; a wake resumes and continues it."""
    sim = await nursery.start(serve_sim, SimOptions(kind="sglang", model="gemma",
                                                    enable_memory_saver=True))
    await sim.wait_phase("ready")
    with trio.fail_after(30):
        running = await nursery.start(service.run, load_settings(str(config(tmp_path, sim,
                                                                            "sglang"))))
        await wait_state(running.board, "e", "ready", where=lambda e: bool(e.models))
        async with httpx2.AsyncClient(base_url=running.url) as client:
            assert (await client.post("/v1/engines/e/sleep")).status_code == 202
            await wait_state(running.board, "e", "sleeping")
            assert sim.stats().engine["paused"] is True
            assert sleep_counts(sim) == {"sleeps": 1, "wakes": 0}
            before = health_requests(running)
            await trio.sleep(1.0)  # its health probe answers 200 meanwhile
            e = running.board.current.engine("e")
            assert e is not None and e.state == "sleeping"
            assert health_requests(running) - before >= 3
            answer = await client.post("/v1/chat/completions", content=CHAT,
                                       headers={"content-type": "application/json"})
            assert answer.status_code == 200, answer.text  # (woken first)
            assert sim.stats().engine["paused"] is False
            assert sleep_counts(sim) == {"sleeps": 1, "wakes": 1}
            await wait_state(running.board, "e", "ready")


async def test_a_models_wake_wakes_its_engine_once_and_an_unknown_model_is_a_404(
        nursery: trio.Nursery, tmp_path: Path) -> None:
    """``POST /v1/models/{id}/wake``: two at once wake the sleeping vLLM once (the second
    joins the first); its alias works too; a model nobody lists is OpenAI's 404; the CLI
    takes a model's id where no engine has that name."""
    sim = await nursery.start(serve_sim, SimOptions(
        kind="vllm", model="gemma", enable_sleep_mode=True, dev_mode=True, wake_s=0.3))
    await sim.wait_phase("ready")
    with trio.fail_after(30):
        running = await nursery.start(service.run, load_settings(str(config(
            tmp_path, sim, "vllm", "aliases = ['g']"))))
        await wait_state(running.board, "e", "ready", where=lambda e: bool(e.models))
        async with httpx2.AsyncClient(base_url=running.url) as client:
            assert (await client.post("/v1/engines/e/sleep")).status_code == 202
            await wait_state(running.board, "e", "sleeping")
            answers: list[httpx2.Response] = []

            async def wake() -> None:
                answers.append(await client.post("/v1/models/gemma/wake"))

            async with trio.open_nursery() as both:
                both.start_soon(wake)
                both.start_soon(wake)
            assert [(a.status_code, a.json()["operation"], a.json()["model"], a.json()["name"])
                    for a in answers] == [(202, "waking", "gemma", "e")] * 2
            await wait_state(running.board, "e", "ready")
            assert sleep_counts(sim) == {"sleeps": 1, "wakes": 1}
            awake = await client.post("/v1/models/g/wake")  # (by its alias)
            assert (awake.status_code, awake.json()["operation"]) == (202, "awake")
            unknown = await client.post("/v1/models/no/such/wake")
            assert unknown.status_code == 404
            assert unknown.json()["error"]["code"] == "model_not_found"
            assert (await client.get("/v1/models/gemma")).status_code == 200  # (unchanged)
            assert (await client.put("/v1/models/gemma/wake")).headers["allow"] == "GET, POST"
            assert (await client.post("/v1/engines/e/sleep")).status_code == 202
            await wait_state(running.board, "e", "sleeping")
        done = await cli(running.url, "wake", "gemma")
        assert done.returncode == 0, done.stderr
        assert done.stdout.decode().startswith("gemma: wake accepted (waking); engine e")
        await wait_state(running.board, "e", "ready")
        assert sleep_counts(sim) == {"sleeps": 2, "wakes": 2}
        refused = await cli(running.url, "wake", "nosuch")
        assert refused.returncode != 0
        [line] = refused.stderr.decode().strip().splitlines()
        assert line.endswith("no engine or model named 'nosuch' on this node"), line


async def test_a_models_wake_loads_it_on_a_multi_model_engine(
        nursery: trio.Nursery, tmp_path: Path) -> None:
    """llama-server in router mode (the simulator): a wake of a cold model is one
    ``POST /models/load`` (a second wake while it loads joins it), and the model shows
    ready once the router says it is loaded."""
    models = tmp_path / "models"
    models.mkdir()
    (tmp_path / "one.gguf").write_bytes(b"GGUF")
    for name in ("alpha", "beta"):
        (models / f"{name}.gguf").symlink_to(tmp_path / "one.gguf")
    sim = await nursery.start(serve_sim, SimOptions(kind="llamacpp", models_dir=str(models),
                                                    models_max=1, model_load_s=0.5))
    await sim.wait_phase("ready")
    path = tmp_path / "nvpair.toml"
    path.write_text(f"listen = '127.0.0.1:0'\n[[engines]]\nname = 'r'\nkind = 'llamacpp'\n"
                    f"port = {sim.port}\n[engines.probes.models]\ninterval_s = 30\n")

    def state(model: str) -> str | None:
        e = running.board.current.engine("r")
        assert e is not None
        return next(m.state for m in e.models if m.id == model)

    with trio.fail_after(30):
        running = await nursery.start(service.run, load_settings(str(path)))
        await wait_state(running.board, "r", "ready", where=lambda e: len(e.models) == 2)
        async with httpx2.AsyncClient(base_url=running.url) as client:
            first = await client.post("/v1/models/alpha/wake")
            assert (first.status_code, first.json()["operation"]) == (202, "loading")
            assert state("alpha") == "loading"
            second = await client.post("/v1/models/alpha/wake")
            assert (second.status_code, second.json()["operation"]) == (202, "loading")
            await wait_state(running.board, "r", "ready", where=lambda e: state("alpha") == "ready")
            assert sim.stats().path("/models/load").count == 1
            again = await client.post("/v1/models/alpha/wake")
            assert (again.status_code, again.json()["operation"]) == (202, "awake")


async def test_vllm_at_level_2_is_woken_with_its_weights_loaded_again(
        nursery: trio.Nursery, tmp_path: Path) -> None:
    """``sleep_level = 2`` drops the weights: nvpair's wake is wake_up (weights),
    collective_rpc reload_weights, wake_up (kv_cache), reset_prefix_cache, so the engine
    answers the model's words, not the garbage a plain wake_up leaves (the simulator's
    U+FFFD tokens)."""
    sim = await nursery.start(serve_sim, SimOptions(
        kind="vllm", model="gemma", enable_sleep_mode=True, dev_mode=True, wake_s=0.1))
    await sim.wait_phase("ready")
    with trio.fail_after(30):
        running = await nursery.start(service.run, load_settings(str(config(
            tmp_path, sim, "vllm", "sleep_level = 2"))))
        await wait_state(running.board, "e", "ready", where=lambda e: bool(e.models))
        async with httpx2.AsyncClient(base_url=running.url) as client:
            assert (await client.post("/v1/engines/e/sleep")).status_code == 202
            await wait_state(running.board, "e", "sleeping")
            assert sim.stats().engine["last_sleep"] == {"level": "2", "mode": "wait"}
            answer = await client.post("/v1/chat/completions", content=CHAT,
                                       headers={"content-type": "application/json"})
            assert answer.status_code == 200, answer.text
            content = answer.json()["choices"][0]["message"]["content"]
            assert content and "\ufffd" not in content
        assert sim.stats().engine["reloads"] == 1
        assert sim.stats().path("/reset_prefix_cache").count == 1
async def test_the_sleep_and_wake_calls_build_no_tls_context_of_their_own(
        nursery: trio.Nursery, tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Each sleep or wake call's client built an SSL context of its own (the trust store
    read on the event loop: 71 ms a client measured on the loaded 2-core machine, so about
    140 ms of every swap by the eviction tiers); they share nvpair's one
    (``nvpair.base.tls.client_tls``), as every other client does."""
    import ssl

    from nvpair.base.tls import client_tls

    client_tls()  # (nvpair's one, built before the count starts)
    sim = await nursery.start(serve_sim, SimOptions(
        kind="vllm", model="gemma", enable_sleep_mode=True, dev_mode=True))
    await sim.wait_phase("ready")
    with trio.fail_after(30):
        running = await nursery.start(service.run, load_settings(str(config(tmp_path, sim,
                                                                            "vllm"))))
        await wait_state(running.board, "e", "ready", where=lambda e: bool(e.models))
        built: list[str] = []
        real = ssl.create_default_context

        def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
            built.append("context")
            return real(*args, **kwargs)

        async with httpx2.AsyncClient(base_url=running.url, timeout=20) as client:
            monkeypatch.setattr(ssl, "create_default_context", counted)
            assert (await client.post("/v1/engines/e/sleep")).status_code == 202
            await wait_state(running.board, "e", "sleeping")
            assert (await client.post("/v1/engines/e/wake")).status_code == 202
            await wait_state(running.board, "e", "ready")
            monkeypatch.undo()
        assert sleep_counts(sim) == {"sleeps": 1, "wakes": 1}
        assert built == []


async def test_vllm_with_idle_sleep_s_sleeps_once_idle_and_never_while_a_stream_runs(
        nursery: trio.Nursery, tmp_path: Path) -> None:
    """``idle_sleep_s`` for a kind nvpair puts to sleep (vLLM): asleep once no routed
    request ran for that long; a stream that outlasts it keeps it awake, and it sleeps
    again only after the stream has ended whole."""
    sim = await nursery.start(serve_sim, SimOptions(
        kind="vllm", model="gemma", enable_sleep_mode=True, dev_mode=True, token_rate=10,
        wake_s=0.1))
    await sim.wait_phase("ready")
    with trio.fail_after(40):
        running = await nursery.start(service.run, load_settings(str(config(
            tmp_path, sim, "vllm", "idle_sleep_s = 1"))))
        e = await wait_state(running.board, "e", "sleeping", within=20)
        assert e.activity is not None and "idle" in e.activity, e.activity
        assert sleep_counts(sim) == {"sleeps": 1, "wakes": 0}
        async with httpx2.AsyncClient(base_url=running.url, timeout=20) as client:
            body = {"model": "gemma", "max_tokens": 25, "stream": True,  # 2.5 s > 1 s
                    "messages": [{"role": "user", "content": "hi"}]}
            chunks: list[bytes] = []
            async with client.stream("POST", "/v1/chat/completions", json=body) as stream:
                assert stream.status_code == 200
                async for chunk in stream.aiter_bytes():
                    chunks.append(chunk)
            assert b"".join(chunks).endswith(b"data: [DONE]\n\n")
            assert sleep_counts(sim) == {"sleeps": 1, "wakes": 1}  # awake all along
            ended = trio.current_time()
            await wait_state(running.board, "e", "sleeping", within=20)
            assert trio.current_time() - ended >= 1.0  # its idle time counts from the end
            assert sleep_counts(sim) == {"sleeps": 2, "wakes": 1}


async def test_a_bug_in_the_look_for_idle_engines_is_logged_and_the_look_goes_on(
        nursery: trio.Nursery, autojump_clock: object, monkeypatch: object) -> None:
    """The idle look runs every second inside a boundary: a fault of nvpair's own code in
    it (stood in for by one that raises) never ends the sleep operations."""
    from nvpair.state.snapshot import Board
    from nvpair.state.traffic import Traffic
    from nvpair.supervision.sleeper import Sleepers

    sleepers = Sleepers((), Board(()), Traffic())
    looked: list[float] = []

    def idle(now: float) -> list[tuple[str, float]]:
        looked.append(now)
        raise RuntimeError("a bug in the idle look")

    sleepers.idle = idle  # type: ignore[method-assign]
    await nursery.start(sleepers.run)
    await trio.sleep(3.5)
    assert len(looked) >= 3  # looked again each second: the loop lives on
    assert sleepers._nursery is not None
