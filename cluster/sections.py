"""The cluster file's sections that describe one part of the cluster: a region ([[regions]]), what
the islands train ([model]) and the merger's settings ([merger]).

Typed and frozen, each checked in `__post_init__` with the key named.  [model] and [merger] take
their defaults and checks from the island's ModelConfig/TrainConfig and the merger's MergerConfig
and SnapshotConfig, so each default lives in one place; cluster.config joins the sections into a
ClusterConfig.
"""

from __future__ import annotations

import contextlib
import dataclasses

from dloco.island.config import MODEL_SIZES, ModelConfig, TrainConfig
from dloco.island.task import BUILTIN
from dloco.merger.config import MergeConfig, MergerConfig, OuterConfig, RoundConfig, SnapshotConfig
from dloco.merger.settings import ReplicationConfig, check_lease
from dloco.protocol.errors import ConfigError, require
from dloco.protocol.shards import names as shard_names


@dataclasses.dataclass(frozen=True)
class Region:
    name: str
    # each step takes this many times its compute (older hardware)
    slowdown: float = 1.0
    # None: unlimited
    uplink_mbps: float | None = None
    downlink_mbps: float | None = None
    rtt_ms: float = 0.0
    # processes of the island (jax.distributed, island/group.py): one per host of the region
    hosts: int = 1
    # H of this region's island (0: [sync] interval); the synchronous modes give every island theirs
    interval: int = 0

    def __post_init__(self) -> None:
        require(
            type(self.name) is str and self.name.replace("-", "").replace("_", "").isalnum(),
            f"region name must be letters, digits, '-' or '_', got {self.name!r}",
        )
        for key in ("slowdown", "uplink_mbps", "downlink_mbps", "rtt_ms"):
            value = getattr(self, key)
            require(
                type(value) in (int, float) or (value is None and key.endswith("_mbps")),
                f"region {self.name}: {key} must be a number, got {value!r}",
            )
        require(
            type(self.hosts) is int and 1 <= self.hosts <= 64,
            f"region {self.name}: hosts must be an int in [1, 64], got {self.hosts!r}",
        )
        require(
            self.slowdown >= 1, f"region {self.name}: slowdown must be >= 1, got {self.slowdown}"
        )
        for key in ("uplink_mbps", "downlink_mbps"):
            value = getattr(self, key)
            require(
                value is None or value > 0, f"region {self.name}: {key} must be > 0, got {value}"
            )
        require(self.rtt_ms >= 0, f"region {self.name}: rtt_ms must be >= 0, got {self.rtt_ms}")
        require(
            type(self.interval) is int and self.interval >= 0,
            f"region {self.name}: interval must be an int >= 0 (0: [sync] interval), got"
            f" {self.interval!r}",
        )

    @property
    def processes(self) -> list[str]:
        """The island's process names: the region's own (process 0, which holds the bus links),
        then `NAME.1`, `NAME.2`, ... for the other hosts."""
        return [self.name, *(f"{self.name}.{index}" for index in range(1, self.hosts))]


_MODEL_FIELDS = {field.name for field in dataclasses.fields(ModelConfig)}


@contextlib.contextmanager
def _section_named(section: str):
    """A process config's error names its own key (`round.quorum`): say which section of the cluster
    file set it."""
    try:
        yield
    except ConfigError as error:
        raise ConfigError(f"[{section}] {error}") from None


@dataclasses.dataclass(frozen=True)
class ModelSection:
    """[model]: what the islands train and their batch.  `task` names the task function
    (island/task.py; a relative PATH.py is the cluster file's neighbour); size, width, ... corpus
    and tokens are the built-in LM's options (island/bytelm.py), unset: the preset's or the data's.
    Other tasks take their options from [task]."""

    task: str = BUILTIN
    size: str | None = None
    width: int | None = None
    depth: int | None = None
    heads: int | None = None
    # tokens (bytes) per sequence
    context: int | None = None
    vocab: int | None = None
    corpus: str | None = None
    tokens: str | None = None
    # sequences (examples) per step
    batch: int = TrainConfig.batch
    # the islands' peak inner learning rate (None: TrainConfig's); in mode sync-dp, the one
    # optimizer's at the global batch
    lr: float | None = None

    def __post_init__(self) -> None:
        require(
            type(self.task) is str and ":" in self.task,
            f"model.task must be 'PATH.py:FUNCTION' or 'MODULE:FUNCTION', got {self.task!r}",
        )
        for key in ("size", "corpus", "tokens"):
            require(
                getattr(self, key) is None or type(getattr(self, key)) is str,
                f"model.{key} must be a string, got {getattr(self, key)!r}",
            )
        for key in ("width", "depth", "heads", "context", "vocab", "batch"):
            value = getattr(self, key)
            require(
                value is None or (type(value) is int and value >= 1),
                f"model.{key} must be a positive int, got {value!r}",
            )
        require(
            self.lr is None or (type(self.lr) in (int, float) and 0 < self.lr < 1),
            f"model.lr must be a number in (0, 1), got {self.lr!r}",
        )
        require(
            self.size is None or self.size in MODEL_SIZES,
            f"model.size must be one of {sorted(MODEL_SIZES)}, got {self.size!r}",
        )
        require(
            not (self.corpus and self.tokens),
            "model: give corpus (text) or tokens (a token file), not both",
        )
        require(
            self.task == BUILTIN or not self.lm_options(),
            f"model: {sorted(self.lm_options())} are the built-in LM's options; "
            f"task {self.task} takes its options from [task]",
        )
        with _section_named("model"):
            # the shape alone (the data's vocabulary is checked when an island loads it)
            if self.task == BUILTIN:
                preset = {
                    **MODEL_SIZES[self.size or "tiny"],
                    **{k: v for k, v in self.lm_options().items() if k in _MODEL_FIELDS},
                }
                ModelConfig(**preset)
            TrainConfig(batch=self.batch)

    def lm_options(self) -> dict:
        """The built-in LM's options that are set."""
        return {
            key: getattr(self, key)
            for key in ("size", "width", "depth", "heads", "context", "vocab", "corpus", "tokens")
            if getattr(self, key) is not None
        }


