"""nvpair against the real llama-server in router mode (docs/multi-model.md): two names
(symlinks) for the shipped GGUF, ``--models-max 1``. Both are listed cold; a chat to one
loads it (ready); a chat to the other while a stream runs on the first waits, then
succeeds, and the stream completes intact."""

from __future__ import annotations

import subprocess
from pathlib import Path

import httpx2
import msgspec
import pytest
import trio
from tests.integration.llamacpp_process import LlamaAssets, stop_process
from tests.managed import wait_state
from tests.ports import free_port

from nvpair import service
from nvpair.config.settings import load_settings

pytestmark = pytest.mark.integration

FAST = """
[engines.probes.ready]
interval_s = 0.2
timeout_s = 0.2
[engines.probes.models]
interval_s = 0.5
timeout_s = 0.5
"""


def chat(model: str, *, stream: bool = False, max_tokens: int = 4) -> bytes:
    return msgspec.json.encode({"model": model, "stream": stream, "max_tokens": max_tokens,
                                "temperature": 0,
                                "messages": [{"role": "user", "content": "Count to ten."}]})


def states(running) -> dict[str, str | None]:  # type: ignore[no-untyped-def]
    e = running.board.current.engine("r")
    return {m.id: m.state for m in e.models}


async def test_two_models_one_slot_through_nvpair(
        llama_assets: LlamaAssets, nursery: trio.Nursery, tmp_path: Path) -> None:
    models = tmp_path / "models"
    models.mkdir()
    for name in ("alpha", "beta"):
        (models / f"{name}.gguf").symlink_to(llama_assets.model)
    port = free_port()
    log = (tmp_path / "router.log").open("wb")
    proc = await trio.lowlevel.open_process(
        [str(llama_assets.binary), "--models-dir", str(models), "--models-max", "1",
         "--host", "127.0.0.1", "--port", str(port), "-c", "1024", "-t", "1"],
        stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
    try:
        path = tmp_path / "nvpair.toml"
        path.write_text(f"listen = '127.0.0.1:0'\n[[engines]]\nname = 'r'\n"
                        f"kind = 'llamacpp'\nport = {port}\n{FAST}")
        with trio.fail_after(180):
            running = await nursery.start(service.run, load_settings(str(path)))
            await wait_state(running.board, "r", "ready", within=60,
                             where=lambda e: len(e.models) == 2)
            assert states(running) == {"alpha": "cold", "beta": "cold"}
            async with httpx2.AsyncClient(base_url=running.url, timeout=120, headers={
                    "content-type": "application/json"}) as client:
                listed = (await client.get("/v1/models")).json()["data"]
                assert {m["id"]: m["nvpair"]["state"] for m in listed} == {
                    "alpha": "cold", "beta": "cold"}
                first = await client.post("/v1/chat/completions", content=chat("alpha"))
                assert first.status_code == 200, first.text
                await wait_state(running.board, "r", "ready", within=30,
                                 where=lambda e: states(running)["alpha"] == "ready")
                order: list[str] = []
                async with client.stream("POST", "/v1/chat/completions", content=chat(
                        "alpha", stream=True, max_tokens=200)) as r:
                    assert r.status_code == 200
                    lines = r.aiter_lines()
                    await lines.__anext__()

                    async def other() -> None:
                        answer = await client.post("/v1/chat/completions",
                                                   content=chat("beta"))
                        assert answer.status_code == 200, answer.text
                        assert answer.json()["model"] == "beta"
                        order.append("beta answered")

                    async with trio.open_nursery() as inner:
                        inner.start_soon(other)
                        body = [line async for line in lines if line]
                        order.append("alpha stream done")
                assert body[-1] == "data: [DONE]", body[-3:]
                assert all(line.startswith("data: {") for line in body[:-1])
                assert order == ["alpha stream done", "beta answered"]
                await wait_state(running.board, "r", "ready", within=30,
                                 where=lambda e: states(running) == {
                                     "alpha": "cold", "beta": "ready"})
    finally:
        with trio.move_on_after(30, shield=True):
            await stop_process(proc)
        log.close()


async def test_a_load_by_another_client_shows_after_the_next_routed_answer(
        llama_assets: LlamaAssets, nursery: trio.Nursery, tmp_path: Path) -> None:
    """Two slots; nvpair's model list every 30 s. A client loads beta straight on the
    router; the next chat nvpair routes (to alpha) reads the list again once answered, so
    beta shows ready within seconds, not at the next list."""
    models = tmp_path / "models"
    models.mkdir()
    for name in ("alpha", "beta"):
        (models / f"{name}.gguf").symlink_to(llama_assets.model)
    port = free_port()
    log = (tmp_path / "router.log").open("wb")
    proc = await trio.lowlevel.open_process(
        [str(llama_assets.binary), "--models-dir", str(models), "--models-max", "2",
         "--host", "127.0.0.1", "--port", str(port), "-c", "1024", "-t", "1"],
        stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
    try:
        path = tmp_path / "nvpair.toml"
        path.write_text(f"listen = '127.0.0.1:0'\n[[engines]]\nname = 'r'\n"
                        f"kind = 'llamacpp'\nport = {port}\n"
                        "[engines.probes.ready]\ninterval_s = 0.2\ntimeout_s = 0.2\n"
                        "[engines.probes.models]\ninterval_s = 30\ntimeout_s = 5\n")
        with trio.fail_after(180):
            running = await nursery.start(service.run, load_settings(str(path)))
            await wait_state(running.board, "r", "ready", within=60,
                             where=lambda e: len(e.models) == 2)
            async with httpx2.AsyncClient(base_url=running.url, timeout=120, headers={
                    "content-type": "application/json"}) as client, \
                    httpx2.AsyncClient(base_url=f"http://127.0.0.1:{port}",
                                       timeout=60) as direct:
                assert (await client.post("/v1/chat/completions", content=chat("alpha"))
                        ).status_code == 200
                loaded = await direct.post("/models/load", json={"model": "beta"})
                assert loaded.status_code == 200, loaded.text
                while True:  # (the router's own state, over HTTP)
                    listed = (await direct.get("/models")).json()["data"]
                    if {m["id"]: m["status"]["value"] for m in listed}["beta"] == "loaded":
                        break
                    await trio.sleep(0.2)
                # (nvpair cannot know it is loaded yet: the list it read again after the
                # first answer may have caught beta loading)
                assert states(running)["beta"] in ("cold", "loading")
                answer = await client.post("/v1/chat/completions", content=chat("alpha"))
                assert answer.status_code == 200, answer.text
                await wait_state(running.board, "r", "ready", within=5,
                                 where=lambda e: states(running) == {
                                     "alpha": "ready", "beta": "ready"})
    finally:
        with trio.move_on_after(30, shield=True):
            await stop_process(proc)
        log.close()
