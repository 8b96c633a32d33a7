"""Generated memory series for the leak detector's tests (``tests/test_memtrend.py``).

Each generator gives the bytes *above a baseline* at every sample time ``i * dt_s``,
deterministic for a seed: the confounders a healthy engine shows (noise, transient
allocation steps, a GC sawtooth, a daily warm-up ramp, a diurnal swing) and the report's leak
(0.39 GB/h from 8.7 GB of headroom: it runs out after about 22 h). ``run`` feeds a series
to a detector and says what it said when.

    python -m tests.memory_series 3        # docs/memory.md's table, 3 seeds a series
    python -m tests.memory_series --cost   # the cost of add + reading per tick, in µs
"""

from __future__ import annotations

import math
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from nvpair.supervision.memtrend import Trend, TrendDetector, TrendSettings

GB = 1e9
MB = 1e6
HOUR = 3600.0
#: what the engine's anonymous memory sits at, and the headroom the report started with
BASELINE = 20 * GB
HEADROOM = 8.7 * GB

Series = list[float]


def _times(hours: float, dt_s: float) -> range:
    return range(int(hours * HOUR / dt_s))


def noise(hours: float, dt_s: float = 60, seed: int = 0, sd: float = 30 * MB) -> Series:
    """Gaussian noise of ``sd`` around the baseline."""
    rng = random.Random(seed)
    return [rng.gauss(0, sd) for _ in _times(hours, dt_s)]


def steps(hours: float, dt_s: float = 60, seed: int = 0, per_hour: float = 2,
          size: tuple[float, float] = (0.3 * GB, 1 * GB),
          lasting_s: tuple[float, float] = (300, 3600)) -> Series:
    """Transient allocations, ``per_hour`` of them (evenly spaced, each start jittered by up
    to half the spacing), each of a uniform ``size`` held a uniform ``lasting_s``, then
    freed; overlapping steps add up (up to three at once)."""
    rng = random.Random(seed)
    n = len(_times(hours, dt_s))
    delta = [0.0] * (n + 1)
    spacing = HOUR / per_hour
    for k in range(int(hours * per_hour)):
        t = (k + rng.uniform(-0.5, 0.5)) * spacing
        height = rng.uniform(*size)
        start = max(0, int(t / dt_s))
        end = min(n, max(start, int((t + rng.uniform(*lasting_s)) / dt_s)))
        delta[start] += height
        delta[end] -= height
    out, level = [], 0.0
    for i in range(n):
        level += delta[i]
        out.append(level)
    return out


def bursts(hours: float, dt_s: float = 60, seed: int = 0, per_hour: float = 2,
           size: tuple[float, float] = (0.3 * GB, 1 * GB),
           lasting_s: tuple[float, float] = (300, 3600)) -> Series:
    """Like ``steps`` but at random (Poisson) times: now and then several allocations pile
    up, 4 GB within half an hour once in a few hundred hours."""
    rng = random.Random(seed)
    n = len(_times(hours, dt_s))
    delta = [0.0] * (n + 1)
    t = rng.expovariate(per_hour / HOUR)
    while t < hours * HOUR:
        height = rng.uniform(*size)
        start = int(t / dt_s)
        end = min(n, int((t + rng.uniform(*lasting_s)) / dt_s))
        delta[start] += height
        delta[end] -= height
        t += rng.expovariate(per_hour / HOUR)
    out, level = [], 0.0
    for i in range(n):
        level += delta[i]
        out.append(level)
    return out


def sawtooth(hours: float, dt_s: float = 60, seed: int = 0, height: float = 0.5 * GB,
             period_s: tuple[float, float] = (600, 3600)) -> Series:
    """A garbage collector's cycle: a linear rise of ``height`` over a period (uniform in
    ``period_s`` per tooth), then a drop back to the baseline."""
    rng = random.Random(seed)
    out: Series = []
    start, period = 0.0, rng.uniform(*period_s)
    for i in _times(hours, dt_s):
        t = i * dt_s
        while t >= start + period:
            start += period
            period = rng.uniform(*period_s)
        out.append(height * (t - start) / period)
    return out


