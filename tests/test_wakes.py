"""Wake-ups on a shared grid: each loop keeps its number of ticks, late by at most its
grid, and loops of different phases wake at the same instants (Trio's autojump clock)."""

import itertools
import math

import httpx2
import trio
from hypothesis import given
from hypothesis import strategies as st
from tests.fakes import FakeEngine, engine_spec, vllm_routes

from nvpair import wakes
from nvpair.prober import run_probes, steady_probe_rate
from nvpair.snapshot import Board
from nvpair.state import initial_state

GRIDS = st.sampled_from([0.0, 1 / 64, 1 / 8, 0.5, 1.0])


@given(st.floats(min_value=0, max_value=1e7, allow_nan=False), GRIDS)
def test_on_grid_is_the_first_point_at_or_after(t: float, grid: float) -> None:
    at = wakes.on_grid(t, grid)
    if grid == 0:
        assert at == t
        return
    assert at - grid < t <= at
    assert at / grid == math.floor(at / grid)


def test_grid_for_is_a_power_of_two_within_the_slack_and_the_rate() -> None:
    assert wakes.grid_for(5) == 0.5  # a tenth of a 5 s health interval
    assert wakes.grid_for(60) == 1.0  # never coarser than a second
    assert wakes.grid_for(2) == 0.125
    assert wakes.grid_for(0.1) == 0.0  # a fast loop keeps its own time
    assert wakes.grid_for(5, rate=2.2) == 0.5  # ten engines: the slack decides
    assert wakes.grid_for(5, rate=222) == 1 / 64  # 1,024 engines: ~3.5 probes a point
    assert wakes.grid_for(5, rate=10_000) == 0.0
    for interval in (0.3, 1, 2, 5, 7, 30, 60, 3600):
        for rate in (0, 1, 10, 100, 300):
            g = wakes.grid_for(interval, rate)
            assert g == 0 or (math.log2(g).is_integer() and g <= 0.1 * interval
                              and (rate == 0 or g * rate <= wakes.PER_WAKE))


async def test_a_ticker_keeps_its_count_and_wakes_on_the_grid(autojump_clock) -> None:
    await trio.sleep(0.37)  # an odd phase
    ticker, ticks = wakes.Ticker(2.0), []
    start = trio.current_time()
    while trio.current_time() < start + 3600:
        await ticker.tick()
        ticks.append(trio.current_time())
    assert ticker.grid == 1.0
    assert 1799 <= len(ticks) <= 1801  # one tick per 2 s, as without the grid
    assert all(t == math.floor(t) for t in ticks)  # each on a whole second
    assert all(0 < b - a <= 2.0 + 1.0 for a, b in itertools.pairwise(ticks))


async def test_loops_of_different_phases_wake_together(autojump_clock) -> None:
    seen: dict[str, list[float]] = {"a": [], "b": [], "c": []}

    async def loop(name: str, phase: float) -> None:
        await trio.sleep(phase)
        ticker = wakes.Ticker(2.0)
        for _ in range(30):
            await ticker.tick()
            seen[name].append(trio.current_time())

    async with trio.open_nursery() as nursery:
        for name, phase in (("a", 0.1), ("b", 0.45), ("c", 0.8)):
            nursery.start_soon(loop, name, phase)
    instants = {t for times in seen.values() for t in times}
    assert len(instants) <= 31  # three loops, one set of wake-ups (90 without the grid)


async def test_probing_counts_an_engines_rate_while_its_probes_run() -> None:
    assert wakes.probe_rate() == 0
    with wakes.probing(0.25):
        with wakes.probing(0.5):
            assert wakes.probe_rate() == 0.75
        assert wakes.probe_rate() == 0.25
    assert wakes.probe_rate() == 0


class _Timed(httpx2.AsyncBaseTransport):
    """Notes the Trio time of each request to a path, then answers as ``inner`` does."""

    def __init__(self, inner: httpx2.AsyncBaseTransport, path: str) -> None:
        self.inner, self.path, self.times = inner, path, []

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        if request.url.path == self.path:
            self.times.append(trio.current_time())
        return await self.inner.handle_async_request(request)


async def test_the_health_probes_of_several_engines_share_wake_ups(
        nursery, autojump_clock) -> None:
    """Six engines, each at its own 5 s schedule with its own jitter: their health probes
    come on the 0.5 s grid, at the manifest's rate, at fewer instants than probes."""
    timed = []
    for i in range(6):
        spec = engine_spec("vllm", name=f"e{i}")
        board = Board((initial_state(spec),))
        transport = _Timed(FakeEngine(vllm_routes()).transport(), "/health")
        timed.append(transport)
        await nursery.start(lambda task_status, s=spec, b=board, t=transport: run_probes(
            s, b, transport=t, task_status=task_status))
        await trio.sleep(0.3)  # different phases
    assert wakes.probe_rate() == 6 * steady_probe_rate(engine_spec("vllm"))
    started = trio.current_time()
    await trio.sleep(600)
    times = [t for tr in timed for t in tr.times if t > started + 10]
    assert all(t / 0.5 == math.floor(t / 0.5) for t in times)
    per_engine = [len([t for t in tr.times if t > started + 10]) for tr in timed]
    assert all(110 <= n <= 119 for n in per_engine), per_engine
    assert len(set(times)) < 0.8 * len(times)
