"""The OpenAI front door against scripted engines and simulators, over real sockets."""

from __future__ import annotations

from pathlib import Path

import httpx2
import msgspec
import pytest
import trio
import trio.testing
from tests.managed import wait_state
from tests.router.script_engine import JSON, ScriptEngine, json_script, sse_script

from nvpair import service
from nvpair.base.streams import close_early
from nvpair.config.settings import load_settings

CHAT = "/v1/chat/completions"


def body(model: str = "m", stream: bool = False, **extra: object) -> bytes:
    return msgspec.json.encode({"model": model, "stream": stream,
                                "messages": [{"role": "user", "content": "hi"}], **extra})


async def start(nursery: trio.Nursery, tmp: Path, engines: dict[str, ScriptEngine],
                extra: str = "", top: str = ""):  # type: ignore[no-untyped-def]
    text = f"listen = '127.0.0.1:0'\n{top}\n"
    for name, eng in engines.items():
        if not eng.port:
            await nursery.start(eng.serve)
        text += (f"[[engines]]\nname = '{name}'\nkind = 'openai'\nport = {eng.port}\n{extra}\n"
                 "[engines.probes.ready]\ninterval_s = 0.1\ntimeout_s = 0.1\n")
    path = tmp / "nvpair.toml"
    path.write_text(text)
    running = await nursery.start(service.run, load_settings(str(path)))
    for name in engines:
        await wait_state(running.board, name, "ready", where=lambda e: bool(e.models))
    return running


async def test_stream_bytes_reach_the_client_unchanged(nursery, tmp_path) -> None:
    eng = ScriptEngine("m")
    script = sse_script(500, model="m")  # 500 identical-shaped chunks: nothing is re-framed
    eng.script = lambda path, raw: script
    with trio.fail_after(30):
        running = await start(nursery, tmp_path, {"e": eng})
        async with httpx2.AsyncClient(headers=JSON, base_url=running.url) as client:
            r = await client.post(CHAT, content=body(stream=True))
    assert r.status_code == 200
    assert r.headers["content-type"] == "text/event-stream"
    assert r.headers["x-nvpair-engine"] == "e"
    assert r.content == b"".join(data for _, data in script[1:])
    assert eng.requests[0][1] == body(stream=True)  # the request body passed untouched


async def test_non_stream_and_embeddings_pass_through(nursery, tmp_path) -> None:
    eng = ScriptEngine("m")
    doc = {"object": "chat.completion", "choices": [], "odd": {"keys": [1, None]}}
    eng.script = lambda path, raw: json_script({"path": path, **doc})
    with trio.fail_after(30):
        running = await start(nursery, tmp_path, {"e": eng})
        async with httpx2.AsyncClient(headers=JSON, base_url=running.url) as client:
            chat = await client.post(CHAT, content=body())
            emb = await client.post("/v1/embeddings",
                                    content=msgspec.json.encode({"model": "m", "input": "x"}))
    assert chat.content == msgspec.json.encode({"path": CHAT, **doc})
    assert emb.json()["path"] == "/v1/embeddings"


async def test_routes_by_alias_and_adds_the_engine_key_never_the_user_token(
        nursery, tmp_path) -> None:
    eng = ScriptEngine("org/model-7b")
    (tmp_path / "key").write_text("engine-secret")
    (tmp_path / "token").write_text("user-token")
    with trio.fail_after(30):
        running = await start(nursery, tmp_path, {"e": eng},
                              extra="aliases = ['fast']\napi_key_file = 'key'",
                              top="token_file = 'token'")
        async with httpx2.AsyncClient(headers=JSON, base_url=running.url) as client:
            denied = await client.post(CHAT, content=body("fast"))
            r = await client.post(CHAT, content=body("fast"),
                                  headers={"Authorization": "Bearer user-token"})
    assert denied.status_code == 401
    assert r.status_code == 200
    headers = eng.requests[-1][2]
    assert headers["authorization"] == "Bearer engine-secret"
    assert "user-token" not in str(eng.requests)


