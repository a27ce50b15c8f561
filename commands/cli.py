"""`dloco`: one command, one subcommand per process or tool.  Wiring only: parse, build, run.

Each package adds its own subcommands; the launcher's and the tools' are in dloco.run_commands
(up, experiment), dloco.compose_commands (status, prepare, report, compose, probe) and
dloco.model_commands (tokenize, export, sample, refold).
"""

from __future__ import annotations

import argparse
import sys

from dloco import compose_commands, model_commands, run_commands
from dloco.cliargs import int_at_least
from dloco.sim import cli as plan

_positive_int = int_at_least(1)


def build_parser() -> argparse.ArgumentParser:
    """Every subcommand, in the order `dloco --help` lists them."""
    parser = argparse.ArgumentParser(
        prog="dloco", description="Decoupled DiLoCo: islands, merger, broker and tools."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    from dloco.benchmarks.commands import add_commands as add_bench_commands

    add_bench_commands(commands, _positive_int)

    from dloco.merger.main import add_commands as add_merger_commands

    add_merger_commands(commands, _positive_int)

    from dloco.island.main import add_commands as add_island_commands

    add_island_commands(commands, _positive_int)

    from dloco.island.evaluator_main import add_commands as add_evaluator_commands

    add_evaluator_commands(commands)

    run_commands.add_up(commands)
    compose_commands.add_status(commands)
    run_commands.add_experiment(commands)
    compose_commands.add_prepare(commands)
    compose_commands.add_report(commands)
    compose_commands.add_compose(commands)
    compose_commands.add_deploy(commands)
    plan.add_parser(commands)
    compose_commands.add_probe(commands)

    from dloco.cluster.etcd import add_command as add_etcd_command

    add_etcd_command(commands)
    model_commands.add_tokenize(commands)
    model_commands.add_export(commands)
    model_commands.add_sample(commands)
    model_commands.add_refold(commands)

    from dloco.broker.main import add_commands as add_broker_commands

    add_broker_commands(commands, _positive_int)
    return parser


def stop_with_launcher() -> bool:
    """A process that `dloco up` started (DLOCO_LAUNCHER_PID in its environment) asks the kernel for
    a SIGTERM when that launcher dies, however it dies: a SIGKILLed launcher must not leave islands
    training for ever.  Returns False when the launcher is gone already.  Linux only; elsewhere
    True.
    """
    import os

    # not for this process's own children (prepare runs one)
    launcher = os.environ.pop("DLOCO_LAUNCHER_PID", None)
    if launcher is None or not sys.platform.startswith("linux"):
        return True
    import ctypes
    import signal

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    # checked after the request: a launcher dying in between is seen here
    return str(os.getppid()) == launcher


def main(argv: list[str] | None = None) -> int:
    if not stop_with_launcher():
        print(
            "dloco: the dloco up that started this process is gone; not starting", file=sys.stderr
        )
        return 1
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
