"""The leak detector: is a memory series rising steadily enough to run out, and when?

Pure and I/O-free: the memory watch feeds it one sample at a time (``add``) and asks for a
``reading``; nothing here reads ``/proc``, awaits or logs. The method, in order:

* **Bucket floors.** Samples fall into fixed buckets (10 minutes by default); each bucket
  keeps only its smallest values (at most ``floor_keep``) and gives its *floor*, a low
  percentile (``floor_quantile``, p10) of its samples. A transient allocation, a GC cycle or
  a burst of requests raises a few samples; a leak raises the floor.
* **A robust slope.** The Theil-Sen slope (the median of the slopes between every pair of
  floors) over the window (6 h), so a few odd buckets cannot tilt it.
* **Monotonicity.** A Mann-Kendall test on the same pairs (z above ``z_min``), and each third
  of the window (``parts``) must rise by at least half the window's slope: a warm-up ramp
  that levels off, or a step that stays, has a flat third.
* **Exhaustion.** With the headroom (bytes left above the reserve), the time until the slope
  uses it up. ``leaking``: that time is within the horizon (24 h); ``growing``: a significant
  rise that is not; ``critical``: a significant slope (over the window, or over the short
  window of finer floors for a fast leak) that exhausts the headroom within ``critical_s``
  (1 h). ``flat`` otherwise, and always until the window is covered (``min_coverage``).
* **Hysteresis.** A state is left only once its line is crossed by 25 % (``hysteresis``),
  so a reading near a line does not flap.

The pairwise work (Theil-Sen and Mann-Kendall, O(n^2) for n floors) is done as floors come
and go (the long window keeps its pairwise slopes sorted) or once per completed bucket, and
cached; ``add`` is a few comparisons and ``reading`` a division between them.
Memory is bounded by the number of buckets in the windows, whatever the number of samples.
"""

from __future__ import annotations

import bisect
import enum
import math
from dataclasses import dataclass, fields, replace

GIB = 1024**3


class Trend(enum.StrEnum):
    FLAT = "flat"
    GROWING = "growing"
    LEAKING = "leaking"
    CRITICAL = "critical"


