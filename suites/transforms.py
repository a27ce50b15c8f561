"""The cluster-file transforms the experiment suites (suites/catalog.py) are made of: a
`Transform` takes the suite's base cluster configuration and returns a run's, one setting changed
(a mode, [sync] or [merger] values, the regions' speeds, links or intervals, a fault schedule);
`chain` applies several in order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from dloco.cluster.chaos import ChaosEvent
from dloco.cluster.config import ClusterConfig

Transform = Callable[[ClusterConfig], ClusterConfig]


def mode(name: str) -> Transform:
    """Mode `name` (decoupled, sync-diloco, sync-avg; cluster/modes.py)."""
    return lambda c: dataclasses.replace(c, mode=name)


def homogeneous(c: ClusterConfig) -> ClusterConfig:
    """Every region at full speed, and so at the [sync] interval."""
    return one_interval(
        dataclasses.replace(
            c, regions=tuple(dataclasses.replace(r, slowdown=1.0) for r in c.regions)
        )
    )


def chain(*transforms: Transform) -> Transform:
    """The transforms applied in order."""

    def apply(c: ClusterConfig) -> ClusterConfig:
        for transform in transforms:
            c = transform(c)
        return c

    return apply


def sync(**values) -> Transform:
    """These [sync] settings (island.config.SyncConfig fields) over the run's."""
    return lambda c: dataclasses.replace(c, sync=dataclasses.replace(c.sync, **values))


def merger(**values) -> Transform:
    """These [merger] settings (cluster.sections.MergerSection fields) over the run's."""
    return lambda c: dataclasses.replace(c, merger=dataclasses.replace(c.merger, **values))


def one_interval(c: ClusterConfig) -> ClusterConfig:
    """Every island at the [sync] interval (no region's own)."""
    return dataclasses.replace(
        c, regions=tuple(dataclasses.replace(r, interval=0) for r in c.regions)
    )


def islands(count: int) -> Transform:
    """The first `count` regions only."""
    return lambda c: dataclasses.replace(c, regions=c.regions[:count])


def links(factor: float) -> Transform:
    """Every region's links `factor` times as fast each way (an unlimited link stays unlimited;
    round trips unchanged)."""

    def scale(mbps: float | None) -> float | None:
        return None if mbps is None else mbps * factor

    def apply(c: ClusterConfig) -> ClusterConfig:
        return dataclasses.replace(
            c,
            regions=tuple(
                dataclasses.replace(
                    r, uplink_mbps=scale(r.uplink_mbps), downlink_mbps=scale(r.downlink_mbps)
                )
                for r in c.regions
            ),
        )

    return apply


def unlinked(c: ClusterConfig) -> ClusterConfig:
    """No link emulation: every region's links unlimited, no latency."""
    return dataclasses.replace(
        c,
        regions=tuple(
            dataclasses.replace(r, uplink_mbps=None, downlink_mbps=None, rtt_ms=0.0)
            for r in c.regions
        ),
    )


def faults(c: ClusterConfig) -> ClusterConfig:
    """Kill the third island and bring it back, then kill the merger and bring it back.  A run
    bounded by steps keys them to progress: the kill at 35 % of the first island's steps, the
    restart after another 25 %, the merger's kill once the restarted island has trained an
    interval, its restart 5 s later.  A run of fixed length: at 35 %, 60 %, 75 % and 80 % of it."""
    region = c.regions[min(2, len(c.regions) - 1)]
    victim, first = region.name, c.regions[0].name
    if c.max_steps:
        n, h = c.max_steps, c.interval_of(region)
        schedule = (
            ChaosEvent(None, "kill", victim, at_step=max(1, round(0.35 * n)), island=first),
            ChaosEvent(
                None,
                "restart",
                victim,
                at_step=max(1, round(0.25 * n)),
                island=first,
                relative=True,
            ),
            ChaosEvent(None, "kill", "merger", at_step=h, island=victim, relative=True),
            ChaosEvent(5.0, "restart", "merger", relative=True),
        )
        return dataclasses.replace(c, chaos=schedule)
    d = c.duration_s
    schedule = [
        (0.35, "kill", victim),
        (0.60, "restart", victim),
        (0.75, "kill", "merger"),
        (0.80, "restart", "merger"),
    ]
    return dataclasses.replace(
        c,
        chaos=tuple(ChaosEvent(round(f * d, 1), action, target) for f, action, target in schedule),
    )


# Speed emulated by CPU quotas (cluster/cpuquota.py): a full-speed island may use 0.45 cores, a
# half-speed one 0.225, whatever its peers do; four full-speed islands take 1.8 of this machine's 2
# cores and leave the rest to the merger and the broker.  With sleeps instead, a half-speed island's
# CPU goes to the fast ones, which then step faster than in a uniform cluster.
CAPPED_CPUS = 0.45


def capped(c: ClusterConfig) -> ClusterConfig:
    """Speed emulated by CPU quotas: CAPPED_CPUS per full-speed island."""
    return dataclasses.replace(c, island_cpus=CAPPED_CPUS)


def interval(h: int) -> Transform:
    """H = h, and each region with its own interval scaled with it."""

    def apply(c: ClusterConfig) -> ClusterConfig:
        regions = tuple(
            (
                dataclasses.replace(
                    r, interval=max(c.sync.fragments, r.interval * h // c.sync.interval)
                )
                if r.interval
                else r
            )
            for r in c.regions
        )
        return dataclasses.replace(c, sync=dataclasses.replace(c.sync, interval=h), regions=regions)

    return apply
