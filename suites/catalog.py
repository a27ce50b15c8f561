"""The experiment suites (`dloco experiment NAME`, run by suites/experiments.py): each a description
and its runs, (label, cluster-file transform) pairs (suites/transforms.py), with its default length,
its --quick steps and runs, and how its islands trace their early evaluations.
"""

from __future__ import annotations

from dloco.cluster.sections import ModelSection
from dloco.suites import linkcurve, speedup, wirebytes
from dloco.suites.transforms import (
    Transform,
    capped,
    chain,
    faults,
    homogeneous,
    interval,
    islands,
    merger,
    mode,
    one_interval,
    sync,
    unlinked,
)

# sync-diloco with quotas: a half-speed island (0.225 cores, ~0.47 steps/s) finishes its H = 48
# steps ~50 s after the fast ones, past the profile's 30 s quorum timeout, which would fold the fast
# pair alone and split every round in two.  Classic DiLoCo waits for everyone.  The islands' settle
# timeout (first) must exceed the quorum timeout.
WAIT_FOR_SLOW = chain(sync(settle_timeout_s=180.0), merger(quorum_timeout_s=150.0))

# Fewer bytes: H = 96, and a fragment's snapshot on the bus at most once per mean round of the
# islands (an island's base is then up to a round of folds behind: max_staleness 8).  See
# default.toml.
LEAN = chain(interval(96), merger(snapshot_every_round=1.0, max_staleness=8))

# The bytes suite's configurations, spelled out so that they stay what they are when the profile
# changes: the former default (every fold down as an int4 diff, int4 deltas up, one H for every
# region, Nesterov at lr 0.35), the profile as shipped, and the profile with topk2 deltas (error
# feedback) up (suites/wirebytes.py has the goals).
EVERY_FOLD_INT4 = chain(
    one_interval,
    sync(interval=48, codec="int4", error_feedback=False),
    merger(
        snapshot_diff_codec="int4",
        snapshot_every_round=0.0,
        max_staleness=4,
        outer="nesterov",
        outer_lr=0.35,
    ),
)
LEAN_BYTES = sync(codec="topk2", error_feedback=True)

