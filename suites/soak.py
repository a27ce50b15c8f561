"""`dloco experiment soak --minutes M --seed S`: one cluster run under a seeded schedule of random
faults, then the invariant checker (analysis/soakcheck.py).

The schedule (`plan`, pure) is one fault at a time, each followed by its recovery: an island killed
and restarted; with `[run] network = "netns"` (root) an island's link partitioned, cut one way or
lossy, and healed; the broker killed and restarted; the primary merger killed (with the standby:
a takeover; the restarted one follows the new primary) or partitioned from everything (the standby
takes over; the old primary is fenced on healing); with the lease in etcd (when the etcd binary
is there) the standby cut off from everyone (it must not take over).  A takeover comes first,
then each other kind the machine allows once, before any repeats.  Times are seconds after the
processes start; the schedule and the seed are printed, and `dloco up --chaos '<schedule>'` with
the same cluster file replays it.

The run is the shipped profile's regions with the tiny model and a standby, in namespaces where
the machine allows.  OUT/soak.md has the schedule, each fault's effect (analysis.chaoseffects) and
the checks; the command exits 1 when a correctness check fails.
"""

from __future__ import annotations

import dataclasses
import random
import shutil
import sys
from pathlib import Path

from dloco.bus.sockets import HEARTBEAT_TIMEOUT_MS
from dloco.cluster import config as cluster_config
from dloco.cluster import netns
from dloco.cluster.chaos import ChaosEvent
from dloco.protocol.errors import ConfigError
from dloco.protocol.shards import names as shard_names

TIMEOUT_S = HEARTBEAT_TIMEOUT_MS / 1000
# the islands compile and join before the first fault
WARMUP_S = 40.0
# the last recovery at least this long before the end: everyone rejoins and is folded again
TAIL_S = 50.0
# between one recovery and the next fault
GAP_S = (8.0, 20.0)
# ... after a merger's: the restarted one catches up as the standby first
AFTER_MERGER_S = 25.0
# percent
LOSSES = (2, 5, 10)


@dataclasses.dataclass(frozen=True)
class Kind:
    action: str
    recovery: str
    # "island" (one drawn), "merger" (the primary when it fires) or "broker"
    target: str
    length_s: tuple[float, float]
    # needs the namespaces
    network: bool = False
    # needs the lease in etcd (with the pair's own lease it loses acknowledged deltas: PROTOCOL.md
    # §12)
    etcd: bool = False


# the first comes first in every schedule
KINDS = {
    "merger-kill": Kind("kill", "restart", "merger", (10.0, 20.0)),
    "island-kill": Kind("kill", "restart", "island", (5.0, 20.0)),
    "partition": Kind("partition", "heal", "island", (2 * TIMEOUT_S, 8 * TIMEOUT_S), network=True),
    "loss": Kind("loss", "heal", "island", (3 * TIMEOUT_S, 8 * TIMEOUT_S), network=True),
    "broker-kill": Kind("kill", "restart", "broker", (3.0, 10.0)),
    "merger-partition": Kind(
        "partition", "heal", "merger", (4 * TIMEOUT_S, 8 * TIMEOUT_S), network=True
    ),
    "partition-out": Kind(
        "partition-out", "heal", "island", (2 * TIMEOUT_S, 6 * TIMEOUT_S), network=True
    ),
    "partition-in": Kind(
        "partition-in", "heal", "island", (2 * TIMEOUT_S, 6 * TIMEOUT_S), network=True
    ),
    # cut off from the primary, the broker and etcd alike
    "standby-partition": Kind(
        "partition", "heal", "standby", (4 * TIMEOUT_S, 8 * TIMEOUT_S), network=True, etcd=True
    ),
}


@dataclasses.dataclass(frozen=True)
class Fault:
    kind: str
    action: str
    recovery: str
    target: str
    start_s: float
    length_s: float

    def events(self) -> tuple[ChaosEvent, ChaosEvent]:
        return (
            ChaosEvent(self.start_s, self.action, self.target),
            ChaosEvent(round(self.start_s + self.length_s, 1), self.recovery, self.target),
        )


