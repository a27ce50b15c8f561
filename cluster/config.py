"""The cluster file (TOML): regions with their hardware and links, model, sync and merger settings.

Typed and frozen; unknown keys and out-of-range values are errors that name the key.  The shipped
default is `cluster/profiles/default.toml` (its comments document the link scaling).
"""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path

from cluster.chaos import ChaosEvent, check, in_order
from cluster.cpuquota import quota_us
from island.config import SyncConfig
from merger.config import FULL_SNAPSHOT_CODECS
from protocol import CODEC_NAMES
from protocol.errors import ConfigError, require

DEFAULT_PROFILE = Path(__file__).parent / "profiles" / "default.toml"


@dataclasses.dataclass(frozen=True)
class Region:
    name: str
    slowdown: float = 1.0  # each step takes this many times its compute (older hardware)
    uplink_mbps: float | None = None  # None: unlimited
    downlink_mbps: float | None = None
    rtt_ms: float = 0.0

    def __post_init__(self) -> None:
        require(self.name.replace("-", "").replace("_", "").isalnum(), f"region name must be letters, digits, '-' or '_', got {self.name!r}")
        require(self.slowdown >= 1, f"region {self.name}: slowdown must be >= 1, got {self.slowdown}")
        for key in ("uplink_mbps", "downlink_mbps"):
            value = getattr(self, key)
            require(value is None or value > 0, f"region {self.name}: {key} must be > 0, got {value}")
        require(self.rtt_ms >= 0, f"region {self.name}: rtt_ms must be >= 0, got {self.rtt_ms}")


