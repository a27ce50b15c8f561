"""`dloco merger` and `dloco replay`: argument parsing and wiring only."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dloco.cliargs import from_args
from dloco.merger.config import (
    ConfigError,
    SnapshotConfig,
)
from dloco.merger.flags import add_merger_flags, merger_config
from dloco.merger.settings import ReplicationConfig, ServiceConfig
from dloco.protocol import DlocoError


def add_commands(commands: argparse._SubParsersAction, positive_int) -> None:
    merger = commands.add_parser(
        "merger", help="run the merger: fold deltas, publish snapshots, keep the log"
    )
    add_merger_flags(merger)
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


def run_merger(args: argparse.Namespace) -> int:
    import zmq

    from dloco.merger.memory import keep_freed_memory
    from dloco.merger.roles import run_merger_roles
    from dloco.merger.starting import initial_core, load_initial, npz_shapes
    from dloco.protocol.shards import parse as parse_shard

    # small freed blocks kept for the next folds, large ones given back (merger/memory.py)
    keep_freed_memory()
    try:
        config = merger_config(args)
        factory = None
        if args.init_npz is not None:
            # read when a fresh core is made (never when the log resumes), by a shard only for its
            # own fragments
            shard, path = parse_shard(args.shard), args.init_npz
            factory = initial_core(
                config,
                lambda: load_initial(path, args.fragments, *shard)[0],
                args.fragments,
                npz_shapes(path),
            )
        elif not (args.run_dir / "wal").exists() and not (args.standby_of or args.peer):
            raise ConfigError(
                f"{args.run_dir} holds no log to resume; give --init-npz to start a new run"
            )
        code, service = run_merger_roles(service_config(args), core_factory=factory)
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


def service_config(args: argparse.Namespace) -> ServiceConfig:
    """The process's settings from the flags, checked (ConfigError); sets `args.name` to the
    shard's name."""
    from dloco.bus.security import security_from_args
    from dloco.protocol.shards import parse as parse_shard
    from dloco.protocol.shards import shard_name

    shard, shards = parse_shard(args.shard)
    args.name = shard_name(args.name, shard, shards)
    if shard >= args.fragments and args.init_npz is not None:
        raise ConfigError(
            f"--shard {args.shard} owns no fragment of --fragments {args.fragments}: give fewer"
            " shards than fragments"
        )
    security = security_from_args(args, args.name, "merger")
    mode = args.replication or ("sync" if args.replication_endpoint else "off")
    replication = ReplicationConfig(
        mode,
        args.replication_endpoint,
        args.standby_of or args.peer,
        args.lease,
        bool(args.standby_of),
        tuple(url for url in args.etcd.split(",") if url.strip()),
        args.etcd_prefix or f"/dloco/{args.name}",
    )
    if args.standby_of and args.peer and args.peer != args.standby_of:
        raise ConfigError("--peer and --standby-of name the same merger: give one of them")
    return ServiceConfig(
        args.run_dir,
        args.delta_endpoint,
        args.snapshot_endpoint,
        args.control_endpoint,
        sender=args.name,
        snapshots=from_args(SnapshotConfig, args),
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


def run_replay(args: argparse.Namespace) -> int:
    from dloco.merger.memory import keep_freed_memory
    from dloco.merger.state.recovery import replay, software_mismatch

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
