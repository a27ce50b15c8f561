"""`dloco`: one command, one subcommand per process or tool.  Wiring only: parse, build, run."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dloco.cliargs import float_at_least, int_at_least, port_number
from dloco.sim import cli as plan

_positive_int = int_at_least(1)


def build_parser() -> argparse.ArgumentParser:
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
        choices=("decoupled", "sync-diloco", "sync-dp"),
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
            " 'kill:us-east@step=60,restart:us-east@us-west.step=150,kill:merger@folds=20,restart:merger@us-west.step=250'"
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
            "quality",
            "soak",
        ),
        help=(
            "the suite (suites/experiments.py, suites/quality.py and suites/soak.py say what each"
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
        "--sync-dp-on-bus",
        action="store_true",
        help=(
            "quality: run sync-dp as a cluster through the bus, not in one process (the same"
            " arithmetic; ~6x slower)"
        ),
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
    plan.add_parser(commands)
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
    tokenize = commands.add_parser(
        "tokenize",
        help="text to a token file (FILE.bin + FILE.json) that `dloco island --tokens` trains on",
    )
    tokenize.add_argument(
        "src",
        nargs="?",
        type=Path,
        default=None,
        help="file or folder of text (default: this Python's standard library sources)",
    )
    tokenize.add_argument(
        "--out",
        type=Path,
        required=True,
        metavar="FILE.bin",
        help="the token ids; FILE.json (and, for bpe, FILE.tokenizer.json) are written beside it",
    )
    tokenize.add_argument(
        "--tokenizer",
        choices=("bytes", "bpe"),
        default="bytes",
        help="bytes: each byte is a token (vocab 256); bpe: a byte-level BPE trained here on SRC",
    )
    tokenize.add_argument(
        "--vocab",
        type=_positive_int,
        default=None,
        help="bpe: the vocabulary to train (default 4096)",
    )
    tokenize.set_defaults(run=_tokenize)
    export = commands.add_parser(
        "export", help="write a run's global model (the merger's checkpoint) as a safetensors file"
    )
    sample = commands.add_parser("sample", help="text from a run's global model (the built-in LM)")
    for tool in (export, sample):
        tool.add_argument(
            "run_dir", type=Path, metavar="RUN_DIR", help="a run directory `dloco up` wrote"
        )
        tool.add_argument(
            "--checkpoint",
            type=int_at_least(0),
            default=None,
            metavar="N",
            help=(
                "the merger's checkpoint at log record N (merger/checkpoints/N.ckpt, as `dloco"
                " replay --verify` numbers them); default: the newest, after a clean stop the final"
                " model"
            ),
        )
        tool.add_argument(
            "--config",
            type=Path,
            default=None,
            help=(
                "the cluster file the run ran, for a run directory without task.json (made before"
                " runs recorded it)"
            ),
        )
    export.add_argument("--out", type=Path, required=True, metavar="FILE.safetensors")
    export.set_defaults(run=_export)
    sample.add_argument(
        "--prompt",
        required=True,
        help="the text to continue (UTF-8; the run's tokenizer's ids for a BPE token file)",
    )
    sample.add_argument(
        "--length",
        type=_positive_int,
        default=200,
        help="tokens (bytes for the byte LM) to generate (default 200)",
    )
    sample.add_argument(
        "--temperature",
        type=float_at_least(0),
        default=0.8,
        help="softmax temperature; 0: always the likeliest (default 0.8)",
    )
    sample.add_argument(
        "--top-k",
        type=int_at_least(0),
        default=40,
        help="sample among the K likeliest; 0: among all (default 40)",
    )
    sample.add_argument(
        "--seed", type=int, default=0, help="the same seed gives the same text (default 0)"
    )
    sample.set_defaults(run=_sample)

    from dloco.broker.main import add_commands as add_broker_commands

    add_broker_commands(commands, _positive_int)
    return parser


def _up(args: argparse.Namespace) -> int:
    import time

    from dloco.cluster import chaos, config, launcher
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
    except (launcher.LaunchError, DlocoError, OSError) as error:
        print(f"dloco up: {error}", file=sys.stderr)
        return 2


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


def _experiment(args: argparse.Namespace) -> int:
    import random
    import time

    from dloco.protocol import DlocoError
    from dloco.suites import experiments

    out = args.out or Path("runs") / f"experiment-{time.strftime('%Y%m%d-%H%M%S')}"
    try:
        runs = tuple(label.strip() for label in args.runs.split(",")) if args.runs else None
        if args.name == "quality":
            from dloco.suites import quality

            if args.reuse or args.steps or args.seconds:
                raise DlocoError(
                    "quality: runs are bounded by their budgets (--budgets); give --out to resume"
                    " an earlier one"
                )
            budgets = quality.parse_budgets(args.budgets) if args.budgets else None
            text = quality.run(
                out,
                quick=args.quick,
                config_path=args.config,
                budgets=budgets,
                only=runs,
                sync_dp_on_bus=args.sync_dp_on_bus,
            )
        elif args.name == "soak":
            from dloco.suites import soak

            if args.reuse or args.steps or args.seconds or args.runs or args.quick:
                raise DlocoError("soak: one run of --minutes, with --seed, --config and --out")
            seed = args.seed if args.seed is not None else random.randrange(1 << 31)
            text, passed = soak.run(out, args.minutes, seed, config_path=args.config)
            print(text)
            return 0 if passed else 1
        elif args.budgets or args.sync_dp_on_bus:
            raise DlocoError("--budgets and --sync-dp-on-bus are for the quality suite")
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


def _tokenize(args: argparse.Namespace) -> int:
    from dloco.island import tokenizing
    from dloco.protocol import DlocoError

    def progress(line: str) -> None:
        print(f"dloco tokenize: {line}", file=sys.stderr, flush=True)

    try:
        report = tokenizing.tokenize(
            args.src, args.out, tokenizing.TokenizeConfig(args.tokenizer, args.vocab), progress
        )
    except (DlocoError, OSError) as error:
        print(f"dloco tokenize: {error}", file=sys.stderr)
        return 2
    print(f"dloco tokenize: {report.summary()}")
    return 0


def _run_task(args: argparse.Namespace):
    """The run's task from --config when given, else from the run directory (None: read there)."""
    from dloco.cluster import config
    from dloco.cluster.records import run_task

    return run_task(config.load(args.config)) if args.config is not None else None


