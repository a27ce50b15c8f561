"""The merger's command line (`dloco merger`).  The flags of its typed configs come from their
fields (`MATH_FLAGS`, `SNAPSHOT_FLAGS`, cliargs.add_fields): the launcher writes a config out by the
same tables (cluster/topology.py)."""

from __future__ import annotations

import argparse
from pathlib import Path

from dloco.cliargs import (
    Flag,
    add_fields,
    add_metrics_flags,
    as_flags,
    float_at_least,
    from_args,
    int_at_least,
)
from dloco.merger.config import (
    FULL_SNAPSHOT_CODECS,
    MergeConfig,
    MergerConfig,
    OuterConfig,
    RoundConfig,
    SnapshotConfig,
)
from dloco.merger.settings import MIN_LEASE_S, MODES, ReplicationConfig, ServiceConfig
from dloco.protocol import CODEC_NAMES
from dloco.protocol.shards import DEFAULT_FRAGMENTS

_positive_int, _non_negative_int = int_at_least(1), int_at_least(0)

# the fold's math: MergerConfig's three parts, each config type with its flags
MATH_FLAGS = (
    (
        MergeConfig,
        (
            Flag("method", flag="--merge", choices=MergeConfig.METHODS),
            Flag(
                "max_staleness",
                help="S: reject deltas more than S versions behind (default %(default)s)",
            ),
            Flag(
                "share_window",
                type=_non_negative_int,
                help=(
                    "scale each fold by its share of a round: the islands seen in the fragment's"
                    " last N versions (default 0: off)"
                ),
            ),
        ),
    ),
    (
        OuterConfig,
        (
            Flag("kind", flag="--outer", choices=OuterConfig.KINDS),
            Flag("lr", flag="--outer-lr"),
            Flag("momentum", flag="--outer-momentum"),
            Flag("delay", type=_positive_int, help="delayed_nesterov: momentum once per N folds"),
            Flag(
                "momentum_dtype",
                flag="--outer-momentum-dtype",
                choices=OuterConfig.MOMENTUM_DTYPES,
                help="what the outer momentum is kept in (default %(default)s; bfloat16: half)",
            ),
        ),
    ),
    (
        RoundConfig,
        (
            Flag(
                "quorum",
                type=_positive_int,
                help="K: islands with a delta pending before a fold (default 1: nobody waits)",
            ),
            Flag(
                "quorum_timeout_s",
                flag="--quorum-timeout",
                help="fold with fewer than K once the oldest pending delta waited this long",
            ),
            Flag(
                "grace_cap_s",
                flag="--grace-cap",
                help="seconds a round may wait for a predicted late island",
            ),
            Flag(
                "cold_wait_s",
                flag="--cold-wait",
                help=(
                    "on a fresh merger, a fragment's fold waits this long at most for a second"
                    " island's nonzero delta, so that a key's first deltas are judged against it"
                    " (default %(default)s; 0: never)"
                ),
            ),
        ),
    ),
)

SNAPSHOT_FLAGS = (
    Flag(
        "snapshot_codec",
        choices=FULL_SNAPSHOT_CODECS,
        help=(
            "codec of full snapshots (int8: a quarter of fp32's bytes; meant with"
            " --snapshot-diff-codec, whose diffs carry its error away)"
        ),
    ),
    Flag(
        "snapshot_diff_codec",
        choices=("none", *CODEC_NAMES),
        help=(
            "publish each fold as the change since the previous snapshot in this codec (default"
            " none: full snapshots)"
        ),
    ),
    Flag(
        "snapshot_full_every",
        type=_non_negative_int,
        help=(
            "with diffs: every N-th version of a fragment goes out in full (default 0: never;"
            " islands ask when they miss one)"
        ),
    ),
    Flag(
        "snapshot_every_round",
        type=float_at_least(0.0),
        help=(
            "publish a fragment at most once per F mean rounds of the islands (the mean of their"
            " EMA intervals between deltas of a fragment); the folds in between go out together"
            " (default 0: after every fold). Islands then base their deltas on a version up to F"
            " rounds of folds old: keep --max-staleness above that"
        ),
    ),
    Flag(
        "served_dtype",
        choices=SnapshotConfig.SERVED_DTYPES,
        help=(
            "with diffs: what the merger and the islands hold the served value in (default fp32;"
            " bf16: half the memory)"
        ),
    ),
)


def merger_config(args: argparse.Namespace) -> MergerConfig:
    """The math's settings from the flags (their defaults are MergerConfig's)."""
    return MergerConfig(*(from_args(config_type, args) for config_type, _ in MATH_FLAGS))


def math_flags(math: MergerConfig) -> list[str]:
    """`math` as the flags `merger_config` reads back (those that differ from the defaults)."""
    parts = (math.merge, math.outer, math.round)
    return [flag for part, (_, flags) in zip(parts, MATH_FLAGS) for flag in as_flags(part, flags)]


