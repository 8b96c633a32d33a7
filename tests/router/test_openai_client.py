"""The official openai client chats through nvpair, as the README shows."""

from __future__ import annotations

import trio
from tests.managed import wait_state

from nvpair import service
from nvpair.config.settings import load_settings
from nvpair.sim import SimOptions, serve_sim


async def test_openai_client_streams_a_chat_through_nvpair(nursery, tmp_path) -> None:
    sim = await nursery.start(serve_sim, SimOptions(kind="llamacpp", model="gemma3-270m",
                                                    max_tokens=8))
    await sim.wait_phase("ready")
    path = tmp_path / "nvpair.toml"
    path.write_text(f"listen = '127.0.0.1:0'\n[[engines]]\nname = 'g'\nkind = 'llamacpp'\n"
                    f"port = {sim.port}\n")
    with trio.fail_after(30):
        running = await nursery.start(service.run, load_settings(str(path)))
        await wait_state(running.board, "g", "ready", where=lambda e: bool(e.models))
        url = running.url

        def chat() -> tuple[str, str]:
            import openai

            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
            text = "".join(c.choices[0].delta.content or "" for c in
                           client.chat.completions.create(
                               model="gemma3-270m", stream=True,
                               messages=[{"role": "user", "content": "hi"}]) if c.choices)
            whole = client.chat.completions.create(
                model="gemma3-270m", messages=[{"role": "user", "content": "hi"}])
            return text, whole.choices[0].message.content or ""

        streamed, whole = await trio.to_thread.run_sync(chat)
    assert streamed and whole
    assert sim.stats().path("/v1/chat/completions").count == 2
