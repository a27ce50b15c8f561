"""Typed, frozen configuration of the merger's math; every value validated with the offender
named."""

from __future__ import annotations

import dataclasses

from dloco.protocol import CODEC_NAMES

# re-exported: the error these configs raise
from dloco.protocol.errors import ConfigError as ConfigError
from dloco.protocol.errors import require as _require
from dloco.protocol.sparse import SPARSE_BITS

# codecs a whole fragment's value may go out in
FULL_SNAPSHOT_CODECS = ("fp32", "bf16", "int8")


@dataclasses.dataclass(frozen=True)
class OuterConfig:
    """Outer optimizer (DiLoCo: SGD with Nesterov momentum, lr 0.7, momentum 0.9)."""

    # "nesterov" | "round_nesterov" | "delayed_nesterov" | "sgd" (merger/fold/outer.py)
    kind: str = "nesterov"
    lr: float = 0.7
    momentum: float = 0.9
    # delayed_nesterov: momentum applied once per `delay` folds (Liu et al. 2024: N)
    delay: int = 4
    # what the momentum (and a round's sum of pseudo-gradients) is kept in; the step itself is
    # computed in float32.  "bfloat16" halves the optimizer state (4 -> 2 B/param)
    momentum_dtype: str = "float32"

    KINDS = ("nesterov", "round_nesterov", "delayed_nesterov", "sgd")
    MOMENTUM_DTYPES = ("float32", "bfloat16")
    # bytes per value of each
    MOMENTUM_BYTES = {"float32": 4, "bfloat16": 2}

    def __post_init__(self) -> None:
        _require(
            self.kind in self.KINDS, f"outer.kind must be one of {self.KINDS}, got {self.kind!r}"
        )
        _require(0 < self.lr <= 10, f"outer.lr must be in (0, 10], got {self.lr}")
        _require(0 <= self.momentum < 1, f"outer.momentum must be in [0, 1), got {self.momentum}")
        _require(
            isinstance(self.delay, int) and self.delay >= 1,
            f"outer.delay must be an int >= 1, got {self.delay!r}",
        )
        _require(
            self.momentum_dtype in self.MOMENTUM_DTYPES,
            f"outer.momentum_dtype must be one of {self.MOMENTUM_DTYPES},"
            f" got {self.momentum_dtype!r}",
        )