@dataclasses.dataclass(frozen=True)
class ClusterConfig:
    regions: tuple[Region, ...]
    duration_s: float = 300.0  # the run's length; with max_steps, a limit: a run still going then has failed
    max_steps: int = 0  # the run ends once every island has trained this many steps (every life) and the chaos has run (0: after duration_s)
    eval_every: int = 50
    eval_early: bool = False  # islands also evaluate at steps 1, 2, 4, ...
    eval_trace: int = 0  # islands evaluate their first N steps after training (island --eval-trace; the experiment suites use it)
    seed: int = 0
    model: dict = dataclasses.field(default_factory=lambda: {"width": 128, "depth": 4, "heads": 4, "context": 128, "batch": 16})
    sync: dict = dataclasses.field(default_factory=lambda: {"fragments": 4, "interval": 48, "codec": "int4", "adoption": "rebase", "alpha": 0.0,
                                                            "error_feedback": False})
    merger: dict = dataclasses.field(default_factory=lambda: {"max_staleness": 4, "quorum": 1, "grace_cap_s": 1.0, "outer": "nesterov",
                                                              "outer_lr": 0.35, "snapshot_codec": "bf16", "merge": "rda",
                                                              "quorum_timeout_s": 30.0, "delay": 4,
                                                              "snapshot_diff_codec": "int4", "snapshot_full_every": 0, "share_window": 8,
                                                              "snapshot_every_round": 0.0})
    chaos: tuple[ChaosEvent, ...] = ()  # kill -9 / restart schedule (cluster.chaos)
    mode: str = "decoupled"  # or a synchronous baseline: "sync-diloco", "sync-dp" (see MODES)
    # Cores a full-speed island may use (a CPU quota, cluster/cpuquota.py); a region's slowdown then
    # divides its quota instead of making it sleep.  0: no quota, slow regions sleep (their CPU goes
    # to the other processes of the machine).
    island_cpus: float = 0.0

    def __post_init__(self) -> None:
        require(len(self.regions) >= 1, "a cluster needs at least one region")
        require(len({r.name for r in self.regions}) == len(self.regions), "region names must be unique")
        require(not {r.name for r in self.regions} & {"merger", "broker"}, "'merger' and 'broker' are not region names")
        require(self.duration_s > 0, f"run.duration_s must be > 0, got {self.duration_s}")
        require(type(self.max_steps) is int and self.max_steps >= 0, f"run.max_steps must be an int >= 0, got {self.max_steps!r}")
        require(type(self.eval_early) is bool, f"run.eval_early must be true or false, got {self.eval_early!r}")
        require(type(self.eval_trace) is int and self.eval_trace >= 0, f"run.eval_trace must be an int >= 0, got {self.eval_trace!r}")
        SyncConfig(**self.sync)  # the island's own checks (codec, adoption and alpha, H >= P, ...), with its messages
        check(self.chaos, self.process_names, [r.name for r in self.regions])
        require(self.mode in MODES, f"run.mode must be one of {sorted(MODES)}, got {self.mode!r}")
        sync, merger = self.effective()
        require(not self.max_steps or self.max_steps >= sync["interval"],
                f"run.max_steps ({self.max_steps}) must be at least sync.interval (H = {sync['interval']} in mode {self.mode}): "
                "an island that stops sooner never sends every fragment")
        quorum = merger["quorum_timeout_s"]
        require(type(quorum) in (int, float) and 0 < quorum < float("inf"), f"merger.quorum_timeout_s must be a number of seconds > 0, got {quorum!r}")
        settle = sync.get("settle_timeout_s", SyncConfig.settle_timeout_s)
        require(not sync.get("blocking") or settle > merger["quorum_timeout_s"],
                f"sync.settle_timeout_s ({settle}) must exceed merger.quorum_timeout_s ({merger['quorum_timeout_s']}) "
                f"in mode {self.mode}: an island would stop waiting for a round the merger still waits to complete")
        cpus = self.island_cpus
        require(type(cpus) in (int, float) and 0 <= cpus < float("inf"), f"run.island_cpus must be a number of cores >= 0, got {cpus!r}")
        for region in self.regions if cpus else ():
            try:
                quota_us(self.cpus_of(region))
            except ValueError as error:
                raise ConfigError(f"run.island_cpus = {cpus} for region {region.name} (slowdown {region.slowdown}): {error}") from None
        require(self.merger["snapshot_codec"] in FULL_SNAPSHOT_CODECS,
                f"merger.snapshot_codec must be one of {FULL_SNAPSHOT_CODECS}, got {self.merger['snapshot_codec']!r}")
        require(self.merger["snapshot_codec"] != "int8" or self.merger["snapshot_diff_codec"] != "none",
                "merger.snapshot_codec = 'int8' needs merger.snapshot_diff_codec: without diffs nothing carries its error away")
        diff = self.merger["snapshot_diff_codec"]
        require(diff == "none" or diff in CODEC_NAMES, f"merger.snapshot_diff_codec must be 'none' or one of {CODEC_NAMES}, got {diff!r}")
        for key in ("snapshot_full_every", "share_window"):
            value = self.merger[key]
            require(type(value) is int and value >= 0, f"merger.{key} must be an int >= 0, got {value!r}")
        every = self.merger["snapshot_every_round"]
        require(type(every) in (int, float) and 0 <= every < float("inf"), f"merger.snapshot_every_round must be a number >= 0, got {every!r}")

    def effective(self) -> tuple[dict, dict]:
        """(sync, merger) settings after the mode's overrides."""
        sync, merger = dict(self.sync), dict(self.merger)
        overrides = MODES[self.mode]
        sync.update(overrides.get("sync", {}))
        merger.update({k: (len(self.regions) if v == "all" else v) for k, v in overrides.get("merger", {}).items()})
        return sync, merger

    def cpus_of(self, region: Region) -> float | None:
        """The cores `region`'s island may use (None: no quota)."""
        return self.island_cpus / region.slowdown if self.island_cpus else None

    @property
    def process_names(self) -> list[str]:
        return [r.name for r in self.regions] + ["merger", "broker"]

    def with_duration(self, seconds: float | None) -> ClusterConfig:
        return self if seconds is None else dataclasses.replace(self, duration_s=seconds)

    def with_steps(self, steps: int | None) -> ClusterConfig:
        return self if steps is None else dataclasses.replace(self, max_steps=steps)

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
MODES = {
    "decoupled": {},
    "sync-diloco": {"sync": {"fragments": 1, "blocking": True},
                    "merger": {"quorum": "all", "grace_cap_s": 0.0, "share_window": 0, "snapshot_every_round": 0.0, "outer": "nesterov", "outer_lr": 0.7}},
    "sync-dp": {"sync": {"fragments": 1, "interval": 1, "codec": "fp32", "blocking": True},
                "merger": {"quorum": "all", "grace_cap_s": 0.0, "merge": "average", "outer": "sgd", "outer_lr": 1.0, "snapshot_codec": "fp32",
                           "snapshot_diff_codec": "none", "share_window": 0, "snapshot_every_round": 0.0}},
}

