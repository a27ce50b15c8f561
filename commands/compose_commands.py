"""The commands a compose file's services run besides the processes (`dloco prepare`, `dloco
status`, `dloco probe`), the compose file itself (`dloco compose`) and the report of a run
(`dloco report`, which `dloco up` writes by itself at the end).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dloco.cliargs import port_number


def add_status(commands: argparse._SubParsersAction) -> None:
    """`dloco status RUN_DIR`: the live status page of a run directory."""
    status = commands.add_parser(
        "status", help="serve the live status page of a run directory (a running or a finished run)"
    )
    status.add_argument("run_dir", type=Path)
    status.add_argument(
        "--port",
        type=port_number(0),
        default=8080,
        help="http://HOST:PORT/ (default 8080; 0: a free port)",
    )
    status.add_argument(
        "--host",
        default="127.0.0.1",
        help="the address to bind (default 127.0.0.1: this machine only)",
    )
    status.set_defaults(run=_status)


def add_prepare(commands: argparse._SubParsersAction) -> None:
    """`dloco prepare`: a run directory's keys, allow-lists and initial model."""
    prepare = commands.add_parser(
        "prepare",
        help=(
            "write a run directory's CURVE keys, allow-lists and initial model (compose's first"
            " service)"
        ),
    )
    prepare.add_argument(
        "--config",
        type=Path,
        default=None,
        help="cluster file (TOML); default: the shipped 4-region profile",
    )
    prepare.add_argument("--run-dir", type=Path, required=True)
    prepare.set_defaults(run=_prepare)


def add_report(commands: argparse._SubParsersAction) -> None:
    """`dloco report RUN_DIR`: a run's report.md and plots."""
    report = commands.add_parser(
        "report",
        help="write RUN_DIR/report.md and its plots (dloco up does at the end; for compose runs)",
    )
    report.add_argument("run_dir", type=Path, metavar="RUN_DIR")
    report.add_argument(
        "--config",
        type=Path,
        default=None,
        help="the cluster file it ran (default: the shipped 4-region profile)",
    )
    report.set_defaults(run=_report)


def add_compose(commands: argparse._SubParsersAction) -> None:
    """`dloco compose`: the docker-compose file of a cluster file."""
    compose = commands.add_parser(
        "compose", help="print the docker-compose file for a cluster file"
    )
    compose.add_argument(
        "--config",
        type=Path,
        default=None,
        help="cluster file (TOML); default: the shipped 4-region profile",
    )
    compose.add_argument(
        "--profile-path",
        default=None,
        help="the cluster file's path as the compose file sees it (default: --config, relative)",
    )
    compose.set_defaults(run=_compose)


def add_deploy(commands: argparse._SubParsersAction) -> None:
    """`dloco deploy`: a cluster file as bundles for separate hosts (cluster/deploy.py)."""
    deploy = commands.add_parser(
        "deploy",
        help=(
            "write a cluster file as one folder per host: the hub (broker, merger, evaluator) and"
            " each region's island, each with its own keys, a compose file and a README"
        ),
    )
    deploy.add_argument("config", type=Path, help="cluster file (TOML)")
    deploy.add_argument(
        "--hub", required=True, help="the hub's host name or address, as the regions reach it"
    )
    deploy.add_argument("--out", type=Path, required=True, help="a new folder for the bundles")
    deploy.add_argument(
        "--standby-host",
        help="with [merger] standby: the second hub host, where the merger's hot standby runs",
    )
    deploy.add_argument(
        "--etcd",
        default="",
        metavar="URL,URL",
        help=(
            'with a standby and [merger] failover = "etcd": the client URLs of an etcd cluster of'
            " your own for the pair's lease (default: one etcd member in the hub's bundle)"
        ),
    )
    deploy.set_defaults(run=_deploy)


def add_probe(commands: argparse._SubParsersAction) -> None:
    """`dloco probe`: a compose service's health check."""
    probe = commands.add_parser(
        "probe", help="health check: exit 0 when every TCP endpoint accepts and every file is fresh"
    )
    probe.add_argument("targets", nargs="+", help="tcp://HOST:PORT or a file path")
    probe.add_argument(
        "--max-age",
        type=float,
        default=120.0,
        help="seconds since a file's last change (default 120)",
    )
    probe.set_defaults(run=_probe)


