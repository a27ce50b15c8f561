"""The cluster file (TOML): regions with their hardware and links, model, sync and merger settings.

Typed and frozen; unknown keys and out-of-range values are errors that name the key.  The sections
are the processes' own configurations: [sync] is the island's SyncConfig, [model] and [merger] take
their defaults and checks from the island's ModelConfig/TrainConfig and the merger's MergerConfig
and SnapshotConfig, so each default lives in one place.  The shipped profile,
`cluster/profiles/default.toml`, overrides them visibly (its comments document the link scaling).
"""

from __future__ import annotations

import contextlib
import dataclasses
import tomllib
from pathlib import Path

from dloco.cluster.chaos import ChaosEvent, check, in_order, is_network
from dloco.cluster.cpuquota import quota_us
from dloco.island.config import MODEL_SIZES, ModelConfig, SyncConfig, TrainConfig
from dloco.island.task import BUILTIN
from dloco.merger.config import MergeConfig, MergerConfig, OuterConfig, RoundConfig, SnapshotConfig
from dloco.merger.replication_wire import ReplicationConfig, check_lease
from dloco.protocol.errors import ConfigError, require
from dloco.protocol.shards import names as shard_names

DEFAULT_PROFILE = Path(__file__).parent / "profiles" / "default.toml"


# processes and compose services
RESERVED_NAMES = frozenset(
    {"merger", "standby", "broker", "evaluator", "prepare", "status", "prometheus", "grafana"}
)


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
            self.name.replace("-", "").replace("_", "").isalnum(),
            f"region name must be letters, digits, '-' or '_', got {self.name!r}",
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
    # delayed_nesterov: momentum once per N folds
    delay: int = OuterConfig.delay
    # K: islands
    quorum: int = RoundConfig.quorum
    quorum_timeout_s: float = RoundConfig.quorum_timeout_s
    grace_cap_s: float = RoundConfig.grace_cap_s
    snapshot_codec: str = SnapshotConfig.snapshot_codec
    snapshot_diff_codec: str = SnapshotConfig.snapshot_diff_codec
    snapshot_full_every: int = SnapshotConfig.snapshot_full_every
    snapshot_every_round: float = SnapshotConfig.snapshot_every_round
    # a hot standby merger beside the primary (PROTOCOL.md §12)
    standby: bool = False
    # with a standby: sync | async
    replication: str = "sync"
    lease_s: float = ReplicationConfig.lease_s
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
            self.shards == 1 or not self.standby,
            "merger.standby with merger.shards > 1: a standby per shard is not built yet;"
            " choose one",
        )
        require(
            self.replication in ("sync", "async"),
            f"merger.replication must be sync or async, got {self.replication!r}",
        )
        check_lease(self.lease_s, "merger.lease_s")
        timeout = self.quorum_timeout_s
        require(
            type(timeout) in (int, float) and 0 < timeout < float("inf"),
            f"merger.quorum_timeout_s must be a number of seconds > 0, got {timeout!r}",
        )
        with _section_named("merger"):
            self.math()
        SnapshotConfig(
            self.snapshot_codec,
            self.snapshot_diff_codec,
            self.snapshot_full_every,
            self.snapshot_every_round,
        )

    @property
    def processes(self) -> list[str]:
        """The merger's process names: `merger` (shard 0), `merger.1`, ...; then `standby`."""
        return [*shard_names("merger", self.shards), *(["standby"] if self.standby else [])]

    def math(self) -> MergerConfig:
        """The merger's MergerConfig these settings give (the outer momentum is the merger's
        default)."""
        return MergerConfig(
            MergeConfig(
                method=self.merge, max_staleness=self.max_staleness, share_window=self.share_window
            ),
            OuterConfig(kind=self.outer, lr=self.outer_lr, delay=self.delay),
            RoundConfig(
                quorum=self.quorum,
                quorum_timeout_s=self.quorum_timeout_s,
                grace_cap_s=self.grace_cap_s,
            ),
        )


