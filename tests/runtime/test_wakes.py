"""Wake-ups on a shared grid: each loop keeps its number of ticks, late by at most its
grid, and loops of different phases wake at the same instants (Trio's autojump clock)."""

import gc
import itertools
import math

import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st
from tests.fakes import FakeEngine, engine_spec, served, vllm_routes

from nvpair.probing.prober import node_probe_rate, run_probes, steady_probe_rate
from nvpair.runtime import wakes
from nvpair.state.snapshot import Board
from nvpair.state.transitions import initial_state

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


async def test_sleeps_to_one_point_wake_together_at_the_point(autojump_clock) -> None:
    woke: dict[float, list[float]] = {}
    start = trio.current_time()

    async def sleeper(t: float, grid: float) -> None:
        await wakes.sleep_until(t, grid)
        woke.setdefault(t, []).append(trio.current_time())

    async with trio.open_nursery() as nursery:
        for t in (start + 3.7, start + 1.1, start + 1.3, start + 1.5, start + 0.2):
            nursery.start_soon(sleeper, t, 0.5)
        nursery.start_soon(sleeper, start + 0.9, 0.0)  # no grid: its own deadline
    assert woke == {start + 3.7: [start + 4.0], start + 1.1: [start + 1.5],
                    start + 1.3: [start + 1.5], start + 1.5: [start + 1.5],
                    start + 0.2: [start + 0.5], start + 0.9: [start + 0.9]}


async def test_an_earlier_point_wakes_a_timer_asleep_for_a_later_one(autojump_clock) -> None:
    start, woke = trio.current_time(), []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(wakes.sleep_until, start + 100, 1.0)
        await trio.sleep(1)  # the timer now sleeps until start + 100
        await wakes.sleep_until(start + 2.2, 0.25)
        woke.append(trio.current_time() - start)
        nursery.cancel_scope.cancel()
    assert woke == [2.25]


async def test_a_cancelled_sleep_leaves_its_point_and_the_others_still_wake(
        autojump_clock) -> None:
    start, woke = trio.current_time(), []

    async def sleeper(name: str) -> None:
        await wakes.sleep_until(start + 5, 1.0)
        woke.append((name, trio.current_time() - start))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(sleeper, "a")
        with trio.move_on_after(2) as scope:
            await wakes.sleep_until(start + 5, 1.0)
        assert scope.cancelled_caught and trio.current_time() - start == 2
        with trio.move_on_after(1):  # every sleeper of a point gone: the point wakes nobody
            await wakes.sleep_until(start + 7, 1.0)
        nursery.start_soon(sleeper, "b")
    assert sorted(woke) == [("a", 5), ("b", 5)]


async def test_a_sleep_to_a_point_past_is_a_checkpoint(autojump_clock) -> None:
    start = trio.current_time()
    await wakes.sleep_until(start - 3, 1.0)
    assert trio.current_time() == start
    with trio.CancelScope() as scope:
        scope.cancel()
        await wakes.sleep_until(start - 3, 1.0)
    assert scope.cancelled_caught
    with pytest.raises(ValueError, match="NaN"):
        await wakes.sleep_until(math.nan, 1.0)


async def test_a_bug_in_the_timer_wakes_every_sleeper_and_stops_nothing(
        autojump_clock, caplog) -> None:
    start, woke = trio.current_time(), []

    async def sleeper() -> None:
        await wakes.sleep_until(start + 60, 1.0)
        woke.append(trio.current_time() - start)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(sleeper)
        await trio.sleep(1)
        timer = wakes._TIMER.get()  # a fault injected: a sleeper that is no task
        timer.add(start + 10, trio.lowlevel.current_task())
        timer.waiting[start + 10][object()] = None  # (woken first: the dict's last)
        await trio.lowlevel.wait_task_rescheduled(lambda _: trio.lowlevel.Abort.SUCCEEDED)
        assert trio.current_time() - start == 10
        await trio.lowlevel.checkpoint()  # (the sleeper was woken in my batch: it runs)
        assert woke == [10]  # woken early, not left asleep
        await wakes.sleep_until(start + 21.5, 1.0)  # later sleeps keep their own time
        assert trio.current_time() - start == 22
    assert "the wake-up timer stopped" in caplog.text


