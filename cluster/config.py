"""The cluster file (TOML) and the ClusterConfig it loads: regions with their hardware and links,
model, sync and merger settings, the run's bounds, mode and chaos schedule.

Typed and frozen; unknown keys and out-of-range values are errors that name the key.  The sections
are the processes' own configurations, each checked by itself ([[regions]], [model] and [merger]
in cluster.sections; [sync] is the island's SyncConfig), so each default lives in one place;
ClusterConfig checks that they fit together under the run mode's overrides (cluster.modes).  The
shipped profile, `cluster/profiles/default.toml`, overrides them visibly (its comments document the
link scaling).
"""

# Over 400 lines: the cluster file's one schema, ClusterConfig with its checks across sections and
# the loader that reads and types each key, so that a key's default, type and check read together.

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path

from dloco.cliargs import field_names
from dloco.cluster.chaos import ChaosEvent, check, from_table, in_order, is_network
from dloco.cluster.cpuquota import quota_us
from dloco.cluster.modes import ALL_ISLANDS, MODES
from dloco.cluster.sections import MergerSection, ModelSection, Region
from dloco.island.config import MODEL_SIZES, SyncConfig, TrainConfig
from dloco.island.flags import SYNC_FLAGS
from dloco.protocol.errors import ConfigError, require

DEFAULT_PROFILE = Path(__file__).parent / "profiles" / "default.toml"


# processes and compose services
RESERVED_NAMES = frozenset(
    {
        "merger",
        "standby",
        "broker",
        "etcd",
        "evaluator",
        "prepare",
        "status",
        "prometheus",
        "grafana",
    }
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
    # the evaluator process (the merger's global model evaluated during the run, for the status
    # page and the report's global curve); false leaves it out: a model that fills the machine
    evaluator: bool = True
    seed: int = 0
    model: ModelSection = dataclasses.field(default_factory=ModelSection)
    # [task]: the task function's options, KEY = VALUE
    task_options: tuple[tuple[str, str | int | float | bool], ...] = ()
    # the island's own
    sync: SyncConfig = dataclasses.field(default_factory=SyncConfig)
    merger: MergerSection = dataclasses.field(default_factory=MergerSection)
    # kill -9 / restart schedule (cluster.chaos)
    chaos: tuple[ChaosEvent, ...] = ()
    # or a baseline: "sync-diloco", "sync-avg", "sync-dp" (in one process only; see MODES)
    mode: str = "decoupled"
    # [merger] settings over the mode's own (a suite's tuning of a baseline: sync-diloco's outer lr
    # and momentum), as (key, value) pairs
    mode_merger: tuple[tuple[str, object], ...] = ()
    # "section.key" of [model], [sync] and [merger] that the cluster file left to the processes'
    # own defaults (`dloco up` says where those differ from the shipped profile)
    defaulted: tuple[str, ...] = dataclasses.field(default=(), compare=False)
    # Cores a full-speed island may use (a CPU quota, cluster/cpuquota.py); a region's slowdown then
    # divides its quota instead of making it sleep.  0: no quota, slow regions sleep (their CPU goes
    # to the other processes of the machine).
    island_cpus: float = 0.0
    # "loopback": every process on 127.0.0.1; "netns": each host in a network namespace of its own
    # behind a router, where chaos can partition links and drop packets (cluster/netns.py; root)
    network: str = "loopback"

    def __post_init__(self) -> None:
        self._check_regions()
        self._check_run()
        self._check_sections()
        self._check_hosts()
        check(
            self.chaos,
            self.process_names,
            [r.name for r in self.regions],
            {p: r.processes for r in self.regions for p in r.processes},
        )
        self._check_mode_and_network()
        self._check_synchronisation()
        self._check_island_cpus()

    def _check_regions(self) -> None:
        """At least one region; names unique and none a name of the cluster's other processes."""
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

    def _check_run(self) -> None:
        """[run]'s bounds and evaluation settings, and [task]'s values."""
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
            type(self.eval_every) is int and self.eval_every >= 1,
            f"run.eval_every must be a positive int, got {self.eval_every!r}",
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
            type(self.evaluator) is bool,
            f"run.evaluator must be true or false, got {self.evaluator!r}",
        )
        require(
            all(
                type(k) is str and k.isidentifier() and type(v) in (str, int, float, bool)
                for k, v in self.task_options
            ),
            "[task] values must be strings, numbers or booleans under identifier keys, got"
            f" {dict(self.task_options)!r}",
        )

    def _check_sections(self) -> None:
        """[model], [sync] and [merger] are their dataclasses (checked by their own
        `__post_init__`)."""
        for name, kind in (
            ("model", ModelSection),
            ("sync", SyncConfig),
            ("merger", MergerSection),
        ):
            require(
                type(getattr(self, name)) is kind,
                f"ClusterConfig.{name} must be a {kind.__name__}, got {getattr(self, name)!r}",
            )

    def _check_hosts(self) -> None:
        """A region of several hosts: no eval trace, and a batch its hosts split evenly."""
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

    def _check_mode_and_network(self) -> None:
        """A known mode and network; the network's faults only on a network of namespaces."""
        require(self.mode in MODES, f"run.mode must be one of {sorted(MODES)}, got {self.mode!r}")
        require(
            self.network in NETWORKS, f"run.network must be one of {NETWORKS}, got {self.network!r}"
        )
        faults = [str(e) for e in self.chaos if is_network(e.action)]
        require(
            not faults or self.network == "netns",
            f'chaos {", ".join(faults[:3])}: faults of the network need run.network = "netns"',
        )

    def _check_synchronisation(self) -> None:
        """The settings after the mode's overrides fit together: shards, fragments, intervals,
        the run's steps and the synchronous modes' timeouts."""
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

    def _check_island_cpus(self) -> None:
        """run.island_cpus: a number of cores, and a quota the kernel can set for every region."""
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
            for key, value in {**mode.merger, **dict(self.mode_merger)}.items()
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
        return [
            *(p for r in self.regions for p in r.processes),
            *self.merger.processes,
            "broker",
            *(["etcd"] if self.merger.etcd else []),
        ]

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


