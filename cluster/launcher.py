"""`dloco up`: a broker, a merger and one island per region as separate OS processes on this
machine, CURVE on, logs per process under the run directory; a live view while it runs; a clean
stop at the end or on Ctrl-C (islands first, so they send their last deltas, then merger, broker);
then the report.  `--chaos` kills and restarts processes on a schedule (cluster.chaos);
`--compose FILE` takes the processes from a docker-compose file instead (cluster.localcompose),
started in dependency order with their health checks awaited.  The processes are
cluster.processes' to start and stop, the run's progress cluster.watch's to follow; here the run is
prepared, started, ended and reported.

A run lasts `duration_s`, or, with `max_steps`, until every island that is up has trained that
many steps (every life), the chaos schedule has run, and every island has trained two intervals
(2 H) since the schedule's last event, so that the recovery is part of the run (analysis.verdict.
targets); then `duration_s` is a limit: a run still going then has failed, and the launcher says
which island was where.  A run whose islands did not train an interval, or whose merger never
folded, fails too (analysis.verdict): the exit status is 0 only for a run that did its work.

Run directory: keys/, allow/{island,merger}/ (the allow-list, by role), init.npz, task.json (what
the islands train: `dloco sample` and `dloco export` build the model from it), cluster.json
(regions, links and settings: `dloco plan --calibrate`), logs/<process>.log, metrics/<region>.jsonl,
merger/ (write-ahead log, checkpoints), report.md, plots/*.png.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
from http.server import ThreadingHTTPServer
from pathlib import Path

from dloco.analysis import verdict
from dloco.bus.keys import create_keys, write_allow_list
from dloco.cluster import etcd, localcompose, netns, status, topology
from dloco.cluster.chaos import is_merger
from dloco.cluster.config import ClusterConfig, unlike_the_profile
from dloco.cluster.localcompose import Service, dloco_program
from dloco.cluster.modes import MODES
from dloco.cluster.ports import free_ports
from dloco.cluster.processes import AUXILIARY, Cluster, LaunchError
from dloco.cluster.records import RunCluster, outline, run_task
from dloco.cluster.watch import Watch
from dloco.protocol.errors import ConfigError
from dloco.protocol.shards import names as shard_names

# in a run directory: where each process serves its Prometheus metrics
ENDPOINTS = "endpoints.json"
# a run that failed or did not train; one stopped by Ctrl-C or SIGTERM
EXIT_FAILED, EXIT_INTERRUPTED = 1, 130


def share_compilations() -> Path:
    """Every process this launcher starts (and the report, in this one) keeps JAX's compiled
    programs in one persistent cache, unless JAX_COMPILATION_CACHE_DIR is set already: an island
    restarted by hand or by chaos, and the next run of the same model, start without compiling again
    (loading a compiled program is far quicker than compiling it).  Returns the cache folder."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dloco" / "jax"
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(cache))
    # the model's many small initialisers too
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
    return Path(os.environ["JAX_COMPILATION_CACHE_DIR"])


def dloco(*args: str) -> list[str]:
    return [*dloco_program(), *map(str, args)]


def prepare(config: ClusterConfig, run_dir: Path) -> None:
    """What every process needs before it starts: CURVE keys, allow-lists, the initial model; and
    the record of the task, for whoever reads the run directory later."""
    for folder in ("logs", "metrics"):
        (run_dir / folder).mkdir(parents=True, exist_ok=True)
    run_task(config).write(run_dir)
    RunCluster.of(config).write(run_dir)
    names = [r.name for r in config.regions]
    # a standby has its primary's key
    mergers = shard_names("merger", config.merger.shards)
    create_keys(run_dir / "keys", ["broker", *mergers, "evaluator", *names])
    write_allow_list(
        run_dir / "keys",
        run_dir / "allow",
        {"merger": mergers, "island": names, "observer": ["evaluator"]},
    )
    init = subprocess.run(
        dloco("island", "--write-init", run_dir / "init.npz", *topology.model_args(config)),
        capture_output=True,
        text=True,
        timeout=300,
    )
    if init.returncode != 0:
        raise LaunchError(f"could not create the initial model: {init.stderr[-500:]}")


