"""One island on several processes (hosts): JAX's multi-controller runtime (`jax.distributed`).

Every process runs the same program: the train step is SPMD over every process's devices (the
batch split over all of them, parameters replicated; island/train.py places each process's part).
Only process 0, the leader, holds the island's bus links: it publishes the deltas and receives
the snapshots.  Whatever the leader changes in the parameters between two steps (an adoption, a
rebase) reaches the others through the JAX program itself: once per step every process takes
part in one small all-gather (`agree`: which parameters changed, and whether any process was
asked to stop) and, when something changed, a broadcast of the new values from the leader.  So
all replicas take the same values at the same step and never diverge, and every process stops
after the same step.

A process that dies breaks the group's collectives: the others' next all-gather fails at once
(gloo reports the closed connection; JAX raises it as a JaxRuntimeError or, from some calls, a
ValueError carrying the runtime's status) and raises GroupLost, which ends that process cleanly
(the leader first drains what it already sent).  A host that vanishes without closing its
connections stops sending heartbeats to the coordinator; after `timeout_s` JAX's coordination
service terminates the remaining processes itself.  The island restarts as a whole, as any island.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from dloco.protocol.errors import DlocoError


class GroupError(DlocoError):
    """A multi-process island was configured wrongly (process id, count, coordinator)."""


class GroupLost(DlocoError):
    """Another process of this island stopped taking part: this one ends too."""


# How the XLA runtime's failed statuses read (absl status codes), whichever Python type carries
# them.
_RUNTIME_STATUS = re.compile(
    r"(UNKNOWN|INTERNAL|UNAVAILABLE|ABORTED|CANCELLED|DEADLINE_EXCEEDED|DATA_LOSS"
    r"|FAILED_PRECONDITION): "
)


def broken(error: BaseException) -> bool:
    """Whether `error`, raised by a JAX call of a multi-process island, is the runtime's failure
    of a collective (another process is gone), not a mistake in this program.  JAX raises a
    failed gloo collective as a JaxRuntimeError, or from some calls (a jit's dispatch in
    `process_allgather`) as a ValueError with the same status text."""
    from jax.errors import JaxRuntimeError

    if isinstance(error, GroupLost | JaxRuntimeError):
        return True
    return isinstance(error, ValueError) and _RUNTIME_STATUS.match(str(error)) is not None


def _lost(error: BaseException) -> GroupLost:
    return GroupLost(
        f"another process of this island stopped taking part: {str(error).splitlines()[0]}"
    )


# `--coordinator slurm`: the group is the job step's tasks (srun), as jax.distributed finds it
SLURM = "slurm"
SLURM_VARIABLES = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID")


def from_slurm(environment: Mapping[str, str]) -> tuple[int, int]:
    """(processes, this process's index) of a task started by srun, from Slurm's environment;
    jax.distributed takes the coordinator (the step's first node) from the same variables.
    GroupError naming what is missing outside srun."""
    missing = [name for name in SLURM_VARIABLES if name not in environment]
    if missing:
        raise GroupError(
            f"--coordinator slurm needs Slurm's environment (run it under srun): {missing} unset"
        )
    try:
        return int(environment["SLURM_NTASKS"]), int(environment["SLURM_PROCID"])
    except ValueError:
        raise GroupError(
            "Slurm's SLURM_NTASKS and SLURM_PROCID must be integers, got"
            f" {environment['SLURM_NTASKS']!r}, {environment['SLURM_PROCID']!r}"
        ) from None


def metrics_path(path: Path | None, index: int) -> Path | None:
    """Where process `index` of a group started with one command line (srun) writes its metrics:
    process 0 at `path`, the others beside it as NAME.I.jsonl (cluster files name hosts so too)."""
    if path is None or index == 0:
        return path
    return path.with_name(f"{path.stem}.{index}{path.suffix}")


def check(coordinator: str | None, processes: int, index: int) -> None:
    """The flags of one process of a group, checked before anything is imported."""
    if processes < 1:
        raise GroupError(f"--num-processes must be >= 1, got {processes}")
    if not 0 <= index < processes:
        raise GroupError(f"--process-id must be in [0, {processes}), got {index}")
    if processes > 1 and coordinator != SLURM:
        host, _, port = (coordinator or "").rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise GroupError(
                "--coordinator must be HOST:PORT (process 0's address, the same for every"
                f" process), got {coordinator!r}"
            )


def pack(paths: Sequence[str], staged: Mapping[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """What the leader changed, as (mask, values): mask[i] is 1 when paths[i] changed; values
    are the changed parameters flattened in `paths` order, float32 (what the wire carries)."""
    mask = np.array([path in staged for path in paths], dtype=np.int32)
    parts = [np.asarray(staged[path], np.float32).ravel() for path in paths if path in staged]
    return mask, np.concatenate(parts) if parts else np.zeros(0, np.float32)


def unpack(
    paths: Sequence[str],
    shapes: Mapping[str, tuple[int, ...]],
    mask: np.ndarray,
    values: np.ndarray,
) -> dict[str, np.ndarray]:
    """The inverse of pack, given every path's shape."""
    if (expected := changed_size(paths, shapes, mask)) != values.size:
        raise GroupError(f"{values.size} values for parameters holding {expected}")
    out, at = {}, 0
    for path, changed in zip(paths, mask):
        if changed:
            size = math.prod(shapes[path])
            out[path] = values[at : at + size].reshape(shapes[path])
            at += size
    return out


def changed_size(
    paths: Sequence[str], shapes: Mapping[str, tuple[int, ...]], mask: np.ndarray
) -> int:
    """How many values pack puts out for `mask`: what every process passes to the broadcast."""
    return sum(math.prod(shapes[path]) for path, changed in zip(paths, mask) if changed)


def initialize(
    coordinator: str, processes: int, index: int, timeout_s: float, join_timeout_s: float
) -> None:
    """Join the group (before any other JAX use in this process).  CPU collectives go over gloo;
    `timeout_s`: how long the coordinator waits for a silent process's heartbeat."""
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # under srun jax.distributed finds the coordinator, count and index itself (SlurmCluster)
    slurm = coordinator == SLURM
    jax.distributed.initialize(
        None if slurm else coordinator,
        num_processes=None if slurm else processes,
        process_id=None if slurm else index,
        initialization_timeout=max(1, round(join_timeout_s)),
        heartbeat_timeout_seconds=max(1, round(timeout_s)),
        shutdown_timeout_seconds=max(1, round(timeout_s)),
    )


class IslandGroup:
    """Agreement between the processes of one island, once per step (see the module's text)."""

    def __init__(self, shapes: Mapping[str, tuple[int, ...]]) -> None:
        import jax

        self.index, self.processes = jax.process_index(), jax.process_count()
        self.leader = self.index == 0
        self.paths, self.shapes = sorted(shapes), dict(shapes)

    def check_same(self, setup: str, ready_timeout_s: float) -> None:
        """Every process was started with the same model and settings (`setup`, any text: its hash
        is compared), before any per-step agreement, whose messages' sizes depend on them.

        First every process waits for the others at the coordination service's barrier, for up to
        `ready_timeout_s`: the group's first collective sets gloo up and gives up after 30 s, and
        a process still importing or compiling on a loaded machine is not a dead one."""
        import hashlib

        # the client JAX's own array serialization waits on
        from jax._src import distributed
        from jax.experimental import multihost_utils

        mine = np.frombuffer(hashlib.sha256(setup.encode()).digest(), dtype=np.int32)
        try:
            distributed.global_state.client.wait_at_barrier(
                "dloco_group_ready", max(1, round(ready_timeout_s * 1000))
            )
            every = np.asarray(multihost_utils.process_allgather(mine))
        except (RuntimeError, ValueError) as error:
            if broken(error):
                raise _lost(error) from None
            raise
        differ = [index for index, row in enumerate(every) if not np.array_equal(row, every[0])]
        if differ:
            raise GroupError(
                f"processes {differ} of this island were started with another model or other"
                " settings than process 0: give every process the same flags but --process-id"
            )

    def agree(
        self, stop: bool, versions: Sequence[int], staged: Mapping[str, np.ndarray]
    ) -> tuple[bool, list[int], dict[str, np.ndarray]]:
        """Every process calls this once per step.  Returns (any process asked to stop, the
        leader's fragment versions, the parameters the leader changed since the last call);
        `versions` and `staged` are read on the leader only."""
        from jax.experimental import multihost_utils

        mask, values = (
            pack(self.paths, staged) if self.leader else (np.zeros(len(self.paths), np.int32), None)
        )
        mine = np.concatenate([[int(stop)], versions, mask]).astype(np.int32)
        try:
            header = np.asarray(multihost_utils.process_allgather(mine))
            versions, mask = (
                [int(v) for v in header[0, 1 : 1 + len(versions)]],
                header[0, 1 + len(versions) :],
            )
            if not mask.any():
                return bool(header[:, 0].any()), versions, {}
            if values is None:
                values = np.zeros(changed_size(self.paths, self.shapes, mask), np.float32)
            values = np.asarray(multihost_utils.broadcast_one_to_all(values))
        except (RuntimeError, ValueError) as error:
            if broken(error):
                raise _lost(error) from None
            raise
        return bool(header[:, 0].any()), versions, unpack(self.paths, self.shapes, mask, values)
