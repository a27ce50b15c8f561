"""The cluster's processes as command lines, from a cluster file: one source for `dloco up` (local
processes on 127.0.0.1) and for the docker-compose file (containers reaching each other by service
name).  Pure: strings in, argument lists out."""

from __future__ import annotations

import dataclasses

from dloco.cluster.config import ClusterConfig
from dloco.island.config import SyncConfig
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
    to the islands' (model_args)."""
    keys, b = f"{run_dir}/keys", at.broker_ports
    out = {
        "broker": [
            "broker",
            "--keys",
            keys,
            "--allow",
            f"{run_dir}/allow",
            "--delta-in",
            f"tcp://{at.bind_host}:{b[0]}",
            "--delta-out",
            f"tcp://{at.bind_host}:{b[1]}",
            "--snapshot-in",
            f"tcp://{at.bind_host}:{b[2]}",
            "--snapshot-out",
            f"tcp://{at.bind_host}:{b[3]}",
            "--stats-every",
            5,
        ]
    }
    sc, mc = config.effective()
    # else the island's default
    settle = (
        ["--settle-timeout", sc.settle_timeout_s]
        if sc.settle_timeout_s != SyncConfig.settle_timeout_s
        else []
    )
    out["merger"] = [
        "merger",
        "--run-dir",
        f"{run_dir}/merger",
        "--init-npz",
        f"{run_dir}/init.npz",
        "--fragments",
        sc.fragments,
        "--keys",
        keys,
        "--allow",
        f"{run_dir}/allow",
        "--delta-endpoint",
        at.broker(1),
        "--snapshot-endpoint",
        at.broker(2),
        "--control-endpoint",
        f"@tcp://{at.bind_host}:{at.control_port}",
        "--max-staleness",
        mc.max_staleness,
        "--quorum",
        mc.quorum,
        "--quorum-timeout",
        mc.quorum_timeout_s,
        "--grace-cap",
        mc.grace_cap_s,
        "--merge",
        mc.merge,
        "--outer",
        mc.outer,
        "--outer-lr",
        mc.outer_lr,
        "--delay",
        mc.delay,
        "--snapshot-codec",
        mc.snapshot_codec,
        "--snapshot-diff-codec",
        mc.snapshot_diff_codec,
        "--snapshot-full-every",
        mc.snapshot_full_every,
        "--share-window",
        mc.share_window,
        "--snapshot-every-round",
        mc.snapshot_every_round,
    ]
    control = f"tcp://{at.merger_host}:{at.control_port}"
    # islands and the evaluator: one control endpoint per merger shard, in shard order
    controls = [control]
    if mc.shards > 1:
        shard0 = out["merger"]
        out["merger"] = [*shard0, "--shard", f"0/{mc.shards}"]
        for index, name in enumerate(shard_names("merger", mc.shards)[1:], 1):
            port, host = (
                at.shard_control_ports[index - 1],
                (at.shard_hosts[index - 1] if at.shard_hosts else at.merger_host),
            )
            shard = _without(_without(shard0, "--run-dir"), "--control-endpoint")
            out[name] = [
                *shard,
                "--run-dir",
                f"{run_dir}/{name}",
                "--control-endpoint",
                f"@tcp://{at.bind_host}:{port}",
                "--name",
                name,
                "--shard",
                f"{index}/{mc.shards}",
            ]
            controls.append(f"tcp://{host}:{port}")
    # the same merger twice (one key, one name): either may be the primary; islands reach both
    if mc.standby:
        standby_control, mine, its = at.standby_ports
        pair = ["--replication", mc.replication, "--lease", mc.lease_s]
        standby = [
            *out["merger"],
            *pair,
            "--replication-endpoint",
            f"@tcp://{at.bind_host}:{its}",
            "--standby-of",
            f"tcp://{at.merger_host}:{mine}",
        ]
        out["standby"] = _without(_without(standby, "--init-npz"), "--control-endpoint") + [
            "--control-endpoint",
            f"@tcp://{at.bind_host}:{standby_control}",
        ]
        out["standby"][out["standby"].index("--run-dir") + 1] = f"{run_dir}/standby"
        out["merger"] += [
            *pair,
            "--replication-endpoint",
            f"@tcp://{at.bind_host}:{mine}",
            "--peer",
            f"tcp://{at.standby_host}:{its}",
        ]
        controls[0] += f",tcp://{at.standby_host}:{standby_control}"
    control = [arg for endpoint in controls for arg in ("--control-endpoint", endpoint)]
    out["evaluator"] = [
        "evaluator",
        "--name",
        "evaluator",
        "--islands",
        len(config.regions),
        *model_args(config, place),
        "--keys",
        keys,
        "--snapshot-endpoint",
        at.broker(3),
        *control,
        "--metrics-out",
        f"{run_dir}/global.jsonl",
    ]
    # with island_cpus the quota slows a region down, not a sleep
    for index, region in enumerate(config.regions):
        links = []
        for flag, value in (
            ("--uplink-mbps", region.uplink_mbps),
            ("--downlink-mbps", region.downlink_mbps),
        ):
            links += [flag, value] if value else []
        out[region.name] = [
            "island",
            "--name",
            region.name,
            "--region",
            region.name,
            "--islands",
            len(config.regions),
            "--island-index",
            index,
            *model_args(config, place),
            "--max-steps",
            10**9,
            *(["--budget-tokens", config.tokens] if config.tokens else []),
            "--eval-every",
            config.eval_every,
            *(["--eval-early"] if config.eval_early else []),
            *(["--eval-trace", config.eval_trace] if config.eval_trace else []),
            "--fragments",
            sc.fragments,
            "--interval",
            config.interval_of(region),
            "--codec",
            sc.codec,
            "--adoption",
            sc.adoption,
            "--alpha",
            sc.alpha,
            *(["--blocking"] if sc.blocking else []),
            *(["--error-feedback"] if sc.error_feedback else []),
            *(["--flush-on-leave"] if sc.flush_on_leave else []),
            *settle,
            "--slowdown",
            1.0 if config.island_cpus else region.slowdown,
            *links,
            "--rtt-ms",
            region.rtt_ms,
            "--keys",
            keys,
            "--delta-endpoint",
            at.broker(0),
            "--snapshot-endpoint",
            at.broker(3),
            *control,
            "--metrics-out",
            f"{run_dir}/metrics/{region.name}.jsonl",
            "--join-timeout",
            300,
        ]
        # one process per host; process 0 (the region's name) holds the bus links and the
        # coordinator
        if region.hosts > 1:
            coordinator = (
                f"{at.coordinator_host or region.name}:{at.coordinator_ports[region.name]}"
            )
            island = out.pop(region.name)
            for index, name in enumerate(region.processes):
                own = (
                    island
                    if index == 0
                    else _without(island, "--metrics-out")
                    + ["--metrics-out", f"{run_dir}/metrics/{name}.jsonl"]
                )
                out[name] = [
                    *own,
                    "--coordinator",
                    coordinator,
                    "--num-processes",
                    region.hosts,
                    "--process-id",
                    index,
                ]
    return {name: [str(arg) for arg in [*args, *at.metrics(name)]] for name, args in out.items()}


def _without(args: list, flag: str) -> list:
    """`args` less `flag` and its value."""
    at = args.index(flag)
    return args[:at] + args[at + 2 :]