def _export(args: argparse.Namespace) -> int:
    from dloco.analysis import export
    from dloco.protocol import DlocoError

    try:
        model, meta = export.export(args.run_dir, args.out, args.checkpoint, _run_task(args))
    except DlocoError as error:
        print(f"dloco export: {error}", file=sys.stderr)
        return 2
    print(
        f"dloco export: wrote {args.out}: {len(model.params)} tensors, {model.count:,} parameters,"
        f" checkpoint at record {model.record}, fragment versions {list(model.versions)}, task"
        f" {meta['task']}"
    )
    return 0


def _sample(args: argparse.Namespace) -> int:
    from dloco.analysis import sampling
    from dloco.protocol import DlocoError

    try:
        got, model = sampling.sample(
            args.run_dir,
            args.prompt,
            args.length,
            args.temperature,
            args.top_k or None,
            args.seed,
            args.checkpoint,
            _run_task(args),
        )
    except DlocoError as error:
        print(f"dloco sample: {error}", file=sys.stderr)
        return 2
    print(got.text)
    print(
        f"dloco sample: {len(got.ids)} tokens after a {len(got.prompt_ids)}-token prompt,"
        f" checkpoint at record {model.record} (fragment versions {list(model.versions)}),"
        f" temperature {args.temperature:g}, top-k {args.top_k or 'all'}, seed {args.seed}",
        file=sys.stderr,
    )
    return 0


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
