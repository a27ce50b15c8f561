"""The cluster's processes as command lines, from a cluster file: one source for `dloco up` (local
processes on 127.0.0.1) and for the docker-compose file (containers reaching each other by service
name).  Pure: strings in, argument lists out."""

from __future__ import annotations

import dataclasses

from dloco.cliargs import as_flags
from dloco.cluster import etcd
from dloco.cluster.config import ClusterConfig
from dloco.island.config import TrainConfig
from dloco.island.flags import SYNC_FLAGS, TRAIN_FLAGS
from dloco.merger.flags import SNAPSHOT_FLAGS, math_flags
from dloco.protocol.shards import names as shard_names


@dataclasses.dataclass(frozen=True)
class Addresses:
    """Where the broker's four sockets and the merger's control socket listen, and how others reach
    them."""

    # delta-in, delta-out, snapshot-in, snapshot-out
    broker_ports: tuple[str, str, str, str]
    control_port: str
    # as dialled by the merger and the islands
    broker_host: str = "127.0.0.1"
    merger_host: str = "127.0.0.1"
    # what the broker and the merger bind ("*" in a container)
    bind_host: str = "127.0.0.1"
    # process name -> its Prometheus port (None: no metrics)
    metrics_ports: dict[str, str] | None = None
    # with [merger] standby: its control port, the merger's and its replication ports
    standby_ports: tuple[str, str, str] | None = None
    standby_host: str = "127.0.0.1"
    # with [merger] failover = "etcd": etcd's client and peer ports, on the broker's host
    etcd_ports: tuple[str, str] = (etcd.CLIENT_PORT, etcd.PEER_PORT)
    # how the mergers reach it (None: broker_host)
    etcd_host: str | None = None
    # with [merger] standby and shards: standby.1, standby.2, ...'s ports (as standby_ports) and
    # hosts (default: standby_host)
    shard_standby_ports: tuple[tuple[str, str, str], ...] = ()
    shard_standby_hosts: tuple[str, ...] = ()
    # a multi-host region -> its coordinator's port (process 0 listens there)
    coordinator_ports: dict[str, str] | None = None
    # None: the region's own name (its process 0's service)
    coordinator_host: str | None = "127.0.0.1"
    # merger shards 1, 2, ...: their control ports (shard 0 has control_port)
    shard_control_ports: tuple[str, ...] = ()
    # and how others reach them (default: merger_host)
    shard_hosts: tuple[str, ...] = ()

    def metrics(self, name: str) -> list[str]:
        """A process's --metrics-port/--metrics-host flags (none without a port)."""
        if not self.metrics_ports or name not in self.metrics_ports:
            return []
        return [
            "--metrics-port",
            self.metrics_ports[name],
            "--metrics-host",
            "0.0.0.0" if self.bind_host == "*" else self.bind_host,
        ]

    def broker(self, index: int) -> str:
        return f"tcp://{self.broker_host}:{self.broker_ports[index]}"


def model_args(config: ClusterConfig, place=lambda path: path) -> list[str]:
    """The island's task arguments; `place` maps a host path (task file, corpus, tokens) to where
    the process sees it."""
    m = config.model
    where, _, function = m.task.rpartition(":")
    args = ["--task", f"{place(where)}:{function}" if where.endswith(".py") else m.task]
    for key, value in m.lm_options().items():
        args += [
            f"--{'model-size' if key == 'size' else key}",
            place(value) if key in ("corpus", "tokens") else value,
        ]
    for pair in task_option_pairs(config):
        args += ["--task-option", pair]
    if m.lr is not None:
        args += ["--lr", m.lr]
    return args + ["--batch", m.batch, "--seed", config.seed]


def task_option_pairs(config: ClusterConfig) -> list[str]:
    """[task] as the islands' --task-option KEY=VALUE pairs (TOML's true/false as the island reads
    them)."""
    return [
        f"{key}={str(value).lower() if type(value) is bool else value}"
        for key, value in config.task_options
    ]


def prepare_command(config_path: str, run_dir: str) -> list[str]:
    return ["prepare", "--config", config_path, "--run-dir", run_dir]