async def test_unknown_model_is_404_and_not_ready_is_503_without_connecting(
        nursery, tmp_path) -> None:
    eng = ScriptEngine("m")
    with trio.fail_after(30):
        running = await start(nursery, tmp_path, {"e": eng})
        async with httpx2.AsyncClient(headers=JSON, base_url=running.url) as client:
            missing = await client.post(CHAT, content=body("nope"))
            await client.post("/v1/engines/e/stop")
            await wait_state(running.board, "e", "stopped")
            connections = eng.connections
            start_t = trio.current_time()
            busy = await client.post(CHAT, content=body("m"))
            elapsed = trio.current_time() - start_t
    assert missing.status_code == 404
    assert missing.json() == {"error": {"message": "The model `nope` does not exist.",
                                        "type": "not_found_error", "code": "model_not_found",
                                        "param": None,
                                        "request_id": missing.headers["x-request-id"]}}
    assert busy.status_code == 503 and busy.headers["retry-after"]
    assert busy.json()["error"]["code"] == "engine_not_ready"
    assert eng.connections == connections  # answered from the snapshot
    assert elapsed < 0.1


async def test_bad_requests_are_4xx(nursery, tmp_path) -> None:
    eng = ScriptEngine("m")
    with trio.fail_after(30):
        running = await start(nursery, tmp_path, {"e": eng},
                              top="[router]\nmax_body_bytes = 2048")
        async with httpx2.AsyncClient(headers=JSON, base_url=running.url) as client:
            big = await client.post(CHAT, content=body(pad="x" * 4096))
            bad = await client.post(CHAT, content=b"{not json")
            nomodel = await client.post(CHAT, content=b"{}")
            nested = await client.post(CHAT, content=b'{"messages": ' + b"[" * 1010
                                       + b"]" * 1010 + b"}")
            get = await client.get(CHAT)
    assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"
    assert bad.status_code == 400 and nomodel.status_code == 400
    assert nested.status_code == 400, nested.text  # msgspec's RecursionError: not a 500
    assert "nested too deeply" in nested.json()["error"]["message"]
    assert get.status_code == 405
    assert eng.posts == 0


async def test_a_post_not_said_to_be_json_is_refused(nursery, tmp_path) -> None:
    """A web page can post text/plain cross-site without a preflight; the router takes
    only bodies sent as application/json."""
    eng = ScriptEngine("m")
    with trio.fail_after(30):
        running = await start(nursery, tmp_path, {"e": eng})
        async with httpx2.AsyncClient(base_url=running.url) as client:
            refused = [await client.post(CHAT, content=body(), headers=h) for h in (
                {"content-type": "text/plain"}, {"content-type": "text/plain;charset=UTF-8"},
                {"content-type": "application/x-www-form-urlencoded"},
                {"content-type": "multipart/form-data; boundary=x"},
                {"content-type": "application/jsonx"}, {})]
            ok = [await client.post(CHAT, content=body(), headers={"content-type": h})
                  for h in ("application/json", "Application/JSON; charset=utf-8")]
    for r in refused:
        assert r.status_code == 415, r.text
        assert r.json()["error"]["code"] == "unsupported_media_type"
        assert "Content-Type: application/json" in r.json()["error"]["message"]
    assert [r.status_code for r in ok] == [200, 200]
    assert eng.posts == 2


@pytest.mark.parametrize("when", ["mid-stream", "before-first-byte", "non-stream"])
async def test_client_disconnect_aborts_the_engine_request(nursery, tmp_path, when: str) -> None:
    eng = ScriptEngine("m")
    if when == "mid-stream":
        eng.script = lambda path, raw: sse_script(1000, gap=0.01)
    elif when == "before-first-byte":
        eng.script = lambda path, raw: [(30.0, b"HTTP/1.1 200 OK\r\n\r\n")]
    else:
        eng.script = lambda path, raw: json_script({"late": True}, delay=30.0)
    with trio.fail_after(30):
        running = await start(nursery, tmp_path, {"e": eng})
        async with httpx2.AsyncClient(headers=JSON, base_url=running.url) as client:
            # mid-stream: leave after the first chunk; otherwise leave after 0.3 s of waiting
            with trio.move_on_after(30 if when == "mid-stream" else 0.3):
                async with client.stream("POST", CHAT,
                                         content=body(stream=when != "non-stream")) as r:
                    chunks = r.aiter_raw()
                    try:
                        await chunks.__anext__()
                    finally:
                        with trio.move_on_after(5, shield=True):
                            await close_early(chunks)
            left_at = trio.current_time()
            await eng.closed.wait()
    seen = eng.closed_at[0] - left_at
    assert seen < 0.1, seen
    with trio.fail_after(5):  # nvpair's handler finishes its cleanup (the counters)
        await trio.testing.wait_all_tasks_blocked(0.05)
    gone = running.traffic.of("e")
    assert gone.client_gone == 1 and gone.failures == 0  # a client leaving never counts


