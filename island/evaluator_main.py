"""`dloco evaluator`: argument parsing and wiring only (the schedule: island/evaluator.py)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

from dloco.cliargs import add_metrics_flags, float_at_least


def add_commands(commands: argparse._SubParsersAction) -> None:
    from dloco.island.flags import add_task_flags

    evaluator = commands.add_parser(
        "evaluator",
        help="evaluate the merger's model during a run: follow the snapshot bus, never train",
    )
    add_task_flags(evaluator)
    evaluator.add_argument(
        "--name", default="evaluator", help="sender id and key name (an observer key with CURVE)"
    )
    evaluator.add_argument("--snapshot-endpoint", required=True, help="SUB for snapshots")
    evaluator.add_argument(
        "--control-endpoint",
        action="append",
        required=True,
        metavar="ENDPOINT[,STANDBY]",
        help=(
            "DEALER to the merger's ROUTER (catch-up, resends); once per merger shard, in shard"
            " order; A,B: a merger and its standby"
        ),
    )
    evaluator.add_argument(
        "--every",
        type=float_at_least(0.0),
        default=10.0,
        help="seconds between evaluations at least (default 10)",
    )
    evaluator.add_argument(
        "--budget",
        type=float_at_least(0.001),
        default=0.1,
        help=(
            "most of its wall time spent evaluating (default 0.1; it also runs at the lowest CPU"
            " priority)"
        ),
    )
    evaluator.add_argument(
        "--metrics-out", type=Path, required=True, help="JSON lines, one per evaluation"
    )
    evaluator.add_argument(
        "--keys",
        type=Path,
        help="CURVE key directory (NAME.key_secret and the servers' .key); CURVE is the default",
    )
    evaluator.add_argument(
        "--insecure", action="store_true", help="plaintext, no authentication (prints a warning)"
    )
    add_metrics_flags(evaluator)
    evaluator.set_defaults(run=run_evaluator)


def lower_priority(keep: set[int]) -> None:
    """nice 19 for every thread of this process (and those it starts later) but `keep` (native
    thread ids) and ZeroMQ's I/O threads: evaluations get the cores the islands and the merger
    leave, while snapshots are still read at once (a slow subscriber would make the broker drop
    messages for every island).  Linux threads have their own nice value; elsewhere the whole
    process.
    """
    try:
        threads = os.listdir("/proc/self/task")
    except OSError:
        os.nice(19)
        return
    for thread in threads:
        try:
            if int(thread) in keep or open(f"/proc/self/task/{thread}/comm").read().startswith(
                "ZMQbg"
            ):
                continue
            os.setpriority(os.PRIO_PROCESS, int(thread), 19)
        # a thread that has just ended
        except (OSError, ValueError):
            continue


# Over 60 lines: the process's start, its following of the global model and its end, in order, with
# what it opened closed in one `finally`.
def run_evaluator(args: argparse.Namespace) -> int:
    stop = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.append(True))
    import optax

    from dloco.bus.security import security_from_args
    from dloco.island import evaluator
    from dloco.island import task as tasks
    from dloco.island.config import TrainConfig
    from dloco.island.flags import task_options
    from dloco.island.follower import SnapshotFollower
    from dloco.island.metrics import MetricsWriter
    from dloco.island.train import Trainer
    from dloco.protocol import DlocoError, model_fingerprint
    from dloco.telemetry.logs import configure_logging

    log = configure_logging("evaluator", name=args.name)
    follower = server = None
    count = 0
    try:
        context = tasks.TaskContext(
            args.island_index, args.islands, args.seed, args.batch, 1, task_options(args)
        )
        task = tasks.build(args.task or tasks.BUILTIN, context)
        # never trains: an optimizer without state (AdamW's would double the memory for nothing)
        trainer = Trainer(
            task.model,
            task.loss,
            TrainConfig(batch=args.batch, seed=args.seed),
            optax.set_to_zero(),
            task.metrics,
        )
        params = trainer.params()
        follower = SnapshotFollower(
            args.name,
            model_fingerprint(params),
            args.snapshot_endpoint,
            args.control_endpoint,
            security_from_args(args, args.name, "evaluator"),
            model_bytes=4 * sum(v.size for v in params.values()),
        )
        lower_priority(keep={follower.receiver_id})
        metrics = MetricsWriter(args.metrics_out)
        if args.metrics_port is not None:
            from dloco.telemetry import prom

            server = prom.serve(
                args.metrics_port,
                args.metrics_host,
                prom.registry_of(lambda: prom.evaluator_families(metrics.latest, metrics.written)),
            )

        def evaluate(values: dict) -> dict[str, float]:
            trainer.set_params(values)
            return trainer.evaluate_all(task.eval_batches)

        # compiled now, so the budget measures evaluations, not the compiler
        evaluate(params)
        log.info("following", every_s=args.every, budget=args.budget)
        count = evaluator.follow(
            follower.current,
            evaluate,
            metrics.write,
            set(params),
            args.every,
            args.budget,
            lambda: bool(stop),
        )
        metrics.close()
    except (DlocoError, ValueError, OSError) as error:
        print(f"dloco evaluator: {error}", file=sys.stderr)
        return 2
    finally:
        if follower is not None:
            follower.close()
        if server is not None:
            prom.stop(server)
    log.info(
        "done",
        evaluations=count,
        dropped=follower.dropped,
        snapshots=dict(follower.downlink.results),
    )
    print(json.dumps({"evaluations": count}))
    return 0
