"""What the simulator is asked: islands (compute and links), the model's size, the exchange's and
the merger's settings, and failures.  Typed and validated, the offender named; read from TOML
(sim/scenariofile.py) or built from presets (sim/presets.py).

Units: seconds, bits per second for links (as links are sold), bytes on the wire, parameters.
"""

from __future__ import annotations

import dataclasses
import math
import random

from dloco.cluster.sections import MergerSection
from dloco.merger.config import MergerConfig, SnapshotConfig
from dloco.protocol import CODEC_NAMES
from dloco.protocol.errors import require
from dloco.sim.quality import MEASURED, QualityCurve

# The merger's fold throughput when nothing better is known: coded delta bytes folded per second by
# one fold worker, as `dloco bench merger` measures it on a 2-core CPU machine, the sender on the
# same cores (BENCHMARKS.md, "Merger ingest").
DEFAULT_MERGER_BYTES_S = 0.25e9
# sync-DP's all-reduce overlaps the backward pass for all but the gradients computed last (the first
# layers'): PyTorch DDP's gradient buckets, each reduced as soon as it is complete.  The share of
# the gradient's exchange that can hide behind the backward pass (itself 2/3 of a step), when
# nothing better is known.
DEFAULT_DP_OVERLAP = 0.9


@dataclasses.dataclass(frozen=True)
class Link:
    # None: unlimited
    up_bps: float | None = None
    down_bps: float | None = None
    rtt_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("up_bps", "down_bps"):
            value = getattr(self, name)
            require(
                value is None or value > 0,
                f"link {name} must be > 0 bits/s or unlimited, got {value}",
            )
        require(self.rtt_s >= 0, f"link rtt_s must be >= 0, got {self.rtt_s}")

    def scaled(self, bps: float) -> Link:
        return dataclasses.replace(self, up_bps=bps, down_bps=bps)


@dataclasses.dataclass(frozen=True)
class Island:
    name: str
    # one inner step, on this island's chips
    step_s: float
    tokens_per_step: int
    link: Link = Link()
    # when its first step starts (joining, compiling)
    start_s: float = 0.0
    # the coefficient of variation of one step's time (0: every step exactly step_s)
    step_cv: float = 0.0
    # its own H (0: the scenario's)
    interval: int = 0
    # it starts holding the model (a checkpoint on its disk): no download before its first step
    holds_model: bool = False

    def __post_init__(self) -> None:
        require(bool(self.name), "an island needs a name")
        require(
            type(self.interval) is int and self.interval >= 0,
            f"island {self.name}: interval must be an int >= 0, got {self.interval!r}",
        )
        require(self.step_s > 0, f"island {self.name}: step_s must be > 0, got {self.step_s}")
        require(
            self.tokens_per_step >= 1,
            f"island {self.name}: tokens_per_step must be >= 1, got {self.tokens_per_step}",
        )
        require(self.start_s >= 0, f"island {self.name}: start_s must be >= 0, got {self.start_s}")
        require(
            0 <= self.step_cv <= 10,
            f"island {self.name}: step_cv must be in [0, 10], got {self.step_cv}",
        )


@dataclasses.dataclass(frozen=True)
class Failure:
    island: str
    # the island dies (kill -9: unsent work is lost)
    at_s: float
    # and is back this long after, joining again (a full snapshot down, restart_s to compile)
    down_s: float