async def sse_events(client: httpx2.AsyncClient, payload: bytes) -> list[bytes]:
    r = await client.post(CHAT, content=payload)
    return [e for e in r.content.split(b"\n\n") if e]


async def timed_stream(url: str) -> tuple[float, list[bytes]]:
    """One streaming request: how long it took, and its SSE events."""
    async with httpx2.AsyncClient(headers=JSON, base_url=url) as client:
        t0 = trio.current_time()
        events = await sse_events(client, body(stream=True))
        return trio.current_time() - t0, events


async def test_silent_engine_is_cut_after_the_idle_gap(nursery, tmp_path) -> None:
    eng = ScriptEngine("m")
    script = sse_script(3)
    eng.script = lambda path, raw: [*script[:3], (60.0, b"data: late\n\n")]
    with trio.fail_after(30):
        running = await start(nursery, tmp_path, {"e": eng},
                              top="[router]\nidle_timeout_s = 0.5")
        elapsed, events = await timed_stream(running.url)
    assert 0.5 <= elapsed < 2.0
    assert events[:2] == [e.strip() for _, e in script[1:3]]
    error = msgspec.json.decode(events[-1].removeprefix(b"data: "))
    assert error["error"]["code"] == "engine_error" and "no data" in error["error"]["message"]
    assert b"[DONE]" not in b"".join(events)


async def test_a_prefill_longer_than_the_idle_gap_is_not_cut(nursery, tmp_path) -> None:
    """vLLM sends a stream's headers at once and its first token after prefill (or a wait
    in its queue): until that first chunk, the first-byte timeout applies, not the gap."""
    eng = ScriptEngine("m")
    script = sse_script(3)
    eng.script = lambda path, raw: [script[0], (1.0, script[1][1]), *script[2:]]
    with trio.fail_after(30):
        running = await start(nursery, tmp_path, {"e": eng},
                              top="[router]\nidle_timeout_s = 0.5\nfirst_byte_timeout_s = 10")
        async with httpx2.AsyncClient(headers=JSON, base_url=running.url) as client:
            r = await client.post(CHAT, content=body(stream=True))
    assert r.content == b"".join(d for _, d in script[1:])


async def test_headers_then_silence_end_at_the_first_byte_timeout(nursery, tmp_path) -> None:
    eng = ScriptEngine("m")
    eng.script = lambda path, raw: [sse_script(0)[0], (60.0, b"data: late\n\n")]
    with trio.fail_after(30):
        running = await start(nursery, tmp_path, {"e": eng},
                              top="[router]\nidle_timeout_s = 30\nfirst_byte_timeout_s = 0.5")
        elapsed, events = await timed_stream(running.url)
    assert 0.5 <= elapsed < 2.0, elapsed
    error = msgspec.json.decode(events[-1].removeprefix(b"data: "))["error"]
    assert error["message"] == ("engine e: no data from the engine within 0.5 s "
                                "(first_byte_timeout_s)")
    assert (error["code"], error["type"]) == ("engine_error", "server_error")


async def test_a_cut_plain_body_reaches_the_client_cut_and_is_no_internal_error(
        nursery, tmp_path, caplog) -> None:
    eng = ScriptEngine("m")
    head = (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
            b"content-length: 100\r\n\r\n")
    eng.script = lambda path, raw: [(0.0, head), (0.0, b'{"partial":')]  # then the close
    with trio.fail_after(30):
        running = await start(nursery, tmp_path, {"e": eng})
        async with httpx2.AsyncClient(headers=JSON, base_url=running.url) as client:
            with pytest.raises(httpx2.RemoteProtocolError):  # 11 of 100 bytes, then the end
                await client.post(CHAT, content=body())
            ok = await client.post(CHAT, content=body("nope"))  # nvpair still answers
    assert ok.status_code == 404
    assert running.traffic.of("e").failures == 1
    assert [r.getMessage() for r in caplog.records if r.levelname == "ERROR"] == []


