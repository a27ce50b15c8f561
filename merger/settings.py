"""The merger process's settings: endpoints, run directory, snapshot forms, disk and security (the
math's settings are merger/config.py's, logged in the genesis record)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from dloco import protocol
from dloco.bus.security import Security
from dloco.merger.config import SnapshotConfig
from dloco.merger.replication_wire import ReplicationConfig


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
    # a standby, its stream and lease (merger/replication.py)
    replication: ReplicationConfig = ReplicationConfig()
    # this merger folds the fragments f with f % shards == shard (protocol/shards.py)
    shard: int = 0
    shards: int = 1

    def owns(self, fragment: int) -> bool:
        return fragment % self.shards == self.shard