@dataclasses.dataclass(frozen=True)
class MergerSection:
    """[merger]: the merger's command line, one flat section.  Defaults and checks are the merger's
    own: MergerConfig's merge, outer and round parts, and SnapshotConfig."""

    # S, in versions
    max_staleness: int = MergeConfig.max_staleness
    merge: str = MergeConfig.method
    share_window: int = MergeConfig.share_window
    outer: str = OuterConfig.kind
    outer_lr: float = OuterConfig.lr
    outer_momentum: float = OuterConfig.momentum
    # delayed_nesterov: momentum once per N folds
    delay: int = OuterConfig.delay
    # float32 | bfloat16: the outer momentum's storage
    momentum_dtype: str = OuterConfig.momentum_dtype
    # K: islands
    quorum: int = RoundConfig.quorum
    quorum_timeout_s: float = RoundConfig.quorum_timeout_s
    grace_cap_s: float = RoundConfig.grace_cap_s
    # a fresh merger's first fold waits at most this long for a second island
    # (merger/fold/outliers.py)
    cold_wait_s: float = RoundConfig.cold_wait_s
    snapshot_codec: str = SnapshotConfig.snapshot_codec
    snapshot_diff_codec: str = SnapshotConfig.snapshot_diff_codec
    snapshot_full_every: int = SnapshotConfig.snapshot_full_every
    snapshot_every_round: float = SnapshotConfig.snapshot_every_round
    # fp32 | bf16: what the merger and the islands hold the served value in
    served_dtype: str = SnapshotConfig.served_dtype
    # a hot standby merger beside the primary (PROTOCOL.md §12)
    standby: bool = False
    # with a standby: sync | async
    replication: str = "sync"
    lease_s: float = ReplicationConfig.lease_s
    # with a standby, who decides the primary: "etcd" (a lease key in etcd, which dloco up starts
    # beside the broker: merger/replication/consensus.py) or "lease" (the pair's own lease, which a
    # standby cut off from everyone cannot tell from a dead primary: PROTOCOL.md §12)
    failover: str = "etcd"
    # merger processes, each folding the fragments f with f % shards == its index
    # (protocol/shards.py)
    shards: int = 1

    def __post_init__(self) -> None:
        require(
            type(self.standby) is bool,
            f"merger.standby must be true or false, got {self.standby!r}",
        )
        require(
            type(self.shards) is int and 1 <= self.shards <= 64,
            f"merger.shards must be an int in [1, 64], got {self.shards!r}",
        )
        require(
            self.replication in ("sync", "async"),
            f"merger.replication must be sync or async, got {self.replication!r}",
        )
        require(
            self.failover in ("lease", "etcd"),
            f"merger.failover must be lease or etcd, got {self.failover!r}",
        )
        check_lease(self.lease_s, "merger.lease_s")
        timeout = self.quorum_timeout_s
        require(
            type(timeout) in (int, float) and 0 < timeout < float("inf"),
            f"merger.quorum_timeout_s must be a number of seconds > 0, got {timeout!r}",
        )
        with _section_named("merger"):
            self.math()
        self.snapshots()

    @property
    def processes(self) -> list[str]:
        """The merger's process names: `merger` (shard 0), `merger.1`, ...; then, with a standby
        per shard, `standby`, `standby.1`, ..."""
        return [
            *shard_names("merger", self.shards),
            *(shard_names("standby", self.shards) if self.standby else []),
        ]

    @property
    def etcd(self) -> bool:
        return self.standby and self.failover == "etcd"

    def snapshots(self) -> SnapshotConfig:
        """The merger's SnapshotConfig these settings give."""
        return SnapshotConfig(
            self.snapshot_codec,
            self.snapshot_diff_codec,
            self.snapshot_full_every,
            self.snapshot_every_round,
            self.served_dtype,
        )

    def math(self) -> MergerConfig:
        """The merger's MergerConfig these settings give."""
        return MergerConfig(
            MergeConfig(
                method=self.merge, max_staleness=self.max_staleness, share_window=self.share_window
            ),
            OuterConfig(
                kind=self.outer,
                lr=self.outer_lr,
                momentum=self.outer_momentum,
                delay=self.delay,
                momentum_dtype=self.momentum_dtype,
            ),
            RoundConfig(
                quorum=self.quorum,
                quorum_timeout_s=self.quorum_timeout_s,
                grace_cap_s=self.grace_cap_s,
                cold_wait_s=self.cold_wait_s,
            ),
        )
