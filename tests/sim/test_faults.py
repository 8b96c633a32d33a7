"""Injected faults, each checked over real HTTP, switched both in process and through the
control port."""

from __future__ import annotations

import httpx2
import pytest
import trio
from tests.sim.helpers import elapsed, raw_request, wait_aborted


async def test_hang_reads_and_never_answers(start_sim, http):
    with trio.fail_after(10):
        sim = await start_sim("vllm")
        sim.set_fault("hang", paths=["/health"])
        client = http(sim, timeout=0.3)
        with pytest.raises(httpx2.ReadTimeout):
            await client.get("/health")
        assert (await client.get("/version")).status_code == 200  # other paths unaffected
        await wait_aborted(sim, "/health")
        assert sim.stats().path("/health").count == 1


async def test_hang_everything_while_the_control_port_answers(start_sim, http):
    with trio.fail_after(10):
        sim = await start_sim("sglang")
        sim.set_fault("hang")
        with pytest.raises(httpx2.ReadTimeout):
            await http(sim, timeout=0.3).get("/ping")
        async with httpx2.AsyncClient(base_url=sim.control_url, timeout=5) as control:
            stats = (await control.get("/__sim/stats")).json()
            assert stats["faults"] == [{"mode": "hang"}]
            assert stats["paths"]["/ping"]["count"] == 1


async def test_stall_sends_headers_then_nothing(start_sim, http):
    with trio.fail_after(10):
        sim = await start_sim("llamacpp")
        sim.set_fault("stall", paths=["/props"])
        client = http(sim, timeout=httpx2.Timeout(5.0, read=0.4))
        async with client.stream("GET", "/props") as response:
            assert response.status_code == 200
            assert int(response.headers["content-length"]) > 0
            with pytest.raises(httpx2.ReadTimeout):
                await response.aread()
        await wait_aborted(sim, "/props")


async def test_reset(start_sim, http):
    with trio.fail_after(10):
        sim = await start_sim("vllm")
        sim.set_fault("reset", paths=["/health"])
        with pytest.raises((httpx2.ReadError, httpx2.RemoteProtocolError)):
            await http(sim).get("/health")
        path = sim.stats().path("/health")
        assert (path.resets, path.errors) == (1, 1)
        # a raw client sees a reset, not an orderly close
        stream = await raw_request(sim, "GET /health HTTP/1.1\nHost: sim\n\n")
        with pytest.raises(trio.BrokenResourceError):
            while await stream.receive_some(1024):
                pass
        await stream.aclose()


async def test_slow_per_path(start_sim, http):
    with trio.fail_after(10):
        sim = await start_sim("vllm")
        sim.set_fault("slow", paths=["/v1/*"], seconds=0.6)
        client = http(sim)
        _, fast = await elapsed(client.get("/health"))
        response, slow = await elapsed(client.get("/v1/models"))
        assert response.status_code == 200
        assert fast < 0.5 and slow >= 0.6


async def test_fixed_error_with_the_engine_body(start_sim, http):
    with trio.fail_after(10):
        sim = await start_sim("llamacpp")
        sim.set_fault("error", paths=["/health"], status=502)
        response = await http(sim).get("/health")
        assert response.status_code == 502
        assert response.json() == {"error": {"code": 502, "message": "injected fault",
                                             "type": "server_error"}}
        assert sim.stats().path("/health").errors == 1


async def test_crash_exits_with_the_code(start_sim):
    with trio.fail_after(10):
        sim = await start_sim("sglang")
        sim.set_fault("crash", exit_code=3)
        assert await sim.wait_exited() == 3


async def test_crash_on_a_matching_request(start_sim, http):
    with trio.fail_after(10):
        sim = await start_sim("vllm")
        sim.set_fault("crash", paths=["/v1/models"], exit_code=9)
        assert (await http(sim).get("/health")).status_code == 200
        with pytest.raises(httpx2.TransportError):
            await http(sim).get("/v1/models")
        assert await sim.wait_exited() == 9


