"""The island's command line (`dloco island`, and the task flags `dloco evaluator` shares).  The
flags of its typed configs come from their fields (`TRAIN_FLAGS`, `SYNC_FLAGS`, cliargs.add_fields):
the launcher writes a config out by the same tables (cluster/topology.py)."""

from __future__ import annotations

import argparse
from pathlib import Path

from dloco.cliargs import Flag, add_fields, add_metrics_flags, int_at_least
from dloco.island.config import ADOPTIONS, MODEL_SIZES, SyncConfig, TrainConfig
from dloco.island.task import BUILTIN

_positive_int = int_at_least(1)

# TrainConfig's fields on the island's command line (batch and seed: TASK_TRAIN_FLAGS)
TRAIN_FLAGS = (
    Flag("max_steps", type=_positive_int),
    "lr",
    "warmup",
    Flag("schedule", choices=("cosine", "constant")),
    Flag(
        "budget_tokens",
        type=int_at_least(0),
        metavar="N",
        help=(
            "the cluster's token budget: after warmup the rate decays over the cluster's tokens "
            "(as the merger's acks tell them), not this island's steps (default 0: none)"
        ),
    ),
    Flag("eval_every", type=_positive_int),
    Flag("eval_early", help="also evaluate at steps 1, 2, 4, 8, ... below --eval-every"),
    Flag(
        "eval_trace",
        metavar="N",
        help=(
            "copy the parameters after each of the first N steps and evaluate them once training is"
            " over (the loss at every early step, without spending training time on evaluations)"
        ),
    ),
)
# ... and those every process that builds the task reads
TASK_TRAIN_FLAGS = (Flag("batch", type=_positive_int), "seed")

SYNC_FLAGS = (
    Flag("fragments", type=_positive_int, help="P (must match the merger)"),
    Flag("interval", type=_positive_int, help="H: inner steps between two deltas of a fragment"),
    Flag("codec", help="delta codec: fp32, bf16, int8, int4, int2"),
    Flag(
        "adoption",
        choices=ADOPTIONS,
        help=(
            "a global fragment arriving between sends: rebase (default) keeps the island's unsent"
            " progress on top of it, replace overwrites it"
        ),
    ),
    Flag("alpha", help="with --adoption replace: theta <- alpha*theta + (1-alpha)*global"),
    "error_feedback",
    Flag(
        "flush_on_leave",
        help=(
            "when stopping, send every fragment's unsent work (up to H steps each) before draining;"
            " off by default: each arrives as a small fold of its own, and a burst of them can"
            " leave the merger's model worse (docs/experiments-archive.md)"
        ),
    ),
    Flag(
        "blocking",
        help="synchronous baselines: after each send, wait for the fold that includes it",
    ),
    Flag(
        "settle_timeout_s",
        flag="--settle-timeout",
        help=(
            "seconds after which the island stops asking what became of a delta (with --blocking:"
            " stops waiting for its fold)"
        ),
    ),
)
# the built-in LM's shorthand flags (each also a --task-option KEY=VALUE)
LM_OPTIONS = ("size", "width", "depth", "heads", "context", "vocab", "corpus", "tokens")


def add_island_flags(island: argparse.ArgumentParser) -> None:
    """Every flag of `dloco island`."""
    island.add_argument(
        "--standalone", action="store_true", help="no broker, no merger: the single-island baseline"
    )
    add_task_flags(island)
    add_fields(island, TrainConfig, TRAIN_FLAGS)
    island.add_argument("--name", default="island-0")
    island.add_argument("--region", default="local")
    island.add_argument(
        "--slowdown",
        type=float,
        default=1.0,
        help="each step takes X times its own compute time (an older chip)",
    )
    island.add_argument(
        "--cpu-cgroup",
        type=Path,
        default=None,
        metavar="DIR",
        help=(
            "a cgroup with a CPU quota (made by dloco up for run.island_cpus): the island trains in"
            " it from its second step and leaves it when training ends (an older chip, without"
            " sleeping)"
        ),
    )
    island.add_argument(
        "--metrics-out", type=Path, default=None, help="JSON lines, one object per step"
    )
    add_metrics_flags(island)
    island.add_argument(
        "--write-init",
        type=Path,
        default=None,
        help="write the initial parameters (.npz, for `dloco merger --init-npz`) and exit",
    )
    _add_group_flags(island)
    network = island.add_argument_group("network (all connect: islands only dial out)")
    add_fields(network, SyncConfig, SYNC_FLAGS)
    _add_link_flags(network)


