"""Passive health over real sockets: which answers of real requests prove an engine healthy."""

from __future__ import annotations

import httpx2
import msgspec
import trio
from tests.managed import wait_state
from tests.router.script_engine import JSON, ScriptEngine, json_script

from nvpair import service
from nvpair.config.settings import load_settings

CHAT = "/v1/chat/completions"
BUSY = {"error": {"message": "busy", "type": "rate_limit_error", "code": 429}}


async def test_a_429_proves_nothing_and_a_failing_health_probe_still_counts(
        nursery, tmp_path) -> None:
    """An engine that fails /health (here: its /v1/models) and answers every request with
    429 must become unhealthy: its answers skip no health probe, and nothing resets the
    probe's failures in a row."""
    eng = ScriptEngine("m")
    await nursery.start(eng.serve)
    eng.script = lambda path, body: json_script(BUSY, status=b"429 Too Many Requests")
    (tmp_path / "nvpair.toml").write_text(
        f"listen = '127.0.0.1:0'\n[[engines]]\nname = 'e'\nkind = 'openai'\nport = {eng.port}\n"
        "[engines.probes.ready]\ninterval_s = 0.1\ntimeout_s = 0.1\n"
        "[engines.probes.health]\ninterval_s = 0.1\ntimeout_s = 0.1\nfailure_threshold = 3\n")
    body = msgspec.json.encode({"model": "m", "messages": []})
    with trio.fail_after(30):
        running = await nursery.start(service.run, load_settings(str(tmp_path / "nvpair.toml")))
        await wait_state(running.board, "e", "ready", where=lambda e: bool(e.models))
        async with httpx2.AsyncClient(headers=JSON, base_url=running.url) as client, \
                trio.open_nursery() as traffic:

            async def steady() -> None:
                while True:
                    r = await client.post(CHAT, content=body)
                    assert r.status_code in (429, 503), r.text
                    await trio.sleep(0.01)

            traffic.start_soon(steady)
            probes = (await client.get("/v1/engines/e")).json()["probes"]
            before = probes.get("health", {}).get("requests", 0)
            await trio.sleep(1.0)  # the span measured: ten health intervals of 429 traffic
            status = (await client.get("/v1/engines/e")).json()
            counters = (await client.get("/v1/router")).json()["engines"]["e"]
            assert status["state"] == "ready"
            health = status["probes"]["health"]
            assert health["passive"] == 0, health  # 429s skipped no probe
            assert health["requests"] - before >= 5, health
            assert counters["rejected"] > 0 and counters["failures"] == 0, counters
            assert counters["last_ok_age_s"] is None and not counters["suspect"], counters
            eng.models_status = b"503 Service Unavailable"
            await wait_state(running.board, "e", "unhealthy", within=10)
            traffic.cancel_scope.cancel()


def test_a_passive_tick_keeps_the_probes_failures_in_a_row() -> None:
    """Real traffic stands in for a probe tick; it is no answer of the probe's path, so it
    must not wipe the failures that make an engine unhealthy."""
    from nvpair.state.snapshot import ProbeStats
    from nvpair.state.transitions import Outcome, record

    failing = ProbeStats(path="/health", ok=False, consecutive_failures=2, requests=2,
                         failures=2)
    after = record(failing, Outcome(ok=True, kind="passive"), 10.0)
    assert after.consecutive_failures == 2 and after.passive == 1
    assert after.requests == 2  # a passive tick sends no request
