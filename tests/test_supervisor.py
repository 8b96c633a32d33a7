"""One engine's probe loops, each in its own fault boundary (nvpair.supervisor)."""

import itertools
import logging

import httpx2
import trio
import trio.testing
from tests.fakes import FakeEngine, engine_spec, vllm_routes
from tests.managed import wait_state

from nvpair.prober import Prober
from nvpair.snapshot import Board
from nvpair.supervisor import initial_state, run_probes


async def test_a_probe_loop_that_raises_is_the_engines_failure_and_restarts(
        nursery, autojump_clock, caplog) -> None:
    """An exception out of a probe loop (here: the engine's answer path raises something no
    probe expects, a bug) makes the engine unhealthy with the reason in one line, is logged
    once, and the loop runs again after its backoff; it never leaves run_probes."""
    caplog.set_level(logging.INFO, logger="nvpair")
    spec = engine_spec("vllm")
    fake = FakeEngine(vllm_routes("m"))
    broken = True
    handle = fake.handle
    tries: list[float] = []

    async def answer(request: httpx2.Request) -> httpx2.Response:
        if broken and request.url.path == "/health":
            tries.append(trio.current_time())
            raise KeyError("x-nvpair-bug")  # not an httpx2 error: escapes the probe
        return await handle(request)

    board = Board((initial_state(spec),))
    registry: dict[str, Prober] = {}
    await nursery.start(lambda task_status: run_probes(
        spec, board, registry, transport=httpx2.MockTransport(answer), task_status=task_status))
    e = await wait_state(board, "e", "unhealthy")
    assert e.error is not None and "\n" not in e.error
    assert "internal error in nvpair (KeyError: 'x-nvpair-bug')" in e.error, e.error
    await trio.sleep(120)  # retried with backoff (1, 2, 4... s), logged once
    gaps = [b - a for a, b in itertools.pairwise(tries)]
    assert 5 <= len(tries) <= 9 and gaps == sorted(gaps) and gaps[0] >= 1, gaps
    assert board.current.engine("e").state == "unhealthy"
    bugs = [r for r in caplog.records if "unexpected error" in r.getMessage()]
    assert len(bugs) == 1 and bugs[0].exc_info is not None
    broken = False
    ready = await wait_state(board, "e", "ready", within=120)
    assert ready.error is None
    await trio.testing.wait_all_tasks_blocked()  # the boundary has seen the good probe
    assert any("works again" in r.getMessage() for r in caplog.records)
    assert registry["e"] is not None  # the supervisor is still running