async def test_stream_null_is_a_valid_request(nursery, tmp_path) -> None:
    eng = ScriptEngine("m")
    with trio.fail_after(30):
        running = await start(nursery, tmp_path, {"e": eng})
        async with httpx2.AsyncClient(headers=JSON, base_url=running.url) as client:
            r = await client.post(CHAT, content=body(stream=None))  # type: ignore[arg-type]
    assert r.status_code == 200, r.text


async def test_slow_but_steady_stream_is_not_cut(nursery, tmp_path) -> None:
    eng = ScriptEngine("m")
    script = sse_script(8, gap=0.2)
    eng.script = lambda path, raw: script
    with trio.fail_after(30):
        running = await start(nursery, tmp_path, {"e": eng},
                              top="[router]\nidle_timeout_s = 0.5")
        async with httpx2.AsyncClient(headers=JSON, base_url=running.url) as client:
            r = await client.post(CHAT, content=body(stream=True))
    assert r.content == b"".join(d for _, d in script[1:])  # 1.8 s in all, gaps under 0.5 s


async def test_engine_death_mid_stream_ends_with_an_error_event(nursery, tmp_path) -> None:
    eng = ScriptEngine("m")
    script = sse_script(5)
    # A chunked body cut in the middle: the engine process died.
    head = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n")
    chunk = script[1][1]
    eng.script = lambda path, raw: [(0.0, head), (0.0, b"%x\r\n%s\r\n" % (len(chunk), chunk)),
                                    (0.0, b"ff\r\npartial")]
    with trio.fail_after(30):
        running = await start(nursery, tmp_path, {"e": eng})
        async with httpx2.AsyncClient(headers=JSON, base_url=running.url) as client:
            events = await sse_events(client, body(stream=True))
    assert events[0] == chunk.strip()
    assert b"the engine cut the answer" in events[-1]
    assert b"[DONE]" not in b"".join(events)
    with trio.fail_after(5):  # nvpair's handler finishes its cleanup
        await trio.testing.wait_all_tasks_blocked(0.05)
    assert running.traffic.of("e").failures == 1


async def test_long_stream_passes_intact(nursery, tmp_path) -> None:
    eng = ScriptEngine("m")
    script = sse_script(20_000)  # a long generation at a fast token rate
    eng.script = lambda path, raw: script
    with trio.fail_after(60):
        running = await start(nursery, tmp_path, {"e": eng})
        async with httpx2.AsyncClient(headers=JSON, base_url=running.url) as client:
            r = await client.post(CHAT, content=body(stream=True))
    assert r.content == b"".join(d for _, d in script[1:])


async def test_least_in_flight_spreads_and_refused_is_retried(nursery, tmp_path) -> None:
    fast, slow = ScriptEngine("m"), ScriptEngine("m")
    fast.script = lambda path, raw: json_script({"by": "fast"}, delay=0.02)
    slow.script = lambda path, raw: json_script({"by": "slow"}, delay=0.2)
    with trio.fail_after(60):
        running = await start(nursery, tmp_path, {"fast": fast, "slow": slow})
        async with httpx2.AsyncClient(headers=JSON, base_url=running.url,
                                      limits=httpx2.Limits(max_connections=16)) as client:
            served: list[str] = []

            async def worker() -> None:
                for _ in range(10):
                    served.append((await client.post(CHAT, content=body())).json()["by"])

            async with trio.open_nursery() as n:
                for _ in range(8):
                    n.start_soon(worker)
    # The slow engine (10x slower) holds requests longer, so it is picked less often.
    assert 0 < served.count("slow") <= 0.3 * len(served), served.count("slow")  # 16-21 % seen


