"""merger/memory.py: freed blocks stay in the process, so allocating the same sizes again costs
no page faults (what a fold does every time: new parameters and momentum, the old ones freed)."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

# A fold's pattern: four new 12 MiB blocks (the benchmark fragment's two tensors, parameters and
# momentum), every page written, then the previous four freed; 30 times.  Prints the minor page
# faults of the last 20.
PROBE = """
import resource, sys
import numpy as np
from dloco.merger.memory import keep_freed_memory
applied = keep_freed_memory() if sys.argv[1] == "keep" else None
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
state = []
for round in range(30):
    if round == 10:
        before = faults()
    # the old ones are freed once these exist
    state = [np.ones(3 << 20, np.float32) for _ in range(4)]
print(applied, faults() - before)
"""


def probe(mode: str) -> tuple[str, int]:
    run = subprocess.run(
        [sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    applied, faults = run.stdout.split()
    return applied, int(faults)


@pytest.mark.skipif(
    platform.system() != "Linux" or not platform.libc_ver()[0] == "glibc", reason="glibc's mallopt"
)
def test_freed_blocks_are_reused_without_page_faults():
    applied, kept = probe("keep")
    assert applied == "True"
    _, default = probe("default")
    # 245,760: every round faulting in every page afresh
    pages = 20 * 4 * (12 << 20) // 4096
    # glibc's defaults hand part of every round's freed memory back (20,360 faults here, ~4 MiB a
    # round)
    assert default > pages // 20, (
        f"glibc's defaults should give freed blocks back and fault them in again: {default} faults"
    )
    assert kept < pages // 100, (
        f"{kept} page faults in 20 rounds with freed memory kept (defaults: {default})"
    )


# Two threads alive at once, taking turns: each allocates 64 MiB in 1 MiB blocks (heap blocks, under
# the mmap threshold), writes them and frees them.  Prints how far the resident set rose.
TURNS = """
import sys, threading
import numpy as np
from dloco.merger.memory import keep_freed_memory
applied = keep_freed_memory() if sys.argv[1] == "keep" else None
def rss():
    line = next(line for line in open("/proc/self/status") if line.startswith("VmRSS"))
    return int(line.split()[1]) << 10
turns = [threading.Event() for _ in range(4)]
def worker(mine):
    for turn in mine:
        turns[turn].wait()
        blocks = [np.ones(1 << 18, np.float32) for _ in range(64)]
        del blocks
        if turn + 1 < len(turns):
            turns[turn + 1].set()
threads = [threading.Thread(target=worker, args=(mine,)) for mine in ((0, 2), (1, 3))]
for thread in threads:
    thread.start()
before = rss()
turns[0].set()
for thread in threads:
    thread.join()
print(applied, (rss() - before) >> 20)
"""


@pytest.mark.skipif(
    platform.system() != "Linux" or not platform.libc_ver()[0] == "glibc", reason="glibc's mallopt"
)
def test_threads_share_one_heap_so_freed_memory_is_kept_once_not_per_thread():
    """What one thread freed, another reuses: the kept memory is bounded once for the process
    (glibc's default gives a contending thread an arena of its own, which keeps its own freed
    blocks).
    """
    run = subprocess.run(
        [sys.executable, "-c", TURNS, "keep"], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    applied, rose = run.stdout.split()
    assert applied == "True" and int(rose) < 100, (
        f"the resident set rose {rose} MiB for two threads' 64 MiB turns"
    )
