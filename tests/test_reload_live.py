"""Reload (docs/lifecycle.md, "Reload") of [tracing] and of keys turned on or off: applied
live, over real HTTP, with nvpair in-process, a scripted engine and real OTLP/HTTP
receivers on 127.0.0.1 (``tests.otlp_receiver``)."""

from __future__ import annotations

import re
import threading
from pathlib import Path

import httpx2
import pytest
import trio
from tests.http.test_sse import stream
from tests.managed import wait_state
from tests.otlp_receiver import Receiver, attrs
from tests.ports import free_port
from tests.router.script_engine import JSON, Script, ScriptEngine, json_script, sse_script
from tests.router.test_relay import CHAT, body
from tests.router.test_tracing import servers

from nvpair import service
from nvpair.config.settings import load_settings

# httpx2's response stream nests async generators (as tests/http/test_sse.py notes)
pytestmark = [pytest.mark.filterwarnings("ignore:Async generator 'httpx2:ResourceWarning"),
              pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")]

TOKEN = "ops-token-0123456789"
ADMIN = {"authorization": f"Bearer {TOKEN}"}


def write(path: Path, port: int, top: str = "", listen: str = "127.0.0.1:0") -> None:
    path.write_text(f"listen = '{listen}'\nnode = 'n1'\n{top}\n[[engines]]\nname = 'e'\n"
                    f"kind = 'openai'\nport = {port}\n[engines.probes.ready]\n"
                    "interval_s = 0.1\ntimeout_s = 0.1\n")


def tracing(receiver: Receiver, name: str = "nvpair") -> str:
    return f"[tracing]\notlp_endpoint = '{receiver.url}'\nservice_name = '{name}'\n"


def ids(spans: list) -> set[str]:  # type: ignore[type-arg]
    """The request ids of the server spans among ``spans``."""
    return {str(attrs(s)["nvpair.request_id"]) for s in servers(spans)}


async def reload(client: httpx2.AsyncClient, **kw: object) -> httpx2.Response:
    return await client.post("/v1/admin/reload", **kw)  # type: ignore[arg-type]


async def test_tracing_turned_on_moved_and_off_by_reloads(nursery, tmp_path) -> None:
    """On: the next requests reach the receiver. Moved to a second receiver (another
    service name) while a stream is under way: the spans finished before go to the first
    (sent as its exporter ends, whose thread ends), the new requests' and the stream's to
    the second, and the stream comes whole. A sample ratio of 0, then off: the next
    requests are traced nowhere."""
    first, second = Receiver(), Receiver()
    await nursery.start(first.serve)
    await nursery.start(second.serve)
    eng = ScriptEngine("m")
    slow = sse_script(20, gap=0.05, model="m")  # (a stream of 1 s)

    def script(path: str, raw: bytes) -> Script:
        return slow if b'"stream":true' in raw else json_script({"ok": 1})

    eng.script = script
    await nursery.start(eng.serve)
    path = tmp_path / "nvpair.toml"
    write(path, eng.port)
    with trio.fail_after(60):
        running = await nursery.start(service.run, load_settings(str(path)))
        await wait_state(running.board, "e", "ready", where=lambda e: bool(e.models))
        async with httpx2.AsyncClient(base_url=running.url, headers=JSON,
                                      timeout=30) as client:
            untraced = await client.post(CHAT, content=body())
            write(path, eng.port, tracing(first))
            on = await reload(client)
            assert on.status_code == 200, on.text
            traced = await client.post(CHAT, content=body())
            got = await first.wait_for(lambda s: traced.headers["x-request-id"] in ids(s))
            assert untraced.headers["x-request-id"] not in ids(got)

            done_before = await client.post(CHAT, content=body())  # (its spans wait to go)
            old_threads = [t for t in threading.enumerate() if t.name == "nvpair-otlp"]
            async with client.stream("POST", CHAT, content=body(stream=True)) as streamed:
                chunks = streamed.aiter_raw()
                head = await chunks.__anext__()  # (the stream is under way)
                write(path, eng.port, tracing(second, "nvpair-2")
                      + "sample_ratio = 1.0\n")
                moved = await reload(client)
                after = await client.post(CHAT, content=body())
                rest = b"".join([c async for c in chunks])
            await first.wait_for(lambda s: done_before.headers["x-request-id"] in ids(s))
            for t in old_threads:  # the first exporter's thread ends (CLOSE_S at most)
                await trio.to_thread.run_sync(t.join, 5.0)
            await second.wait_for(lambda s: {after.headers["x-request-id"],
                                             streamed.headers["x-request-id"]} <= ids(s))

            write(path, eng.port, tracing(second, "nvpair-2") + "sample_ratio = 0.0\n")
            zero = await reload(client)
            unsampled = await client.post(CHAT, content=body())
            write(path, eng.port)
            off = await reload(client)
            nowhere = await client.post(CHAT, content=body())
            write(path, eng.port, tracing(first))  # (on again: what follows is seen)
            again = await reload(client)
            last = await client.post(CHAT, content=body())
            await first.wait_for(lambda s: last.headers["x-request-id"] in ids(s))
            assert running.reloader is not None and running.reloader.export is not None
            export = running.reloader.export
            current = export.current
            assert current is not None
            total = len(first.spans) + len(second.spans)
            assert await trio.to_thread.run_sync(
                current.wait, lambda _: export.exported == total, 5.0)
            metrics = (await client.get("/metrics")).text
    assert untraced.status_code == traced.status_code == after.status_code == 200
    for r in (on, moved, zero, off, again):
        assert r.status_code == 200 and r.json()["sections"] == ["tracing"], r.text
    assert streamed.status_code == 200
    assert head + rest == b"".join(data for _, data in slow[1:])  # whole
    assert not any(t.is_alive() for t in old_threads)
    firsts, seconds = ids(first.spans), ids(second.spans)
    assert done_before.headers["x-request-id"] in firsts  # none lost of what had ended
    assert {after.headers["x-request-id"], streamed.headers["x-request-id"]} <= seconds
    assert not seconds & firsts and untraced.headers["x-request-id"] not in firsts
    assert nowhere.headers["x-request-id"] not in firsts | seconds
    assert unsampled.headers["x-request-id"] not in firsts | seconds  # (sample_ratio 0)
    assert {r["service.name"] for r in second.resources} == {"nvpair-2"}
    assert f"nvpair_trace_spans_exported_total {total}\n" in metrics
    assert "nvpair_trace_spans_dropped_total 0\n" in metrics


async def test_keys_turned_on_and_off_by_reloads(nursery, tmp_path) -> None:
    """On: a request without a key is 401 at once, an event stream opened without one
    ends (``bye``, reason ``keys``), the dashboard no longer checks the Host. Off again:
    open to this machine and allowed_hosts only, as without keys at a start."""
    (tmp_path / "ops").write_text(TOKEN)
    keys = "[[keys]]\nname = 'ops'\ntoken_file = 'ops'\nrole = 'admin'\n"
    eng = ScriptEngine("m")
    await nursery.start(eng.serve)
    path = tmp_path / "nvpair.toml"
    write(path, eng.port)
    foreign = {"host": "mybox"}
    with trio.fail_after(60):
        running = await nursery.start(service.run, load_settings(str(path)))
        await wait_state(running.board, "e", "ready", where=lambda e: bool(e.models))
        async with httpx2.AsyncClient(base_url=running.url, timeout=30) as client:
            before = await client.get("/v1/engines")
            ui_before = await client.get("/ui/", headers=foreign)
            async with stream(client, "/v1/events") as events:
                await events.start()
                write(path, eng.port, keys)
                on = await reload(client)
                assert on.status_code == 200, on.text
                ended = await events.rest()
            no_key = await client.get("/v1/engines")
            routed = await client.post(CHAT, content=body(), headers=JSON)
            with_key = await client.get("/v1/engines", headers=ADMIN)
            ui_on = await client.get("/ui/", headers=foreign)
            metrics_on = (await client.get("/metrics", headers=ADMIN)).text
            write(path, eng.port, "allowed_hosts = ['mybox']\n")
            off = await reload(client, headers=ADMIN)
            open_again = await client.get("/v1/engines")
            allowed = await client.get("/v1/engines", headers=foreign)
            other = await client.get("/v1/engines", headers={"host": "elsewhere"})
            ui_off = await client.get("/ui/", headers={"host": "elsewhere"})
    assert before.status_code == 200 and ui_before.status_code == 403
    assert on.status_code == 200 and on.json()["sections"] == ["keys"], on.text
    assert [e.event for e in ended if not e.comment][-1] == "bye"
    assert ended[-1].doc() == {"node": "n1", "reason": "keys"}
    assert no_key.status_code == 401 and routed.status_code == 401
    assert with_key.status_code == 200
    assert ui_on.status_code == 200  # (with a token the page is served to any Host)
    assert 'nvpair_key_requests_total{key="ops"}' in metrics_on
    assert off.status_code == 200, off.text
    assert off.json()["sections"] == ["keys", "allowed_hosts"], off.text
    assert open_again.status_code == 200 and allowed.status_code == 200
    assert other.status_code == 403 and other.json()["error"]["code"] == "forbidden_host"
    assert ui_off.status_code == 403


async def test_keys_off_on_a_non_loopback_listen_is_refused_and_keys_stay_on(
        nursery, tmp_path) -> None:
    """Without a key the API must listen on loopback only: a reload that takes the keys
    away from nvpair listening on 0.0.0.0 is refused with the check's line."""
    (tmp_path / "ops").write_text(TOKEN)
    eng = ScriptEngine("m")
    await nursery.start(eng.serve)
    path = tmp_path / "nvpair.toml"
    port = free_port()
    listen = f"0.0.0.0:{port}"
    write(path, eng.port, "token_file = 'ops'\n", listen=listen)
    with trio.fail_after(60):
        running = await nursery.start(service.run, load_settings(str(path)))
        await wait_state(running.board, "e", "ready", where=lambda e: bool(e.models))
        async with httpx2.AsyncClient(base_url=f"http://127.0.0.1:{port}",
                                      timeout=30) as client:
            write(path, eng.port, listen=listen)
            refused = await reload(client, headers=ADMIN)
            no_key = await client.get("/v1/engines")
            with_key = await client.get("/v1/engines", headers=ADMIN)
    assert refused.status_code == 400
    message = refused.json()["error"]["message"]
    assert re.fullmatch(rf"{re.escape(str(path))}: listen: 0\.0\.0\.0 is not a loopback "
                        r"address; set token_file \(or \[\[keys\]\]\) in the config so that "
                        r"the API requires a bearer token", message), message
    assert no_key.status_code == 401 and with_key.status_code == 200
    assert running.reloader is not None
    assert (running.reloader.applied, running.reloader.refused) == (0, 1)
