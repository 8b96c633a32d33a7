"""``nvpair sim farm``: many simulated engines in one process, each its own port and state."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys

import httpx2
import pytest
import trio

from nvpair.sim.farm import Farm, behaviour, serve_farm


def test_behaviour_every_fourth_alternates_hung_and_slow() -> None:
    assert [behaviour(i, 4) for i in range(8)] == [
        "quick", "quick", "quick", "hung", "quick", "quick", "quick", "slow"]
    assert {behaviour(i, 0) for i in range(8)} == {"quick"}


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"kind": "nope", "count": 1}, "--kind: unknown kind 'nope'"),
    ({"kind": "sglang", "count": 0}, "--count must be >= 1"),
    ({"kind": "sglang", "count": 1, "models_per_engine": 2}, "only an ollama engine"),
    ({"kind": "sglang", "count": 10, "base_port": 65530}, "do not fit in 1-65535"),
])
def test_bad_farm_is_a_one_line_error(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Farm(**kwargs)  # type: ignore[arg-type]


async def test_engines_are_independent_ports_with_their_own_models() -> None:
    farm = Farm(kind="sglang", count=4, first=8, bad_every=2)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            engines = await nursery.start(serve_farm, farm)
            assert [e["index"] for e in engines] == [8, 9, 10, 11]
            assert len({e["port"] for e in engines}) == 4
            assert [e["behaviour"] for e in engines] == ["quick", "hung", "quick", "slow"]
            async with httpx2.AsyncClient(timeout=5) as client:
                for e in (engines[0], engines[2]):
                    r = await client.get(f"http://127.0.0.1:{e['port']}/v1/models")
                    assert [m["id"] for m in r.json()["data"]] == [e["model"]]
                    assert e["model"] == f"m-{e['index']:03d}"
                hung = f"http://127.0.0.1:{engines[1]['port']}"
                assert (await client.get(f"{hung}/model_info")).status_code == 200
                with trio.move_on_after(0.3) as scope:
                    await client.get(f"{hung}/v1/models")
                assert scope.cancelled_caught  # the hung engine never lists
            nursery.cancel_scope.cancel()


async def test_ollama_engines_serve_many_models() -> None:
    farm = Farm(kind="ollama", count=2, models_per_engine=300)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            engines = await nursery.start(serve_farm, farm)
            async with httpx2.AsyncClient(timeout=5) as client:
                for e in engines:
                    r = await client.get(f"http://127.0.0.1:{e['port']}/api/tags")
                    names = [m["name"] for m in r.json()["models"]]
                    assert len(names) == e["models"] == 300
                    assert names[0] == e["model"] == f"m-{e['index']:03d}-00000"
                    assert names[-1] == f"m-{e['index']:03d}-00299"
            nursery.cancel_scope.cancel()


async def test_base_port_places_the_engines() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        base = s.getsockname()[1]
    farm = Farm(kind="vllm", count=1, base_port=base, control=True)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            engines = await nursery.start(serve_farm, farm)
            assert engines[0]["port"] == base
            assert isinstance(engines[0]["control"], int)
            nursery.cancel_scope.cancel()


async def test_the_process_prints_its_engines_and_stops_on_sigterm() -> None:
    with trio.fail_after(20):
        proc = await trio.lowlevel.open_process(
            [sys.executable, "-m", "nvpair.sim", "farm", "--kind", "sglang", "--count", "3"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert proc.stdout is not None
        text = b""
        while b"\n" not in text:
            chunk = await proc.stdout.receive_some(65536)
            assert chunk, "the farm exited before printing its engines"
            text += chunk
        engines = json.loads(text)
        assert [e["model"] for e in engines] == ["m-000", "m-001", "m-002"]
        async with httpx2.AsyncClient(timeout=5) as client:
            r = await client.get(f"http://127.0.0.1:{engines[2]['port']}/v1/models")
            assert r.json()["data"][0]["id"] == "m-002"
        proc.send_signal(signal.SIGTERM)
        assert await proc.wait() == 0


def test_a_taken_port_is_a_one_line_error() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "nvpair.sim", "farm", "--count", "1", "--base-port",
             str(port)], capture_output=True, text=True, timeout=20)
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("nvpair sim farm: "), done.stderr
