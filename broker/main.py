"""`dloco broker` and `dloco keys`: argument parsing and wiring only."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dloco.cliargs import add_metrics_flags


def add_commands(commands: argparse._SubParsersAction, positive_int) -> None:
    add_broker_command(commands, positive_int)
    add_keys_command(commands)


def add_broker_command(commands: argparse._SubParsersAction, positive_int) -> None:
    """`dloco broker`: the buses' endpoints, keys, queue budget and metrics."""
    from dloco.broker.proxy import BrokerConfig

    broker = commands.add_parser(
        "broker", help="run the broker: XSUB/XPUB proxies for the delta and snapshot buses"
    )
    broker.add_argument(
        "--delta-in", default="tcp://*:5555", help="XSUB for delta publishers (islands)"
    )
    broker.add_argument(
        "--delta-out", default="tcp://*:5556", help="XPUB for delta subscribers (merger)"
    )
    broker.add_argument(
        "--snapshot-in", default="tcp://*:5557", help="XSUB for snapshot publishers (merger)"
    )
    broker.add_argument(
        "--snapshot-out", default="tcp://*:5558", help="XPUB for snapshot subscribers (islands)"
    )
    broker.add_argument(
        "--keys", type=Path, help="key directory holding broker.key_secret (CURVE, the default)"
    )
    broker.add_argument(
        "--allow", type=Path, help="directory of accepted client public keys (*.key)"
    )
    broker.add_argument(
        "--insecure", action="store_true", help="plaintext, no authentication (prints a warning)"
    )
    broker.add_argument(
        "--memory-mib",
        type=positive_int,
        default=BrokerConfig.memory_bytes >> 20,
        help="queue budget per socket, MiB",
    )
    broker.add_argument(
        "--chunk-bytes",
        type=positive_int,
        default=BrokerConfig.chunk_bytes,
        help="typical message size, to size high-water marks",
    )
    broker.add_argument(
        "--stats-every",
        type=float,
        default=BrokerConfig.stats_every_s,
        help="seconds between counter log lines",
    )
    add_metrics_flags(broker)
    broker.set_defaults(run=run_broker)


def add_keys_command(commands: argparse._SubParsersAction) -> None:
    """`dloco keys`: key pairs to create, and optionally the allow-list role they get."""
    keys = commands.add_parser("keys", help="create CURVE key pairs (mode 0600), one per component")
    keys.add_argument("directory", type=Path)
    keys.add_argument("names", nargs="+", help="e.g. broker merger island-0 island-1")
    keys.add_argument(
        "--allow",
        type=Path,
        help="also list the new public keys in this allow-list directory, under --role",
    )
    keys.add_argument(
        "--role",
        choices=("island", "merger", "observer"),
        help="the role the keys get in --allow (bus/keys.py SOCKET_ROLES)",
    )
    keys.set_defaults(run=run_keys)


def run_broker(args: argparse.Namespace) -> int:
    import zmq

    from dloco.broker.proxy import Broker, BrokerConfig, BusEndpoints
    from dloco.bus.security import Security
    from dloco.protocol import DlocoError
    from dloco.telemetry.logs import configure_logging

    log = configure_logging("broker")
    try:
        security = Security(None, "broker")
        if args.insecure:
            if args.keys or args.allow:
                raise DlocoError("--insecure contradicts --keys/--allow")
            print(
                "dloco broker: WARNING: --insecure: traffic is plaintext and anyone can connect",
                file=sys.stderr,
            )
        else:
            if not (args.keys and args.allow):
                raise DlocoError(
                    "CURVE is on by default: give --keys DIR (with broker.key_secret) and --allow"
                    " DIR, or --insecure"
                )
            security = Security(Path(args.keys), "broker", Path(args.allow))
        config = BrokerConfig(
            (
                BusEndpoints("delta", args.delta_in, args.delta_out),
                BusEndpoints("snapshot", args.snapshot_in, args.snapshot_out),
            ),
            memory_bytes=args.memory_mib << 20,
            chunk_bytes=args.chunk_bytes,
            security=security,
            stats_every_s=args.stats_every,
            metrics_port=args.metrics_port,
            metrics_host=args.metrics_host,
        )
        broker = Broker(config, log)
    except (DlocoError, OSError) as error:
        print(f"dloco broker: {error}", file=sys.stderr)
        return 2
    # a malformed or busy endpoint
    except zmq.ZMQError as error:
        print(f"dloco broker: cannot bind: {error}", file=sys.stderr)
        return 2
    return broker.run()


def run_keys(args: argparse.Namespace) -> int:
    from dloco.bus.keys import create_keys, write_allow_list
    from dloco.protocol import DlocoError

    try:
        if (args.allow is None) != (args.role is None):
            raise DlocoError(
                "--allow and --role go together: the allow-list folder and the role the keys get"
                " in it"
            )
        for path in create_keys(args.directory, args.names):
            print(path)
        if args.allow is not None:
            write_allow_list(args.directory, args.allow, {args.role: args.names})
            print(f"listed {', '.join(args.names)} as {args.role} in {args.allow / args.role}")
    except (DlocoError, OSError) as error:
        print(f"dloco keys: {error}", file=sys.stderr)
        return 2
    return 0