def _status(args: argparse.Namespace) -> int:
    import signal
    import time

    from dloco.cluster import status
    from dloco.cluster.records import RunCluster
    from dloco.protocol import DlocoError

    try:
        regions = [region.name for region in RunCluster.read(args.run_dir).regions]
        server = status.serve(args.run_dir, regions, args.port, args.host)
    except (DlocoError, OSError) as error:
        print(f"dloco status: {error}", file=sys.stderr)
        return 2
    print(
        f"dloco status: http://{args.host}:{server.server_address[1]}/ (Ctrl-C stops)", flush=True
    )
    stopping = []
    # a container's stop, a launcher's, a terminal's Ctrl-C: exit 0
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.append(True))
    while not stopping:
        time.sleep(0.2)
    server.shutdown()
    server.server_close()
    return 0


def _prepare(args: argparse.Namespace) -> int:
    from dloco.cluster import config, launcher
    from dloco.protocol import DlocoError

    try:
        launcher.prepare(config.load(args.config), args.run_dir)
    except (DlocoError, OSError) as error:
        print(f"dloco prepare: {error}", file=sys.stderr)
        return 2
    print(f"dloco prepare: {args.run_dir} has keys, allow-lists and init.npz")
    return 0


def _report(args: argparse.Namespace) -> int:
    from dloco.analysis.report import write_report
    from dloco.cluster import config
    from dloco.cluster.records import outline
    from dloco.protocol import DlocoError

    try:
        if not (args.run_dir / "merger").is_dir():
            raise DlocoError(f"{args.run_dir} is not a run directory (no merger/ in it)")
        path = write_report(outline(config.load(args.config)), args.run_dir, {})
    except (DlocoError, OSError) as error:
        print(f"dloco report: {error}", file=sys.stderr)
        return 2
    print(f"dloco report: {path}")
    return 0


def _compose(args: argparse.Namespace) -> int:
    import os

    from dloco.cluster import compose, config
    from dloco.protocol import DlocoError

    try:
        cluster = config.load(args.config)
    except DlocoError as error:
        print(f"dloco compose: {error}", file=sys.stderr)
        return 2
    profile = args.profile_path or (
        os.path.relpath(args.config) if args.config else "cluster/profiles/default.toml"
    )
    try:
        sys.stdout.write(
            compose.render(cluster, profile, args.config.parent if args.config else None)
        )
    except DlocoError as error:
        print(f"dloco compose: {error}", file=sys.stderr)
        return 2
    return 0


def _probe(args: argparse.Namespace) -> int:
    import os
    import socket
    import time
    from urllib.parse import urlsplit

    failed = []
    for target in args.targets:
        if target.startswith("tcp://"):
            address = urlsplit(target)
            try:
                socket.create_connection((address.hostname, address.port), timeout=2).close()
            except (OSError, ValueError) as error:
                failed.append(f"{target}: {error}")
        else:
            try:
                age = time.time() - os.path.getmtime(target)
            except OSError as error:
                failed.append(f"{target}: {error.strerror}")
                continue
            if age > args.max_age:
                failed.append(f"{target}: not written for {age:.0f} s (> {args.max_age:g})")
    for line in failed:
        print(f"dloco probe: {line}", file=sys.stderr)
    return 1 if failed else 0


def _deploy(args: argparse.Namespace) -> int:
    from dloco.cluster import config, deploy, launcher
    from dloco.protocol import DlocoError

    try:
        bundles = deploy.write(
            config.load(args.config),
            args.hub,
            args.out,
            launcher.prepare,
            standby=args.standby_host,
            etcd_urls=args.etcd,
        )
    except (DlocoError, OSError) as error:
        print(f"dloco deploy: {str(error).removeprefix('deploy: ')}", file=sys.stderr)
        return 2
    for bundle in bundles:
        print(f"dloco deploy: {bundle}/ (its README.md says where it goes and how to start it)")
    return 0
