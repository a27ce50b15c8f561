"""`dloco island`: argument parsing and wiring only."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys

from dloco.cliargs import from_args
from dloco.island.config import SyncConfig, TrainConfig
from dloco.island.flags import add_island_flags, task_options
from dloco.island.group import SLURM, GroupLost, from_slurm, metrics_path
from dloco.island.group import check as group_check
from dloco.island.task import BUILTIN


def add_commands(commands: argparse._SubParsersAction, positive_int) -> None:
    island = commands.add_parser(
        "island", help="run an island: train on its shard and exchange fragments"
    )
    add_island_flags(island)
    island.set_defaults(run=run_island)


def checked(args: argparse.Namespace, task_context) -> tuple:
    """Everything that can be checked without JAX, first: a bad argument fails in a second, not
    after the import.  Returns (train config, task context, sync config, networked)."""
    from dloco.protocol import DlocoError

    train = from_args(TrainConfig, args)
    context = task_context(
        args.island_index, args.islands, args.seed, args.batch, args.max_steps, task_options(args)
    )
    sync = from_args(SyncConfig, args)
    if not 0 <= args.island_index < args.islands:
        raise DlocoError(f"--island-index must be in [0, {args.islands}), got {args.island_index}")
    if args.coordinator == SLURM:
        args.num_processes, args.process_id = from_slurm(os.environ)
        args.metrics_out = metrics_path(args.metrics_out, args.process_id)
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
    # before any thread starts: freed large blocks go back to the kernel (merger/memory.py)
    from dloco.merger.memory import keep_freed_memory

    keep_freed_memory()
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
