"""CPU quotas for islands (`[run] island_cpus`): emulated hardware speed that does not depend on
what the other processes of the machine are doing.

Why.  A region's `slowdown` alone makes an island sleep `slowdown - 1` times each step's compute.
On a shared machine (four islands on two cores) the sleeping island hands its CPU to the others, so
the full-speed islands of a mixed cluster run faster than those of a uniform one, and a comparison
of the two (the `heterogeneous` suite) measures the shared machine.  Real islands own their chips; a
slow region's slowness gives nobody else a cycle.  With a quota, each island gets at most
`island_cpus / slowdown` cores whatever its peers do, and while the quotas add up to no more than
the machine's cores a full-speed island gets the same cycles next to slow peers as next to fast
ones.

How.  Linux CFS bandwidth control: `cpu.max` ("QUOTA PERIOD") in cgroup v2, `cpu.cfs_quota_us` and
`cpu.cfs_period_us` in cgroup v1, on a group per island under one group per launcher; the same
mechanism as docker's `--cpus` (and compose's `cpus:`, which `dloco compose` writes).  It needs
permission to create cgroups (root).  The quota arithmetic and the mount
table parsing are pure; `CpuQuotas` does the file I/O.
"""

from __future__ import annotations

import dataclasses
import errno
import os
from pathlib import Path

from dloco.protocol.errors import DlocoError

# the CFS bandwidth period (the kernel's default)
PERIOD_US = 100_000
# the kernel refuses quotas under 1 ms per period
MIN_QUOTA_US = 1_000


class CpuQuotaError(DlocoError):
    """CPU quotas were asked for and cannot be set here (no cgroup CPU controller, no
    permission)."""


def quota_us(cores: float, period_us: int = PERIOD_US) -> int:
    """Microseconds of CPU per period for `cores` cores (0.45 cores: 45,000 us per 100,000 us)."""
    if not cores > 0 or cores == float("inf"):
        raise ValueError(f"cores must be a finite number > 0, got {cores}")
    quota = round(cores * period_us)
    if quota < MIN_QUOTA_US:
        raise ValueError(
            f"{cores} cores is {quota} us per {period_us} us period: the kernel's minimum is"
            f" {MIN_QUOTA_US} us"
        )
    return quota


@dataclasses.dataclass(frozen=True)
class Controller:
    """Where the CPU controller is: `version` 1 or 2, the hierarchy's mount point, and the cgroup
    (relative to it) that new groups go under."""

    version: int
    mount: Path
    # e.g. "" (the hierarchy's root) or "docker/abc"
    parent: str


def find_controller(
    mountinfo: str, own_cgroups: str, v2_controllers: dict[str, str]
) -> Controller | None:
    """The CPU controller from the text of /proc/self/mountinfo and /proc/self/cgroup, and the
    `cgroup.controllers` text of each cgroup2 mount point.  v1 (a `cgroup` mount whose options name
    `cpu`) wins when both exist: a controller is bound to one hierarchy only, and where v1 holds it
    the v2 mount lists none.  New v1 groups nest under this process's own group (its path made
    relative to the mounted subtree); v2 groups go under the mount's root (in v2 a group holding
    processes cannot hand controllers to children), so v2 needs root, not a delegated subtree."""
    mounts = []
    for line in mountinfo.splitlines():
        fields = line.split()
        if " - " not in line or len(fields) < 5:
            continue
        after = line.split(" - ", 1)[1].split()
        # the hierarchy's path mounted (field 4) and where (field 5)
        if len(after) >= 3:
            mounts.append(
                (
                    after[0],
                    _unescape(fields[3]).strip("/"),
                    Path(_unescape(fields[4])),
                    after[2].split(","),
                )
            )
    own = {}
    for line in own_cgroups.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            for name in parts[1].split(",") if parts[1] else ["(v2)"]:
                own[name] = parts[2].strip("/")
    for kind, root, mount, options in mounts:
        if kind == "cgroup" and "cpu" in options:
            # relative to the hierarchy's root; the mount may show only a subtree of it
            path = own.get("cpu", "")
            if root and (path == root or path.startswith(root + "/")):
                path = path[len(root) :].strip("/")
            return Controller(1, mount, path)
    for kind, _, mount, _ in mounts:
        if kind == "cgroup2" and "cpu" in v2_controllers.get(str(mount), "").split():
            return Controller(2, mount, "")
    return None