async def test_flap_per_request(start_sim, http):
    with trio.fail_after(10):
        sim = await start_sim("vllm")
        sim.set_fault("flap", paths=["/health"])
        client = http(sim)
        codes = [(await client.get("/health")).status_code for _ in range(4)]
        assert codes == [200, 503, 200, 503]
        assert (await client.get("/version")).status_code == 200


async def test_flap_per_period(start_sim, http):
    with trio.fail_after(10):
        sim = await start_sim("sglang", health_generation=False)
        client = http(sim)
        period = 0.3
        set_at = trio.current_time()  # the fault's clock starts now: no checkpoint in between
        sim.set_fault("flap", paths=["/health"], seconds=period)
        seen: dict[int, set[int]] = {0: set(), 1: set()}
        while not (seen[0] and seen[1]):
            before = int((trio.current_time() - set_at) // period)
            status = (await client.get("/health")).status_code
            after = int((trio.current_time() - set_at) // period)
            if before == after:  # the server answered inside one known period
                seen[before % 2].add(status)
            await trio.sleep(period / 3)  # pacing through the periods, not synchronisation
        assert seen == {0: {200}, 1: {503}}


async def test_mismatch_serves_another_model(start_sim, http):
    with trio.fail_after(10):
        sim = await start_sim("sglang")
        sim.set_fault("mismatch", model="other/model")
        client = http(sim)
        assert (await client.get("/v1/models")).json()["data"][0]["id"] == "other/model"
        assert (await client.get("/model_info")).json()["served_model_name"] == "other/model"
        sim.clear_faults()
        assert (await client.get("/v1/models")).json()["data"][0]["id"] != "other/model"


async def test_refuse_then_listen_again(start_sim, http):
    with trio.fail_after(10):
        sim = await start_sim("llamacpp")
        client = http(sim)
        assert (await client.get("/health")).status_code == 200  # a pooled keep-alive connection
        sim.set_fault("refuse")
        await sim.settle()
        assert not sim.listening
        with pytest.raises(httpx2.ConnectError):
            await client.get("/health")
        with pytest.raises(OSError):
            await trio.open_tcp_stream("127.0.0.1", sim.port)
        sim.clear_faults()
        await sim.settle()
        assert (await client.get("/health")).status_code == 200


async def test_initial_fault_from_options(start_sim, http):
    with trio.fail_after(10):
        from nvpair.sim import Fault

        sim = await start_sim("vllm", fault=Fault("error", status=503))
        assert (await http(sim).get("/health")).status_code == 503


# -- garbage: what a hostile engine answers ---------------------------------------------------

async def read_all(stream: trio.SocketStream) -> bytes:
    """Everything until the server closes (or resets) the connection."""
    data = b""
    try:
        while chunk := await stream.receive_some(65536):
            data += chunk
    except trio.BrokenResourceError:
        pass
    await stream.aclose()
    return data


async def garbage(sim, kind: str, path: str = "/v1/models", **options) -> bytes:
    sim.set_fault("garbage", kind=kind, paths=[path], **options)
    stream = await raw_request(sim, f"GET {path} HTTP/1.1\nHost: sim\nConnection: close\n\n")
    return await read_all(stream)


async def test_garbage_bodies(start_sim, http):
    import json

    with trio.fail_after(20):
        sim = await start_sim("vllm")
        client = http(sim)
        deep = await garbage(sim, "deep_json")
        assert deep.endswith(b"[" * 5000 + b"]" * 5000) and deep.startswith(b"HTTP/1.1 200")
        sim.set_fault("garbage", kind="huge", paths=["/v1/models"])
        huge = (await client.get("/v1/models")).content
        assert len(huge) >= 12_000_000 and len(json.loads(huge)["data"]) > 10_000
        sim.set_fault("garbage", kind="many", paths=["/v1/models"])
        many = (await client.get("/v1/models")).content
        assert len(json.loads(many)["data"]) == 150_000 and len(many) < 4 * 2**20
        sim.set_fault("garbage", kind="not_utf8", paths=["/v1/models"])
        with pytest.raises(UnicodeDecodeError):
            (await client.get("/v1/models")).content.decode()
        sim.set_fault("garbage", kind="odd_models", paths=["/v1/models"])
        odd = (await client.get("/v1/models")).json()["data"]
        ids = [m["id"] for m in odd]
        assert ids[0] == "good-1" and ids[-1] == "good-2"
        assert "i" * 600 in ids and 42 in ids and "ctl\x00nul" in ids and "ctl\nnewline" in ids
        assert {"id": "created-true", "created": True} in odd
        assert {"id": "long-owner", "owned_by": "o" * 600} in odd
        # paths limits it; the shape follows the path (Ollama's /api/tags lists "models")
        assert (await client.get("/version")).status_code == 200
        sim.set_fault("garbage", kind="many", paths=["/api/tags"])
        tags = await client.get("/api/tags")
        assert len(tags.json()["models"]) == 150_000


async def test_garbage_on_the_wire(start_sim, http):
    with trio.fail_after(20):
        sim = await start_sim("openai")
        redirect = await garbage(sim, "redirect")
        assert redirect.startswith(b"HTTP/1.1 302 ")
        assert b"location: http://127.0.0.1:9/" in redirect
        assert (await garbage(sim, "redirect", status=301)).startswith(b"HTTP/1.1 301 ")
        not_http = await garbage(sim, "not_http")
        assert not_http.startswith(b"SSH-2.0-") and b"HTTP/" not in not_http
        big = await garbage(sim, "big_headers")
        head, _, body = big.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200") and len(head) > 64 * 1024 and body
        reset = await garbage(sim, "reset_after_headers")
        head, _, body = reset.partition(b"\r\n\r\n")
        length = int(head.split(b"content-length: ")[1].split(b"\r\n")[0])
        assert head.startswith(b"HTTP/1.1 200") and len(body) < length
        assert sim.stats().path("/v1/models").resets >= 1
        with pytest.raises(httpx2.HTTPError):  # a client sees a broken answer
            await http(sim).get("/v1/models")


async def test_garbage_drips_one_byte_at_a_time(start_sim):
    with trio.fail_after(20):
        sim = await start_sim("llamacpp")
        sim.set_fault("garbage", kind="drip", paths=["/v1/models"], seconds=0.2)
        stream = await raw_request(sim, "GET /v1/models HTTP/1.1\nHost: sim\n\n")
        head = b""
        while b"\r\n\r\n" not in head:
            head += await stream.receive_some(65536)
        started = trio.current_time()
        first = head.partition(b"\r\n\r\n")[2] or await stream.receive_some(65536)
        second = await stream.receive_some(65536)
        assert (len(first), len(second)) == (1, 1)
        assert trio.current_time() - started >= 0.15  # paced, not sent at once
        await stream.aclose()


async def test_garbage_needs_a_known_kind(start_sim):
    from nvpair.sim import Fault

    with pytest.raises(ValueError, match="needs a kind"):
        Fault("garbage")
    with pytest.raises(ValueError, match="unknown garbage kind"):
        Fault("garbage", kind="nope")  # type: ignore[arg-type]
    with trio.fail_after(10):
        sim = await start_sim("vllm")
        async with httpx2.AsyncClient(base_url=sim.control_url) as control:
            answer = await control.post("/__sim/fault", json={"mode": "garbage",
                                                               "kind": "deep_json"})
            assert answer.json()["faults"] == [{"mode": "garbage", "kind": "deep_json"}]
            bad = await control.post("/__sim/fault", json={"mode": "garbage", "kind": "x"})
            assert bad.status_code == 400