@dataclasses.dataclass(frozen=True)
class MergeConfig:
    """How admitted deltas of one round become one merged delta."""

    # "rda" (radial-directional averaging) | "average" (token-weighted mean)
    method: str = "rda"
    # S: reject deltas whose base is more than S versions behind
    max_staleness: int = 4
    # weight *= (1 + staleness) ** -power; 0 disables the discount
    staleness_power: float = 0.0
    # tensors whose path contains one of these use the plain mean (paper)
    average_paths: tuple[str, ...] = ("embed",)
    # 0: every fold takes a whole outer step.  N > 0: a fold's step is scaled by its share of the
    # weight of a whole round: the islands that contributed to this fragment within the last N
    # versions (merger/fold/weighting.py fold_share).  Single-delta folds then add up to one step
    # per round.
    share_window: int = 0
    # A delta whose norm is more than this many times the median of the other islands' recent
    # medians is rejected as an outlier (merger/fold/outliers.py); 0 turns the check off.
    outlier_factor: float = 20.0
    # A fold moves the fragment by at most this many times the largest of the other islands' recent
    # median movements per island's part (what an island's part moves it: its weight x its delta's
    # norm); a larger part is scaled down to it (merger/fold/outliers.py, merger/fold/clipping.py).
    # 0: no guard.
    clip_factor: float = 2.0
    # Until an island has a movement reference in a fragment (its first folds on a fresh merger),
    # each of its deltas counts in a fold with a norm of at most this many times the largest delta
    # norm the other islands have on record there, however few (merger/fold/outliers.py
    # delta_limits); a larger delta is scaled down.  0: off (only the fragment's norm bounds them).
    cold_factor: float = 2.0
    # No island's weight in a fold (tokens**2 / steps, as it claims them) exceeds this many times
    # the heaviest other island's, in the fold or among the fragment's recent contributors; 0: no
    # cap. 2 leaves the shipped profile's islands as they are (a half-speed region's H is half, so
    # its weight is half) and keeps one key's claims from shrinking the others' shares of a round by
    # more than that (benchmarks/attacks.py: at 8, a burst of 30 deltas starved an honest island).
    max_weight_ratio: float = 2.0

    METHODS = ("rda", "average")

    def __post_init__(self) -> None:
        _require(
            self.method in self.METHODS,
            f"merge.method must be one of {self.METHODS}, got {self.method!r}",
        )
        _require(
            isinstance(self.max_staleness, int) and self.max_staleness >= 0,
            f"merge.max_staleness must be an int >= 0, got {self.max_staleness!r}",
        )
        _require(
            0 <= self.staleness_power <= 8,
            f"merge.staleness_power must be in [0, 8], got {self.staleness_power}",
        )
        _require(
            isinstance(self.share_window, int) and self.share_window >= 0,
            f"merge.share_window must be an int >= 0, got {self.share_window!r}",
        )
        _require(
            self.max_weight_ratio == 0 or self.max_weight_ratio >= 1,
            f"merge.max_weight_ratio must be 0 (off) or >= 1, got {self.max_weight_ratio}",
        )
        _require(
            self.outlier_factor == 0 or self.outlier_factor >= 2,
            f"merge.outlier_factor must be 0 (off) or >= 2, got {self.outlier_factor}",
        )
        _require(
            self.clip_factor == 0 or self.clip_factor >= 1,
            f"merge.clip_factor must be 0 (off) or >= 1, got {self.clip_factor}",
        )
        _require(
            self.cold_factor == 0 or self.cold_factor >= 1,
            f"merge.cold_factor must be 0 (off) or >= 1, got {self.cold_factor}",
        )


@dataclasses.dataclass(frozen=True)
class RoundConfig:
    """When to fold: a minimum quorum, then an adaptive grace window."""

    # K: islands with a delta pending before a fold; 1 = nobody is ever held back by others
    quorum: int = 1
    # fold with fewer than K once the oldest pending delta waited this long
    quorum_timeout_s: float = 30.0
    # never wait longer than this past the moment the quorum was met
    grace_cap_s: float = 1.0
    # wait this much past an island's predicted arrival
    grace_slack_s: float = 0.05
    # smoothing of each island's inter-arrival time
    ema_alpha: float = 0.3
    # While a pending island has nothing to be judged against in a fragment (no movement reference,
    # and no other island has sent it a nonzero delta: a fresh merger's first folds) and another
    # island is live, the fold waits at most this long past the oldest pending delta, so that a
    # key that sends before the honest islands have trained meets their deltas
    # (merger/fold/outliers.py `unjudged`).  0: never waits.
    cold_wait_s: float = 30.0

    def __post_init__(self) -> None:
        _require(
            isinstance(self.quorum, int) and self.quorum >= 1,
            f"round.quorum must be an int >= 1, got {self.quorum!r}",
        )
        _require(
            self.quorum_timeout_s > 0,
            f"round.quorum_timeout_s must be > 0, got {self.quorum_timeout_s}",
        )
        _require(self.grace_cap_s >= 0, f"round.grace_cap_s must be >= 0, got {self.grace_cap_s}")
        _require(
            self.grace_slack_s >= 0, f"round.grace_slack_s must be >= 0, got {self.grace_slack_s}"
        )
        _require(
            0 < self.ema_alpha <= 1, f"round.ema_alpha must be in (0, 1], got {self.ema_alpha}"
        )
        _require(self.cold_wait_s >= 0, f"round.cold_wait_s must be >= 0, got {self.cold_wait_s}")