@dataclasses.dataclass(frozen=True)
class ClusterConfig:
    regions: tuple[Region, ...]
    # the run's length; with max_steps, a limit: a run still going then has failed
    duration_s: float = 300.0
    # the run ends once every island has trained this many steps (every life) and the chaos has run
    # (0: after duration_s)
    max_steps: int = 0
    # a budget: the run ends once the cluster has trained this many tokens (every island, every
    # life) and the chaos has run; the islands' schedules decay over it (0: none)
    tokens: int = 0
    eval_every: int = TrainConfig.eval_every
    # islands also evaluate at steps 1, 2, 4, ...
    eval_early: bool = False
    # islands evaluate their first N steps after training (island --eval-trace; the experiment
    # suites use it)
    eval_trace: int = 0
    seed: int = 0
    model: ModelSection = dataclasses.field(default_factory=ModelSection)
    # [task]: the task function's options, KEY = VALUE
    task_options: tuple[tuple[str, str | int | float | bool], ...] = ()
    # the island's own
    sync: SyncConfig = dataclasses.field(default_factory=SyncConfig)
    merger: MergerSection = dataclasses.field(default_factory=MergerSection)
    # kill -9 / restart schedule (cluster.chaos)
    chaos: tuple[ChaosEvent, ...] = ()
    # or a synchronous baseline: "sync-diloco", "sync-dp" (see MODES)
    mode: str = "decoupled"
    # Cores a full-speed island may use (a CPU quota, cluster/cpuquota.py); a region's slowdown then
    # divides its quota instead of making it sleep.  0: no quota, slow regions sleep (their CPU goes
    # to the other processes of the machine).
    island_cpus: float = 0.0
    # "loopback": every process on 127.0.0.1; "netns": each host in a network namespace of its own
    # behind a router, where chaos can partition links and drop packets (cluster/netns.py; root)
    network: str = "loopback"

    def __post_init__(self) -> None:
        require(len(self.regions) >= 1, "a cluster needs at least one region")
        require(
            len({r.name for r in self.regions}) == len(self.regions), "region names must be unique"
        )
        taken = sorted({r.name for r in self.regions} & RESERVED_NAMES)
        require(
            not taken,
            f"{', '.join(map(repr, taken))}: not a region name (the cluster's other processes and"
            f" services: {', '.join(sorted(RESERVED_NAMES))})",
        )
        require(self.duration_s > 0, f"run.duration_s must be > 0, got {self.duration_s}")
        require(
            type(self.max_steps) is int and self.max_steps >= 0,
            f"run.max_steps must be an int >= 0, got {self.max_steps!r}",
        )
        require(
            type(self.tokens) is int and self.tokens >= 0,
            f"run.tokens must be an int >= 0, got {self.tokens!r}",
        )
        require(
            not (self.tokens and self.max_steps),
            "run.tokens and run.max_steps both bound the run: give one",
        )
        require(
            type(self.eval_early) is bool,
            f"run.eval_early must be true or false, got {self.eval_early!r}",
        )
        require(
            type(self.eval_trace) is int and self.eval_trace >= 0,
            f"run.eval_trace must be an int >= 0, got {self.eval_trace!r}",
        )
        require(
            all(
                type(k) is str and k.isidentifier() and type(v) in (str, int, float, bool)
                for k, v in self.task_options
            ),
            "[task] values must be strings, numbers or booleans under identifier keys, got"
            f" {dict(self.task_options)!r}",
        )
        for name, kind in (
            ("model", ModelSection),
            ("sync", SyncConfig),
            ("merger", MergerSection),
        ):
            require(
                type(getattr(self, name)) is kind,
                f"ClusterConfig.{name} must be a {kind.__name__}, got {getattr(self, name)!r}",
            )
        for region in self.regions:
            require(
                region.hosts == 1 or not self.eval_trace,
                f"region {region.name}: run.eval_trace is for an island of one process (hosts ="
                f" {region.hosts})",
            )
            require(
                self.model.batch % region.hosts == 0,
                f"region {region.name}: model.batch ({self.model.batch}) must be divisible by its"
                f" hosts ({region.hosts}): each takes an equal part",
            )
        check(
            self.chaos,
            self.process_names,
            [r.name for r in self.regions],
            {p: r.processes for r in self.regions for p in r.processes},
        )
        require(self.mode in MODES, f"run.mode must be one of {sorted(MODES)}, got {self.mode!r}")
        require(
            self.network in NETWORKS, f"run.network must be one of {NETWORKS}, got {self.network!r}"
        )
        faults = [str(e) for e in self.chaos if is_network(e.action)]
        require(
            not faults or self.network == "netns",
            f'chaos {", ".join(faults[:3])}: faults of the network need run.network = "netns"',
        )
        sync, merger = self.effective()
        require(
            merger.shards <= sync.fragments,
            f"merger.shards ({merger.shards}) must not exceed sync.fragments ({sync.fragments} in"
            f" mode {self.mode}): a shard folds the fragments f with f % shards == its index, and"
            " each needs one",
        )
        for region in self.regions:
            require(
                not region.interval or region.interval >= sync.fragments,
                f"region {region.name}: interval ({region.interval}) must be >= sync.fragments"
                f" ({sync.fragments}): each fragment is due once per interval",
            )
        longest = max(self.interval_of(region) for region in self.regions)
        require(
            not self.max_steps or self.max_steps >= longest,
            f"run.max_steps ({self.max_steps}) must be at least the longest interval (H = {longest}"
            f" in mode {self.mode}): an island that stops sooner never sends every fragment",
        )
        require(
            not sync.blocking or sync.settle_timeout_s > merger.quorum_timeout_s,
            f"sync.settle_timeout_s ({sync.settle_timeout_s}) must exceed merger.quorum_timeout_s"
            f" ({merger.quorum_timeout_s}) in mode {self.mode}: an island would stop waiting for a"
            " round the merger still waits to complete",
        )
        cpus = self.island_cpus
        require(
            type(cpus) in (int, float) and 0 <= cpus < float("inf"),
            f"run.island_cpus must be a number of cores >= 0, got {cpus!r}",
        )
        for region in self.regions if cpus else ():
            try:
                quota_us(self.cpus_of(region))
            except ValueError as error:
                raise ConfigError(
                    f"run.island_cpus = {cpus} for region {region.name} (slowdown"
                    f" {region.slowdown}): {error}"
                ) from None

    def effective(self) -> tuple[SyncConfig, MergerSection]:
        """(sync, merger) settings after the mode's overrides (MODES)."""
        mode = MODES[self.mode]
        merger = {
            key: len(self.regions) if value == ALL_ISLANDS else value
            for key, value in mode.merger.items()
        }
        return dataclasses.replace(self.sync, **mode.sync), dataclasses.replace(
            self.merger, **merger
        )

    def interval_of(self, region: Region) -> int:
        """H of `region`'s island: its own interval in the decoupled mode; the [sync] interval
        otherwise (a synchronous mode's rounds need one H, which it sets for every island as it sets
        P)."""
        return (
            region.interval
            if region.interval and self.mode == "decoupled"
            else self.effective()[0].interval
        )

    def cpus_of(self, region: Region) -> float | None:
        """The cores `region`'s island may use (None: no quota)."""
        return self.island_cpus / region.slowdown if self.island_cpus else None

    @property
    def process_names(self) -> list[str]:
        return [p for r in self.regions for p in r.processes] + [*self.merger.processes, "broker"]

    def with_duration(self, seconds: float | None) -> ClusterConfig:
        return self if seconds is None else dataclasses.replace(self, duration_s=seconds)

    def with_steps(self, steps: int | None) -> ClusterConfig:
        return self if steps is None else dataclasses.replace(self, max_steps=steps)

    def with_tokens(self, tokens: int | None) -> ClusterConfig:
        return self if tokens is None else dataclasses.replace(self, tokens=tokens, max_steps=0)

    def with_mode(self, mode: str | None) -> ClusterConfig:
        return self if mode is None else dataclasses.replace(self, mode=mode)

    def with_chaos(self, schedule: tuple[ChaosEvent, ...] | None) -> ClusterConfig:
        return self if schedule is None else dataclasses.replace(self, chaos=schedule)