def plan(
    seed: int,
    seconds: float,
    islands: list[str],
    network: bool,
    etcd: bool = False,
    shards: int = 1,
) -> list[Fault]:
    """Faults one after another from WARMUP_S until TAIL_S before `seconds`: a takeover first, then
    every other kind allowed (`network`: the namespace ones too; `etcd`: the standby's cut) once in
    a seeded order, then drawn at random; a merger's fault hits one of `shards` pairs, drawn."""
    rng = random.Random(seed)
    kinds = [
        name
        for name, kind in KINDS.items()
        if (network or not kind.network) and (etcd or not kind.etcd)
    ]
    first = kinds[1:]
    rng.shuffle(first)
    first.insert(0, kinds[0])
    faults, at = [], WARMUP_S
    while True:
        name = first.pop(0) if first else rng.choice(kinds)
        kind = KINDS[name]
        length = round(rng.uniform(*kind.length_s), 1)
        if at + length > seconds - TAIL_S:
            return faults
        target = rng.choice(islands) if kind.target == "island" else kind.target
        if target in ("merger", "standby") and shards > 1:
            target = rng.choice(shard_names(target, shards))
        action = f"loss-{rng.choice(LOSSES)}" if kind.action == "loss" else kind.action
        faults.append(Fault(name, action, kind.recovery, target, round(at, 1), length))
        at += length + (
            AFTER_MERGER_S
            if target.partition(".")[0] in ("merger", "standby")
            else rng.uniform(*GAP_S)
        )


def schedule(faults: list[Fault]) -> str:
    """The `--chaos` string that replays `faults`."""
    return ",".join(str(event) for fault in faults for event in fault.events())


def soak_config(
    config_path: Path | None, seconds: float, network: bool, etcd: bool = False
) -> cluster_config.ClusterConfig:
    """The cluster file's regions and settings (default: the shipped profile), the tiny model, a
    standby for each merger shard (its lease in etcd with `etcd`), `seconds` long; in namespaces
    with `network`."""
    from dloco.suites.catalog import QUICK_MODEL

    base = cluster_config.load(config_path)
    return dataclasses.replace(
        base,
        model=QUICK_MODEL,
        duration_s=seconds,
        max_steps=0,
        tokens=0,
        eval_every=50,
        chaos=(),
        merger=dataclasses.replace(base.merger, standby=True, failover="etcd" if etcd else "lease"),
        network="netns" if network else "loopback",
    )


def run(
    out_dir: Path,
    minutes: float,
    seed: int,
    config_path: Path | None = None,
    log=lambda line: print(line, file=sys.stderr, flush=True),
) -> tuple[str, bool]:
    """Run the soak into OUT/soak/, check it, write OUT/soak.md; returns the Markdown and whether
    every correctness check passed."""
    from dloco.cluster import launcher
    from dloco.suites.soakreport import check_run, write_up

    if not minutes * 60 >= WARMUP_S + TAIL_S + 30:
        raise ConfigError(
            f"a soak needs at least {(WARMUP_S + TAIL_S + 30) / 60:.1f} minutes, got {minutes:g}"
        )
    reason = netns.unavailable()
    network, etcd = reason is None, shutil.which("etcd") is not None
    config = soak_config(config_path, minutes * 60, network, etcd)
    islands = [region.name for region in config.regions]
    faults = plan(
        seed, config.duration_s, islands, network, config.merger.etcd, config.merger.shards
    )
    chaos = schedule(faults)
    config = dataclasses.replace(config, chaos=tuple(e for f in faults for e in f.events()))
    log(
        f"dloco experiment soak: seed {seed}, {minutes:g} minutes, {len(faults)} faults"
        + ("" if network else f" (no network faults: {reason})")
        + (", the lease in etcd" if config.merger.etcd else " (no etcd binary: the pair's lease)")
        + f"; schedule: {chaos}"
    )
    run_dir = out_dir / "soak"
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "up.out", "w") as out:
        code = launcher.run(config, run_dir, out=out)
    log(f"dloco experiment soak: the run ended with exit {code}; checking {run_dir}")
    checks = check_run(run_dir, config)
    text = write_up(run_dir, config, faults, chaos, seed, minutes, code, checks, reason)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "soak.md").write_text(text)
    return text, code == 0 and all(c.ok for c in checks if not c.timing)
