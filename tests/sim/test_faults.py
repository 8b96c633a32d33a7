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
