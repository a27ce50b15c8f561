"""Small timing helpers shared by the benchmarks: medians, never single runs (the machine is
shared)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np


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


def memcpy_seconds(arrays: Sequence[np.ndarray], reps: int) -> float:
    """The reference of every rate: median time of `np.copyto` of each array in turn into one
    scratch buffer as large as the largest (the same bytes as the arrays, without a second copy of
    them all in memory)."""
    scratch = np.empty(max(a.size for a in arrays), dtype=arrays[0].dtype)

    def copy_all() -> None:
        for array in arrays:
            np.copyto(scratch[: array.size].reshape(array.shape), array)

    return median_seconds(copy_all, reps)


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def receive_timed(
    sub: Any,
    expected: int,
    handle: Callable[[list], None] = lambda frames: None,
    timeout_s: float = 600.0,
) -> tuple[int, float]:
    """Receive `expected` messages from a ZeroMQ socket, passing each to `handle`; return (wire
    bytes, seconds from the first arrival to the last handled).  Raises TimeoutError if the stream
    stalls for `timeout_s`."""
    received, nbytes, first = 0, 0, None
    deadline = time.monotonic() + timeout_s
    while received < expected:
        if not sub.poll(1000):
            if time.monotonic() > deadline:
                raise TimeoutError(f"received {received} of {expected} messages")
            continue
        frames = sub.recv_multipart(copy=False)
        first = time.perf_counter() if first is None else first
        nbytes += sum(len(f) for f in frames)
        received += 1
        handle([f.buffer for f in frames])
    return nbytes, time.perf_counter() - first
