"""`dloco plan`: its arguments and what it prints."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from dloco.cliargs import float_at_least, int_at_least
from dloco.protocol.errors import DlocoError

PRESETS = ("seed", "seed-every-fold")


# Over 60 lines: the parser's flags, a table read top to bottom.
def add_parser(commands) -> None:
    plan = commands.add_parser(
        "plan",
        help=(
            "simulate a cluster at any scale (virtual time, the merger's and islands' own decision"
            " code): utilisation, speed against synchronous training, bytes, the merger's load,"
            " goodput"
        ),
    )
    plan.add_argument(
        "scenario",
        nargs="?",
        type=Path,
        default=None,
        help="a scenario file (TOML; docs/planning.md); default: --preset",
    )
    plan.add_argument(
        "--preset",
        choices=PRESETS,
        default="seed",
        help=(
            "seed: the seed's 12B run on four US regions, snapshots held to one per round;"
            " seed-every-fold: every fold goes down (default seed)"
        ),
    )
    plan.add_argument(
        "--hours",
        type=float_at_least(0.01),
        default=None,
        help="simulated hours (default: the scenario's)",
    )
    plan.add_argument(
        "--interval",
        type=int_at_least(1),
        default=None,
        metavar="H",
        help="inner steps between two deltas of a fragment (islands given their own keep it)",
    )
    plan.add_argument(
        "--fragments",
        type=int_at_least(1),
        default=None,
        metavar="P",
        help="fragments of the model",
    )
    plan.add_argument(
        "--mtbf-hours",
        type=float_at_least(0.01),
        default=None,
        help="failures: mean hours between failures per island",
    )
    plan.add_argument(
        "--down-minutes",
        type=float_at_least(0),
        default=10.0,
        help="with --mtbf-hours: minutes a failed island is down (default 10)",
    )
    plan.add_argument(
        "--target-util",
        type=_targets,
        default=None,
        metavar="U[,U...]",
        help=(
            "also print, for each U (0 < U < 1), the link speed from which the steady utilisation"
            " that counts is at least U, in each mode (e.g. 0.5,0.9,0.99)"
        ),
    )
    plan.add_argument(
        "--scale",
        default="all",
        metavar="all|each|ISLAND",
        help=(
            "with --target-util: scale every link together (default), each island's in turn, or one"
            " island's"
        ),
    )
    plan.add_argument(
        "--window-rounds",
        type=int_at_least(1),
        default=None,
        metavar="N",
        help="with --target-util: simulate N rounds of the slowest island per probe (default 20)",
    )
    plan.add_argument("--json", action="store_true", help="print JSON instead of Markdown")
    plan.add_argument(
        "--plots",
        type=Path,
        default=None,
        metavar="DIR",
        help=(
            "also write utilisation against bandwidth and goodput against failure rate as PNGs (a"
            " minute or more)"
        ),
    )
    plan.add_argument(
        "--calibrate",
        type=Path,
        default=None,
        metavar="RUN_DIR",
        help="instead: simulate a finished `dloco up` run and print predicted against measured",
    )
    plan.add_argument(
        "--config",
        type=Path,
        default=None,
        help=(
            "with --calibrate: the cluster file the run ran, for a run directory without"
            " cluster.json"
        ),
    )
    plan.set_defaults(run=run)


def _targets(text: str) -> list[float]:
    try:
        targets = [float(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--target-util takes numbers in (0, 1), comma-separated, got {text!r}"
        ) from None
    return targets


def scenario_of(args):
    from dloco.sim import presets, scenariofile

    s = (
        scenariofile.load(args.scenario)
        if args.scenario is not None
        else presets.seed(held=args.preset == "seed")
    )
    if args.hours is not None:
        s = dataclasses.replace(s, duration_s=args.hours * 3600)
    if args.interval is not None or args.fragments is not None:
        s = dataclasses.replace(
            s, interval=args.interval or s.interval, fragments=args.fragments or s.fragments
        )
    if args.mtbf_hours is not None:
        s = s.with_mtbf(args.mtbf_hours * 3600, args.down_minutes * 60)
    return s


def run(args: argparse.Namespace) -> int:
    from dloco.sim import plan, planreport, targetutil

    try:
        if args.calibrate is not None:
            from dloco.sim import calibrate

            result = calibrate.calibrate(args.calibrate, args.config)
            print(
                calibrate.to_json(result)
                if args.json
                else calibrate.markdown(result, args.calibrate)
            )
            return 0
        for target in args.target_util or []:
            targetutil.require_target(target)
        s = scenario_of(args)
        print(
            f"dloco plan: simulating {len(s.islands)} islands for {s.duration_s / 3600:.2f} h ...",
            file=sys.stderr,
        )
        report = plan.plan(s)
        target = None
        if args.target_util is not None:
            target = targetutil.target_util(
                s, args.target_util, args.scale, args.window_rounds or targetutil.TARGET_ROUNDS
            )
        if args.json:
            print(planreport.write_json(report | ({"target_util": target} if target else {})))
        else:
            print(planreport.markdown(report, target))
        if args.plots is not None:
            from dloco.sim import plots

            for path in plots.write(
                s, args.plots, progress=lambda line: print(f"dloco plan: {line}", file=sys.stderr)
            ):
                print(f"dloco plan: wrote {path}", file=sys.stderr)
    except DlocoError as error:
        print(f"dloco plan: {error}", file=sys.stderr)
        return 2
    return 0