def warmup(hours: float, dt_s: float = 60, seed: int = 0, height: float = 1.5 * GB,
           tau_s: tuple[float, float] = (1800, 7200), day_s: float = 24 * HOUR) -> Series:
    """A daily warm-up: restarted every ``day_s`` (from the first sample), the memory rises
    by ``height`` and levels off (a saturating ramp, time constant uniform in ``tau_s``)."""
    rng = random.Random(seed)
    out: Series = []
    day, tau = -1, 0.0
    for i in _times(hours, dt_s):
        t = i * dt_s
        if int(t // day_s) != day:
            day, tau = int(t // day_s), rng.uniform(*tau_s)
        out.append(height * (1 - math.exp(-(t - day * day_s) / tau)))
    return out


def linear_warmup(hours: float, dt_s: float = 60, seed: int = 0, height: float = 1.5 * GB,
                  ramp_s: tuple[float, float] = (3600, 4 * 3600),
                  day_s: float = 24 * HOUR) -> Series:
    """A daily warm-up as a straight ramp of ``height`` over a uniform ``ramp_s``, then flat."""
    rng = random.Random(seed)
    out: Series = []
    day, ramp = -1, 0.0
    for i in _times(hours, dt_s):
        t = i * dt_s
        if int(t // day_s) != day:
            day, ramp = int(t // day_s), rng.uniform(*ramp_s)
        out.append(height * min(1.0, (t - day * day_s) / ramp))
    return out


def diurnal(hours: float, dt_s: float = 60, seed: int = 0, swing: float = 0.6 * GB,
            day_s: float = 24 * HOUR) -> Series:
    """Day and night: a sinusoid of ``swing`` peak to peak, its phase set by the seed."""
    phase = random.Random(seed).uniform(0, 2 * math.pi)
    return [swing / 2 * (1 + math.sin(2 * math.pi * i * dt_s / day_s + phase))
            for i in _times(hours, dt_s)]


def leak(hours: float, dt_s: float = 60, seed: int = 0, per_h: float = 0.39 * GB) -> Series:
    """The report's leak: a steady ``per_h`` (no noise: add some)."""
    return [per_h * i * dt_s / HOUR for i in _times(hours, dt_s)]


def mix(*series: Series) -> Series:
    """The sum of series, sample by sample (as long as the shortest)."""
    return [sum(values) for values in zip(*series, strict=False)]


#: every confounder alone, by name: (hours, dt_s, seed) -> series
CONFOUNDERS: dict[str, Callable[[float, float, int], Series]] = {
    "noise": lambda h, dt, seed: noise(h, dt, seed),
    "steps": lambda h, dt, seed: mix(steps(h, dt, seed), noise(h, dt, seed + 1)),
    "sawtooth": lambda h, dt, seed: mix(sawtooth(h, dt, seed), noise(h, dt, seed + 1)),
    "warm-up": lambda h, dt, seed: mix(warmup(h, dt, seed), noise(h, dt, seed + 1)),
    "linear warm-up": lambda h, dt, seed: mix(linear_warmup(h, dt, seed),
                                              noise(h, dt, seed + 1)),
    "diurnal": lambda h, dt, seed: mix(diurnal(h, dt, seed), noise(h, dt, seed + 1)),
}
#: harder than any one confounder: not held to zero false alarms (docs/memory.md has counts)
HARDER: dict[str, Callable[[float, float, int], Series]] = {
    "bursts": lambda h, dt, seed: mix(bursts(h, dt, seed), noise(h, dt, seed + 1)),
    "all at once": lambda h, dt, seed: mix(steps(h, dt, seed), sawtooth(h, dt, seed + 1),
                                           warmup(h, dt, seed + 2), diurnal(h, dt, seed + 3),
                                           noise(h, dt, seed + 4)),
}


@dataclass
class Run:
    """What a detector said over a series: episodes (entries into a state) and when."""

    dt_s: float
    episodes: dict[Trend, int] = field(default_factory=lambda: {t: 0 for t in Trend})
    first: dict[Trend, float] = field(default_factory=dict)
    #: seconds from the start when the headroom ran out (None: it never did)
    exhausted_s: float | None = None
    seconds: float = 0.0

    def lead_s(self, trend: Trend) -> float | None:
        """How long before the headroom ran out ``trend`` was first said."""
        if self.exhausted_s is None or trend not in self.first:
            return None
        return self.exhausted_s - self.first[trend]


def run(above: Series, dt_s: float, settings: TrendSettings | None = None,
        headroom: float = HEADROOM, baseline: float = BASELINE) -> Run:
    """Feed ``above`` (bytes above the baseline) sample by sample, reading after each one;
    the headroom falls as the memory rises. Stops when the headroom runs out."""
    detector = TrendDetector(settings or TrendSettings())
    result = Run(dt_s)
    last = Trend.FLAT
    started = time.perf_counter()
    for i, extra in enumerate(above):
        t = i * dt_s
        left = int(headroom - extra)
        if left <= 0:
            result.exhausted_s = t
            break
        detector.add(t, int(baseline + extra))
        trend = detector.reading(t, left).trend
        if trend is not last:
            result.episodes[trend] += 1
            result.first.setdefault(trend, t)
            last = trend
    result.seconds = time.perf_counter() - started
    return result


def table(hours: float = 960, dt_s: float = 60, seeds: int = 1) -> str:
    """docs/memory.md's table: false episodes per confounder, warning times for the leak."""
    lines = ["| series | samples | growing | leaking | critical | leaking ahead of exhaustion "
             "| critical ahead |", "|---|---|---|---|---|---|---|"]
    for name, make in {**CONFOUNDERS, **HARDER}.items():
        counts = {t: 0 for t in Trend}
        n = 0
        for seed in range(seeds):
            series = make(hours, dt_s, seed)
            n += len(series)
            r = run(series, dt_s)
            for t in Trend:
                counts[t] += r.episodes[t]
        lines.append(f"| {name}, {hours:g} h x {seeds} | {n:,} | {counts[Trend.GROWING]} | "
                     f"{counts[Trend.LEAKING]} | {counts[Trend.CRITICAL]} | - | - |")
    for name, extra in (("leak 0.39 GB/h", lambda h, dt, s: noise(h, dt, s)),
                        ("leak + all confounders", HARDER["all at once"])):
        leads: dict[Trend, list[float]] = {Trend.LEAKING: [], Trend.CRITICAL: []}
        for seed in range(seeds):
            r = run(mix(leak(30, dt_s, seed), extra(30, dt_s, seed)), dt_s)
            for t in leads:
                lead = r.lead_s(t)
                if lead is not None:
                    leads[t].append(lead)

        def span(values: list[float]) -> str:
            if not values:
                return "never"
            low, high = min(values) / 60, max(values) / 60
            if low >= 90:
                return (f"{low / 60:.1f} h" if low == high
                        else f"{low / 60:.1f}-{high / 60:.1f} h")
            return f"{low:.0f} min" if low == high else f"{low:.0f}-{high:.0f} min"

        lines.append(f"| {name}, from 8.7 GB x {seeds} | | | | | {span(leads[Trend.LEAKING])} "
                     f"| {span(leads[Trend.CRITICAL])} |")
    return "\n".join(lines)


def cost(hours: float = 48, dt_s: float = 15) -> str:
    """The cost of one ``add`` + ``reading`` (what the watch does per engine per tick), on
    the report's leak among every confounder at the watch's 15 s: mean, p99 and max in µs."""
    series = mix(leak(hours, dt_s), HARDER["all at once"](hours, dt_s, 0))
    detector = TrendDetector(TrendSettings())
    clock = time.perf_counter_ns
    costs = []
    for i, extra in enumerate(series):
        t = i * dt_s
        start = clock()
        detector.add(t, int(BASELINE + extra))
        detector.reading(t, int(HEADROOM * 3 - extra))  # more headroom: runs to the end
        costs.append(clock() - start)
    costs.sort()
    mean = sum(costs) / len(costs) / 1000
    p99 = costs[int(0.99 * len(costs))] / 1000
    return (f"add + reading, {len(costs):,} ticks at {dt_s:g} s: mean {mean:.1f} µs, "
            f"p99 {p99:.1f} µs, max {costs[-1] / 1000:.0f} µs")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--cost"]:
        print(cost())
    else:
        print(table(seeds=int(sys.argv[1]) if len(sys.argv) > 1 else 1))
