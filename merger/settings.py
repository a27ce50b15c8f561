"""The merger process's settings: endpoints, run directory, snapshot forms, disk and security (the
math's settings are merger/config.py's, logged in the genesis record)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from dloco import protocol
from dloco.bus.security import Security
from dloco.merger.config import SnapshotConfig
from dloco.protocol.errors import ConfigError

# how a primary replicates its log (PROTOCOL.md §12)
MODES = ("sync", "async", "off")


# The shortest lease a merger accepts, in seconds: below it a busy primary's heartbeat jitter alone
# would hand the model to its standby.
MIN_LEASE_S = 0.1


def check_lease(lease_s: object, name: str) -> None:
    """The one rule for a lease, for the merger's flag and the cluster file alike."""
    if type(lease_s) not in (int, float) or not MIN_LEASE_S <= lease_s < float("inf"):
        raise ConfigError(f"{name} must be a number of seconds >= {MIN_LEASE_S}, got {lease_s!r}")


@dataclasses.dataclass(frozen=True)
class ReplicationConfig:
    # sync | async | off
    mode: str = "off"
    # ROUTER this merger binds while it is the primary ('@tcp://...')
    endpoint: str = ""
    # the other merger's replication endpoint: followed as a standby, fenced after a takeover
    peer: str = ""
    # a standby takes over after this long without the primary's lease; the primary drops it after
    # twice this
    lease_s: float = 3.0
    # start as the standby of `peer`
    standby: bool = False
    # etcd's client URLs: the primary holds a lease key there and a standby takes over only by
    # claiming it (merger/replication/consensus.py); empty: the pair's own lease decides
    etcd: tuple[str, ...] = ()
    # the pair's keys in etcd (default /dloco/SENDER)
    etcd_prefix: str = ""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"replication mode must be one of {MODES}, got {self.mode!r}")
        check_lease(self.lease_s, "the lease (--lease)")
        if self.mode != "off" and not self.endpoint:
            raise ConfigError(
                "replication needs --replication-endpoint (where this merger serves its log as the"
                " primary)"
            )
        if self.standby and not self.peer:
            raise ConfigError("a standby needs the primary's replication endpoint (--standby-of)")
        if self.etcd and not self.peer:
            raise ConfigError(
                "--etcd decides which of two mergers is the primary: give the other's"
                " replication endpoint too (--peer or --standby-of)"
            )
        if self.peer and self.mode == "off":
            raise ConfigError(
                "a merger with a peer streams its log when it is the primary: give"
                " --replication-endpoint (and --replication sync or async)"
            )

    @property
    def on(self) -> bool:
        return self.mode != "off"


@dataclasses.dataclass(frozen=True)
class ServiceConfig:
    run_dir: Path
    # SUB
    delta_endpoint: str
    # PUB
    snapshot_endpoint: str
    # ROUTER
    control_endpoint: str
    sender: str = "merger"
    # the forms fragments go out in, and how often (merger/config.py)
    snapshots: SnapshotConfig = SnapshotConfig()
    max_chunk_bytes: int = protocol.DEFAULT_MAX_CHUNK_BYTES
    fsync: str = "batch"
    # folds between checkpoints
    checkpoint_every: int = 50
    reassembly_ttl_s: float = 60.0
    # partial deltas, in all (each island: half of it)
    reassembly_bytes: int = 512 << 20
    # stream messages held beyond a gap, in all (each island: half of it)
    held_bytes: int = 256 << 20
    # an island silent this long (no chunk, no heartbeat) is logged as gone
    peer_timeout_s: float = 10.0
    # plaintext unless keys are given
    security: Security = Security(None, "merger")
    # Prometheus metrics served on this port (telemetry/prom.py); None: off
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    # a standby, its stream and lease (merger/replication/primary.py)
    replication: ReplicationConfig = ReplicationConfig()
    # this merger folds the fragments f with f % shards == shard (protocol/shards.py)
    shard: int = 0
    shards: int = 1

    def owns(self, fragment: int) -> bool:
        return fragment % self.shards == self.shard
