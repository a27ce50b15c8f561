"""The run modes: the decoupled mode this project is about, and the synchronous baselines it is
measured against, each as its overrides of the cluster file's [sync] and [merger] sections
(cluster.config applies them: ClusterConfig.effective)."""

from __future__ import annotations

import dataclasses


# The run modes: the same islands, links and corpus; only how they synchronise differs.
# sync-diloco: classic DiLoCo — the whole model (P = 1) every H steps, every island blocks until
#   the merger has all N deltas and returns the new global model.
# The synchronous modes fold every island's delta at once with a whole outer step (share_window 0),
# as classic DiLoCo does, and publish every fold at once (snapshot_every_round 0).  sync-diloco's
# outer step is Nesterov lr 0.7 without momentum, whatever the profile sets for decoupled folds: the
# best of its tuning grid at H = 12 (EXPERIMENTS.md, "Quality"; DiLoCo's momentum 0.9, tuned at
# H = 500, ranks sixth of eight there); a suite tunes it through ClusterConfig.mode_merger.
# Their islands wait for each fold.  A round waits for every island up to the quorum timeout
# (30 s): at H = 48 the shipped profile's half-speed islands finish inside it, after the fast
# ones; at H = 96 they lag past it and a round would go on without them, so H = 96 in a synchronous
# mode is not classic DiLoCo here.  (A longer timeout alone does not help: an island gives up
# waiting for its delta's fold after 60 s and trains on; the quorum counts islands, so its next
# delta does not complete a round without the slow ones, but the round still waits only up to the
# timeout.)
# sync-avg: parameter averaging after every step — each island takes one step of its own AdamW
#   (its own moments, its own clip) on its own batch, sends its full fp32 change and blocks until
#   the merger returns the average of the islands' models (outer SGD, lr 1).  That is local AdamW
#   with H = 1, not data parallelism, but its bytes and its barrier per step are those of an fp32
#   all-reduce through a hub: the quality suite times data parallelism over the links with it.
# sync-dp: data parallelism, one AdamW on the all-reduced gradient of the global batch.  It runs in
#   one process (suites/inprocess.py, `dloco experiment quality`), not on the bus; its overrides
#   are sync-avg's, so that its bytes per step are counted as an fp32 all-reduce's.
@dataclasses.dataclass(frozen=True)
class Mode:
    """A run mode's overrides of the [sync] and [merger] sections (dataclasses.replace
    arguments)."""

    sync: dict = dataclasses.field(default_factory=dict)
    # quorum ALL_ISLANDS: the cluster's number of islands
    merger: dict = dataclasses.field(default_factory=dict)
    # runs as processes on the bus (`dloco up`); otherwise in one process only
    on_bus: bool = True


ALL_ISLANDS = "all"
MODES = {
    "decoupled": Mode(),
    "sync-diloco": Mode(
        sync={"fragments": 1, "blocking": True},
        merger={
            "quorum": ALL_ISLANDS,
            "grace_cap_s": 0.0,
            "share_window": 0,
            "snapshot_every_round": 0.0,
            "outer": "nesterov",
            "outer_lr": 0.7,
            "outer_momentum": 0.0,
        },
    ),
    "sync-avg": Mode(
        sync={"fragments": 1, "interval": 1, "codec": "fp32", "blocking": True},
        merger={
            "quorum": ALL_ISLANDS,
            "grace_cap_s": 0.0,
            "merge": "average",
            "outer": "sgd",
            "outer_lr": 1.0,
            "snapshot_codec": "fp32",
            "snapshot_diff_codec": "none",
            "served_dtype": "fp32",
            "share_window": 0,
            "snapshot_every_round": 0.0,
        },
    ),
}
MODES["sync-dp"] = dataclasses.replace(MODES["sync-avg"], on_bus=False)
# the modes `dloco up` runs
BUS_MODES = tuple(name for name, mode in MODES.items() if mode.on_bus)