def _add_group_flags(island: argparse.ArgumentParser) -> None:
    hosts = island.add_argument_group(
        "one island on several processes or hosts (jax.distributed; process 0 alone holds the bus"
        " links)"
    )
    hosts.add_argument(
        "--coordinator",
        default=None,
        metavar="HOST:PORT",
        help=(
            "process 0's address for the group, the same for every process; `slurm`: the tasks"
            " of an srun job step (coordinator, --num-processes and --process-id from Slurm's"
            " environment; processes other than 0 write their metrics as NAME.I beside"
            " --metrics-out)"
        ),
    )
    hosts.add_argument(
        "--num-processes",
        type=_positive_int,
        default=1,
        help="processes in this island (default 1)",
    )
    hosts.add_argument(
        "--process-id", type=int, default=0, help="this process's index in [0, --num-processes)"
    )
    hosts.add_argument(
        "--group-timeout",
        type=float,
        default=10.0,
        help=(
            "seconds without a heartbeat after which the coordinator ends the island's other"
            " processes"
        ),
    )


def _add_link_flags(network) -> None:
    """Endpoints, keys, link emulation and timeouts."""
    network.add_argument("--delta-endpoint", help="PUB for deltas, e.g. tcp://127.0.0.1:5555")
    network.add_argument("--snapshot-endpoint", help="SUB for snapshots and acks")
    network.add_argument(
        "--control-endpoint",
        action="append",
        metavar="ENDPOINT[,STANDBY]",
        help=(
            "DEALER to the merger's ROUTER (catch-up, resends); once per merger shard, in shard"
            " order; A,B: a merger and its standby"
        ),
    )
    network.add_argument(
        "--uplink-mbps", type=float, default=None, help="emulated uplink rate (default unlimited)"
    )
    network.add_argument(
        "--downlink-mbps",
        type=float,
        default=None,
        help="emulated downlink rate (default unlimited)",
    )
    network.add_argument(
        "--rtt-ms", type=float, default=0.0, help="emulated round-trip time, half added each way"
    )
    network.add_argument(
        "--join-timeout",
        type=float,
        default=60.0,
        help="seconds to wait for the merger's initial snapshot",
    )
    network.add_argument(
        "--keys",
        type=Path,
        help="CURVE key directory (NAME.key_secret and the servers' .key); CURVE is the default",
    )
    network.add_argument(
        "--insecure", action="store_true", help="plaintext, no authentication (prints a warning)"
    )
    network.add_argument(
        "--bus-server",
        default="broker",
        help="key name of what the bus endpoints reach (broker, or merger when direct)",
    )
    network.add_argument(
        "--control-server",
        default="merger",
        help=(
            "key name of the merger (the control endpoint's server); snapshots and acks from any"
            " other sender are dropped"
        ),
    )
    network.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="at the end, seconds to wait for the last deltas to be sent and acknowledged",
    )


def add_task_flags(parser: argparse.ArgumentParser) -> None:
    """What to train and on what: the task, its options, the shard, the batch and the seed (islands
    and the evaluator)."""
    parser.add_argument(
        "--task",
        default=None,
        metavar="PATH.py:FUNCTION",
        help=(
            "what to train: a function returning island.task.Task, as PATH.py:FUNCTION or"
            f" MODULE:FUNCTION (default: the built-in LM, {BUILTIN})"
        ),
    )
    parser.add_argument(
        "--task-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an option for the task function (repeatable)",
    )
    parser.add_argument(
        "--island-index", type=int, default=0, help="which shard this island trains on"
    )
    parser.add_argument(
        "--islands", type=_positive_int, default=1, help="how many shards the data is cut into"
    )
    lm = parser.add_argument_group(
        "the built-in LM's options (shorthand for --task-option KEY=VALUE)"
    )
    lm.add_argument(
        "--model-size",
        dest="size",
        choices=MODEL_SIZES,
        default=None,
        help="a preset (default tiny: 0.87 M parameters)",
    )
    for flag in ("width", "depth", "heads", "context", "vocab"):
        lm.add_argument(f"--{flag}", type=_positive_int, default=None, help="override the preset's")
    source = lm.add_mutually_exclusive_group()
    source.add_argument(
        "--corpus",
        type=Path,
        default=None,
        help="file or folder of text (default: this Python's standard library sources)",
    )
    source.add_argument(
        "--tokens",
        type=Path,
        default=None,
        metavar="FILE",
        help="a token file (.bin or .npy of uint16/uint32 ids; dloco tokenize writes one)",
    )
    lm.add_argument(
        "--eval-batches", type=_positive_int, default=None, help="held-out batches (default 8)"
    )
    add_fields(parser, TrainConfig, TASK_TRAIN_FLAGS)


def task_options(args: argparse.Namespace) -> dict:
    """--task-option pairs, then the built-in LM's shorthand flags that were given."""
    from dloco.island.task import parse_options

    options = parse_options(args.task_option)
    for key in (*LM_OPTIONS, "eval_batches"):
        if getattr(args, key) is not None:
            options[key] = (
                str(getattr(args, key))
                if isinstance(getattr(args, key), Path)
                else getattr(args, key)
            )
    return options
