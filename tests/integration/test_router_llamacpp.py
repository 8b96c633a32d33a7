"""The front door against the real llama-server: a chat through nvpair, and a client that
leaves mid-stream frees the engine's slot (read from the engine's own /slots)."""

from __future__ import annotations

from pathlib import Path

import httpx2
import msgspec
import pytest
import trio
from tests.integration.llamacpp_process import DEFAULT_ALIAS, LlamaServer
from tests.managed import wait_state

from nvpair import service
from nvpair.base.streams import close_early
from nvpair.config.settings import load_settings

pytestmark = pytest.mark.integration


def _chat(stream: bool, max_tokens: int) -> bytes:
    return msgspec.json.encode({"model": DEFAULT_ALIAS, "stream": stream,
                                "max_tokens": max_tokens, "temperature": 0,
                                "messages": [{"role": "user", "content": "Count to ten."}]})


async def _slots_busy(server: LlamaServer) -> int:
    async with httpx2.AsyncClient(base_url=server.base_url, timeout=10) as client:
        slots = (await client.get("/slots")).json()
    return sum(1 for s in slots if s["is_processing"])


async def test_chat_through_nvpair_and_disconnect_frees_the_slot(
        real_llama_server: LlamaServer, nursery: trio.Nursery, tmp_path: Path) -> None:
    server = real_llama_server
    path = tmp_path / "nvpair.toml"
    path.write_text(f"listen = '127.0.0.1:0'\n[[engines]]\nname = 'g'\nkind = 'llamacpp'\n"
                    f"port = {server.port}\n")
    with trio.fail_after(90):
        running = await nursery.start(service.run, load_settings(str(path)))
        await wait_state(running.board, "g", "ready", where=lambda e: bool(e.models), within=30)
        async with httpx2.AsyncClient(base_url=running.url, timeout=60,
                                      headers={"content-type": "application/json"}) as client:
            whole = await client.post("/v1/chat/completions", content=_chat(False, 8))
            assert whole.status_code == 200, whole.text
            assert whole.json()["object"] == "chat.completion"
            assert whole.headers["x-nvpair-engine"] == "g"
            # A long stream, left after three chunks.
            async with client.stream("POST", "/v1/chat/completions",
                                     content=_chat(True, 400)) as r:
                assert r.status_code == 200
                chunks = r.aiter_raw()
                try:
                    for _ in range(3):
                        await chunks.__anext__()
                finally:
                    with trio.move_on_after(5, shield=True):
                        await close_early(chunks)
            left = trio.current_time()
        # The engine notices at its next token: poll its own /slots (an external process).
        while True:
            if not await _slots_busy(server):
                break
            await trio.sleep(0.02)  # an external process: poll it
        freed_after = trio.current_time() - left
    assert freed_after < 2.0, freed_after
    traffic = running.traffic.of("g")
    assert traffic.failures == 0 and traffic.client_gone == 1