def native_services(config: ClusterConfig, run_dir: Path) -> dict[str, Service]:
    """Broker, merger and islands as processes of this Python on 127.0.0.1, free ports."""
    names = ["broker", *config.merger.processes, "evaluator", *(r.name for r in config.regions)]
    groups = [r.name for r in config.regions if r.hosts > 1]
    shards = config.merger.shards
    standbys = shards - 1 if config.merger.standby else 0
    ports = [str(p) for p in free_ports(10 + len(names) + len(groups) + shards - 1 + 3 * standbys)]
    extra = ports[10 + len(names) :]
    pairs = extra[len(groups) + shards - 1 :]
    at = topology.Addresses(
        broker_ports=tuple(ports[:4]),
        control_port=ports[4],
        standby_ports=tuple(ports[5:8]),
        etcd_ports=(ports[8], ports[9]),
        metrics_ports=dict(zip(names, ports[10 : 10 + len(names)], strict=True)),
        coordinator_ports=dict(zip(groups, extra[: len(groups)], strict=True)),
        shard_control_ports=tuple(extra[len(groups) : len(groups) + shards - 1]),
        shard_standby_ports=tuple(tuple(pairs[3 * k : 3 * k + 3]) for k in range(standbys)),
    )
    commands = topology.commands(config, at, str(run_dir))
    (run_dir / ENDPOINTS).write_text(
        json.dumps(
            {
                "metrics": {
                    name: f"http://127.0.0.1:{port}/metrics"
                    for name, port in at.metrics_ports.items()
                }
            },
            indent=2,
        )
        + "\n"
    )
    cpus = {name: config.cpus_of(r) for r in config.regions for name in r.processes}
    services = {name: Service(dloco(*args), cpus=cpus.get(name)) for name, args in commands.items()}
    return etcd.first(services, dloco("probe", f"tcp://127.0.0.1:{at.etcd_ports[0]}"))


