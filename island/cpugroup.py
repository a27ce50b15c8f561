"""The island's emulated hardware speed as a CPU quota (`dloco island --cpu-cgroup DIR`).

The launcher creates the cgroup with the quota (cluster/cpuquota.py: `island_cpus / slowdown`
cores); the island moves itself in after its first step and out again when training ends.  So
start-up (imports, compiling, joining: several CPU-seconds, which at a quarter of a core would
take most of a short run) and the evaluations of `--eval-trace` after training (a measurement,
not the island's work) run at the machine's speed, as the sleep-based `--slowdown` leaves step 1
alone.  Unlike the sleep, the quota also slows what the island does between steps (its held-out
evaluations, its network threads): all of it runs on the emulated chip.  Leaving goes back to the
group the launcher made the island's group in: its own group under cgroup v1, the hierarchy's
root under v2 (cluster/cpuquota.py).  Writing a process id to a group's `cgroup.procs` moves all of
the process's threads, and the threads it starts later are born there.
"""

from __future__ import annotations

import os
from pathlib import Path

from dloco.protocol.errors import DlocoError


class CpuGroupError(DlocoError):
    """The island could not enter or leave its CPU quota group."""


class CpuGroup:
    def __init__(self, path: Path) -> None:
        if not (path / "cgroup.procs").is_file():
            raise CpuGroupError(
                f"--cpu-cgroup {path}: not a cgroup (no cgroup.procs); the launcher creates it"
                " (run.island_cpus)"
            )
        self.path, self.joined = path, False

    def join(self) -> None:
        """Enter the group: from now on the island runs at its quota."""
        self._move(self.path)
        self.joined = True

    def leave(self) -> None:
        """Back to the group the launcher made the island's group in (`<parent>/<run>/<island>` ->
        `<parent>`); nothing when it never joined."""
        if self.joined:
            self._move(self.path.parent.parent)
            self.joined = False

    @staticmethod
    def _move(group: Path) -> None:
        try:
            (group / "cgroup.procs").write_text(f"{os.getpid()}\n")
        except OSError as error:
            raise CpuGroupError(
                f"cannot move this island into the cgroup {group}: {error.strerror}"
            ) from None