# The run modes: the same islands, links and corpus; only how they synchronise differs.
# sync-diloco: classic DiLoCo — the whole model (P = 1) every H steps, every island blocks until the
#   merger has all N deltas and returns the new global model.
# Both synchronous modes fold every island's delta at once with a whole outer step (share_window 0),
# as classic DiLoCo and data parallelism do (sync-diloco with DiLoCo's Nesterov at lr 0.7, whatever
# the profile sets for decoupled folds), and publish every fold at once (snapshot_every_round 0):
# their islands wait for it.  A round waits for every island up to the quorum timeout (30 s): at
# H = 48 the half-speed islands finish ~25 s after the fast ones, inside it; at H = 96 (~50 s) a
# round would go on without them, so H = 96 in a synchronous mode is not classic DiLoCo here.  (A
# longer timeout alone does not help: an island gives up waiting for its delta's fold after 60 s and
# trains on; the quorum counts islands, so its next delta does not complete a round without the
# slow ones, but the round still waits only up to the timeout.)
# sync-dp: a stand-in for data-parallel all-reduce — every step each island sends its full fp32
#   change and blocks until the merger returns the average (outer SGD, lr 1: the new global model is
#   the mean of the islands' models), so the bytes and the barrier per step are those of an
#   all-reduce of fp32 gradients.
@dataclasses.dataclass(frozen=True)
class Mode:
    """A run mode's overrides of the [sync] and [merger] sections (dataclasses.replace
    arguments)."""

    sync: dict = dataclasses.field(default_factory=dict)
    # quorum ALL_ISLANDS: the cluster's number of islands
    merger: dict = dataclasses.field(default_factory=dict)


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
        },
    ),
    "sync-dp": Mode(
        sync={"fragments": 1, "interval": 1, "codec": "fp32", "blocking": True},
        merger={
            "quorum": ALL_ISLANDS,
            "grace_cap_s": 0.0,
            "merge": "average",
            "outer": "sgd",
            "outer_lr": 1.0,
            "snapshot_codec": "fp32",
            "snapshot_diff_codec": "none",
            "share_window": 0,
            "snapshot_every_round": 0.0,
        },
    ),
}

