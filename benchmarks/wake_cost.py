"""What a wake-up costs on this machine: the same small step (50 JSON encodings of a
200-int list), timed with the thread's CPU clock, back to back and after sleeps of 0.1,
1 and 3 s, and five steps in one wake-up after 1 s (docs/benchmarks.md, "Wake-ups on a
grid"): ``python -m benchmarks.wake_cost``. Prints one JSON document (medians, µs)."""

from __future__ import annotations

import json
import statistics
import time


def _step() -> None:
    doc = {"a": list(range(200))}
    for _ in range(50):
        json.dumps(doc)


def _median_us(gap_s: float, runs: int, steps: int = 1) -> float:
    took = []
    for _ in range(runs):
        time.sleep(gap_s)
        started = time.thread_time()
        for _ in range(steps):
            _step()
        took.append(time.thread_time() - started)
    return round(statistics.median(took) * 1e6)


def main() -> int:
    out = {"step_back_to_back_us": _median_us(0, 50),
           "step_after_0.1s_us": _median_us(0.1, 20),
           "step_after_1s_us": _median_us(1, 8),
           "step_after_3s_us": _median_us(3, 5),
           "five_steps_in_one_wake_after_1s_us": _median_us(1, 8, steps=5)}
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