def commands(
    config: ClusterConfig, at: Addresses, run_dir: str, place=lambda path: path
) -> dict[str, list[str]]:
    """`dloco` arguments (without the program) of the broker, the merger, the evaluator (the global
    model during the run, island/evaluator.py) and every island; `place` maps the task's host paths
    to the islands' (model_args).  The typed configs' flags are written by the processes' own
    tables (island/flags.py, merger/flags.py)."""
    keys, bind = f"{run_dir}/keys", at.bind_host
    ports = at.broker_ports
    out = {
        "broker": [
            "broker",
            *_flags(keys=keys, allow=f"{run_dir}/allow", stats_every=5),
            *_flags(delta_in=f"tcp://{bind}:{ports[0]}", delta_out=f"tcp://{bind}:{ports[1]}"),
            *_flags(
                snapshot_in=f"tcp://{bind}:{ports[2]}", snapshot_out=f"tcp://{bind}:{ports[3]}"
            ),
        ]
    }
    controls = _mergers(config, at, run_dir, out)
    control = [arg for endpoint in controls for arg in ("--control-endpoint", endpoint)]
    out["evaluator"] = [
        "evaluator",
        *_flags(name="evaluator", islands=len(config.regions)),
        *model_args(config, place),
        *_flags(keys=keys, snapshot_endpoint=at.broker(3)),
        *control,
        *_flags(metrics_out=f"{run_dir}/global.jsonl"),
    ]
    for index, region in enumerate(config.regions):
        out.update(_island(config, at, run_dir, place, region, index, control))
    return {name: [str(arg) for arg in [*args, *at.metrics(name)]] for name, args in out.items()}


def _flags(**values) -> list:
    """`--name value` for each keyword, in order (underscores written as dashes)."""
    return [arg for name, value in values.items() for arg in (f"--{name.replace('_', '-')}", value)]


def _mergers(config: ClusterConfig, at: Addresses, run_dir: str, out: dict) -> list[str]:
    """The merger's command line (each shard's, the standby's) into `out`; returns the control
    endpoints islands dial, one per shard in shard order ("A,B": a merger and its standby)."""
    sc, mc = config.effective()
    snapshots = mc.snapshots()
    out["merger"] = [
        "merger",
        *_flags(run_dir=f"{run_dir}/merger", init_npz=f"{run_dir}/init.npz"),
        *_flags(fragments=sc.fragments, keys=f"{run_dir}/keys", allow=f"{run_dir}/allow"),
        *_flags(delta_endpoint=at.broker(1), snapshot_endpoint=at.broker(2)),
        *_flags(control_endpoint=f"@tcp://{at.bind_host}:{at.control_port}"),
        *math_flags(mc.math()),
        *as_flags(snapshots, SNAPSHOT_FLAGS),
    ]
    controls = [f"tcp://{at.merger_host}:{at.control_port}"]
    if mc.shards > 1:
        shard0 = out["merger"]
        out["merger"] = [*shard0, "--shard", f"0/{mc.shards}"]
        for index, name in enumerate(shard_names("merger", mc.shards)[1:], 1):
            port = at.shard_control_ports[index - 1]
            host = at.shard_hosts[index - 1] if at.shard_hosts else at.merger_host
            out[name] = [
                *_without(_without(shard0, "--run-dir"), "--control-endpoint"),
                *_flags(run_dir=f"{run_dir}/{name}"),
                *_flags(control_endpoint=f"@tcp://{at.bind_host}:{port}"),
                *_flags(name=name, shard=f"{index}/{mc.shards}"),
            ]
            controls.append(f"tcp://{host}:{port}")
    # each shard twice (one key, one name): either may be the primary; islands reach both
    if mc.standby:
        for index, (name, standby_name) in enumerate(
            zip(shard_names("merger", mc.shards), shard_names("standby", mc.shards), strict=True)
        ):
            out[standby_name] = _pair(mc, at, run_dir, out, index, name, standby_name)
            standby_control = (
                at.standby_ports if index == 0 else at.shard_standby_ports[index - 1]
            )[0]
            controls[index] += f",tcp://{_standby_host(at, index)}:{standby_control}"
    return controls