def run(
    config: ClusterConfig,
    run_dir: Path,
    out=sys.stdout,
    compose_file: Path | None = None,
    wanted: list[str] | None = None,
    status_port: int | None = None,
) -> int:
    """Start, watch, stop, report.  Returns the exit status: 0 when the run did its work and every
    process stopped cleanly, EXIT_FAILED with the reasons printed, EXIT_INTERRUPTED after Ctrl-C.

    With `compose_file`, the processes are that file's services (`wanted` and what they depend on),
    run locally; `config` then only names the regions, the model and the run's bounds for the live
    view and report.  `status_port`: serve the status page there while the run lasts (0: a free
    port; None: no page)."""
    if not MODES[config.mode].on_bus:
        raise ConfigError(
            f"mode {config.mode} runs in one process only (`dloco experiment quality` trains it:"
            " suites/inprocess.py); on the bus, sync-avg averages the islands' parameters after"
            " every step (the bytes and barrier of an fp32 all-reduce, not its arithmetic)"
        )
    run_dir = run_dir.resolve()
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    share_compilations()
    network = None
    if compose_file is None:
        network, services, order = _own_services(config, run_dir)
    else:
        config, services, order = _compose_services(config, run_dir, compose_file, wanted)
    try:
        cluster = Cluster(config, run_dir, services, order, network)
    except BaseException:
        if network is not None:
            network.close()
        raise
    watch = Watch(cluster, out)
    previous = {sig: signal.signal(sig, watch.interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    page = None
    try:
        # cluster/status.py: the live page, from the run directory's files
        if status_port is not None:
            page = status.serve(run_dir, watch.islands, status_port)
            watch.say(f"dloco up: status page at http://127.0.0.1:{page.server_address[1]}/")
        if compose_file is None and (unlike := unlike_the_profile(config)):
            watch.say(
                "dloco up: not in the cluster file, so the processes' own defaults, unlike the"
                f" shipped profile (cluster/profiles/default.toml): {', '.join(unlike)}"
            )
        watch.say(f"dloco up: preparing {run_dir} (keys, initial model) ...")
        if (quotas := cluster.quota_summary()) is not None:
            watch.say(quotas)
        if compose_file is None:
            prepare(config, run_dir)
        cluster.start_all()
        watch.run()
    finally:
        codes = _stop(watch, previous, page)
    return _report(watch, codes)


def _own_services(
    config: ClusterConfig, run_dir: Path
) -> tuple[netns.Network | None, dict[str, Service], list[str]]:
    """The cluster file's processes and their start order: on this machine's loopback, or each host
    in a network namespace of its own (cluster/netns.py; the network is returned, to be closed)."""
    if config.merger.etcd and shutil.which("etcd") is None:
        raise ConfigError(
            'a standby with merger.failover = "etcd" (the default) needs the etcd binary on PATH'
            ' (Debian: apt install etcd-server); or set failover = "lease", the pair\'s own lease,'
            " which a standby cut off from everyone cannot tell from a dead primary (PROTOCOL.md"
            " §12)"
        )
    network = netns.Network(netns.host_names(config)) if config.network == "netns" else None
    services = (
        netns.services(config, run_dir, network) if network else native_services(config, run_dir)
    )
    order = [
        "broker",
        *(["etcd"] if "etcd" in services else []),
        *config.merger.processes,
        *(["evaluator"] if config.evaluator else []),
        *(p for r in config.regions for p in r.processes),
    ]
    if not config.evaluator:
        services.pop("evaluator", None)
    return network, services, order


def _compose_services(
    config: ClusterConfig, run_dir: Path, compose_file: Path, wanted: list[str] | None
) -> tuple[ClusterConfig, dict[str, Service], list[str]]:
    """A compose file's services (`wanted` and what they need) as local processes, each port
    variable a free port, in their start order; `config` narrowed to the regions they run."""
    if config.network == "netns":
        raise LaunchError(
            'run.network = "netns" starts its own processes in namespaces: not with --compose'
        )
    variables = localcompose.port_variables(compose_file.read_text())
    ports = dict(zip(variables, map(str, free_ports(len(variables))), strict=True))
    services = localcompose.load(compose_file, {"DLOCO_RUN_DIR": str(run_dir), **ports})
    order = localcompose.start_order(services, wanted)
    unknown = [
        n
        for n in order
        if n not in ("prepare", "broker", "evaluator", "status")
        and not is_merger(n)
        and n not in config.process_names
    ]
    if unknown:
        raise LaunchError(f"{compose_file}: services {unknown} are not regions of the cluster file")
    config = dataclasses.replace(
        config, regions=tuple(r for r in config.regions if r.name in order)
    )
    return config, services, order


def _stop(watch: Watch, previous: dict, page: ThreadingHTTPServer | None) -> dict[str, int]:
    """Every process stopped in order (their exit statuses returned), the network and the CPU
    quotas removed, the signal handlers put back (`previous`), the status page closed."""
    cluster = watch.cluster
    watch.say("dloco up: stopping (islands, then merger, then broker) ...")
    codes = cluster.stop_all()
    if cluster.network is not None:
        cluster.network.close()
    if cluster.quotas is not None:
        for group in cluster.quotas.close():
            watch.say(f"dloco up: could not remove the cgroup {group}")
    for sig, handler in previous.items():
        signal.signal(sig, handler)
    if page is not None:
        page.shutdown()
        page.server_close()
    return codes


def _report(watch: Watch, codes: dict[str, int]) -> int:
    """The run's end: which processes failed, the report written (report.md, plots), the problems
    printed; returns the exit status."""
    from dloco.analysis.report import write_report

    cluster, progress, problems = watch.cluster, watch.progress, watch.problems
    run_dir = watch.run_dir
    progress.update()
    failed = {
        name: code
        for name, code in codes.items()
        if code != 0
        and name not in cluster.down
        and name not in watch.dead
        and name not in AUXILIARY
        and name not in cluster.stopped_starting
    }
    for name in sorted(cluster.stopped_starting):
        watch.say(f"dloco up: {name} was still starting when stopped (exit {codes[name]})")
    for name in sorted(set(codes) & set(AUXILIARY) - watch.warned):
        if codes[name] != 0:
            watch.say(
                f"dloco up: WARNING: {name} exited with {codes[name]} (see"
                f" {run_dir / 'logs' / name}.log)"
            )
    if failed:
        problems.append(
            "exit status " + ", ".join(f"{name} {code}" for name, code in failed.items())
        )
    if not watch.interrupted and not problems:
        problems += verdict.untrained(progress.steps, progress.folds, watch.interval)
    path = write_report(outline(watch.config), run_dir, codes, problems)
    for problem in problems:
        watch.say(f"dloco up: FAILED: {problem}")
    if "\n## WARNING: the global model\n" in path.read_text():
        watch.say(
            "dloco up: WARNING: the global model ended worse than it started or than every island"
            f" (see {path})"
        )
    watch.say(f"dloco up: report at {path}")
    if watch.interrupted:
        return EXIT_INTERRUPTED
    return EXIT_FAILED if problems else 0