def add_merger_flags(merger: argparse.ArgumentParser) -> None:
    """Every flag of `dloco merger`."""
    merger.add_argument(
        "--run-dir",
        type=Path,
        required=True,
        help="write-ahead log and checkpoints live here; an existing one is resumed",
    )
    merger.add_argument(
        "--init-npz",
        type=Path,
        help="initial global parameters (.npz, one array per parameter path); needed for a new run",
    )
    merger.add_argument(
        "--fragments",
        type=_positive_int,
        default=DEFAULT_FRAGMENTS,
        help="P, fragments of the model (default %(default)s)",
    )
    _add_endpoint_flags(merger)
    for config_type, flags in MATH_FLAGS:
        add_fields(merger, config_type, flags)
    add_fields(merger, SnapshotConfig, SNAPSHOT_FLAGS)
    _add_service_flags(merger)
    add_metrics_flags(merger)
    _add_standby_flags(merger.add_argument_group("hot standby (PROTOCOL.md §12)"))


def _add_endpoint_flags(merger: argparse.ArgumentParser) -> None:
    merger.add_argument(
        "--delta-endpoint",
        required=True,
        help="SUB for deltas; '@tcp://...' binds, 'tcp://...' connects",
    )
    merger.add_argument(
        "--snapshot-endpoint", required=True, help="PUB for snapshots and acks; '@' binds"
    )
    merger.add_argument(
        "--control-endpoint", required=True, help="ROUTER for catch-up requests; '@' binds"
    )


def _add_service_flags(merger: argparse.ArgumentParser) -> None:
    """The process's disk, memory, name and keys."""
    merger.add_argument(
        "--fsync", choices=("always", "batch", "never"), default=ServiceConfig.fsync
    )
    merger.add_argument(
        "--checkpoint-every",
        type=_positive_int,
        default=ServiceConfig.checkpoint_every,
        help="folds between checkpoints",
    )
    merger.add_argument(
        "--receive-mib",
        type=_positive_int,
        default=(ServiceConfig.reassembly_bytes + ServiceConfig.held_bytes) >> 20,
        help=(
            "memory for islands' messages not yet whole or in order: 2/3 for partial deltas, 1/3"
            " for messages beyond a gap; one island may hold half of each (default 768)"
        ),
    )
    merger.add_argument(
        "--peer-timeout",
        type=float,
        default=ServiceConfig.peer_timeout_s,
        help="seconds of silence after which an island is logged as gone",
    )
    merger.add_argument(
        "--name",
        default=None,
        help="sender id and key name (default merger; shard I > 0 of --shard: merger.I)",
    )
    merger.add_argument(
        "--shard",
        default="0/1",
        metavar="I/N",
        help=(
            "fold only the fragments f with f %% N == I (one of N merger shards, each with its own"
            " run directory; islands give one --control-endpoint per shard, in shard order)"
        ),
    )
    merger.add_argument(
        "--keys",
        type=Path,
        help="CURVE key directory (NAME.key_secret, broker.key); CURVE is the default",
    )
    merger.add_argument(
        "--allow", type=Path, help="accepted client public keys, for the sockets this merger binds"
    )
    merger.add_argument(
        "--insecure", action="store_true", help="plaintext, no authentication (prints a warning)"
    )


def _add_standby_flags(standby) -> None:
    standby.add_argument(
        "--replication-endpoint",
        default="",
        help=(
            "ROUTER on which this merger, while it is the primary, streams its log to a standby"
            " ('@tcp://...')"
        ),
    )
    standby.add_argument(
        "--replication",
        choices=MODES,
        default=None,
        help=(
            "sync: publish nothing before the standby has it on disk; async: stream, never wait;"
            " off (default: sync with --replication-endpoint, else off)"
        ),
    )
    standby.add_argument(
        "--peer",
        default="",
        help=(
            "the other merger's replication endpoint: a primary restarted after a takeover "
            "finds its successor there and becomes its standby"
        ),
    )
    standby.add_argument(
        "--standby-of",
        default="",
        metavar="ENDPOINT",
        help="start as the standby of the primary at ENDPOINT",
    )
    standby.add_argument(
        "--lease",
        type=float_at_least(MIN_LEASE_S),
        default=ReplicationConfig.lease_s,
        help=(
            "seconds without the primary's heartbeat after which its standby takes over (default"
            " 3); the primary drops a standby silent for twice this"
        ),
    )
    standby.add_argument(
        "--etcd",
        metavar="URL,URL",
        default="",
        help=(
            "etcd's client URLs: the primary holds a lease key there, renewed every lease/6, and"
            " acknowledges nothing without it; a standby takes over only by claiming the key"
            " once etcd let the lease lapse (default: none, the pair's own lease decides)"
        ),
    )
    standby.add_argument(
        "--etcd-prefix",
        metavar="KEY",
        default="",
        help="the pair's keys in etcd (default /dloco/NAME)",
    )