async def test_a_sleep_makes_a_fraction_of_the_objects_of_a_trio_sleep(
        autojump_clock) -> None:
    """What each sleeping probe loop leaves for the young collections to walk."""
    start = trio.current_time()

    async def made(sleep) -> float:
        async with trio.open_nursery() as nursery:
            for i in range(8):  # warm: the timer, the point, the code paths
                nursery.start_soon(sleep, start + 50 + i / 1000)
            await trio.testing.wait_all_tasks_blocked()
            gc.collect()
            before = len(gc.get_objects())
            for i in range(200):
                nursery.start_soon(sleep, start + 50 + i / 1000)
            await trio.testing.wait_all_tasks_blocked()
            gc.collect()
            per_sleep = (len(gc.get_objects()) - before) / 200
            nursery.cancel_scope.cancel()
        return per_sleep

    async def parked(_t: float) -> None:  # a task and nothing else: the base
        await trio.lowlevel.wait_task_rescheduled(lambda _: trio.lowlevel.Abort.SUCCEEDED)

    base = await made(parked)
    ours = await made(lambda t: wakes.sleep_until(t, 1.0)) - base
    trios = await made(trio.sleep_until) - base
    assert ours <= 4 and trios >= 2 * ours, (ours, trios)


def test_the_node_probe_rate_is_its_configured_engines_steady_rates() -> None:
    specs = [engine_spec("vllm", name=f"e{i}") for i in range(3)]
    assert node_probe_rate(specs) == pytest.approx(3 * steady_probe_rate(specs[0]))
    assert node_probe_rate([]) == 0


async def test_a_probe_loop_wakes_on_the_grid_of_the_rate_passed_in(
        nursery, autojump_clock) -> None:
    """One engine whose node probes 256 times a second (1,024 engines' worth): its 5 s
    health probes come on the 1/64 s grid, not the 0.5 s grid of an engine alone."""
    fake = FakeEngine(vllm_routes())
    spec = await served(nursery, fake, engine_spec("vllm"))
    board = Board((initial_state(spec),))
    prober = await nursery.start(lambda task_status: run_probes(
        spec, board, probe_rate=256.0, task_status=task_status))
    assert prober.probe_rate == 256.0
    await trio.sleep(300)
    times = fake.times["/health"][2:]
    assert len(times) > 40
    assert all(t * 64 == math.floor(t * 64) for t in times)
    assert any(t / 0.5 != math.floor(t / 0.5) for t in times)


async def test_the_health_probes_of_several_engines_share_wake_ups(
        nursery, autojump_clock) -> None:
    """Six engines, each at its own 5 s schedule with its own jitter: their health probes
    come on the 0.5 s grid, at the manifest's rate, at fewer instants than probes."""
    fakes = []
    for i in range(6):
        fake = FakeEngine(vllm_routes())
        fakes.append(fake)
        spec = await served(nursery, fake, engine_spec("vllm", name=f"e{i}"))
        board = Board((initial_state(spec),))
        await nursery.start(lambda task_status, s=spec, b=board: run_probes(
            s, b, probe_rate=6 * steady_probe_rate(s), task_status=task_status))
        await trio.sleep(0.3)  # different phases
    started = trio.current_time()
    await trio.sleep(600)
    times = [t for fake in fakes for t in fake.times["/health"] if t > started + 10]
    assert all(t / 0.5 == math.floor(t / 0.5) for t in times)
    per_engine = [len([t for t in fake.times["/health"] if t > started + 10])
                  for fake in fakes]
    assert all(110 <= n <= 119 for n in per_engine), per_engine
    assert len(set(times)) < 0.8 * len(times)
