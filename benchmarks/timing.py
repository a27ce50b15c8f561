"""Small timing helpers shared by the benchmarks: medians, never single runs (the machine is shared)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def median_seconds(fn: Callable[[], object], reps: int, warmup: int = 1) -> float:
    """Median wall time of `fn()` over `reps` runs after `warmup` untimed runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")
