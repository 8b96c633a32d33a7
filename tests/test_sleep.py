"""Sleep as a state (docs/sleep.md): nvpair, real sockets, simulators in this process.

A sleeping engine is listed ``sleeping`` and probed only by what never wakes it (counted on
the simulator's side); a routed request to a sleeping llama-server wakes it by itself; the
wake and sleep routes drive vLLM's sleep with ``mode=wait``, so a stream in flight ends
whole.
"""

from __future__ import annotations

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


def config(tmp: Path, sim: SimHandle, kind: str, extra: str = "") -> Path:
    path = tmp / "nvpair.toml"
    path.write_text(f"listen = '127.0.0.1:0'\nsweep_deadline_s = 1\n[[engines]]\nname = 'e'\n"
                    f"kind = '{kind}'\nport = {sim.port}\nmodel = 'gemma'\nsleep = true\n"
                    f"{extra}\n{FAST}")
    return path


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
