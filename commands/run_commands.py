"""`dloco up` and `dloco experiment`: a cluster run on this machine, or a named suite of them."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dloco.cliargs import int_at_least, port_number

_positive_int = int_at_least(1)


# Over 60 lines: `dloco up`'s flags, a table read top to bottom.
def add_up(commands: argparse._SubParsersAction) -> None:
    """`dloco up`: the cluster file's processes, a live view, a report."""
    up = commands.add_parser(
        "up",
        help=(
            "the main job: broker, merger and one island per region on this machine, with a live"
            " view and a report"
        ),
    )
    up.add_argument(
        "--config",
        type=Path,
        default=None,
        help="cluster file (TOML); default: the shipped 4-region profile",
    )
    up.add_argument(
        "--run-dir",
        type=Path,
        default=None,
        help="where logs, metrics, the merger's log and the report go (default runs/<time>)",
    )
    up.add_argument(
        "--duration",
        type=float,
        default=None,
        help=(
            "seconds to run (overrides the cluster file); with --steps, the limit after which the"
            " run has failed"
        ),
    )
    up.add_argument(
        "--steps",
        type=_positive_int,
        default=None,
        metavar="N",
        help=(
            "the run ends once every island has trained N steps (every life) and the chaos schedule"
            " has run (overrides the cluster file's run.max_steps): runs bounded by work,"
            " --duration their limit"
        ),
    )
    up.add_argument(
        "--tokens",
        type=_positive_int,
        default=None,
        metavar="N",
        help=(
            "a budget: the run ends once the cluster has trained N tokens (every island, every"
            " life), and every island's schedule decays over the cluster's progress towards N"
            " (overrides run.tokens; --duration its limit)"
        ),
    )
    up.add_argument(
        "--mode",
        choices=("decoupled", "sync-diloco", "sync-avg", "sync-dp"),
        default=None,
        help=(
            "how the islands synchronise (overrides the cluster file): this project, or a"
            " synchronous baseline"
        ),
    )
    up.add_argument(
        "--compose",
        type=Path,
        default=None,
        metavar="FILE",
        help=(
            "run this docker-compose file's services as local processes instead (service name ->"
            " 127.0.0.1)"
        ),
    )
    up.add_argument(
        "--services",
        default=None,
        help="with --compose: comma-separated services to run (and what they depend on)",
    )
    up.add_argument(
        "--chaos",
        default=None,
        metavar="SCHEDULE",
        help=(
            "kill -9 / restart processes when the run reaches a point: an island's steps, the"
            " merger's folds or seconds, e.g."
            " 'kill:us-east@step=60,restart:us-east@us-west.step=150,"
            "kill:merger@folds=20,restart:merger@us-west.step=250'"
            " (overrides the cluster file's [[chaos]]; cluster/chaos.py)"
        ),
    )
    up.add_argument(
        "--status-port",
        type=port_number(-1),
        default=0,
        metavar="PORT",
        help=(
            "serve the live status page at http://127.0.0.1:PORT/ (default 0: a free port, printed"
            " at start; -1: no page)"
        ),
    )
    up.set_defaults(run=_up)


# Over 60 lines: `dloco experiment`'s flags, a table read top to bottom.
def add_experiment(commands: argparse._SubParsersAction) -> None:
    """`dloco experiment NAME`: a suite of runs side by side."""
    experiment = commands.add_parser(
        "experiment", help="run a named suite of cluster runs side by side; Markdown + PNG plots"
    )
    experiment.add_argument(
        "name",
        choices=(
            "speedup",
            "heterogeneous",
            "faults",
            "quantization",
            "quantization-sync",
            "adoption",
            "merging",
            "downlink",
            "bytes",
            "links",
            "quality",
            "soak",
        ),
        help=(
            "the suite (suites/catalog.py, suites/quality.py and suites/soak.py say what each"
            " measures)"
        ),
    )
    experiment.add_argument(
        "--minutes", type=float, default=30.0, help="soak: the run's length (default 30)"
    )
    experiment.add_argument(
        "--seed",
        type=int,
        default=None,
        help="soak: the fault schedule's seed (default: drawn, and printed)",
    )
    experiment.add_argument(
        "--budgets",
        default=None,
        metavar="N,N,...",
        help=(
            "quality: the cluster token budgets, K/M/G decimal (default 1M,4M,16M; --quick:"
            " 49152,147456)"
        ),
    )
    experiment.add_argument(
        "--seeds",
        default=None,
        metavar="N,N,...",
        help="quality: the seeds of every mode and budget (model init and data order; default 0)",
    )
    experiment.add_argument(
        "--dp-lr",
        type=float,
        default=None,
        metavar="LR",
        help="quality: sync-dp's peak learning rate at the global batch (default: the tuned one)",
    )
    experiment.add_argument(
        "--diloco-outer",
        default=None,
        metavar="LR,MOMENTUM",
        help="quality: sync-diloco's outer Nesterov step (default: the tuned one)",
    )
    experiment.add_argument(
        "--tune",
        choices=("sync-dp", "sync-diloco", "decoupled"),
        default=None,
        help=(
            "quality: run that mode's tuning grid at the first budget instead (sync-dp: its"
            " peak lr; sync-diloco: outer lr x momentum at H = 12 and 48; decoupled: H from 6"
            " to 384, and at the profile's H its outer lr with and without momentum and 1, 2 or 6"
            " fragments), read on validation; --runs picks settings by label"
        ),
    )
    experiment.add_argument(
        "--results",
        type=Path,
        default=None,
        metavar="DIR",
        help=(
            "quality: write each run's record there as it lands (default OUT/results; the"
            " committed ones are in experiments/results/quality)"
        ),
    )
    experiment.add_argument(
        "--from-results",
        type=Path,
        action="append",
        default=[],
        metavar="DIR",
        help="quality: run nothing; tabulate and plot the records in DIR (repeatable)",
    )
    experiment.add_argument(
        "--quick",
        action="store_true",
        help=(
            "tiny model, some suites fewer runs, each bounded by work (96-192 steps per island):"
            " checks directions, not magnitudes"
        ),
    )
    experiment.add_argument(
        "--seconds",
        type=float,
        default=None,
        help=(
            "seconds per run (default: the suite's, 150-300); with --steps or --quick, the limit of"
            " a run"
        ),
    )
    experiment.add_argument(
        "--steps",
        type=_positive_int,
        default=None,
        metavar="N",
        help="bound every run by work: it ends once every island has trained N steps",
    )
    experiment.add_argument(
        "--config",
        type=Path,
        default=None,
        help="cluster file the runs start from (default: the shipped profile)",
    )
    experiment.add_argument(
        "--out",
        type=Path,
        default=None,
        help="where runs, NAME.md and experiments/*.png go (default runs/experiment-<time>)",
    )
    experiment.add_argument(
        "--runs",
        default=None,
        help="only these runs of the suite, comma-separated labels (e.g. fp32,int4)",
    )
    experiment.add_argument(
        "--from",
        dest="reuse",
        type=Path,
        action="append",
        default=[],
        metavar="DIR",
        help=(
            "run nothing: tabulate the runs in an earlier --out folder (repeat --from to put"
            " repeats in one table)"
        ),
    )
    experiment.set_defaults(run=_experiment)


