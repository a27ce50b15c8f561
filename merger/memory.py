"""Keep freed memory in the merger process instead of handing it back to the kernel after every
fold.

A fold allocates the fragment's new parameters and momentum (two float32 copies of the fragment)
and frees the previous ones; reassembly allocates a buffer per delta.  glibc's malloc serves
blocks above its mmap threshold (128 KiB, rising dynamically to at most 32 MiB) with a fresh
mmap and trims freed heap tops back to the kernel, so with its defaults every fold touches tens of
megabytes of new pages: one minor page fault per 4 KiB.  On the ingest benchmark's fragment (4 int4
deltas x 6.3 M parameters, one core) a fold takes 37-45 ms with glibc's defaults and 26-29 ms with
these settings (docs/benchmarks-archive.md).

`keep_freed_memory` raises the mmap threshold to glibc's maximum (32 MiB: larger blocks are still
mapped fresh — a fragment tensor above 8 M parameters pays the faults anyway) and lets the heap
keep up to `trim_threshold` bytes of freed memory.  The cost is resident memory the process no
longer needs at that moment, bounded by that threshold per malloc arena; and it makes every
thread share one arena (glibc gives each thread that contends its own, up to 8 per core: the
receiving thread, the fold worker, XLA's and the codec's threads each kept their own freed
fragments).  On `dloco bench scale` at 200 M parameters one arena took the merger's peak from 32.2
to 26.0 bytes per parameter, its ingest no slower (BENCHMARKS.md, "Cost of model size").
Elsewhere than glibc (macOS, musl) it does nothing and says so.
"""

from __future__ import annotations

import ctypes
import ctypes.util

# glibc <malloc.h>
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -2, -3, -8
# glibc refuses more on 64-bit (HEAP_MAX_SIZE / 2)
MMAP_THRESHOLD_MAX = 32 << 20
# freed bytes a heap may keep (the benchmark's fragments free ~50 MB per fold)
TRIM_THRESHOLD = 512 << 20
# grow the heap in steps this large, fewer brk calls
TOP_PAD = 64 << 20
# every thread allocates from the main heap (the merger's allocations are few and large: measured no
# slower)
ARENAS = 1


def keep_freed_memory(trim_threshold: int = TRIM_THRESHOLD) -> bool:
    """Apply the settings (before the process starts its threads: an arena a thread already has
    stays); True where glibc accepted all four, False where there is no mallopt."""
    name = ctypes.util.find_library("c")
    mallopt = getattr(ctypes.CDLL(name), "mallopt", None) if name else None
    if mallopt is None:
        return False
    settings = (
        (M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX),
        (M_TRIM_THRESHOLD, trim_threshold),
        (M_TOP_PAD, TOP_PAD),
        (M_ARENA_MAX, ARENAS),
    )
    return all(mallopt(option, value) == 1 for option, value in settings)
