"""merger/memory.py: freed small blocks stay in the process, so allocating the same sizes again
costs no page faults; large ones are given back whole when freed, even from between blocks still in
use (a heap would keep them as holes), and are faulted in as huge pages where the process starts
with glibc's tunable for it."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from dloco.merger.memory import with_huge_pages

# A fold's pattern in blocks under the mmap threshold: 48 new 256 KiB blocks, every page written,
# then the previous 48 freed; 30 times.  Prints the minor page faults of the last 20.
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
    state = [np.ones(1 << 16, np.float32) for _ in range(48)]
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
    pages = 20 * 48 * (256 << 10) // 4096
    # glibc's defaults hand part of every round's freed memory back (20,360 faults here, ~4 MiB a
    # round)
    assert default > pages // 20, (
        f"glibc's defaults should give freed blocks back and fault them in again: {default} faults"
    )
    assert kept < pages // 100, (
        f"{kept} page faults in 20 rounds with freed memory kept (defaults: {default})"
    )


# Two threads alive at once, taking turns: each allocates 64 MiB in 512 KiB blocks (heap blocks,
# under the mmap threshold), writes them and frees them.  Prints how far the resident set rose.
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
        blocks = [np.ones(1 << 17, np.float32) for _ in range(128)]
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


# 64 blocks of 4 MiB written, then every other one freed: prints how far the resident set fell.
HOLES = """
import sys
import numpy as np
from dloco.merger.memory import keep_freed_memory
applied = keep_freed_memory()
def rss():
    line = next(line for line in open("/proc/self/status") if line.startswith("VmRSS"))
    return int(line.split()[1]) << 10
blocks = [np.ones(1 << 20, np.float32) for _ in range(64)]
before = rss()
del blocks[::2]
print(applied, (before - rss()) >> 20)
"""

# A fold's pattern in large blocks: four new 12 MiB blocks (a fragment's parameters and momentum),
# every page written, then the previous four freed; 30 times.  Prints the minor page faults of the
# last 20.  numpy advises huge pages for its own large arrays; XLA's buffers, like most, are plain
# malloc blocks, so numpy's advice is turned off here.
LARGE = PROBE.replace(
    "(1 << 16, np.float32) for _ in range(48)", "(3 << 20, np.float32) for _ in range(4)"
).replace(
    "import numpy as np\n", "import numpy as np\nnp._core.multiarray._set_madvise_hugepage(False)\n"
)


@pytest.mark.skipif(
    platform.system() != "Linux" or not platform.libc_ver()[0] == "glibc", reason="glibc's mallopt"
)
def test_large_blocks_freed_between_others_are_given_back():
    """A heap keeps a freed block in its middle as a hole; the merger's large blocks are mapped on
    their own, so half of 256 MiB freed is half given back."""
    run = subprocess.run([sys.executable, "-c", HOLES], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    applied, fell = run.stdout.split()
    assert applied == "True" and int(fell) >= 120, f"the resident set fell {fell} MiB of 128"


def _transparent_huge_pages() -> bool:
    try:
        setting = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False
    return "[never]" not in setting


@pytest.mark.skipif(
    platform.system() != "Linux"
    or platform.libc_ver()[0] != "glibc"
    or tuple(int(x) for x in platform.libc_ver()[1].split(".")[:2]) < (2, 35)
    or not _transparent_huge_pages(),
    reason="glibc 2.35's malloc.hugetlb tunable and transparent huge pages",
)
def test_large_blocks_fault_in_as_huge_pages_with_the_tunable():
    """As `dloco up` starts a merger (`with_huge_pages`): the fold pattern in 12 MiB blocks, each
    mapped afresh, faults 2 MiB pages over the aligned part of each mapping and 4 KiB ones at its
    unaligned ends (~520 a block here), not 3,072 of 4 KiB."""
    env = with_huge_pages({**os.environ, "GLIBC_TUNABLES": "glibc.malloc.check=0"})
    assert env["GLIBC_TUNABLES"] == "glibc.malloc.check=0:glibc.malloc.hugetlb=1"
    run = subprocess.run(
        [sys.executable, "-c", LARGE, "keep"], capture_output=True, text=True, timeout=120, env=env
    )
    assert run.returncode == 0, run.stderr
    applied, faults = run.stdout.split()
    pages = 20 * 4 * (12 << 20) // 4096
    assert applied == "True" and int(faults) < pages // 3, f"{faults} faults for {pages} pages"