def _up(args: argparse.Namespace) -> int:
    import time

    from dloco.cluster import chaos, config, launcher
    from dloco.cluster.processes import LaunchError
    from dloco.protocol import DlocoError

    try:
        schedule = chaos.parse(args.chaos) if args.chaos is not None else None
        cluster = (
            config.load(args.config)
            .with_duration(args.duration)
            .with_mode(args.mode)
            .with_steps(args.steps)
            .with_tokens(args.tokens)
            .with_chaos(schedule)
        )
        if args.services is not None and args.compose is None:
            raise config.ConfigError("--services needs --compose")
    except DlocoError as error:
        print(f"dloco up: {error}", file=sys.stderr)
        return 2
    run_dir = args.run_dir or Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    wanted = [s.strip() for s in args.services.split(",") if s.strip()] if args.services else None
    try:
        return launcher.run(
            cluster,
            run_dir,
            compose_file=args.compose,
            wanted=wanted,
            status_port=None if args.status_port < 0 else args.status_port,
        )
    except (LaunchError, DlocoError, OSError) as error:
        print(f"dloco up: {error}", file=sys.stderr)
        return 2


def _quality(args: argparse.Namespace, out: Path, runs: tuple[str, ...] | None) -> str:
    from dloco.protocol import DlocoError
    from dloco.suites import quality, qualityplan

    if args.reuse or args.steps or args.seconds:
        raise DlocoError(
            "quality: runs are bounded by their budgets (--budgets); give --out to resume an"
            " earlier one"
        )
    if args.from_results:
        return quality.run_from_results(args.from_results, out, args.config)
    return quality.run(
        out,
        quick=args.quick,
        config_path=args.config,
        budgets=qualityplan.parse_budgets(args.budgets) if args.budgets else None,
        only=runs,
        settings=qualityplan.parse_settings(args.seeds, args.dp_lr, args.diloco_outer),
        tune=args.tune,
        results_dir=args.results,
    )


def _experiment(args: argparse.Namespace) -> int:
    import random
    import time

    from dloco.protocol import DlocoError
    from dloco.suites import experiments

    out = args.out or Path("runs") / f"experiment-{time.strftime('%Y%m%d-%H%M%S')}"
    try:
        runs = tuple(label.strip() for label in args.runs.split(",")) if args.runs else None
        if args.name == "quality":
            text = _quality(args, out, runs)
        elif args.name == "soak":
            from dloco.suites import soak

            if args.reuse or args.steps or args.seconds or args.runs or args.quick:
                raise DlocoError("soak: one run of --minutes, with --seed, --config and --out")
            seed = args.seed if args.seed is not None else random.randrange(1 << 31)
            text, passed = soak.run(out, args.minutes, seed, config_path=args.config)
            print(text)
            return 0 if passed else 1
        elif args.budgets or args.seeds or args.tune or args.from_results or args.results:
            raise DlocoError(
                "--budgets, --seeds, --tune, --results and --from-results are for the quality suite"
            )
        else:
            text = experiments.run(
                args.name,
                out,
                quick=args.quick,
                config_path=args.config,
                seconds=args.seconds,
                only=runs,
                reuse=tuple(args.reuse),
                steps=args.steps,
            )
    except (DlocoError, OSError) as error:
        print(f"dloco experiment: {error}", file=sys.stderr)
        return 130 if getattr(error, "interrupted", False) else 2
    print(text)
    print(
        f"dloco experiment: written {out / (args.name + '.md')} and {out / 'experiments'}/",
        file=sys.stderr,
    )
    return 0