def _standby_host(at: Addresses, index: int) -> str:
    return (
        at.shard_standby_hosts[index - 1] if index and at.shard_standby_hosts else at.standby_host
    )


def _pair(mc, at: Addresses, run_dir: str, out: dict, index: int, name: str, standby: str) -> list:
    """Shard `index`'s standby's command line; its primary's (`out[name]`) gains the flags of a
    pair: replication, lease, the peer, etcd."""
    standby_control, mine, its = (
        at.standby_ports if index == 0 else at.shard_standby_ports[index - 1]
    )
    primary_host = at.shard_hosts[index - 1] if index and at.shard_hosts else at.merger_host
    pair = _flags(replication=mc.replication, lease=mc.lease_s)
    if mc.etcd:
        client, peer = at.etcd_ports
        out.setdefault(
            "etcd", etcd.dloco_args(f"{run_dir}/etcd", at.bind_host, at.broker_host, client, peer)
        )
        pair += _flags(etcd=f"http://{at.etcd_host or at.broker_host}:{client}")
    command = [
        *_without(_without(out[name], "--init-npz"), "--control-endpoint"),
        *pair,
        *_flags(replication_endpoint=f"@tcp://{at.bind_host}:{its}"),
        *_flags(standby_of=f"tcp://{primary_host}:{mine}"),
        *_flags(control_endpoint=f"@tcp://{at.bind_host}:{standby_control}"),
    ]
    command[command.index("--run-dir") + 1] = f"{run_dir}/{standby}"
    out[name] += [
        *pair,
        *_flags(replication_endpoint=f"@tcp://{at.bind_host}:{mine}"),
        *_flags(peer=f"tcp://{_standby_host(at, index)}:{its}"),
    ]
    return command


def _island(config: ClusterConfig, at, run_dir: str, place, region, index: int, control) -> dict:
    """The command line of `region`'s island: one process, or one per host (process 0, named as
    the region, holds the bus links and the coordinator)."""
    sc, _ = config.effective()
    train = TrainConfig(
        batch=config.model.batch,
        seed=config.seed,
        max_steps=10**9,
        budget_tokens=config.tokens or 0,
        eval_every=config.eval_every,
        eval_early=config.eval_early,
        eval_trace=config.eval_trace or 0,
    )
    sync = dataclasses.replace(sc, interval=config.interval_of(region))
    links = {"uplink_mbps": region.uplink_mbps, "downlink_mbps": region.downlink_mbps}
    island = [
        "island",
        *_flags(name=region.name, region=region.name),
        *_flags(islands=len(config.regions), island_index=index),
        *model_args(config, place),
        *as_flags(train, TRAIN_FLAGS),
        *as_flags(sync, SYNC_FLAGS),
        # with island_cpus the quota slows a region down, not a sleep
        *_flags(slowdown=1.0 if config.island_cpus else region.slowdown),
        *_flags(**{name: value for name, value in links.items() if value}),
        *_flags(rtt_ms=region.rtt_ms, keys=f"{run_dir}/keys"),
        *_flags(delta_endpoint=at.broker(0), snapshot_endpoint=at.broker(3)),
        *control,
        *_flags(metrics_out=f"{run_dir}/metrics/{region.name}.jsonl", join_timeout=300),
    ]
    if region.hosts == 1:
        return {region.name: island}
    coordinator = f"{at.coordinator_host or region.name}:{at.coordinator_ports[region.name]}"
    out = {}
    for process, name in enumerate(region.processes):
        own = island
        if process > 0:
            own = _without(island, "--metrics-out")
            own += _flags(metrics_out=f"{run_dir}/metrics/{name}.jsonl")
        out[name] = [
            *own,
            *_flags(coordinator=coordinator, num_processes=region.hosts, process_id=process),
        ]
    return out


def _without(args: list, flag: str) -> list:
    """`args` less `flag` and its value."""
    at = args.index(flag)
    return args[:at] + args[at + 2 :]