async def test_refused_connection_is_retried_on_another_engine(nursery, tmp_path) -> None:
    a, b = ScriptEngine("m"), ScriptEngine("m")
    b.script = lambda path, raw: json_script({"by": "b"})
    with trio.fail_after(30):
        running = await start(nursery, tmp_path, {"a": a, "b": b})
        # a's port now refuses, but its next health probe is seconds away: still "ready".
        await a.close_listener()
        # Which engine goes first is a coin toss (both idle): ask until a has been tried
        # (six asks missed a 1 time in 64; thirty miss it 1 time in 10^9).
        results: list[str] = []
        async with httpx2.AsyncClient(headers=JSON, base_url=running.url) as client:
            while running.traffic.of("a").requests == 0 and len(results) < 30:
                results.append((await client.post(CHAT, content=body())).json()["by"])
    assert running.traffic.of("a").requests >= 1  # a was tried, refused, and b took it
    assert results == ["b"] * len(results) and b.posts == len(results)


async def test_idle_pools_are_reaped_so_no_engine_connection_sits_in_close_wait(
        nursery, tmp_path) -> None:
    """llama-server closes idle keep-alive connections after 5 s (the simulator here after
    2 s); the pool would keep its end of each in CLOSE-WAIT until its next request. After a
    burst, the router's connections to the engine are closed within 10 s, and a later
    request opens a new one."""
    import os

    from tests.peers.cluster import sockets

    from nvpair.sim import SimOptions, serve_sim

    sim = await nursery.start(serve_sim, SimOptions(kind="llamacpp", model="gemma3-270m",
                                                    max_tokens=4, idle_timeout_s=2.0,
                                                    np=12))
    await sim.wait_phase("ready")

    async def towards_engine() -> dict[int, str]:
        """This process's client sockets to the engine: local port -> state."""
        return {s.local_port: s.state for s in await sockets()
                if s.pid == os.getpid() and s.peer_port == sim.port}

    (tmp_path / "nvpair.toml").write_text(
        f"listen = '127.0.0.1:0'\n[[engines]]\nname = 'g'\nkind = 'llamacpp'\n"
        f"port = {sim.port}\n")
    chat = msgspec.json.encode({"model": "gemma3-270m", "max_tokens": 4,
                                "messages": [{"role": "user", "content": "hi"}]})
    with trio.fail_after(40):
        running = await nursery.start(service.run, load_settings(str(tmp_path / "nvpair.toml")))
        await wait_state(running.board, "g", "ready", where=lambda e: bool(e.models))
        probes = set(await towards_engine())  # the prober's own client, not the router's
        async with httpx2.AsyncClient(headers=JSON, base_url=running.url,
                                      limits=httpx2.Limits(max_connections=16)) as client:
            answers: list[int] = []

            async def one() -> None:
                answers.append((await client.post(CHAT, content=chat)).status_code)

            async with trio.open_nursery() as burst:
                for _ in range(12):
                    burst.start_soon(one)
            assert answers == [200] * 12
            relayed = {p: s for p, s in (await towards_engine()).items() if p not in probes}
            assert len(relayed) >= 4 and set(relayed.values()) == {"ESTAB"}, relayed
            left = relayed
            with trio.move_on_after(10):  # a wait-until with a ceiling, polled
                while left:
                    await trio.sleep(0.2)
                    left = {p: s for p, s in (await towards_engine()).items() if p in relayed}
            assert not left, f"still open 10 s after the burst: {left}"
            again = await client.post(CHAT, content=chat)  # a new pool, made on demand
            assert again.status_code == 200, again.text


async def test_a_pool_that_fails_to_close_stays_the_routers_own_failure(
        nursery, tmp_path, monkeypatch) -> None:
    """The reaper closes an idle pool and closing it raises (a bug, or the transport's):
    the router logs it and goes on routing; before, the error ended the router's nursery
    and with it the service."""
    from nvpair.router.upstream import Upstream

    a = ScriptEngine("m")
    tried = trio.Event()

    async def aclose(self: Upstream) -> None:
        tried.set()
        raise RuntimeError("close failed")

    with trio.fail_after(30):
        running = await start(nursery, tmp_path, {"a": a})
        async with httpx2.AsyncClient(headers=JSON, base_url=running.url) as client:
            assert (await client.post(CHAT, content=body())).status_code == 200
            monkeypatch.setattr(Upstream, "aclose", aclose)
            await tried.wait()  # the reaper closed the idle pool, and that raised
            monkeypatch.undo()
            r = await client.post(CHAT, content=body())  # a new pool
            assert r.status_code == 200
            assert (await client.get("/healthz")).status_code == 200
