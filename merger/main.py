"""`dloco merger` and `dloco replay`: argument parsing and wiring only."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from dloco.cliargs import add_metrics_flags, float_at_least, int_at_least
from dloco.merger.config import (
    FULL_SNAPSHOT_CODECS,
    ConfigError,
    MergeConfig,
    MergerConfig,
    OuterConfig,
    RoundConfig,
    SnapshotConfig,
)
from dloco.merger.replication_wire import MIN_LEASE_S, MODES, ReplicationConfig
from dloco.merger.settings import ServiceConfig
from dloco.protocol import CODEC_NAMES, DlocoError
from dloco.protocol.shards import DEFAULT_FRAGMENTS


def add_commands(commands: argparse._SubParsersAction, positive_int) -> None:
    non_negative_int = int_at_least(0)
    merger = commands.add_parser(
        "merger", help="run the merger: fold deltas, publish snapshots, keep the log"
    )
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
        type=positive_int,
        default=DEFAULT_FRAGMENTS,
        help="P, fragments of the model (default %(default)s)",
    )
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
    merger.add_argument(
        "--max-staleness",
        type=int,
        default=MergeConfig.max_staleness,
        help="S: reject deltas more than S versions behind (default %(default)s)",
    )
    merger.add_argument("--merge", choices=MergeConfig.METHODS, default=MergeConfig.method)
    merger.add_argument(
        "--share-window",
        type=non_negative_int,
        default=MergeConfig.share_window,
        help=(
            "scale each fold by its share of a round: the islands seen in the fragment's last N"
            " versions (default 0: off)"
        ),
    )
    merger.add_argument("--outer", choices=OuterConfig.KINDS, default=OuterConfig.kind)
    merger.add_argument("--outer-lr", type=float, default=OuterConfig.lr)
    merger.add_argument("--outer-momentum", type=float, default=OuterConfig.momentum)
    merger.add_argument(
        "--delay",
        type=positive_int,
        default=OuterConfig.delay,
        help="delayed_nesterov: momentum once per N folds",
    )
    merger.add_argument(
        "--quorum",
        type=positive_int,
        default=RoundConfig.quorum,
        help="K: islands with a delta pending before a fold (default 1: nobody waits)",
    )
    merger.add_argument(
        "--quorum-timeout",
        type=float,
        default=RoundConfig.quorum_timeout_s,
        help="fold with fewer than K once the oldest pending delta waited this long",
    )
    merger.add_argument(
        "--grace-cap",
        type=float,
        default=RoundConfig.grace_cap_s,
        help="seconds a round may wait for a predicted late island",
    )
    merger.add_argument(
        "--snapshot-codec",
        choices=FULL_SNAPSHOT_CODECS,
        default=SnapshotConfig.snapshot_codec,
        help=(
            "codec of full snapshots (int8: a quarter of fp32's bytes; meant with"
            " --snapshot-diff-codec, whose diffs carry its error away)"
        ),
    )
    merger.add_argument(
        "--snapshot-diff-codec",
        choices=("none", *CODEC_NAMES),
        default=SnapshotConfig.snapshot_diff_codec,
        help=(
            "publish each fold as the change since the previous snapshot in this codec (default"
            " none: full snapshots)"
        ),
    )
    merger.add_argument(
        "--snapshot-full-every",
        type=non_negative_int,
        default=SnapshotConfig.snapshot_full_every,
        help=(
            "with diffs: every N-th version of a fragment goes out in full (default 0: never;"
            " islands ask when they miss one)"
        ),
    )
    merger.add_argument(
        "--snapshot-every-round",
        type=float_at_least(0.0),
        default=SnapshotConfig.snapshot_every_round,
        help=(
            "publish a fragment at most once per F mean rounds of the islands (the mean of their"
            " EMA intervals between deltas of a fragment); the folds in between go out together"
            " (default 0: after every fold). Islands then base their deltas on a version up to F"
            " rounds of folds old: keep --max-staleness above that"
        ),
    )
    merger.add_argument(
        "--fsync", choices=("always", "batch", "never"), default=ServiceConfig.fsync
    )
    merger.add_argument(
        "--checkpoint-every",
        type=positive_int,
        default=ServiceConfig.checkpoint_every,
        help="folds between checkpoints",
    )
    merger.add_argument(
        "--receive-mib",
        type=positive_int,
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
    add_metrics_flags(merger)
    standby = merger.add_argument_group("hot standby (PROTOCOL.md §12)")
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
    merger.set_defaults(run=run_merger)

    replay = commands.add_parser(
        "replay", help="rebuild the global model from a merger's log and print its hashes"
    )
    replay.add_argument("logdir", type=Path, help="the merger's --run-dir")
    replay.add_argument(
        "--every", type=positive_int, default=1, help="print the sha256 after every N-th fold"
    )
    replay.add_argument(
        "--verify",
        action="store_true",
        help="compare with the checkpoints; exit 1 on any mismatch or corrupt record",
    )
    replay.set_defaults(run=run_replay)


def merger_config(args: argparse.Namespace) -> MergerConfig:
    """The math's settings from the flags (their defaults are MergerConfig's)."""
    return MergerConfig(
        MergeConfig(
            method=args.merge, max_staleness=args.max_staleness, share_window=args.share_window
        ),
        OuterConfig(
            kind=args.outer, lr=args.outer_lr, momentum=args.outer_momentum, delay=args.delay
        ),
        RoundConfig(
            quorum=args.quorum, quorum_timeout_s=args.quorum_timeout, grace_cap_s=args.grace_cap
        ),
    )


def snapshot_config(args: argparse.Namespace) -> SnapshotConfig:
    return SnapshotConfig(
        args.snapshot_codec,
        args.snapshot_diff_codec,
        args.snapshot_full_every,
        args.snapshot_every_round,
    )


def run_merger(args: argparse.Namespace) -> int:
    import zmq

    from dloco.bus.security import security_from_args
    from dloco.merger.core import initial_core
    from dloco.merger.memory import keep_freed_memory
    from dloco.merger.roles import run_merger_roles
    from dloco.protocol.shards import parse as parse_shard
    from dloco.protocol.shards import shard_name

    # folds reuse freed pages instead of faulting in fresh ones (merger/memory.py)
    keep_freed_memory()
    try:
        config = merger_config(args)
        factory = None
        if args.init_npz is not None:
            with np.load(args.init_npz) as data:
                factory = initial_core(
                    config,
                    {path: data[path].astype(np.float32) for path in data.files},
                    args.fragments,
                )
        elif not (args.run_dir / "wal").exists() and not (args.standby_of or args.peer):
            raise ConfigError(
                f"{args.run_dir} holds no log to resume; give --init-npz to start a new run"
            )
        shard, shards = parse_shard(args.shard)
        args.name = shard_name(args.name, shard, shards)
        if shard >= args.fragments and args.init_npz is not None:
            raise ConfigError(
                f"--shard {args.shard} owns no fragment of --fragments {args.fragments}: give fewer"
                " shards than fragments"
            )
        if shards > 1 and (args.standby_of or args.peer or args.replication_endpoint):
            raise ConfigError(
                "--shard with a standby (--standby-of, --peer, --replication-endpoint): a standby"
                " per shard is not built yet"
            )
        security = security_from_args(args, args.name, "merger")
        mode = args.replication or ("sync" if args.replication_endpoint else "off")
        replication = ReplicationConfig(
            mode,
            args.replication_endpoint,
            args.standby_of or args.peer,
            args.lease,
            bool(args.standby_of),
        )
        if args.standby_of and args.peer and args.peer != args.standby_of:
            raise ConfigError("--peer and --standby-of name the same merger: give one of them")
        service_config = ServiceConfig(
            args.run_dir,
            args.delta_endpoint,
            args.snapshot_endpoint,
            args.control_endpoint,
            sender=args.name,
            snapshots=snapshot_config(args),
            fsync=args.fsync,
            checkpoint_every=args.checkpoint_every,
            security=security,
            reassembly_bytes=(args.receive_mib << 20) * 2 // 3,
            held_bytes=(args.receive_mib << 20) // 3,
            peer_timeout_s=args.peer_timeout,
            metrics_port=args.metrics_port,
            metrics_host=args.metrics_host,
            replication=replication,
            shard=shard,
            shards=shards,
        )
        code, service = run_merger_roles(service_config, core_factory=factory)
    except (DlocoError, OSError, zmq.ZMQError) as error:
        print(f"dloco merger: {error}", file=sys.stderr)
        return 2
    if service is not None and service.storage_failed is not None:
        print(
            f"dloco merger: stopped: {service.storage_failed}; free space in {args.run_dir} and"
            " restart (the log resumes)",
            file=sys.stderr,
        )
    return code


def run_replay(args: argparse.Namespace) -> int:
    from dloco.merger.memory import keep_freed_memory
    from dloco.merger.recovery import replay, software_mismatch

    keep_freed_memory()
    folds = 0

    def on_fold(index, record, report, core) -> None:
        nonlocal folds
        folds += 1
        if folds % args.every == 0:
            print(
                f"record {index} fold fragment={record['fragment']} version={report.version}"
                f" sha256={core.digest()}"
            )

    try:
        mismatches = 0
        note = software_mismatch(args.logdir)
        if note is not None:
            print(f"dloco replay: note: {note}", file=sys.stderr)
        for position, expected, actual in replay(args.logdir, on_fold, strict=args.verify):
            status = "ok" if expected == actual else "MISMATCH"
            mismatches += expected != actual
            print(
                f"checkpoint at record {position}: {status} sha256={actual}"
                + ("" if expected == actual else f" expected={expected}")
            )
    except (DlocoError, OSError, KeyError) as error:
        print(f"dloco replay: {error}", file=sys.stderr)
        return 1
    if args.verify and mismatches:
        print(f"dloco replay: {mismatches} checkpoint(s) do not match the log", file=sys.stderr)
        return 1
    return 0
