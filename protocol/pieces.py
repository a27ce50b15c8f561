"""Work through a long vector in cache-sized pieces, on a small thread pool: how the codecs
(protocol/quantization.py) keep their numpy passes in L2 and use more than one core.

Pure numpy and threads; no I/O.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

# Work in pieces of about this many input bytes: large enough to amortise numpy's per-call cost,
# small enough that the temporaries stay in L2.
PASS_BYTES = 1 << 21
# numpy releases the GIL inside its loops, so pieces run in parallel on a small thread pool.
DEFAULT_THREADS = min(4, os.cpu_count() or 1)
MAX_THREADS = 64
THREAD_PREFIX = "dloco-codec"


def run_pieces(fn: Callable[[int, int], None], n: int, per_piece: int, threads: int) -> None:
    """Call fn(lo, hi) over [0, n) in pieces of `per_piece`, on up to `threads` threads (at most
    MAX_THREADS; inline when already on a codec thread, so nested calls cannot deadlock)."""
    bounds = [(lo, min(n, lo + per_piece)) for lo in range(0, n, per_piece)]
    threads = min(threads, MAX_THREADS)
    if threads <= 1 or len(bounds) < 2 or threading.current_thread().name.startswith(THREAD_PREFIX):
        for lo, hi in bounds:
            fn(lo, hi)
        return
    # list() re-raises the first exception of any piece in the caller's thread.
    list(_pool(threads).map(lambda b: fn(*b), bounds))


def run_split(fn: Callable[[int, int], None], n: int, threads: int) -> None:
    """Call fn(lo, hi) over [0, n) cut into `threads` contiguous parts, the last on the calling
    thread: for compiled loops that release the GIL, which run at memory speed on a few long
    parts (pieces handed out one by one slow them down)."""
    threads = max(1, min(threads, MAX_THREADS, n))
    cuts = [n * k // threads for k in range(threads + 1)]
    if threads == 1 or threading.current_thread().name.startswith(THREAD_PREFIX):
        fn(0, n)
        return
    futures = [_pool(threads - 1).submit(fn, lo, hi) for lo, hi in zip(cuts[:-2], cuts[1:-1])]
    fn(cuts[-2], cuts[-1])
    for future in futures:
        future.result()


_pools: dict[int, ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()


def _pool(threads: int) -> ThreadPoolExecutor:
    with _pools_lock:
        if threads not in _pools:
            _pools[threads] = ThreadPoolExecutor(
                max_workers=threads, thread_name_prefix=THREAD_PREFIX
            )
        return _pools[threads]


class WorkBuffers:
    """Cache-sized temporaries, reused per thread so that no piece pays for fresh pages."""

    def __init__(self, rows: int, block: int) -> None:
        self.f32_RxK = np.empty((rows, block), dtype=np.float32)
        self.u8_RxK = np.empty((rows, block), dtype=np.uint8)
        # int4 decoding: each code byte's two levels as one u16
        self.u16_RxH = np.empty((rows, block // 2), dtype=np.uint16)
        self.absmax_R = np.empty(rows, dtype=np.float32)


_local = threading.local()


def work_buffers(rows: int, block: int) -> WorkBuffers:
    """This thread's temporaries for pieces of `rows` blocks of `block` values."""
    cache = _local.__dict__.setdefault("work", {})
    if (rows, block) not in cache:
        cache[(rows, block)] = WorkBuffers(rows, block)
    return cache[(rows, block)]