@dataclass(frozen=True)
class TrendSettings:
    """Durations in seconds; every one scales (tests use windows of seconds, see ``scaled``)."""

    #: the long window of bucket floors the slope and the tests run over
    window_s: float = 6 * 3600
    #: ``leaking`` when the headroom runs out within this
    horizon_s: float = 24 * 3600
    #: one floor per bucket
    bucket_s: float = 600
    #: the short window for ``critical`` (a fast leak), of finer floors
    short_window_s: float = 1800
    #: one floor per short bucket
    short_bucket_s: float = 120
    #: ``critical`` when a significant slope exhausts the headroom within this
    critical_s: float = 3600
    #: a slope below this is not a rise (bytes per hour of real time; ``scaled`` divides it)
    min_slope_bytes_per_h: float = 20e6
    #: the floor of a bucket: this quantile of its samples
    floor_quantile: float = 0.10
    #: at most this many smallest samples kept per bucket (beyond ``floor_keep / quantile``
    #: samples in a bucket, the floor is the ``floor_keep``-th smallest: lower, still a floor)
    floor_keep: int = 32
    #: Mann-Kendall z above which a rise is significant (one-sided p < 0.01)
    z_min: float = 2.33
    #: consecutive parts of the window (and of the short one) that must each rise by at
    #: least half the window's slope: a ramp that levels off has a flat last part
    parts: int = 3
    short_parts: int = 3
    #: a state is left only past its line times this (``leaking`` until the headroom lasts
    #: 1.25 horizons, ``critical`` until it lasts 1.25 h; a rise stays steady until its
    #: slope, z or least part falls 1.25 times below the line): no flapping at the line
    hysteresis: float = 1.25
    #: the part of a window that must have floors before anything but ``flat`` is said
    min_coverage: float = 0.95

    def __post_init__(self) -> None:
        for name in ("window_s", "horizon_s", "bucket_s", "short_window_s", "short_bucket_s",
                     "critical_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"memory trend: {name} must be a positive number, got {value!r}")
        for parts_name, parts in (("parts", self.parts), ("short_parts", self.short_parts)):
            if parts < 1:
                raise ValueError(f"memory trend: {parts_name} must be at least 1, got {parts}")
        for window, bucket, parts in (("window_s", "bucket_s", self.parts),
                                      ("short_window_s", "short_bucket_s", self.short_parts)):
            w, b = getattr(self, window), getattr(self, bucket)
            if round(w / b) < max(4, 2 * parts):  # two floors a part at least
                raise ValueError(f"memory trend: {window} ({w:g}) must hold at least "
                                 f"{max(4, 2 * parts)} buckets of {bucket} ({b:g})")
        if not 0 < self.floor_quantile < 1:
            raise ValueError("memory trend: floor_quantile must be between 0 and 1, "
                             f"got {self.floor_quantile!r}")
        if self.floor_keep < 1:
            raise ValueError(f"memory trend: floor_keep must be at least 1, got {self.floor_keep}")
        if not (math.isfinite(self.hysteresis) and self.hysteresis >= 1):
            raise ValueError(f"memory trend: hysteresis must be 1 or more, got {self.hysteresis!r}")
        if not 0 < self.min_coverage <= 1:
            raise ValueError("memory trend: min_coverage must be in (0, 1], "
                             f"got {self.min_coverage!r}")

    def scaled(self, factor: float) -> TrendSettings:
        """Every duration times ``factor`` (and the minimum slope divided by it): the same
        detector on a faster clock, e.g. ``scaled(1 / 3600)`` turns hours into seconds."""
        durations = {f.name: getattr(self, f.name) * factor for f in fields(self)
                     if f.name.endswith("_s")}
        return replace(self, **durations,
                       min_slope_bytes_per_h=self.min_slope_bytes_per_h / factor)


@dataclass(frozen=True)
class TrendReading:
    trend: Trend
    #: the slope the state rests on (the short window's when ``critical`` from it), bytes/h
    slope_bytes_per_h: float
    #: seconds until the headroom runs out at that slope (None: not rising, or no headroom)
    exhaustion_s: float | None
    #: the latest bucket floor (None before the first bucket completes)
    floor_bytes: int | None
    #: seconds of the window that have floors (of the short window when ``critical`` from it)
    covered_s: float
    #: a few words on why this state
    why: str
    #: the window the slope is over, seconds (the long or the short one)
    window_s: float = 0.0


_ALARMS = (Trend.LEAKING, Trend.CRITICAL)


class _Floor:
    """The smallest samples of one bucket (at most ``keep``) and how many there were."""

    __slots__ = ("count", "index", "keep", "smallest")

    def __init__(self, index: int, keep: int) -> None:
        self.index = index
        self.keep = keep
        self.count = 0
        self.smallest: list[int] = []

    def add(self, value: int) -> None:
        self.count += 1
        smallest = self.smallest
        if len(smallest) < self.keep:
            bisect.insort(smallest, value)
        elif value < smallest[-1]:
            smallest.pop()
            bisect.insort(smallest, value)

    def floor(self, quantile: float) -> int:
        rank = max(1, math.ceil(quantile * self.count))
        return self.smallest[min(rank, len(self.smallest)) - 1]


@dataclass(frozen=True)
class _Fit:
    slope_per_bucket: float
    #: Mann-Kendall z (0 when the pairs do not rise on balance)
    z: float
    #: the least rising part's slope over the window's (None: not computed, the fit failed
    #: even the relaxed tests before it)
    parts_ratio: float | None
    #: the window has enough floors for the tests
    enough: bool

    def steady(self, min_slope: float, z_min: float, relax: float) -> tuple[bool, str]:
        """Whether the rise passes every test, each line divided by ``relax`` (1: entering
        a state; more: staying in it), and why not."""
        slope = self.slope_per_bucket
        if not self.enough:
            return False, "too few floors"
        if slope < min_slope / relax:
            return False, "no rise" if slope <= 0 else "rise below the minimum slope"
        if self.z <= z_min / relax:
            return False, f"rise not steady (Mann-Kendall z {self.z:.1f})"
        if self.parts_ratio is None or self.parts_ratio < 0.5 / relax:
            return False, "a part of the window is not rising"
        return True, "steady rise"


def _theil_sen(xs: list[int], ys: list[int]) -> tuple[float, list[float]]:
    """The median pairwise slope, and every pairwise slope sorted (xs strictly rising)."""
    n = len(xs)
    slopes = sorted([(ys[j] - ys[i]) / (xs[j] - xs[i])
                     for i in range(n - 1) for j in range(i + 1, n)])
    return _median(slopes), slopes


def _median(values: list[float]) -> float:
    m = len(values)
    if m == 0:
        return 0.0
    mid = m // 2
    return values[mid] if m % 2 else (values[mid - 1] + values[mid]) / 2


def _fit(xs: list[int], ys: list[int], min_slope_per_bucket: float, z_min: float,
         parts: int, relax: float, pairs: list[float] | None = None) -> _Fit:
    """Theil-Sen slope, Mann-Kendall z, and how much each of ``parts`` consecutive parts of
    the window rises against the slope, over floors at bucket indices (``pairs``: the sorted
    pairwise slopes, if already known). The parts are fitted only if the rest would pass
    with every line divided by ``relax``."""
    n = len(xs)
    if pairs is None:
        slope, slopes = _theil_sen(xs, ys)
    else:
        slope, slopes = _median(pairs), pairs
    # Mann-Kendall S: rising pairs minus falling pairs (xs rise, so a slope's sign is theirs)
    s = (len(slopes) - bisect.bisect_right(slopes, 0.0)) - bisect.bisect_left(slopes, 0.0)
    var = n * (n - 1) * (2 * n + 5) / 18 if n > 1 else 1.0
    z = (s - 1) / math.sqrt(var) if s > 0 else 0.0
    enough = n >= 2 * parts
    ratio = None
    if enough and slope > 0 and slope >= min_slope_per_bucket / relax and z > z_min / relax:
        ratio = min(_theil_sen(xs[k * n // parts:(k + 1) * n // parts],
                               ys[k * n // parts:(k + 1) * n // parts])[0]
                    for k in range(parts)) / slope
    return _Fit(slope, z, ratio, enough)


def slope_bound(n: int, spread: float) -> float:
    """An upper bound of the Theil-Sen slope (per index step) of ``n`` points at distinct
    integer positions whose values span ``spread``: a median slope ``s > 0`` needs at least
    half of the n(n-1)/2 pairs at slope ``s`` or more, each of them at most ``spread / s``
    steps apart, and there are at most ``n * spread / s`` such pairs; so ``s <= 4 spread /
    (n - 1)``."""
    return 4 * spread / (n - 1) if n > 1 else 0.0


class _Series:
    """Bucket floors over one window, and the fit over them, cached per set of floors.

    With ``pairs``, the sorted slopes of every pair of floors in the window are kept up to
    date as floors come and go (n - 1 insertions or deletions each, by bisection), so a fit
    needs no sort: about 1 µs over the long window's 630 pairs, where computing and sorting
    them takes about 70-130 µs.
    """

    def __init__(self, bucket_s: float, window_s: float, parts: int,
                 settings: TrendSettings, pairs: bool) -> None:
        self.bucket_s = bucket_s
        self.parts = parts
        self.window_s = window_s
        self.buckets = max(1, round(window_s / bucket_s))
        self.settings = settings
        self.min_slope_per_bucket = settings.min_slope_bytes_per_h * bucket_s / 3600
        #: (bucket index, floor), indices rising, all within the window (at most ``buckets``)
        #: (a list, not a deque: an empty deque holds a 600-byte block, two series an
        #: engine; a window is at most a few dozen floors, so popping the first is cheap)
        self.floors: list[tuple[int, int]] = []
        self.pairs: list[float] | None = [] if pairs else None
        #: floors needed before the window says anything but flat
        self.needed = max(2 * parts, math.ceil(settings.min_coverage * self.buckets))
        #: max - min of the window's floors (cached with the window)
        self.spread = 0
        self.current: _Floor | None = None
        self.lowest = -(2**62)
        #: moves with each floor that comes or goes; the window and the fit are cached on it
        self.version = 0
        self._window_version = -1
        self._window: tuple[list[int], list[int]] = ([], [])
        self._fit_version = -1
        self._fit: _Fit | None = None

    def add(self, t: float, value: int) -> None:
        index = math.floor(t / self.bucket_s)
        current = self.current
        if current is None or index > current.index:
            if current is not None:
                self._evict(index - self.buckets)
                self._append(current.index, current.floor(self.settings.floor_quantile))
            current = self.current = _Floor(index, self.settings.floor_keep)
        current.add(value)  # a sample from an earlier bucket (a clock step back) counts here

    def _append(self, index: int, floor: int) -> None:
        if index < self.lowest:
            return
        pairs = self.pairs
        if pairs is not None:
            for i, y in self.floors:
                bisect.insort(pairs, (floor - y) / (index - i))
        self.floors.append((index, floor))
        self.version += 1

    def _evict(self, lowest: int) -> None:
        """Drop the floors below bucket ``lowest`` (the window only moves forward)."""
        if lowest <= self.lowest:
            return
        self.lowest = lowest
        floors, pairs = self.floors, self.pairs
        while floors and floors[0][0] < lowest:
            i0, y0 = floors.pop(0)
            self.version += 1
            if pairs is not None:  # the same expression as at insertion: the same float
                for i, y in floors:
                    del pairs[bisect.bisect_left(pairs, (y - y0) / (i - i0))]

    def window(self, t: float) -> tuple[list[int], list[int]]:
        """The completed floors in the window that ends at ``t``."""
        self._evict(math.floor(t / self.bucket_s) - self.buckets)
        if self._window_version == self.version:
            return self._window
        xs = [i for i, _ in self.floors]
        ys = [y for _, y in self.floors]
        self._window_version, self._window = self.version, (xs, ys)
        self.spread = max(ys) - min(ys) if ys else 0
        return xs, ys

    def covered(self, xs: list[int]) -> float:
        return len(xs) * self.bucket_s

    def enough(self, xs: list[int]) -> bool:
        return len(xs) >= self.needed

    def fit(self, t: float) -> _Fit:
        """The fit over the window that ends at ``t`` (computed once per set of floors)."""
        xs, ys = self.window(t)
        if self._fit_version != self.version or self._fit is None:
            self._fit = _fit(xs, ys, self.min_slope_per_bucket, self.settings.z_min, self.parts,
                             self.settings.hysteresis, self.pairs)
            self._fit_version = self.version
        return self._fit

    def steady(self, fit: _Fit, held: bool) -> tuple[bool, str]:
        """``fit``'s verdict: by the lines to enter a rising state, or (``held``: the
        detector is in one) by the lines relaxed by the hysteresis, to stay in it."""
        return fit.steady(self.min_slope_per_bucket, self.settings.z_min,
                          self.settings.hysteresis if held else 1.0)

    def latest(self) -> int | None:
        if self.floors:
            return self.floors[-1][1]
        if self.current is not None:
            return self.current.floor(self.settings.floor_quantile)
        return None


class TrendDetector:
    """One memory series: ``add`` samples (monotonic seconds, bytes), ask for a ``reading``."""

    def __init__(self, settings: TrendSettings) -> None:
        self.settings = settings
        self._long = _Series(settings.bucket_s, settings.window_s, settings.parts, settings,
                             pairs=True)
        # the short window's fit is skipped on most ticks (see reading): no pairs kept
        self._short = _Series(settings.short_bucket_s, settings.short_window_s,
                              settings.short_parts, settings, pairs=False)
        self._last = Trend.FLAT
        self._within = f"within {_duration(settings.critical_s)}"

    def add(self, t: float, value_bytes: int) -> None:
        if not math.isfinite(t):
            return
        value = int(value_bytes)
        self._long.add(t, value)
        self._short.add(t, value)

    def reading(self, t: float, headroom_bytes: int | None) -> TrendReading:
        """The state at ``t``, given the bytes left above the reserve (None: unknown, so
        nothing can run out and a rise is at most ``growing``)."""
        reading = self._reading(t, headroom_bytes)
        self._last = reading.trend
        return reading

    def _reading(self, t: float, headroom: int | None) -> TrendReading:
        s = self.settings
        floor = self._long.latest()
        if not math.isfinite(t):
            return TrendReading(Trend.FLAT, 0.0, None, floor, 0.0, "no time", s.window_s)
        # a state is left only when its line is crossed by a margin (no flapping at the line)
        critical_s = s.critical_s * (s.hysteresis if self._last is Trend.CRITICAL else 1)
        horizon_s = s.horizon_s * (s.hysteresis if self._last in _ALARMS else 1)
        within = self._within
        # a fast leak first: the short window of finer floors
        xs, _ = self._short.window(t)
        if (headroom is not None and self._short.enough(xs)
                # only if the steepest slope these floors allow could run out in time
                and slope_bound(len(xs), self._short.spread) / s.short_bucket_s * critical_s
                >= headroom):
            fit = self._short.fit(t)
            per_s = fit.slope_per_bucket / s.short_bucket_s
            steady, _ = self._short.steady(fit, self._last is Trend.CRITICAL)
            if steady and per_s > 0:
                left = max(0.0, headroom / per_s)
                if left <= critical_s:
                    return TrendReading(Trend.CRITICAL, per_s * 3600, left, floor,
                                        self._short.covered(xs),
                                        f"headroom runs out {within} (short window)",
                                        s.short_window_s)
        xs, _ = self._long.window(t)
        covered = self._long.covered(xs)
        if not self._long.enough(xs):
            return TrendReading(Trend.FLAT, 0.0, None, floor, covered,
                                "window not yet covered", s.window_s)
        fit = self._long.fit(t)
        per_h = fit.slope_per_bucket / s.bucket_s * 3600
        steady, why = self._long.steady(fit, self._last is not Trend.FLAT)
        if not steady:
            return TrendReading(Trend.FLAT, per_h, None, floor, covered, why, s.window_s)
        if headroom is None:
            return TrendReading(Trend.GROWING, per_h, None, floor, covered,
                                "steady rise; no headroom known", s.window_s)
        left = max(0.0, headroom / (per_h / 3600))
        if left <= critical_s:
            return TrendReading(Trend.CRITICAL, per_h, left, floor, covered,
                                f"headroom runs out {within}", s.window_s)
        if left <= horizon_s:
            return TrendReading(Trend.LEAKING, per_h, left, floor, covered,
                                "steady rise runs out within the horizon", s.window_s)
        return TrendReading(Trend.GROWING, per_h, left, floor, covered,
                            "steady rise, headroom lasts beyond the horizon", s.window_s)


def reserve_bytes(mem_available: int, anon_pages: int) -> int:
    """earlyoom's line, by default: 10 % of MemAvailable + AnonPages, at least 2 GiB."""
    return max(int(0.10 * (max(0, mem_available) + max(0, anon_pages))), 2 * GIB)


def _gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB"


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{max(0, round(seconds))} s"
    if seconds < 5400:
        return f"{round(seconds / 60)} min"
    return f"{round(seconds / 3600)} h"


def trend_line(name: str, reading: TrendReading, headroom_bytes: int | None,
             what: str = "anonymous memory") -> str:
    """One line in words, e.g. ``head: anonymous memory +0.39 GB/h for 6 h; headroom 8.7 GB
    runs out in about 22 h``."""
    r = reading
    if r.trend is Trend.FLAT:
        floor = f" at {_gb(r.floor_bytes)}" if r.floor_bytes is not None else ""
        if r.why == "window not yet covered":
            return (f"{name}: {what}{floor}, watching ({_duration(r.covered_s)} of "
                    f"{_duration(r.window_s)} seen)")
        return f"{name}: {what} flat{floor} over {_duration(r.covered_s)}"
    line = f"{name}: {what} {r.slope_bytes_per_h / 1e9:+.2f} GB/h for {_duration(r.covered_s)}"
    if headroom_bytes is None:
        return line + "; headroom unknown"
    if r.exhaustion_s is None:
        return line + f"; headroom {_gb(headroom_bytes)}"
    if r.trend is Trend.GROWING:
        return line + (f"; headroom {_gb(headroom_bytes)} lasts about "
                       f"{_duration(r.exhaustion_s)}")
    return line + (f"; headroom {_gb(headroom_bytes)} runs out in about "
                   f"{_duration(r.exhaustion_s)}")