# The keys a cluster file may set: those that reach the processes' command lines
# (cluster/topology.py).
# [run]'s keys and the type each takes (float: any number)
_RUN_TYPES = {
    "duration_s": float,
    "max_steps": int,
    "tokens": int,
    "eval_every": int,
    "eval_early": bool,
    "eval_trace": int,
    "evaluator": bool,
    "seed": int,
    "mode": str,
    "island_cpus": float,
    "network": str,
}
_RUN_KEYS = set(_RUN_TYPES)
NETWORKS = ("loopback", "netns")
# [sync]: the island's exchange flags but `blocking`, which the mode sets
SYNC_KEYS = set(field_names(SYNC_FLAGS)) - {"blocking"}
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
    _check_tables(path, data)
    region_keys = {f.name for f in dataclasses.fields(Region)}
    regions = []
    for entry in data.get("regions", []):
        extra = set(entry) - region_keys
        require(not extra, f"{path}: unknown keys in [[regions]]: {sorted(extra)}")
        try:
            regions.append(Region(**entry))
        except TypeError as error:
            raise ConfigError(f"{path}: bad [[regions]] entry {entry}: {error}") from None
    chaos = [from_table(path, entry) for entry in data.get("chaos", [])]
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
        evaluator=run.get("evaluator", defaults.evaluator),
        seed=int(run.get("seed", defaults.seed)),
        mode=str(run.get("mode", "decoupled")),
        island_cpus=run.get("island_cpus", defaults.island_cpus),
        network=run.get("network", defaults.network),
        model=_near(path, _section(path, "model", ModelSection, data)),
        task_options=tuple(sorted(data.get("task", {}).items())),
        sync=_section(path, "sync", SyncConfig, data),
        merger=_section(path, "merger", MergerSection, data),
        chaos=in_order(chaos),
        defaulted=tuple(
            f"{section}.{key}"
            for section in ("model", "sync", "merger")
            for key in sorted(_SECTIONS[section])
            if key not in data.get(section, {})
        ),
    )


def unlike_the_profile(config: ClusterConfig) -> list[str]:
    """The settings `config`'s file left to the processes' defaults where those differ from the
    shipped profile's (DiLoCo's H = 50 and outer lr 0.7 where the profile measured better), as
    `sync.interval = 50 (the profile: 12)`."""
    profile = load()
    found = []
    for name in config.defaulted:
        section, key = name.split(".")
        value, shipped = (getattr(getattr(c, section), key) for c in (config, profile))
        if section == "model" and value is None:
            # unset: the size preset's
            value = MODEL_SIZES[config.model.size or "tiny"].get(key)
        if value is not None and value != shipped:
            found.append(f"{name} = {value!r} (the profile: {shipped!r})")
    return found


def _check_tables(path: Path, data: dict) -> None:
    """Known sections, each a table (an array of tables: [[regions]], [[chaos]]) of known keys,
    [run]'s keys of their types."""
    require(
        isinstance(data.get("task", {}), dict),
        f"{path}: [task] must be a table of KEY = VALUE (the task itself is [model] task)",
    )
    for section in _SECTIONS:
        require(
            isinstance(data.get(section, {}), dict),
            f"{path}: [{section}] must be a table of KEY = VALUE, got {data.get(section)!r}",
        )
    for section in ("regions", "chaos"):
        entries = data.get(section, [])
        require(
            isinstance(entries, list) and all(isinstance(e, dict) for e in entries),
            f"{path}: [[{section}]] must be tables, got {entries!r}",
        )
    unknown = set(data) - set(_SECTIONS) - {"regions", "chaos", "task"}
    require(not unknown, f"{path}: unknown sections {sorted(unknown)}")
    for section, keys in _SECTIONS.items():
        extra = set(data.get(section, {})) - keys
        require(not extra, f"{path}: unknown keys in [{section}]: {sorted(extra)}")
    for key, value in data.get("run", {}).items():
        types, what = _KINDS[_RUN_TYPES[key]]
        require(type(value) in types, f"{path}: run.{key} must be {what}, got {value!r}")


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