# The keys a cluster file may set: those that reach the processes' command lines
# (cluster/topology.py).
_RUN_KEYS = {
    "duration_s",
    "max_steps",
    "tokens",
    "eval_every",
    "eval_early",
    "eval_trace",
    "seed",
    "mode",
    "island_cpus",
    "network",
}
NETWORKS = ("loopback", "netns")
SYNC_KEYS = {
    "fragments",
    "interval",
    "codec",
    "adoption",
    "alpha",
    "error_feedback",
    "flush_on_leave",
    "settle_timeout_s",
}
_SECTIONS = {
    "run": _RUN_KEYS,
    "model": {f.name for f in dataclasses.fields(ModelSection)},
    "sync": SYNC_KEYS,
    "merger": {f.name for f in dataclasses.fields(MergerSection)},
}


def load(path: str | Path | None = None) -> ClusterConfig:
    path = Path(path) if path is not None else DEFAULT_PROFILE
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as error:
        raise ConfigError(f"cannot read cluster file {path}: {error}") from None
    unknown = set(data) - set(_SECTIONS) - {"regions", "chaos", "task"}
    require(
        isinstance(data.get("task", {}), dict),
        f"{path}: [task] must be a table of KEY = VALUE (the task itself is [model] task)",
    )
    require(not unknown, f"{path}: unknown sections {sorted(unknown)}")
    for section, keys in _SECTIONS.items():
        extra = set(data.get(section, {})) - keys
        require(not extra, f"{path}: unknown keys in [{section}]: {sorted(extra)}")
    region_keys = {f.name for f in dataclasses.fields(Region)}
    regions = []
    for entry in data.get("regions", []):
        extra = set(entry) - region_keys
        require(not extra, f"{path}: unknown keys in [[regions]]: {sorted(extra)}")
        try:
            regions.append(Region(**entry))
        except TypeError as error:
            raise ConfigError(f"{path}: bad [[regions]] entry {entry}: {error}") from None
    chaos = [_chaos_event(path, entry) for entry in data.get("chaos", [])]
    defaults = ClusterConfig(regions=(Region("x"),))
    run = data.get("run", {})
    return ClusterConfig(
        regions=tuple(regions),
        duration_s=float(run.get("duration_s", defaults.duration_s)),
        max_steps=run.get("max_steps", defaults.max_steps),
        tokens=run.get("tokens", defaults.tokens),
        eval_every=int(run.get("eval_every", defaults.eval_every)),
        eval_early=run.get("eval_early", defaults.eval_early),
        eval_trace=run.get("eval_trace", defaults.eval_trace),
        seed=int(run.get("seed", defaults.seed)),
        mode=str(run.get("mode", "decoupled")),
        island_cpus=run.get("island_cpus", defaults.island_cpus),
        network=run.get("network", defaults.network),
        model=_near(path, _section(path, "model", ModelSection, data)),
        task_options=tuple(sorted(data.get("task", {}).items())),
        sync=_section(path, "sync", SyncConfig, data),
        merger=_section(path, "merger", MergerSection, data),
        chaos=in_order(chaos),
    )


