"""The cluster file (TOML): regions with their hardware and links, model, sync and merger settings.

Typed and frozen; unknown keys and out-of-range values are errors that name the key.  The shipped
default is `cluster/profiles/default.toml` (its comments document the link scaling).
"""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path

from cluster.chaos import ChaosEvent, check
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
    duration_s: float = 300.0
    eval_every: int = 50
    seed: int = 0
    model: dict = dataclasses.field(default_factory=lambda: {"width": 128, "depth": 4, "heads": 4, "context": 128, "batch": 16})
    sync: dict = dataclasses.field(default_factory=lambda: {"fragments": 4, "interval": 48, "codec": "int4", "alpha": 0.0})
    merger: dict = dataclasses.field(default_factory=lambda: {"max_staleness": 4, "quorum": 1, "grace_cap_s": 1.0, "outer": "nesterov",
                                                              "outer_lr": 0.7, "snapshot_codec": "bf16"})
    chaos: tuple[ChaosEvent, ...] = ()  # kill -9 / restart schedule (cluster.chaos)

    def __post_init__(self) -> None:
        require(len(self.regions) >= 1, "a cluster needs at least one region")
        require(len({r.name for r in self.regions}) == len(self.regions), "region names must be unique")
        require(not {r.name for r in self.regions} & {"merger", "broker"}, "'merger' and 'broker' are not region names")
        require(self.duration_s > 0, f"run.duration_s must be > 0, got {self.duration_s}")
        require(self.sync["codec"] in CODEC_NAMES, f"sync.codec must be one of {CODEC_NAMES}, got {self.sync['codec']!r}")
        check(self.chaos, self.process_names)

    @property
    def process_names(self) -> list[str]:
        return [r.name for r in self.regions] + ["merger", "broker"]

    def with_duration(self, seconds: float | None) -> ClusterConfig:
        return self if seconds is None else dataclasses.replace(self, duration_s=seconds)

    def with_chaos(self, schedule: tuple[ChaosEvent, ...] | None) -> ClusterConfig:
        return self if schedule is None else dataclasses.replace(self, chaos=schedule)


_SECTIONS = {"run": {"duration_s", "eval_every", "seed"}, "model": {"width", "depth", "heads", "context", "batch"},
             "sync": {"fragments", "interval", "codec", "alpha"},
             "merger": {"max_staleness", "quorum", "grace_cap_s", "outer", "outer_lr", "snapshot_codec"}}


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
    chaos = []
    for entry in data.get("chaos", []):
        require(set(entry) == {"at_s", "action", "target"}, f"{path}: a [[chaos]] entry needs exactly at_s, action and target, got {sorted(entry)}")
        try:
            chaos.append(ChaosEvent(float(entry["at_s"]), str(entry["action"]), str(entry["target"])))
        except (TypeError, ValueError):
            raise ConfigError(f"{path}: [[chaos]] at_s must be a number of seconds, got {entry['at_s']!r}") from None
    defaults = ClusterConfig(regions=(Region("x"),))
    run = data.get("run", {})
    return ClusterConfig(
        regions=tuple(regions), duration_s=float(run.get("duration_s", defaults.duration_s)),
        eval_every=int(run.get("eval_every", defaults.eval_every)), seed=int(run.get("seed", defaults.seed)),
        model={**defaults.model, **data.get("model", {})}, sync={**defaults.sync, **data.get("sync", {})},
        merger={**defaults.merger, **data.get("merger", {})}, chaos=tuple(sorted(chaos, key=lambda e: e.at_s)),
    )
