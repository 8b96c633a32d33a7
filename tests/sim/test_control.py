"""The control port: stats, faults and phases over HTTP, and the accounting it reports."""

from __future__ import annotations

import httpx2
import pytest
import trio


async def test_stats_count_every_request(start_sim, http):
    with trio.fail_after(10):
        sim = await start_sim("vllm")
        client = http(sim)
        for _ in range(3):
            await client.get("/health")
        await client.get("/nope")
        async with httpx2.AsyncClient(base_url=sim.control_url, timeout=5) as control:
            stats = (await control.get("/__sim/stats")).json()
        assert stats["kind"] == "vllm" and stats["phase"] == "ready"
        assert stats["port"] == sim.port and stats["listening"] is True
        health = stats["paths"]["/health"]
        assert (health["count"], health["in_flight"], health["statuses"]) == (3, 0, {"200": 3})
        assert health["latency_max_s"] >= health["latency_p50_s"] > 0
        assert stats["paths"]["/nope"]["statuses"] == {"404": 1}
        assert stats["total"]["count"] == 4
        assert stats["connections"] == 1  # keep-alive
        assert "/__sim/stats" not in stats["paths"]


async def test_faults_phases_and_reset_over_http(start_sim, http):
    with trio.fail_after(10):
        sim = await start_sim("vllm")
        client = http(sim)
        async with httpx2.AsyncClient(base_url=sim.control_url, timeout=5) as control:
            set_ = await control.post("/__sim/fault", json={
                "mode": "error", "paths": ["/health"], "status": 503})
            assert set_.json() == {"faults": [
                {"mode": "error", "paths": ["/health"], "status": 503}]}
            assert (await client.get("/health")).status_code == 503
            assert (await control.delete("/__sim/fault")).json() == {"faults": []}
            assert (await client.get("/health")).status_code == 200

            refused = await control.post("/__sim/fault", json={"mode": "refuse"})
            assert refused.status_code == 200
            with pytest.raises(httpx2.ConnectError):
                await client.get("/health")
            await control.post("/__sim/fault", json={"mode": "none"})
            assert (await client.get("/health")).status_code == 200

            phase = await control.post("/__sim/phase", json={"phase": "loading"})
            assert phase.json() == {"phase": "loading"}
            with pytest.raises(httpx2.ConnectError):
                await client.get("/health")
            await control.post("/__sim/phase", json={"phase": "ready"})
            assert (await client.get("/health")).status_code == 200

            assert (await control.post("/__sim/reset-stats")).json() == {"ok": True}
            stats = (await control.get("/__sim/stats")).json()
            assert stats["paths"] == {} and stats["total"]["count"] == 0

            for bad in ({"mode": "explode"}, {"mode": "slow", "extra": 1}, {"phase": "x"}):
                path = "/__sim/phase" if "phase" in bad else "/__sim/fault"
                response = await control.post(path, json=bad)
                assert response.status_code == 400 and "error" in response.json()
            assert (await control.get("/health")).status_code == 404

            assert (await control.post("/__sim/stop")).json() == {"ok": True}
        assert await sim.wait_exited() == 0


async def test_reset_keeps_in_flight_requests_consistent(start_sim, http):
    with trio.fail_after(10):
        sim = await start_sim("vllm")
        sim.set_fault("hang", paths=["/health"])
        async with trio.open_nursery() as nursery:
            nursery.start_soon(http(sim, timeout=5).get, "/health")
            await sim.wait_until(lambda s: s.path("/health").in_flight == 1)
            sim.reset_stats()
            stats = sim.stats()
            assert stats.path("/health").in_flight == 1 and stats.path("/health").count == 0
            nursery.cancel_scope.cancel()
        await sim.wait_until(lambda s: s.path("/health").in_flight == 0)