_SECTIONS = {"run": {"duration_s", "max_steps", "eval_every", "eval_early", "eval_trace", "seed", "mode", "island_cpus"}, "model": {"width", "depth", "heads", "context", "batch"},
             "sync": {"fragments", "interval", "codec", "adoption", "alpha", "error_feedback", "flush_on_leave", "settle_timeout_s"},
             "merger": {"max_staleness", "quorum", "grace_cap_s", "outer", "outer_lr", "snapshot_codec", "merge", "quorum_timeout_s", "delay",
                        "snapshot_diff_codec", "snapshot_full_every", "share_window", "snapshot_every_round"}}


def load(path: str | Path | None = None) -> ClusterConfig:
    path = Path(path) if path is not None else DEFAULT_PROFILE
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as error:
        raise ConfigError(f"cannot read cluster file {path}: {error}") from None
    unknown = set(data) - set(_SECTIONS) - {"regions", "chaos"}
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
        regions=tuple(regions), duration_s=float(run.get("duration_s", defaults.duration_s)), max_steps=run.get("max_steps", defaults.max_steps),
        eval_every=int(run.get("eval_every", defaults.eval_every)), eval_early=run.get("eval_early", defaults.eval_early),
        eval_trace=run.get("eval_trace", defaults.eval_trace), seed=int(run.get("seed", defaults.seed)), mode=str(run.get("mode", "decoupled")),
        island_cpus=run.get("island_cpus", defaults.island_cpus),
        model={**defaults.model, **data.get("model", {})}, sync={**defaults.sync, **data.get("sync", {})},
        merger={**defaults.merger, **data.get("merger", {})}, chaos=in_order(chaos),
    )


_CHAOS_POINTS = {"at_s", "at_step", "at_folds"}


def _chaos_event(path: Path, entry: dict) -> ChaosEvent:
    """A [[chaos]] table: action, target and one point (at_s, at_step with an optional island, or at_folds),
    `relative = true` to count it from the event before."""
    points = _CHAOS_POINTS & set(entry)
    allowed = {"action", "target", *_CHAOS_POINTS, "island", "relative"}
    require({"action", "target"} <= set(entry) and len(points) == 1 and set(entry) <= allowed and ("island" not in entry or "at_step" in entry),
            f"{path}: a [[chaos]] entry needs action, target and one of at_s, at_step (with an optional island) or at_folds "
            f"(and optionally relative), got {sorted(entry)}")
    relative = entry.get("relative", False)
    (point,) = points
    value = entry[point]
    if point == "at_s":
        require(type(value) in (int, float), f"{path}: [[chaos]] at_s must be a number of seconds, got {value!r}")
        return ChaosEvent(float(value), str(entry["action"]), str(entry["target"]), relative=relative)
    require(type(value) is int, f"{path}: [[chaos]] {point} must be an int, got {value!r}")
    return ChaosEvent(None, str(entry["action"]), str(entry["target"]), **{point: value},
                      island=str(entry["island"]) if "island" in entry else None, relative=relative)