def _near(path: Path, model: ModelSection) -> ModelSection:
    """Relative paths in [model] (a task file, corpus, tokens) are the cluster file's neighbours."""

    def near(value: str) -> str:
        return value if Path(value).is_absolute() else str((path.parent / value).resolve())

    where, sep, function = model.task.rpartition(":")
    task = f"{near(where)}:{function}" if where.endswith(".py") else model.task
    return dataclasses.replace(
        model,
        task=task,
        corpus=model.corpus and near(model.corpus),
        tokens=model.tokens and near(model.tokens),
    )


_KINDS = {
    bool: ((bool,), "true or false"),
    int: ((int,), "an int"),
    float: ((int, float), "a number"),
    str: ((str,), "a string"),
}


def _section(path: Path, name: str, kind: type, data: dict):
    """A section of the cluster file as its dataclass: the keys it sets over the dataclass's
    defaults, checked by the dataclass; a value of a type its checks cannot compare is named
    here."""
    values = data.get(name, {})
    try:
        return kind(**values)
    except TypeError:
        for key, value in values.items():
            types, what = _KINDS[type(getattr(kind, key))]
            require(type(value) in types, f"{path}: {name}.{key} must be {what}, got {value!r}")
        raise


_CHAOS_POINTS = {"at_s", "at_step", "at_folds"}


def _chaos_event(path: Path, entry: dict) -> ChaosEvent:
    """A [[chaos]] table: action, target and one point (at_s, or at_step or at_folds with an
    optional island), `relative = true` to count it from the event before."""
    points = _CHAOS_POINTS & set(entry)
    allowed = {"action", "target", *_CHAOS_POINTS, "island", "relative"}
    require(
        {"action", "target"} <= set(entry)
        and len(points) == 1
        and set(entry) <= allowed
        and ("island" not in entry or "at_s" not in entry),
        f"{path}: a [[chaos]] entry needs action, target and one of at_s, at_step or at_folds (the"
        f" last two with an optional island) (and optionally relative), got {sorted(entry)}",
    )
    relative = entry.get("relative", False)
    (point,) = points
    value = entry[point]
    if point == "at_s":
        require(
            type(value) in (int, float),
            f"{path}: [[chaos]] at_s must be a number of seconds, got {value!r}",
        )
        return ChaosEvent(
            float(value), str(entry["action"]), str(entry["target"]), relative=relative
        )
    require(type(value) is int, f"{path}: [[chaos]] {point} must be an int, got {value!r}")
    return ChaosEvent(
        None,
        str(entry["action"]),
        str(entry["target"]),
        **{point: value},
        island=str(entry["island"]) if "island" in entry else None,
        relative=relative,
    )
