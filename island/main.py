"""`dloco island`: argument parsing and wiring only."""

from __future__ import annotations

import argparse
import dataclasses
import json
import signal
import sys
from pathlib import Path

from dloco.cliargs import add_metrics_flags, int_at_least
from dloco.island.config import ADOPTIONS, MODEL_SIZES, SyncConfig, TrainConfig
from dloco.island.group import GroupLost
from dloco.island.group import check as group_check
from dloco.island.task import BUILTIN


def add_commands(commands: argparse._SubParsersAction, positive_int) -> None:
    island = commands.add_parser(
        "island", help="run an island: train on its shard and exchange fragments"
    )
    island.add_argument(
        "--standalone", action="store_true", help="no broker, no merger: the single-island baseline"
    )
    island.add_argument("--max-steps", type=positive_int, default=TrainConfig.max_steps)
    add_task_flags(island)
    island.add_argument("--name", default="island-0")
    island.add_argument("--region", default="local")
    island.add_argument("--lr", type=float, default=TrainConfig.lr)
    island.add_argument("--warmup", type=int, default=TrainConfig.warmup)
    island.add_argument("--schedule", choices=("cosine", "constant"), default=TrainConfig.schedule)
    island.add_argument(
        "--budget-tokens",
        type=int_at_least(0),
        default=TrainConfig.budget_tokens,
        metavar="N",
        help=(
            "the cluster's token budget: after warmup the rate decays over the cluster's tokens "
            "(as the merger's acks tell them), not this island's steps (default 0: none)"
        ),
    )
    island.add_argument("--eval-every", type=positive_int, default=TrainConfig.eval_every)
    island.add_argument(
        "--eval-early",
        action="store_true",
        help="also evaluate at steps 1, 2, 4, 8, ... below --eval-every",
    )
    island.add_argument(
        "--eval-trace",
        type=int,
        default=TrainConfig.eval_trace,
        metavar="N",
        help=(
            "copy the parameters after each of the first N steps and evaluate them once training is"
            " over (the loss at every early step, without spending training time on evaluations)"
        ),
    )
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
    hosts = island.add_argument_group(
        "one island on several processes or hosts (jax.distributed; process 0 alone holds the bus"
        " links)"
    )
    hosts.add_argument(
        "--coordinator",
        default=None,
        metavar="HOST:PORT",
        help="process 0's address for the group, the same for every process",
    )
    hosts.add_argument(
        "--num-processes", type=positive_int, default=1, help="processes in this island (default 1)"
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
    network = island.add_argument_group("network (all connect: islands only dial out)")
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
        "--fragments",
        type=positive_int,
        default=SyncConfig.fragments,
        help="P (must match the merger)",
    )
    network.add_argument(
        "--interval",
        type=positive_int,
        default=SyncConfig.interval,
        help="H: inner steps between two deltas of a fragment",
    )
    network.add_argument(
        "--codec", default=SyncConfig.codec, help="delta codec: fp32, bf16, int8, int4, int2"
    )
    network.add_argument(
        "--adoption",
        choices=ADOPTIONS,
        default=SyncConfig.adoption,
        help=(
            "a global fragment arriving between sends: rebase (default) keeps the island's unsent"
            " progress on top of it, replace overwrites it"
        ),
    )
    network.add_argument(
        "--alpha",
        type=float,
        default=SyncConfig.alpha,
        help="with --adoption replace: theta <- alpha*theta + (1-alpha)*global",
    )
    network.add_argument("--error-feedback", action="store_true")
    network.add_argument(
        "--flush-on-leave",
        action="store_true",
        help=(
            "when stopping, send every fragment's unsent work (up to H steps each) before draining;"
            " off by default: each arrives as a small fold of its own, and a burst of them can"
            " leave the merger's model worse (docs/experiments-archive.md)"
        ),
    )
    network.add_argument(
        "--blocking",
        action="store_true",
        help="synchronous baselines: after each send, wait for the fold that includes it",
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
        "--settle-timeout",
        type=float,
        default=SyncConfig.settle_timeout_s,
        help=(
            "seconds after which the island stops asking what became of a delta (with --blocking:"
            " stops waiting for its fold)"
        ),
    )
    network.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="at the end, seconds to wait for the last deltas to be sent and acknowledged",
    )
    island.set_defaults(run=run_island)