@dataclasses.dataclass(frozen=True)
class SnapshotConfig:
    """How the merger publishes fragments to the islands (the service's choice; no effect on the
    folds)."""

    # full snapshots: one of FULL_SNAPSHOT_CODECS
    snapshot_codec: str = "fp32"
    # "none", or publish each fold as the change since the last snapshot in this codec
    # (protocol/downlink.py)
    snapshot_diff_codec: str = "none"
    # with diffs: every N-th version of a fragment in full too (0: never; an island that misses a
    # diff asks)
    snapshot_full_every: int = 0
    # a fragment's snapshot at most once per this many mean rounds of the islands (0: every fold)
    snapshot_every_round: float = 0.0
    # with diffs: what the value served to islands is held in, by the merger and by every island
    # ("bf16": half the memory on both ends; protocol/downlink.py)
    served_dtype: str = "fp32"

    SERVED_DTYPES = ("fp32", "bf16")
    # bytes per value of each
    SERVED_BYTES = {"fp32": 4, "bf16": 2}

    def __post_init__(self) -> None:
        _require(
            self.snapshot_codec in FULL_SNAPSHOT_CODECS,
            f"merger.snapshot_codec must be one of {FULL_SNAPSHOT_CODECS}, got"
            f" {self.snapshot_codec!r}",
        )
        diff = self.snapshot_diff_codec
        _require(
            diff == "none" or diff in CODEC_NAMES,
            f"merger.snapshot_diff_codec must be 'none' or one of {CODEC_NAMES}, got {diff!r}",
        )
        _require(
            diff not in SPARSE_BITS,
            f"merger.snapshot_diff_codec = {diff!r}: a sparse diff moves 1/32 of the value islands"
            " hold, which falls behind the global model while their deltas keep pushing it (the"
            " merger's model diverged in a measured run, EXPERIMENTS.md 'Bytes'); use int2 or"
            " int4",
        )
        _require(
            self.snapshot_codec != "int8" or diff != "none",
            "merger.snapshot_codec = 'int8' needs merger.snapshot_diff_codec: without diffs nothing"
            " carries its error away",
        )
        _require(
            type(self.snapshot_full_every) is int and self.snapshot_full_every >= 0,
            f"merger.snapshot_full_every must be an int >= 0, got {self.snapshot_full_every!r}",
        )
        every = self.snapshot_every_round
        _require(
            type(every) in (int, float) and 0 <= every < float("inf"),
            f"merger.snapshot_every_round must be a number >= 0, got {every!r}",
        )
        _require(
            self.served_dtype in self.SERVED_DTYPES,
            f"merger.served_dtype must be one of {self.SERVED_DTYPES}, got {self.served_dtype!r}",
        )
        _require(
            self.served_dtype == "fp32" or diff != "none",
            "merger.served_dtype = 'bf16' needs merger.snapshot_diff_codec: only diff snapshots"
            " keep a served value",
        )

    @property
    def served(self) -> str | None:
        """A snapshot's `served` field (None: float32)."""
        return None if self.served_dtype == "fp32" else self.served_dtype


@dataclasses.dataclass(frozen=True)
class MergerConfig:
    """Everything that determines the merger's math; logged in the genesis record so a replay folds
    alike."""

    merge: MergeConfig = MergeConfig()
    outer: OuterConfig = OuterConfig()
    round: RoundConfig = RoundConfig()

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> MergerConfig:
        try:
            merge = dict(data["merge"])
            # a log from before the guard: its folds were never clipped
            merge.setdefault("clip_factor", 0.0)
            # nor a first fold's deltas limited by the other islands'
            merge.setdefault("cold_factor", 0.0)
            merge["average_paths"] = tuple(merge.get("average_paths", ()))
            return cls(
                MergeConfig(**merge), OuterConfig(**data["outer"]), RoundConfig(**data["round"])
            )
        except (KeyError, TypeError) as error:
            raise ConfigError(f"merger config is malformed: {error}") from None
