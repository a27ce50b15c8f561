"""`dloco bench SUITE`: the benchmarks' command lines (each suite is benchmarks/<suite>.py: run,
summary)."""

from __future__ import annotations

import argparse
import json
import sys

from dloco.cliargs import float_at_least
from dloco.merger.config import OuterConfig, SnapshotConfig


# Over 60 lines: the bench suites' flags, a table read top to bottom, one suite after another.
def add_commands(commands: argparse._SubParsersAction, positive_int) -> None:
    """`dloco bench SUITE` and each suite's flags; `run_bench` runs the suite."""
    bench = commands.add_parser("bench", help="run a benchmark and print its figures")
    suites = bench.add_subparsers(dest="suite", required=True, metavar="SUITE")
    codec = suites.add_parser(
        "codec", help="quantize/dequantize/frame ~100 MB of deltas with every codec vs memcpy"
    )
    codec.add_argument(
        "--json", action="store_true", help="print one JSON object instead of a table"
    )
    codec.add_argument(
        "--mib", type=positive_int, default=100, help="MiB of float32 deltas (default 100)"
    )
    codec.add_argument(
        "--block",
        type=positive_int,
        default=256,
        help="values per quantization block (power of two, default 256)",
    )
    codec.add_argument(
        "--reps",
        type=positive_int,
        default=5,
        help="timed repetitions; medians are reported (default 5)",
    )
    codec.add_argument(
        "--threads", type=positive_int, default=None, help="codec threads (default: min(4, cores))"
    )
    codec.set_defaults(
        run=run_bench,
        bench_params={"total_mib": "mib", "block": "block", "reps": "reps", "threads": "threads"},
    )
    merger = suites.add_parser(
        "merger",
        help="merger ingest: receive+decode+dequantize+fold+log of int4 deltas, GB/s of wire bytes",
    )
    merger.add_argument("--json", action="store_true", help="print one JSON object")
    merger.add_argument(
        "--params", type=positive_int, default=25_165_824, help="model size (default 25,165,824)"
    )
    merger.add_argument(
        "--islands", type=positive_int, default=4, help="deltas per fold (default 4)"
    )
    merger.add_argument("--fragments", type=positive_int, default=4)
    merger.add_argument("--rounds", type=positive_int, default=2)
    merger.add_argument(
        "--passes",
        type=positive_int,
        default=3,
        help="timed steady-state passes after the cold one; the median is reported (default 3)",
    )
    merger.add_argument(
        "--standby",
        action="store_true",
        help=(
            "passes with the log streamed to a standby process in sync mode, alternating with"
            " passes without: the cost"
        ),
    )
    merger.set_defaults(
        run=run_bench,
        bench_params={
            "params": "params",
            "fragments": "fragments",
            "islands": "islands",
            "rounds": "rounds",
            "passes": "passes",
            "standby": "standby",
        },
    )
    merger.add_argument(
        "--shards",
        type=shard_counts,
        default=None,
        metavar="S,S,...",
        help=(
            "instead: the same deltas folded by S merger shard processes side by side, for each S"
            " (e.g. 1,2): aggregate ingest, its ratio to the first S, and each shard's CPU"
            " (benchmarks/merger_shards.py)"
        ),
    )
    failover = suites.add_parser(
        "failover",
        help=(
            "time from a primary merger's kill -9 to the first fold of its standby (median of runs)"
        ),
    )
    failover.add_argument("--json", action="store_true", help="print one JSON object")
    failover.add_argument("--runs", type=positive_int, default=5, help="failovers (default 5)")
    failover.add_argument(
        "--lease",
        type=float_at_least(0.1),
        default=3.0,
        help="the mergers' lease in seconds (default 3)",
    )
    failover.add_argument(
        "--etcd",
        action="store_true",
        help="each run also with the lease in etcd (a local member; needs the etcd binary)",
    )
    failover.set_defaults(
        run=run_bench, bench_params={"runs": "runs", "lease_s": "lease", "etcd": "etcd"}
    )
    island = suites.add_parser(
        "island", help="island steps/s with int4 publishing on vs standalone, side by side"
    )
    island.add_argument("--json", action="store_true", help="print one JSON object")
    island.add_argument(
        "--steps", type=positive_int, default=300, help="timed steps per run (default 300)"
    )
    island.add_argument(
        "--rounds",
        type=positive_int,
        default=3,
        help="alternating standalone/publishing pairs (default 3)",
    )
    island.set_defaults(run=run_bench, bench_params={"steps": "steps", "rounds": "rounds"})
    adoption = suites.add_parser(
        "adoption",
        help="an island's parameter read and fragment write per adoption vs one training step",
    )
    adoption.add_argument("--json", action="store_true", help="print one JSON object")
    adoption.add_argument("--reps", type=positive_int, default=20, help="repetitions (default 20)")
    adoption.set_defaults(run=run_bench, bench_params={"reps": "reps"})
    bus = suites.add_parser(
        "bus", help="1 MiB messages: raw PUB->SUB vs through the broker vs broker with CURVE"
    )
    bus.add_argument("--json", action="store_true", help="print one JSON object")
    bus.add_argument("--messages", type=positive_int, default=400)
    bus.add_argument(
        "--repeats",
        type=positive_int,
        default=3,
        help="interleaved measurements per path; medians reported",
    )
    bus.set_defaults(run=run_bench, bench_params={"count": "messages", "repeats": "repeats"})
    attacks = suites.add_parser(
        "attacks",
        help=(
            "poisoning by one island key (ramps, bursts, claimed tokens, 1e6x after a restart or"
            " takeover): how far each moves the merger's model, in multiples of honest folds"
        ),
    )
    attacks.add_argument("--json", action="store_true", help="print one JSON object")
    attacks.add_argument(
        "--islands", default="2,4", help="cluster sizes, the attacker included (default 2,4)"
    )
    attacks.add_argument("--seed", type=int, default=0)
    attacks.set_defaults(run=run_bench, bench_params={"islands": "islands", "seed": "seed"})
    scale = suites.add_parser(
        "scale",
        help=(
            "the cost of model size: each stage of a delta's trip (island, broker, merger,"
            " snapshot, island) in GB/s and x memcpy, and merger and island memory per parameter"
        ),
    )
    scale.add_argument("--json", action="store_true", help="print one JSON object")
    scale.add_argument(
        "--sizes",
        default="10M,50M,125M,350M",
        help=(
            "model sizes in parameters, comma-separated, K/M/G decimal (default 10M,50M,125M,350M)"
        ),
    )
    scale.add_argument(
        "--reps",
        type=positive_int,
        default=3,
        help="timed rounds per size after a warm-up one; medians (default 3)",
    )
    scale.add_argument(
        "--momentum-dtype",
        choices=OuterConfig.MOMENTUM_DTYPES,
        default=OuterConfig.momentum_dtype,
        help="what the merger keeps its outer momentum in (default %(default)s)",
    )
    scale.add_argument(
        "--fragments",
        type=positive_int,
        default=4,
        help="P, fragments of the model: a fold holds one at a time (default %(default)s)",
    )
    scale.add_argument(
        "--served-dtype",
        choices=SnapshotConfig.SERVED_DTYPES,
        default=SnapshotConfig.served_dtype,
        help="what the merger and the island hold the served value in (default %(default)s)",
    )
    scale.add_argument(
        "--light-island",
        action="store_true",
        help=(
            "the island side without a model (no theta, no anchors: its send and adoption leave"
            " out exchange.advance and the rebase), for sizes where a whole island does not fit"
            " beside the merger; the merger's stages and both memory figures are the same"
        ),
    )
    scale.add_argument(
        "--shards",
        type=positive_int,
        default=1,
        help=(
            "merger processes, each folding its share of the fragments (f %% N), as `dloco merger"
            " --shard I/N`; memory is judged per shard, per parameter of its share; the merger's"
            " stages are the shards' times summed (each takes its round in turn)"
            " (default %(default)s)"
        ),
    )
    scale.set_defaults(
        run=run_bench,
        bench_params={
            "shards": "shards",
            "sizes": "sizes",
            "reps": "reps",
            "momentum_dtype": "momentum_dtype",
            "served_dtype": "served_dtype",
            "fragments": "fragments",
            "light_island": "light_island",
        },
    )


def shard_counts(text: str) -> list[int]:
    """--shards 1,2: positive shard counts."""
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be shard counts like 1,2, got {text!r}") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"must be shard counts >= 1 like 1,2, got {text!r}")
    return counts


def run_bench(args: argparse.Namespace) -> int:
    """Run benchmarks.<suite>.run(...) with the suite's options; print JSON or its one-line
    summary."""
    import importlib

    from dloco.protocol import DlocoError

    module, params = (
        importlib.import_module(f"dloco.benchmarks.{args.suite}"),
        dict(args.bench_params),
    )
    # bench merger --shards: the same work over merger shard processes
    if args.suite == "merger" and args.shards:
        if args.standby:
            print(
                "dloco bench merger: --shards and --standby measure different things; give one",
                file=sys.stderr,
            )
            return 2
        module, params = (
            importlib.import_module("dloco.benchmarks.merger_shards"),
            {
                **params,
                "shard_counts": "shards",
            },
        )
        params.pop("standby")
    try:
        result = module.run(**{param: getattr(args, option) for param, option in params.items()})
    except DlocoError as error:
        print(f"dloco bench {args.suite}: {error}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2) if args.json else module.summary(result))
    return 0