def add_task_flags(parser: argparse.ArgumentParser) -> None:
    """What to train and on what: the task, its options, the shard, the batch and the seed (islands
    and the evaluator)."""
    positive_int = int_at_least(1)
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
        "--islands", type=positive_int, default=1, help="how many shards the data is cut into"
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
        lm.add_argument(f"--{flag}", type=positive_int, default=None, help="override the preset's")
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
        "--eval-batches", type=positive_int, default=None, help="held-out batches (default 8)"
    )
    parser.add_argument("--batch", type=positive_int, default=TrainConfig.batch)
    parser.add_argument("--seed", type=int, default=TrainConfig.seed)


def train_config(args: argparse.Namespace) -> TrainConfig:
    return TrainConfig(
        batch=args.batch,
        lr=args.lr,
        warmup=args.warmup,
        schedule=args.schedule,
        max_steps=args.max_steps,
        eval_every=args.eval_every,
        eval_early=args.eval_early,
        eval_trace=args.eval_trace,
        seed=args.seed,
        budget_tokens=args.budget_tokens,
    )


def sync_config(args: argparse.Namespace) -> SyncConfig:
    return SyncConfig(
        fragments=args.fragments,
        interval=args.interval,
        codec=args.codec,
        adoption=args.adoption,
        alpha=args.alpha,
        error_feedback=args.error_feedback,
        flush_on_leave=args.flush_on_leave,
        blocking=args.blocking,
        settle_timeout_s=args.settle_timeout,
    )


def checked(args: argparse.Namespace, task_context) -> tuple:
    """Everything that can be checked without JAX, first: a bad argument fails in a second, not
    after the import.  Returns (train config, task context, sync config, networked)."""
    from dloco.protocol import DlocoError

    train = train_config(args)
    context = task_context(
        args.island_index, args.islands, args.seed, args.batch, args.max_steps, task_options(args)
    )
    sync = sync_config(args)
    if not 0 <= args.island_index < args.islands:
        raise DlocoError(f"--island-index must be in [0, {args.islands}), got {args.island_index}")
    group_check(args.coordinator, args.num_processes, args.process_id)
    if args.num_processes > 1 and (args.eval_trace or args.write_init is not None):
        raise DlocoError("--eval-trace and --write-init are for an island of one process")
    if not args.group_timeout > 0:
        raise DlocoError(f"--group-timeout must be > 0, got {args.group_timeout}")
    networked = not args.standalone and args.write_init is None and args.process_id == 0
    if networked and not (args.delta_endpoint and args.snapshot_endpoint and args.control_endpoint):
        raise DlocoError(
            "a networked island needs --delta-endpoint, --snapshot-endpoint and --control-endpoint"
            " (or --standalone)"
        )
    return train, context, sync, networked


