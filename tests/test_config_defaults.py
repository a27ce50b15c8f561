"""Every default is written once: what a process gets from its command line with no flags is its
config dataclass's default, and a cluster file that leaves a key out gets the process's default."""

from __future__ import annotations

import dataclasses

import pytest

from dloco import protocol
from dloco.broker.proxy import BrokerConfig
from dloco.cli import build_parser
from dloco.cliargs import from_args
from dloco.cluster.config import ClusterConfig
from dloco.cluster.sections import MergerSection, Region
from dloco.island.config import SyncConfig, TrainConfig
from dloco.merger.config import MergeConfig, MergerConfig, OuterConfig, RoundConfig, SnapshotConfig
from dloco.merger.flags import merger_config
from dloco.merger.settings import MIN_LEASE_S, ReplicationConfig, ServiceConfig
from dloco.protocol.errors import ConfigError

MERGER = [
    "merger",
    "--run-dir",
    "r",
    "--delta-endpoint",
    "tcp://a:1",
    "--snapshot-endpoint",
    "tcp://a:2",
    "--control-endpoint",
    "tcp://a:3",
]


def test_an_island_without_flags_trains_and_exchanges_with_the_dataclasses_defaults():
    args = build_parser().parse_args(["island"])
    assert from_args(TrainConfig, args) == TrainConfig()
    assert from_args(SyncConfig, args) == SyncConfig()


def test_a_merger_without_flags_folds_publishes_and_keeps_its_log_with_the_dataclasses_defaults():
    args = build_parser().parse_args(MERGER)
    assert merger_config(args) == MergerConfig()
    assert from_args(SnapshotConfig, args) == SnapshotConfig()
    service = ServiceConfig("r", "a", "b", "c")
    assert (args.fsync, args.checkpoint_every, args.peer_timeout) == (
        service.fsync,
        service.checkpoint_every,
        service.peer_timeout_s,
    )
    assert args.receive_mib << 20 == service.reassembly_bytes + service.held_bytes
    assert args.lease == ReplicationConfig().lease_s and args.fragments == SyncConfig().fragments


def test_a_broker_without_flags_has_the_dataclasses_budget():
    args = build_parser().parse_args(["broker", "--insecure"])
    defaults = BrokerConfig(())
    assert (args.memory_mib << 20, args.chunk_bytes, args.stats_every) == (
        defaults.memory_bytes,
        defaults.chunk_bytes,
        defaults.stats_every_s,
    )


def test_a_cluster_file_that_leaves_keys_out_gets_the_processes_defaults():
    cluster = ClusterConfig(regions=(Region("a"),))
    assert (
        cluster.eval_every == TrainConfig().eval_every
        and cluster.model.batch == TrainConfig().batch
    )
    assert cluster.sync == SyncConfig()
    section, merge, outer, rounds = MergerSection(), MergeConfig(), OuterConfig(), RoundConfig()
    assert (section.max_staleness, section.merge, section.share_window) == (
        merge.max_staleness,
        merge.method,
        merge.share_window,
    )
    assert (section.outer, section.outer_lr, section.delay, section.momentum_dtype) == (
        outer.kind,
        outer.lr,
        outer.delay,
        outer.momentum_dtype,
    )
    assert (section.quorum, section.quorum_timeout_s, section.grace_cap_s, section.cold_wait_s) == (
        rounds.quorum,
        rounds.quorum_timeout_s,
        rounds.grace_cap_s,
        rounds.cold_wait_s,
    )
    snapshots = SnapshotConfig()
    assert {
        f.name: getattr(section, f.name) for f in dataclasses.fields(SnapshotConfig)
    } == dataclasses.asdict(snapshots)
    assert section.lease_s == ReplicationConfig().lease_s


def test_one_chunk_size_and_one_no_diff_codec():
    assert (
        SyncConfig().chunk_bytes
        == BrokerConfig(()).chunk_bytes
        == ServiceConfig("r", "a", "b", "c").max_chunk_bytes
        == protocol.DEFAULT_MAX_CHUNK_BYTES
    )
    # the merger's service holds the same SnapshotConfig as the CLI and the cluster file ("none": no
    # diffs)
    assert ServiceConfig("r", "a", "b", "c").snapshots.snapshot_diff_codec == "none"


@pytest.mark.parametrize("lease", [0.05, 0, -1.0, float("inf"), "3"])
def test_a_lease_is_checked_by_one_rule_with_one_error(lease, capsys):
    with pytest.raises(ConfigError, match=f">= {MIN_LEASE_S}") as from_process:
        ReplicationConfig(lease_s=lease)
    with pytest.raises(ConfigError, match=f">= {MIN_LEASE_S}"):
        MergerSection(lease_s=lease)
    assert "--lease" in str(from_process.value)
    if isinstance(lease, float) and lease != float("inf"):
        with pytest.raises(SystemExit):
            build_parser().parse_args([*MERGER, "--lease", str(lease)])
        assert "--lease" in capsys.readouterr().err


def test_a_cluster_files_cold_wait_reaches_the_merger_and_is_checked():
    from dloco.merger.flags import math_flags

    flags = math_flags(MergerSection(cold_wait_s=0.0).math())
    assert flags[flags.index("--cold-wait") + 1] in ("0.0", "0")
    with pytest.raises(ConfigError, match="round.cold_wait_s must be >= 0"):
        MergerSection(cold_wait_s=-1.0)
