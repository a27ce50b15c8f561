"""How the merger process uses memory: freed small blocks are kept, large ones given back at once.

A fold allocates its merged direction and, in its outer step, the pseudo-gradient (its new
parameters and momentum are written over the old: merger/fold/merge.py `PendingStep`); reassembly
allocates a buffer per delta; a snapshot diff a tensor's change.  Two costs pull apart:

- page faults: a block mapped fresh is faulted in a page at a time (4 KiB), and with glibc's
  defaults every fold's new blocks are fresh pages, tens of megabytes of them: a fold takes
  markedly longer than one that reuses freed memory;
- holes: a heap gives memory back only from its top, so large blocks freed in its middle stay
  resident: with every block up to 32 MiB on the heap, the merger's peak stands well above what
  it has in use.

`keep_freed_memory` maps blocks of `MMAP_THRESHOLD` (1 MiB) and more on their own, so freeing one
gives it back whole, and lets the heap keep up to `trim_threshold` bytes of freed smaller blocks.
It makes every thread share one arena (glibc gives each thread that contends its own, up to 8 per
core, each keeping its own freed blocks).  Mapped blocks are faulted in cheaply when the process
starts with `HUGE_PAGES` in GLIBC_TUNABLES (glibc 2.35+: transparent huge pages of 2 MiB for its
mapped blocks, 512 times fewer faults); `dloco up` and compose start the merger so
(`with_huge_pages`); a merger started by hand wants the variable too.  So a large merger's peak
comes down and its ingest stays as it was; but a merger whose tensors are between 1 and 32 MiB
(glibc's most for the heap) then folds into fresh pages, and more slowly, as every merger with
larger tensors does anyway (BENCHMARKS.md, "Cost of model size").  Folds write their new
parameters and momentum over the old, so those are not fresh pages (the direction and
pseudo-gradient are).
The island calls `keep_freed_memory` too (island/main.py): without it a large model's island keeps
its freed blocks resident as holes, between steps and at its peak.
Elsewhere than glibc (macOS, musl) it does nothing and says so.
"""

from __future__ import annotations

from dloco.bus import libc

# glibc <malloc.h>
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -2, -3, -8
# blocks this large and larger are mapped on their own: given back whole when freed
MMAP_THRESHOLD = 1 << 20
# freed bytes of smaller blocks the heap may keep
TRIM_THRESHOLD = 64 << 20
# grow the heap in steps this large, fewer brk calls
TOP_PAD = 64 << 20
# every thread allocates from the main heap (the merger's allocations are few and large: measured no
# slower)
ARENAS = 1


def keep_freed_memory(trim_threshold: int = TRIM_THRESHOLD) -> bool:
    """Apply the settings (before the process starts its threads: an arena a thread already has
    stays); True where glibc accepted all four, False where there is no mallopt."""
    mallopt = libc.function("mallopt")
    if mallopt is None:
        return False
    settings = (
        (M_MMAP_THRESHOLD, MMAP_THRESHOLD),
        (M_TRIM_THRESHOLD, trim_threshold),
        (M_TOP_PAD, TOP_PAD),
        (M_ARENA_MAX, ARENAS),
    )
    return all(mallopt(option, value) == 1 for option, value in settings)


# glibc's tunable that advises transparent huge pages for the blocks it maps (read at start only)
HUGE_PAGES = "glibc.malloc.hugetlb=1"


def with_huge_pages(env: dict[str, str]) -> dict[str, str]:
    """`env` with HUGE_PAGES added to its GLIBC_TUNABLES (others kept): for a process to start."""
    tunables = [t for t in env.get("GLIBC_TUNABLES", "").split(":") if t]
    if HUGE_PAGES not in tunables:
        tunables.append(HUGE_PAGES)
    return {**env, "GLIBC_TUNABLES": ":".join(tunables)}