# Over 60 lines: the process's start in its order (the flags checked before JAX is imported, the
# group joined before any other JAX use, the signal handlers set once the loop exists); what stands
# alone is split out (`checked`, and island/lifecycle.py for the end).
def run_island(args: argparse.Namespace) -> int:
    # SIGTERM while starting (imports, compiling, joining): stop cleanly, not by the default action
    early_stop = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: early_stop.append(True))
    from dloco.island import task as tasks
    from dloco.protocol import DlocoError
    from dloco.telemetry.logs import configure_logging

    log = configure_logging("island", island=args.name, region=args.region)
    link = metrics_server = ending = None
    try:
        train, context, sync, networked = checked(args, tasks.TaskContext)

        import numpy as np

        from dloco import protocol
        from dloco.bus.security import security_from_args
        from dloco.island.cpugroup import CpuGroup
        from dloco.island.lifecycle import Ending
        from dloco.island.loop import IslandLoop
        from dloco.island.metrics import MetricsWriter
        from dloco.island.network import NetworkLink
        from dloco.island.shaper import LinkShaper
        from dloco.island.train import Trainer

        if args.num_processes > 1:
            from dloco.island import group

            group.initialize(
                args.coordinator,
                args.num_processes,
                args.process_id,
                args.group_timeout,
                args.join_timeout,
            )
            log = log.bind(process=args.process_id)
        task = tasks.build(args.task or BUILTIN, context)
        log.info("task", spec=args.task or BUILTIN, name=task.name)
        trainer = Trainer(task.model, task.loss, train, task.optimizer, task.metrics)
        if args.write_init is not None:
            np.savez(args.write_init, **trainer.params())
            log.info("wrote_initial_parameters", path=str(args.write_init))
            return 0
        parameters = sum(v.size for v in trainer.params().values())
        log.info("model", params=parameters, devices=[str(d) for d in trainer.devices])
        if networked:
            security = security_from_args(args, args.name, "island")
            link = NetworkLink(
                args.name,
                protocol.model_fingerprint(trainer.params()),
                sync,
                args.delta_endpoint,
                args.snapshot_endpoint,
                args.control_endpoint,
                LinkShaper.from_mbps(args.uplink_mbps, args.rtt_ms),
                LinkShaper.from_mbps(args.downlink_mbps, args.rtt_ms),
                log=log,
                security=security,
                bus_server=args.bus_server,
                control_server=args.control_server,
                model_bytes=4 * parameters,
            )
        cpu_group = CpuGroup(args.cpu_cgroup) if args.cpu_cgroup is not None else None

        def enter_quota() -> None:
            cpu_group.join()
            log.info("cpu_quota", group=str(cpu_group.path))

        metrics = MetricsWriter(args.metrics_out)
        if args.metrics_port is not None:
            metrics_server = serve_metrics(args, metrics, link)
        members = None
        if args.num_processes > 1:
            members = group.IslandGroup({p: v.shape for p, v in trainer.params().items()})
        loop = IslandLoop(
            trainer,
            task.batches,
            task.eval_batches,
            train,
            sync,
            metrics,
            link=link,
            slowdown=args.slowdown,
            log=log,
            on_compiled=enter_quota if cpu_group else None,
            count=task.tokens_in,
            group=members,
        )
        signals = []
        # stop after the current step, then drain and exit 0
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(
                sig, lambda *_: (signals.append(True), setattr(loop, "stop_requested", True))
            )
        loop.stop_requested = bool(early_stop)
        ending = Ending(
            loop,
            link,
            metrics,
            log,
            sync.flush_on_leave,
            args.drain_timeout,
            args.group_timeout,
            grouped=members is not None,
            cpu_group=cpu_group,
        )
        try:
            # the same model, settings and data in every process, before any per-step agreement
            if members is not None:
                members.check_same(
                    json.dumps(
                        [
                            protocol.model_fingerprint(trainer.params()),
                            dataclasses.asdict(sync),
                            dataclasses.asdict(train),
                            args.island_index,
                            args.islands,
                            args.task or BUILTIN,
                            context.options,
                        ],
                        sort_keys=True,
                        default=str,
                    ),
                    args.join_timeout,
                )
            if link is not None or members is not None:
                loop.join(args.join_timeout)
                log.info("joined", versions=[p.version for p in loop.progress])
            summary = loop.run()
        # a multi-process island's collective failed: another process died
        except (GroupLost, RuntimeError, ValueError) as error:
            if members is None or not group.broken(error):
                raise
            ending.group_lost(error)
        summary = ending.finish(summary, signals=len(signals))
    except (DlocoError, ValueError, OSError) as error:
        print(f"dloco island: {error}", file=sys.stderr)
        return 2
    finally:
        # the ending closes it once drained
        still_open = ending.link if ending is not None else link
        if still_open is not None:
            still_open.close()
        if metrics_server is not None:
            from dloco.telemetry import prom

            prom.stop(metrics_server)
    log.info("done", **{k: round(v, 4) if isinstance(v, float) else v for k, v in summary.items()})
    print(json.dumps(summary))
    return 0


def serve_metrics(args: argparse.Namespace, metrics, link):
    """Prometheus metrics from the island's last step event and its link (telemetry/prom.py)."""
    from dloco.telemetry import prom

    def read():
        received = (
            {f: held.version for f, held in dict(link.downlink.served).items()}
            if link is not None
            else {}
        )
        return prom.island_families(
            metrics.latest, len(link.uplink.outbox) if link is not None else 0, received
        )

    return prom.serve(args.metrics_port, args.metrics_host, prom.registry_of(read))


def task_options(args: argparse.Namespace) -> dict:
    """--task-option pairs, then the built-in LM's shorthand flags that were given."""
    from dloco.island.task import parse_options

    options = parse_options(args.task_option)
    for key in (
        "size",
        "width",
        "depth",
        "heads",
        "context",
        "vocab",
        "corpus",
        "tokens",
        "eval_batches",
    ):
        if getattr(args, key) is not None:
            options[key] = (
                str(getattr(args, key))
                if isinstance(getattr(args, key), Path)
                else getattr(args, key)
            )
    return options
