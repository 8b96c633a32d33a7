"""The leak detector (nvpair.supervision.memtrend) on generated series (tests/memory_series.py).

The confounders run for 960 simulated hours at one sample a minute (57,600 samples each;
the watch samples every 15 s, but the detector's floors do not change with the rate and a
minute keeps each series under a second).
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.memory_series import (
    BASELINE,
    CONFOUNDERS,
    GB,
    HEADROOM,
    HOUR,
    MB,
    leak,
    mix,
    noise,
    run,
    steps,
)

from nvpair.supervision.memtrend import (
    GIB,
    Trend,
    TrendDetector,
    TrendReading,
    TrendSettings,
    _theil_sen,
    reserve_bytes,
    slope_bound,
    trend_line,
)

DT = 60.0


@pytest.mark.parametrize("name", list(CONFOUNDERS))
def test_no_false_alarm_on_any_confounder_alone_over_960_hours(name: str) -> None:
    r = run(CONFOUNDERS[name](960, DT, 0), DT)
    assert r.exhausted_s is None
    assert r.episodes[Trend.LEAKING] == 0, name
    assert r.episodes[Trend.CRITICAL] == 0, name


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_reports_leak_is_leaking_at_least_8_hours_before_the_headroom_runs_out(
        seed: int) -> None:
    r = run(mix(leak(30, DT), noise(30, DT, seed)), DT)
    assert r.exhausted_s is not None and 21 * HOUR < r.exhausted_s < 23 * HOUR
    lead = r.lead_s(Trend.LEAKING)
    assert lead is not None and lead >= 8 * HOUR
    # leaking first, critical near the end: within the last two hours, at least 30 min ahead
    assert r.first[Trend.LEAKING] < r.first[Trend.CRITICAL]
    critical = r.lead_s(Trend.CRITICAL)
    assert critical is not None and 30 * 60 <= critical <= 2 * HOUR
    assert r.episodes[Trend.LEAKING] == 1 and r.episodes[Trend.CRITICAL] == 1


def test_the_leak_among_allocation_steps_is_still_flagged_8_hours_ahead() -> None:
    r = run(mix(leak(30, DT), steps(30, DT, 5), noise(30, DT, 6)), DT)
    lead = r.lead_s(Trend.LEAKING)
    assert lead is not None and lead >= 8 * HOUR


def test_a_diurnal_swing_is_growing_at_most_twice_a_day() -> None:
    # its rising half-day is a steady rise, rightly; the hysteresis keeps it from flapping
    r = run(CONFOUNDERS["diurnal"](240, DT, 0), DT)
    assert 5 <= r.episodes[Trend.GROWING] <= 2 * 10
    assert r.episodes[Trend.LEAKING] == r.episodes[Trend.CRITICAL] == 0


def _feed(detector: TrendDetector, series: list[float], dt: float = DT,
          headroom: float | None = HEADROOM) -> list[tuple[float, TrendReading]]:
    out = []
    for i, extra in enumerate(series):
        t = i * dt
        detector.add(t, int(BASELINE + extra))
        left = None if headroom is None else int(headroom - extra)
        out.append((t, detector.reading(t, left)))
    return out


def test_the_first_leaking_reading_says_the_slope_and_the_time_left() -> None:
    readings = _feed(TrendDetector(TrendSettings()), mix(leak(30, DT), noise(30, DT, 3)))
    t, first = next((t, r) for t, r in readings if r.trend is Trend.LEAKING)
    assert first.slope_bytes_per_h == pytest.approx(0.39 * GB, rel=0.1)
    truth = HEADROOM / (0.39 * GB) * HOUR - t
    assert first.exhaustion_s == pytest.approx(truth, rel=0.15)
    assert first.covered_s >= 0.95 * 6 * HOUR
    assert first.floor_bytes is not None
    assert first.floor_bytes == pytest.approx(BASELINE + 0.39 * GB * t / HOUR, abs=0.2 * GB)


def test_a_slow_rise_is_growing_within_the_horizon_and_leaking_with_a_longer_one() -> None:
    slow = mix(leak(30, DT, per_h=0.1 * GB), noise(30, DT, 4))  # 8.7 GB lasts ~87 h
    short = {r.trend for _, r in _feed(TrendDetector(TrendSettings()), slow)}
    assert short == {Trend.FLAT, Trend.GROWING}
    longer = {r.trend for _, r in _feed(TrendDetector(TrendSettings(horizon_s=100 * HOUR)),
                                        slow)}
    assert Trend.LEAKING in longer and Trend.CRITICAL not in longer
    # without a headroom there is nothing to run out: a rise is growing, never leaking
    unknown = {r.trend for _, r in _feed(TrendDetector(TrendSettings()),
                                         mix(leak(30, DT), noise(30, DT, 4)), headroom=None)}
    assert unknown == {Trend.FLAT, Trend.GROWING}


def test_nothing_but_flat_until_the_window_is_covered() -> None:
    readings = _feed(TrendDetector(TrendSettings()), leak(8, DT, per_h=2 * GB),
                     headroom=30 * GB)
    before = [r for t, r in readings if t < 5.5 * HOUR]
    assert {r.trend for r in before} == {Trend.FLAT}
    assert before[-1].why == "window not yet covered"
    assert readings[-1][1].trend is Trend.LEAKING


def test_a_fast_leak_is_critical_from_the_short_window_before_the_long_one_is_covered(
        ) -> None:
    # 6 GB/h from 8.7 GB: out in about 85 min; the long window would need 6 h
    readings = _feed(TrendDetector(TrendSettings()), mix(leak(2, DT, per_h=6 * GB),
                                                         noise(2, DT, 8)))
    t, first = next((t, r) for t, r in readings if r.trend is Trend.CRITICAL)
    assert t < 1 * HOUR
    assert first.slope_bytes_per_h == pytest.approx(6 * GB, rel=0.15)
    assert first.window_s == 1800


def test_windows_scaled_to_seconds_work_the_same() -> None:
    f = 1 / 3600  # an hour becomes a second
    fast = TrendSettings().scaled(f)
    assert fast.window_s == pytest.approx(6) and fast.bucket_s == pytest.approx(600 * f)
    series = mix(leak(30, DT), noise(30, DT, 0))
    slow_run = run(series, DT)
    fast_run = run(series, DT * f, fast)
    assert fast_run.exhausted_s == pytest.approx(slow_run.exhausted_s * f)  # type: ignore[operator]
    for trend in (Trend.LEAKING, Trend.CRITICAL):
        assert fast_run.first[trend] == pytest.approx(slow_run.first[trend] * f, abs=600 * f)
    # the slope is still said per hour of real time: 0.39 GB/h becomes 0.39 GB per second
    readings = _feed(TrendDetector(fast), series, dt=DT * f)
    leaking = next(r for _, r in readings if r.trend is Trend.LEAKING)
    assert leaking.slope_bytes_per_h == pytest.approx(0.39 * GB * 3600, rel=0.1)
    quiet = run(CONFOUNDERS["steps"](200, DT, 1), DT * f, fast)
    assert quiet.episodes[Trend.LEAKING] == quiet.episodes[Trend.CRITICAL] == 0


def test_a_process_leaking_20_mb_per_s_is_leaking_within_30_s_with_a_20_s_window() -> None:
    # what the watch's real-process tests use: a 20 s window of 1 s buckets, 4 samples a second
    s = TrendSettings(window_s=20, bucket_s=1, short_window_s=8, short_bucket_s=0.5,
                      horizon_s=600, critical_s=5)
    d = TrendDetector(s)
    trends = []
    for i in range(30 * 4):
        t = i / 4
        d.add(t, int(500 * MB + 20 * MB * t))
        trends.append((t, d.reading(t, int(8 * GB - 20 * MB * t)).trend))
    first = next(t for t, trend in trends if trend is Trend.LEAKING)
    assert first <= 30
    flat = TrendDetector(s)
    for i in range(30 * 4):
        flat.add(i / 4, int(500 * MB) + (i % 7) * 1_000_000)
        assert flat.reading(i / 4, int(8 * GB)).trend is Trend.FLAT


def test_a_gap_in_the_samples_makes_it_flat_until_the_window_is_covered_again() -> None:
    d = TrendDetector(TrendSettings())
    for i in range(int(8 * HOUR / DT)):
        d.add(i * DT, int(BASELINE + 0.5 * GB * i * DT / HOUR))
    t = 8 * HOUR
    assert d.reading(t, int(5 * GB)).trend is Trend.LEAKING
    # no samples for 3 hours (the engine was stopped, the watch paused)
    later = d.reading(t + 3 * HOUR, int(5 * GB))
    assert later.trend is Trend.FLAT and later.covered_s < 4 * HOUR


def test_a_bucket_floor_ignores_its_transient_peaks() -> None:
    d = TrendDetector(TrendSettings())
    for i in range(40):  # one 10-minute bucket at 15 s: 3 samples 2 GB higher
        d.add(i * 15, int(BASELINE + (2 * GB if i in (5, 6, 30) else 0) + i))
    d.add(600, int(BASELINE))  # completes the bucket
    assert d.reading(600, None).floor_bytes == int(BASELINE) + 3  # p10 of 40: the 4th lowest


def test_a_constant_series_has_a_slope_of_zero_and_is_flat() -> None:
    d = TrendDetector(TrendSettings())
    for i in range(int(7 * HOUR / 15)):
        d.add(i * 15, 12 * 10**9)
    r = d.reading(7 * HOUR, 10**9)
    assert r.trend is Trend.FLAT and r.slope_bytes_per_h == 0 and r.exhaustion_s is None
    assert r.floor_bytes == 12 * 10**9 and 0.95 * 6 * HOUR <= r.covered_s <= 6 * HOUR


def test_reserve_is_earlyooms_line_or_2_gib() -> None:
    assert reserve_bytes(8 * GIB, 8 * GIB) == 2 * GIB
    assert reserve_bytes(100 * GIB, 60 * GIB) == 16 * GIB
    assert reserve_bytes(-1, -1) == 2 * GIB


def test_describe_says_it_in_words() -> None:
    leaking = TrendReading(Trend.LEAKING, 0.39e9, 22.3 * HOUR, 21 * 10**9, 6 * HOUR,
                           "steady rise", 6 * HOUR)
    assert trend_line("head", leaking, int(8.7e9)) == (
        "head: anonymous memory +0.39 GB/h for 6 h; headroom 8.7 GB runs out in about 22 h")
    critical = TrendReading(Trend.CRITICAL, 3.1e9, 23 * 60, None, 1800, "x", 1800)
    assert trend_line("a", critical, int(1.2e9)) == (
        "a: anonymous memory +3.10 GB/h for 30 min; headroom 1.2 GB runs out in about 23 min")
    growing = TrendReading(Trend.GROWING, 0.08e9, 109 * HOUR, None, 6 * HOUR, "x", 6 * HOUR)
    assert trend_line("b", growing, int(8.7e9), what="node memory") == (
        "b: node memory +0.08 GB/h for 6 h; headroom 8.7 GB lasts about 109 h")
    flat = TrendReading(Trend.FLAT, 0.0, None, 12 * 10**9, 6 * HOUR, "no rise", 6 * HOUR)
    assert trend_line("c", flat, None) == "c: anonymous memory flat at 12.0 GB over 6 h"
    watching = TrendReading(Trend.FLAT, 0.0, None, None, 2 * HOUR, "window not yet covered",
                            6 * HOUR)
    assert trend_line("d", watching, None) == "d: anonymous memory, watching (2 h of 6 h seen)"


def test_settings_that_cannot_work_are_refused_in_one_line() -> None:
    with pytest.raises(ValueError, match=r"window_s \(600\) must hold at least 6 buckets"):
        TrendSettings(window_s=600, bucket_s=600)
    with pytest.raises(ValueError, match=r"short_window_s \(10\) must hold at least 8 buckets"):
        TrendSettings(short_window_s=10, short_bucket_s=2, short_parts=4)
    with pytest.raises(ValueError, match="bucket_s must be a positive number, got -1"):
        TrendSettings(bucket_s=-1)
    with pytest.raises(ValueError, match="window_s must be a positive number, got nan"):
        TrendSettings(window_s=math.nan)


small = TrendSettings(window_s=40, bucket_s=2, short_window_s=8, short_bucket_s=1,
                      horizon_s=100, critical_s=10, floor_keep=4)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(-5, 30, allow_nan=False),
                          st.integers(-(2**62), 2**62)), max_size=200),
       st.one_of(st.none(), st.integers(-(2**62), 2**62)))
def test_any_samples_give_one_of_the_states_and_never_raise(
        samples: list[tuple[float, int]], headroom: int | None) -> None:
    d = TrendDetector(small)
    t = 0.0
    for step, value in samples:
        t += step  # steps back too: a clock that jumped, or two callers
        d.add(t, value)
        r = d.reading(t, headroom)
        assert r.trend in set(Trend)
        assert r.exhaustion_s is None or r.exhaustion_s >= 0
        assert 0 <= r.covered_s <= max(small.window_s, small.short_window_s)
    d.add(math.inf, 1)
    assert d.reading(math.nan, headroom).trend is Trend.FLAT


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 20_000), st.integers(0, 2**40))
def test_memory_stays_bounded_whatever_the_number_of_samples(n: int, seed: int) -> None:
    d = TrendDetector(small)
    for i in range(n):
        d.add(i * 0.01, (seed * 2654435761 + i * 40503) % 2**40)
    for series in (d._long, d._short):
        assert len(series.floors) <= series.buckets
        assert series.current is not None and len(series.current.smallest) <= small.floor_keep


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(-(10**12), 10**12), min_size=2, max_size=40), st.data())
def test_the_theil_sen_slope_never_exceeds_its_bound(ys: list[int], data: st.DataObject) -> None:
    gaps = data.draw(st.lists(st.integers(1, 5), min_size=len(ys) - 1, max_size=len(ys) - 1))
    xs = [0]
    for g in gaps:
        xs.append(xs[-1] + g)
    slope, _ = _theil_sen(xs, ys)
    assert slope <= slope_bound(len(ys), max(ys) - min(ys)) * (1 + 1e-9) + 1e-9


@given(st.integers(2, 50), st.integers(-(10**12), 10**12))
def test_the_slope_of_a_constant_series_is_zero(n: int, value: int) -> None:
    assert _theil_sen(list(range(n)), [value] * n)[0] == 0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 9, allow_nan=False), st.integers(0, 10**10)),
                max_size=300))
def test_the_kept_pair_slopes_are_those_of_the_window_as_floors_come_and_go(
        samples: list[tuple[float, int]]) -> None:
    d = TrendDetector(small)
    t = 0.0
    for step, value in samples:
        t += step  # gaps of up to 9 s evict several 2-s buckets at once
        d.add(t, value)
        d.reading(t, None)
        series = d._long
        xs, ys = series.window(t)
        assert series.pairs == _theil_sen(xs, ys)[1]
        assert len(xs) <= series.buckets and xs == sorted(set(xs))