def _unescape(path: str) -> str:
    """mountinfo writes space, tab, newline and backslash as octal escapes."""
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        path = path.replace(code, char)
    return path


def detect() -> Controller | None:
    """This machine's CPU controller, or None (not Linux, no cgroup file system, no CPU
    controller)."""
    try:
        mountinfo = Path("/proc/self/mountinfo").read_text()
        own = Path("/proc/self/cgroup").read_text()
    except OSError:
        return None
    v2 = {}
    for line in mountinfo.splitlines():
        if " - cgroup2 " in line:
            mount = _unescape(line.split()[4])
            try:
                v2[mount] = (Path(mount) / "cgroup.controllers").read_text()
            except OSError:
                pass
    return find_controller(mountinfo, own, v2)


class CpuQuotas:
    """One cgroup per capped island under `<parent>/<tag>` (the island moves itself in and out:
    island/cpugroup.py); `close()` removes them once their processes are gone."""

    def __init__(self, controller: Controller | None, tag: str) -> None:
        if controller is None:
            raise CpuQuotaError(
                "CPU quotas need the cgroup CPU controller, and this machine has none that this"
                " process can see (run.island_cpus = 0 emulates slow regions by sleeping instead)"
            )
        self.controller = controller
        self.root = controller.mount / controller.parent / tag
        self.groups: dict[str, Path] = {}
        try:
            if controller.version == 2:
                _enable_cpu(controller.mount / controller.parent)
            self.root.mkdir(exist_ok=True)
            if controller.version == 2:
                _enable_cpu(self.root)
        except OSError as error:
            self.close()
            raise CpuQuotaError(
                f"cannot create the cgroup {self.root}: {error.strerror} (CPU quotas need root; "
                "run.island_cpus = 0 emulates slow regions by sleeping instead)"
            ) from None

    def create(self, name: str, cores: float) -> None:
        """A group for process `name` with `cores` cores of CPU bandwidth."""
        try:
            quota = quota_us(cores)
        except ValueError as error:
            raise CpuQuotaError(f"{name}: {error}") from None
        group = self.root / name
        try:
            group.mkdir(exist_ok=True)
            if self.controller.version == 2:
                (group / "cpu.max").write_text(f"{quota} {PERIOD_US}\n")
            else:
                (group / "cpu.cfs_period_us").write_text(f"{PERIOD_US}\n")
                (group / "cpu.cfs_quota_us").write_text(f"{quota}\n")
        except OSError as error:
            raise CpuQuotaError(f"cannot set {cores} cores on {group}: {error.strerror}") from None
        self.groups[name] = group

    def close(self) -> list[str]:
        """Remove the groups; returns what could not be removed (a process still in it), for the
        caller to log."""
        left = []
        for group in [*self.groups.values(), self.root]:
            try:
                group.rmdir()
            except FileNotFoundError:
                pass
            except OSError as error:
                left.append(f"{group} ({errno.errorcode.get(error.errno, error.errno)})")
        self.groups = {}
        return left


def _enable_cpu(group: Path) -> None:
    """v2: let `group`'s children use the CPU controller (already on: nothing to do)."""
    control = group / "cgroup.subtree_control"
    if "cpu" not in control.read_text().split():
        control.write_text("+cpu\n")


def unavailable() -> str | None:
    """Why CPU quotas cannot be set on this machine by this process, or None when they can (a
    probe group is created and removed)."""
    try:
        CpuQuotas(detect(), f"dloco-probe-{os.getpid()}").close()
    except CpuQuotaError as error:
        return str(error)
    return None