SUITES: dict[str, tuple[str, list[tuple[str, Transform]]]] = {
    "speedup": (
        (
            "The three modes at the default profile's links (scaled like the seed's 2-5 Gbit/s for"
            " a 12B model, see cluster/profiles/default.toml), and decoupled at H = 96 (48 on the"
            " half-speed regions; a fragment's snapshot at most once per mean round, as in the"
            " profile): time to a target loss, loss at equal tokens, utilisation, bytes per token."
            f" `{speedup.FULL_SPEED}` is sync-avg without link emulation, for as many steps as the"
            " decoupled runs' cluster tokens: its loss per step, with sync-avg's measured time per"
            " step, gives sync-avg's time to the decoupled runs' final loss (suites/speedup.py)."
        ),
        [
            ("decoupled", mode("decoupled")),
            ("decoupled-h96-held", chain(mode("decoupled"), LEAN)),
            ("sync-diloco", mode("sync-diloco")),
            ("sync-avg", mode("sync-avg")),
            (speedup.FULL_SPEED, chain(mode("sync-avg"), unlinked)),
        ],
    ),
    "heterogeneous": (
        (
            "Four islands, two at half speed, against four at full speed, in decoupled and"
            " sync-diloco: do the fast islands wait for the slow ones, and does the slow hardware"
            " cost the model anything? Speeds are CPU quotas (0.45 cores per full-speed island), so"
            " a slow island's cycles go to nobody else. Three full-speed islands have the mixed"
            " cluster's compute per second on fewer replicas. The mixed decoupled run's half-speed"
            " islands send at the profile's H = 24, the others at 48."
        ),
        [
            ("decoupled-mixed", chain(mode("decoupled"), capped)),
            ("decoupled-uniform", chain(mode("decoupled"), homogeneous, capped)),
            # three full-speed islands: the mixed cluster's compute per second (2 x 1 + 2 x 1/2), on
            # as many replicas
            (
                "decoupled-uniform-3-islands",
                chain(mode("decoupled"), homogeneous, islands(3), capped),
            ),
            ("sync-diloco-mixed", chain(mode("sync-diloco"), capped, WAIT_FOR_SLOW)),
            (
                "sync-diloco-uniform",
                chain(mode("sync-diloco"), homogeneous, capped, WAIT_FOR_SLOW),
            ),
        ],
    ),
    "faults": (
        (
            "One island killed -9 for a quarter of the run, then the merger, in decoupled and"
            " sync-diloco: the survivors' step rate during the island's absence, the time to the"
            " next fold after the merger comes back, the loss curve."
        ),
        [
            ("decoupled", chain(mode("decoupled"), faults)),
            ("sync-diloco", chain(mode("sync-diloco"), faults)),
        ],
    ),
    "quantization": (
        (
            "Delta codecs fp32, bf16, int8, int4, int2, each without and with error feedback"
            " (decoupled)."
        ),
        [
            (f"{codec}{'-ef' if ef else ''}", sync(codec=codec, error_feedback=ef))
            for codec in ("fp32", "bf16", "int8", "int4", "int2")
            for ef in (False, True)
        ],
    ),
    "quantization-sync": (
        (
            "The delta codecs in sync-diloco, where a run is reproducible (every island waits for"
            " every round, folds are canonical: the same configuration gives the same bytes), so"
            " the codec is the only difference between two runs' losses at equal tokens — single"
            " decoupled runs differ by a few percent from timing alone."
        ),
        [
            (
                f"{codec}{'-ef' if ef else ''}",
                chain(mode("sync-diloco"), sync(codec=codec, error_feedback=ef)),
            )
            for codec, ef in (
                ("fp32", False),
                ("bf16", False),
                ("int8", False),
                ("int4", False),
                ("int4", True),
                ("int2", False),
                ("int2", True),
            )
        ],
    ),
    "adoption": (
        (
            "A global fragment arriving between an island's sends: `rebase` (the default: the"
            " island's unsent work on the fragment stays on top and goes out whole in its next"
            " delta) against `replace` (docs/design.md's adopt-on-arrival: that work is"
            " overwritten), decoupled, with the profile's mixed speeds and with four equal islands"
            " (in phase, so each fragment's snapshots arrive seconds before the other islands send"
            " it)."
        ),
        [
            (
                f"{adoption}-{speeds}",
                chain(
                    mode("decoupled"),
                    sync(adoption=adoption),
                    *([homogeneous] if speeds == "uniform" else []),
                ),
            )
            for speeds in ("mixed", "uniform")
            for adoption in ("rebase", "replace")
        ],
    ),
    "merging": (
        (
            "Plain weighted average vs RDA at 2 and 4 islands (the profile's outer step: Nesterov"
            " at its lr on folds scaled by their share of a round); against the outer steps at"
            " DiLoCo's lr 0.7 (4 islands, RDA): Nesterov on the same share-scaled folds, Round"
            " Nesterov (momentum once per round of shares), Delayed Nesterov with a whole step per"
            " fold."
        ),
        [
            (f"{merge}-{n}-islands", chain(merger(merge=merge), islands(n)))
            for n in (2, 4)
            for merge in ("average", "rda")
        ]
        + [
            ("nesterov-lr0.7-4-islands", merger(outer_lr=0.7)),
            ("round-nesterov-lr0.7-4-islands", merger(outer="round_nesterov", outer_lr=0.7)),
            (
                "delayed-nesterov-lr0.7-4-islands",
                merger(outer="delayed_nesterov", outer_lr=0.7, share_window=0),
            ),
        ],
    ),
    "downlink": (
        (
            "Snapshots down as the whole fragment in bf16 after every fold, as int4 diffs of the"
            " value islands hold (protocol/downlink.py) after every fold, and as int4 diffs held to"
            " one per fragment per mean round of the islands (the profile's default), decoupled:"
            " bytes per token, and whether the loss pays for them."
        ),
        [
            (
                "bf16-full",
                merger(snapshot_codec="bf16", snapshot_diff_codec="none", snapshot_every_round=0.0),
            ),
            ("int4-diff", merger(snapshot_diff_codec="int4", snapshot_every_round=0.0)),
            (
                "int4-diff-held",
                merger(snapshot_diff_codec="int4", snapshot_every_round=1.0, max_staleness=8),
            ),
        ],
    ),
    "bytes": (
        (
            "Bytes on the wire per trained token, up and down: sync-avg, the former default (every"
            " fold down as an int4 diff, int4 deltas up, one H for every region), the profile as"
            " shipped (a fragment's int4 diff held to one per mean round of the islands, half-speed"
            " regions at half the H), and the profile with topk2 deltas (error feedback) up: the"
            " ratio to sync-avg, the merger's model at equal cluster tokens and at equal time, the"
            " islands' utilisation, and the goals (suites/wirebytes.py)."
        ),
        [
            (wirebytes.SYNC_AVG, mode("sync-avg")),
            (wirebytes.REFERENCE, EVERY_FOLD_INT4),
            ("default", lambda c: c),
            ("lean", LEAN_BYTES),
        ],
    ),
    "links": (
        (
            "The bandwidth curve measured, not modelled: sync-avg (this system's hub moving data"
            " parallelism's fp32 exchange, a barrier every step) at 1x, 2x and 8x the profile's"
            " links, its seconds per step beside the model the quality suite's wall-clock table"
            " uses; decoupled at 1x, 1/8 and 1/32 of the links, whether its islands still train"
            " without waiting (suites/linkcurve.py)."
        ),
        linkcurve.runs(),
    ),
}
# Seconds per run by default (a suite stays within 30 minutes on 2 cores).  heterogeneous: five
# runs, each ~95 s longer than its length (start-up, stop, trace evaluations), so 240 s.
DEFAULT_SECONDS = {
    "speedup": 300.0,
    "heterogeneous": 240.0,
    "faults": 300.0,
    "quantization": 150.0,
    "quantization-sync": 150.0,
    "adoption": 300.0,
    "merging": 210.0,
    "downlink": 300.0,
    "bytes": 300.0,
    "links": 180.0,
}
# --quick: the tiny model and a few runs per suite (the ones whose direction shows in a short run),
# each bounded by work: every island trains this many steps (at least one interval, H = 48, and for
# sync-diloco whole rounds).  QUICK_LIMIT_S is only the limit of a run that cannot get there.
QUICK_STEPS = {
    "speedup": 96,
    "heterogeneous": 144,
    "faults": 192,
    "quantization": 96,
    "quantization-sync": 96,
    "adoption": 144,
    "merging": 96,
    "downlink": 144,
    "bytes": 144,
    "links": 96,
}
QUICK_LIMIT_S = 900.0
QUICK_RUNS = {
    "speedup": ("decoupled", "sync-diloco", "sync-avg"),
    "heterogeneous": ("decoupled-mixed", "sync-diloco-mixed", "sync-diloco-uniform"),
    "quantization": ("fp32", "int4", "int2"),
    "quantization-sync": ("fp32", "int4"),
    "adoption": ("rebase-uniform", "replace-uniform"),
    "merging": ("average-4-islands", "rda-4-islands", "round-nesterov-lr0.7-4-islands"),
    "links": ("sync-avg-x1", "decoupled-x1", "decoupled-x0.125"),
}
QUICK_MODEL = ModelSection(width=32, depth=1, heads=2, context=32, batch=8)
# Islands evaluate each of their first N steps after training (below eval_every, 50 and 20 in quick
# runs): 47-50 s at the end of a default run (four islands on two cores).  Suites of many runs,
# whose bars are not times, evaluate at steps 1, 2, 4, ... 32 in the loop instead, to stay within 30
# minutes (quantization: 10 runs, merging: 7).
EVAL_TRACE, QUICK_EVAL_TRACE = 48, 19
UNTRACED = {"quantization", "merging"}