@dataclasses.dataclass(frozen=True)
class Scenario:
    islands: tuple[Island, ...]
    # model parameters
    params: int
    # P
    fragments: int = 4
    # H
    interval: int = 48
    # the deltas' codec (uplink)
    codec: str = "int4"
    block: int = 256
    # the merger's settings, as a cluster file's [merger] gives them
    merger: MergerSection = MergerSection()
    # coded delta bytes one fold worker folds per second (None: DEFAULT_MERGER_BYTES_S, said so)
    merger_bytes_s: float | None = None
    # per fold, whatever its size (bookkeeping, the outer step's dispatch)
    fold_overhead_s: float = 0.002
    # merger processes, fragment p on shard p % shards, each with its own fold worker
    merger_shards: int = 1
    # the merger's own link, each way (deltas in, snapshots out to the broker); None: unlimited
    merger_link_bps: float | None = None
    # what a folded token is worth against the steps its delta covered (sim/quality.py)
    quality: QualityCurve = MEASURED
    # sync-DP: the share of its all-reduce that may hide behind the backward pass
    dp_overlap: float = DEFAULT_DP_OVERLAP
    # sync-DiLoCo's all-reduce codec ("": the scenario's `codec`; "bf16" as published)
    diloco_codec: str = ""
    # sync-DiLoCo's overlap depth tau: its exchange may hide behind tau inner steps of the next
    # round
    overlap_steps: int = 0
    duration_s: float = 3600.0
    # a restarted island's start-up (compiling), on top of downloading the model again
    restart_s: float = 60.0
    failures: tuple[Failure, ...] = ()
    # per fragment, (delta, snapshot on the bus, full snapshot) bytes on the wire when known exactly
    # (calibration encodes the run's real model); None: from `params` and the codecs (sim/engine.py)
    wire: tuple[tuple[int, int, int], ...] | None = None
    # of the step times' noise
    seed: int = 0

    def __post_init__(self) -> None:
        require(len(self.islands) >= 1, "a scenario needs at least one island")
        names = [island.name for island in self.islands]
        require(
            len(set(names)) == len(names),
            f"island names must be unique, got duplicates in {names[:8]}",
        )
        require(
            self.params >= self.fragments >= 1,
            f"params ({self.params}) must be >= fragments ({self.fragments}) >= 1",
        )
        require(
            self.interval >= self.fragments,
            f"interval H ({self.interval}) must be >= fragments P ({self.fragments})",
        )
        for island in self.islands:
            require(
                not island.interval or island.interval >= self.fragments,
                f"island {island.name}: interval H ({island.interval}) must be >= fragments P"
                f" ({self.fragments})",
            )
        require(
            self.codec in CODEC_NAMES, f"codec must be one of {CODEC_NAMES}, got {self.codec!r}"
        )
        require(
            (self.merger_bytes_s is None or self.merger_bytes_s > 0) and self.fold_overhead_s >= 0,
            "merger_gbps must be > 0 and fold_overhead_s >= 0",
        )
        require(
            type(self.merger_shards) is int and 1 <= self.merger_shards <= self.fragments,
            f"merger_shards must be an int in [1, fragments = {self.fragments}], got"
            f" {self.merger_shards!r}",
        )
        require(
            self.merger_link_bps is None or self.merger_link_bps > 0,
            f"merger_link_gbps must be > 0, got {self.merger_link_bps}",
        )
        require(0 <= self.dp_overlap <= 1, f"dp_overlap must be in [0, 1], got {self.dp_overlap}")
        require(
            self.diloco_codec in ("", *CODEC_NAMES),
            f"diloco_codec must be one of {CODEC_NAMES}, got {self.diloco_codec!r}",
        )
        require(
            type(self.overlap_steps) is int and self.overlap_steps >= 0,
            f"overlap_steps must be an int >= 0, got {self.overlap_steps!r}",
        )
        require(
            self.duration_s > 0 and self.restart_s >= 0, "duration_s must be > 0 and restart_s >= 0"
        )
        require(
            self.wire is None or len(self.wire) == self.fragments,
            f"wire needs one entry per fragment ({self.fragments})",
        )
        for failure in self.failures:
            require(failure.island in names, f"failure names unknown island {failure.island!r}")
            require(
                failure.at_s >= 0 and failure.down_s >= 0,
                f"failure of {failure.island}: at_s and down_s must be >= 0",
            )

    @property
    def math(self) -> MergerConfig:
        return self.merger.math()

    @property
    def snapshots(self) -> SnapshotConfig:
        return self.merger.snapshots()

    @property
    def fold_bytes_s(self) -> float:
        return DEFAULT_MERGER_BYTES_S if self.merger_bytes_s is None else self.merger_bytes_s

    @property
    def peak_tokens_s(self) -> float:
        return sum(island.tokens_per_step / island.step_s for island in self.islands)

    def with_links(self, bps: float, only: str | None = None) -> Scenario:
        """Every island's links (or only island `only`'s) at `bps` both ways, RTTs kept."""
        islands = tuple(
            dataclasses.replace(i, link=i.link.scaled(bps)) if only in (None, i.name) else i
            for i in self.islands
        )
        return dataclasses.replace(self, islands=islands)

    def longest_round_s(self) -> float:
        """The longest island round: its H (its own, else the scenario's) times its step."""
        return max((i.interval or self.interval) * i.step_s for i in self.islands)

    def with_mtbf(self, mtbf_s: float, down_s: float, seed: int = 0) -> Scenario:
        """Failures drawn per island from an exponential time between failures (mean `mtbf_s`),
        each down `down_s`; reproducible from `seed`.  mtbf_s = inf: none."""
        failures = []
        for index, island in enumerate(self.islands):
            rng, at = random.Random(seed * 1_000_003 + index), 0.0
            while math.isfinite(mtbf_s):
                at += rng.expovariate(1.0 / mtbf_s)
                if at >= self.duration_s:
                    break
                failures.append(Failure(island.name, at, down_s))
                at += down_s + self.restart_s
        return dataclasses.replace(self, failures=tuple(failures))


def step_seconds(
    params: float, tokens_per_step: float, chips: int, peak_flops: float, mfu: float
) -> float:
    """One step's time from its FLOPs: 6 N D (forward and backward of a dense Transformer) over the
    chips' peak times MFU."""
    require(
        chips >= 1 and peak_flops > 0 and 0 < mfu <= 1,
        f"chips ({chips}) >= 1, peak_flops > 0 and mfu in (0, 1], got mfu {mfu}",
    )
    return 6.0 * params * tokens_per_step / (chips * peak_flops * mfu)
