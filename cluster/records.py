"""What `dloco up` records of a cluster in its run directory, and the plain values the analysis
takes from a cluster file: the task its islands train (task.json, analysis.runinfo.RunTask), how its
processes were set up (cluster.json, RunCluster) and what a report lists per island (RunOutline)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from dloco.analysis.report import IslandOutline, RunOutline
from dloco.analysis.runinfo import RunDirError, RunTask
from dloco.cluster.config import ClusterConfig
from dloco.cluster.sections import MergerSection, Region
from dloco.cluster.topology import task_option_pairs
from dloco.island.config import SyncConfig
from dloco.island.task import parse_options

# in a run directory: its regions and their links, and the exchange's and merger's settings
RUN_CLUSTER = "cluster.json"


def run_task(config: ClusterConfig) -> RunTask:
    """The task of a cluster, as its islands build it: [task] read back from the --task-option pairs
    they are given (cluster/topology.model_args), the built-in LM's [model] keys over them as its
    flags go over them.  So a TOML string "64" is the int 64 here as it is there."""
    options = {**parse_options(task_option_pairs(config)), **config.model.lm_options()}
    return RunTask(config.model.task, options, config.seed, config.model.batch, len(config.regions))


def outline(config: ClusterConfig) -> RunOutline:
    """What a report says of the run's plan, per island and in all."""

    def speed(region: Region) -> str:
        if config.island_cpus:
            return f"{region.slowdown} ({config.cpus_of(region):g}-core quota)"
        return str(region.slowdown)

    islands = tuple(
        IslandOutline(
            r.name, speed(r), config.interval_of(r), r.uplink_mbps, r.downlink_mbps, r.rtt_ms
        )
        for r in config.regions
    )
    return RunOutline(config.mode, config.duration_s, config.max_steps, islands, run_task(config))


@dataclasses.dataclass(frozen=True)
class RunCluster:
    """How a run's processes were set up, as they ran (the mode's overrides applied): the regions
    and their emulated links, the islands' [sync] and the merger's [merger] settings.  `dloco plan
    --calibrate` simulates a run from it."""

    mode: str
    regions: tuple[Region, ...]
    sync: SyncConfig
    merger: MergerSection

    @classmethod
    def of(cls, config: ClusterConfig) -> RunCluster:
        """`config`'s settings as its processes get them: the mode's overrides, each region's H."""
        sync, merger = config.effective()
        regions = tuple(
            dataclasses.replace(
                r, interval=config.interval_of(r) if config.interval_of(r) != sync.interval else 0
            )
            for r in config.regions
        )
        return cls(config.mode, regions, sync, merger)

    def write(self, run_dir: Path) -> Path:
        path = Path(run_dir) / RUN_CLUSTER
        path.write_text(json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True) + "\n")
        return path

    @classmethod
    def read(cls, run_dir: Path) -> RunCluster:
        path = Path(run_dir) / RUN_CLUSTER
        try:
            fields = json.loads(path.read_text())
            return cls(
                fields["mode"],
                tuple(Region(**r) for r in fields["regions"]),
                SyncConfig(**fields["sync"]),
                MergerSection(**fields["merger"]),
            )
        except FileNotFoundError:
            raise RunDirError(
                f"{run_dir} has no {RUN_CLUSTER} (a run directory made before runs recorded it): "
                "give --config the cluster file it ran"
            ) from None
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as error:
            raise RunDirError(f"cannot read {path}: {error}") from None
