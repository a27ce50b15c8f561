"""`dloco up`: a broker, a merger and one island per region as separate OS processes on this
machine, CURVE on, logs per process under the run directory; a live view while it runs; a clean
stop at the end or on Ctrl-C (islands first, so they send their last deltas, then merger, broker);
then the report.  `--chaos` kills and restarts processes on a schedule (cluster.chaos);
`--compose FILE` takes the processes from a docker-compose file instead (cluster.compose), started
in dependency order with their health checks awaited.

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
import time
from pathlib import Path

from dloco.analysis import verdict
from dloco.analysis.runinfo import RunProgress, island_stage, merger_role
from dloco.bus.security import create_keys, write_allow_list
from dloco.cluster import chaos, compose, cpuquota, netns, status, topology
from dloco.cluster.chaos import MERGERS, is_merger
from dloco.cluster.compose import Service
from dloco.cluster.config import ClusterConfig
from dloco.cluster.liveview import LiveView
from dloco.cluster.ports import free_ports
from dloco.cluster.records import RunCluster, outline, run_task
from dloco.protocol.errors import DlocoError
from dloco.protocol.shards import names as shard_names

# in a run directory: where each process serves its Prometheus metrics
ENDPOINTS = "endpoints.json"
# their end is reported, never a run's failure: the islands and the merger train without them
AUXILIARY = ("evaluator", "status")
# an island drains (up to 30 s), then may evaluate its --eval-trace (up to 90 s)
STOP_TIMEOUT_S = 150.0
# the rest of a multi-host island whose process was killed: it drains (up to 30 s) and exits
GROUP_END_TIMEOUT_S = 60.0
# a run that failed or did not train; one stopped by Ctrl-C or SIGTERM
EXIT_FAILED, EXIT_INTERRUPTED = 1, 130
# in a started process's environment: the launcher it dies with
LAUNCHER_PID = "DLOCO_LAUNCHER_PID"


class LaunchError(DlocoError):
    """The cluster could not be prepared or started."""


def share_compilations() -> Path:
    """Every process this launcher starts (and the report, in this one) keeps JAX's compiled
    programs in one persistent cache, unless JAX_COMPILATION_CACHE_DIR is set already: an island
    restarted by hand or by chaos, and the next run of the same model, start without compiling again
    (seconds instead of tens of seconds on 2 cores).  Returns the cache folder."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dloco" / "jax"
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(cache))
    # the model's many small initialisers too
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
    return Path(os.environ["JAX_COMPILATION_CACHE_DIR"])


def dloco(*args: str) -> list[str]:
    return [sys.executable, "-m", "dloco", *map(str, args)]


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
    ports = [str(p) for p in free_ports(8 + len(names) + len(groups) + config.merger.shards - 1)]
    extra = ports[8 + len(names) :]
    at = topology.Addresses(
        broker_ports=tuple(ports[:4]),
        control_port=ports[4],
        standby_ports=tuple(ports[5:8]),
        metrics_ports=dict(zip(names, ports[8 : 8 + len(names)], strict=True)),
        coordinator_ports=dict(zip(groups, extra[: len(groups)], strict=True)),
        shard_control_ports=tuple(extra[len(groups) :]),
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
    return {name: Service(dloco(*args), cpus=cpus.get(name)) for name, args in commands.items()}


class Cluster:
    def __init__(
        self,
        config: ClusterConfig,
        run_dir: Path,
        services: dict[str, Service],
        order: list[str],
        network: netns.Network | None = None,
    ) -> None:
        self.config, self.run_dir, self.services, self.order, self.network = (
            config,
            run_dir,
            services,
            order,
            network,
        )
        self.faults = netns.Faults(network) if network is not None else None
        self.processes: dict[str, subprocess.Popen] = {}
        # killed on purpose (chaos), not yet restarted
        self.down: set[str] = set()
        # chaos target -> the process its kill killed (a merger's role moves)
        self.killed_as: dict[str, str] = {}
        # A multi-host island's processes (config.Region.processes) go down and come back together:
        # when one dies the others end by themselves (island/group.py), and a restart starts them
        # all.
        self.groups = {
            name: region.processes for region in config.regions for name in region.processes
        }
        # what this run starts
        capped = {name: services[name].cpus for name in order if services[name].cpus}
        self.quotas = None
        # before anything starts: a machine without the controller fails here, with the reason
        if capped:
            self.quotas = cpuquota.CpuQuotas(cpuquota.detect(), f"dloco-{os.getpid()}")
            try:
                for name, cores in capped.items():
                    self.quotas.create(name, cores)
            except cpuquota.CpuQuotaError:
                self.quotas.close()
                raise

    # ---- processes -----------------------------------------------------------------------------
    def start(self, name: str) -> None:
        service = self.services[name]
        # The process stops itself if this launcher dies, however it dies (dloco/cli.py:
        # stop_with_launcher).
        env = {**os.environ, **service.env, LAUNCHER_PID: str(os.getpid())}
        # A capped island enters its quota's group itself, after compiling (island/cpugroup.py).
        command = (
            [*service.command, "--cpu-cgroup", str(self.quotas.groups[name])]
            if service.cpus
            else service.command
        )
        with open(self.run_dir / "logs" / f"{name}.log", "ab") as log:
            # A POSIX session of its own: a terminal's Ctrl-C reaches only the launcher, which stops
            # the rest in order.
            self.processes[name] = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        self.down.discard(name)

    def start_all(self) -> None:
        """In dependency order; a dependency's condition (completed, healthy, started) is awaited
        first."""
        for name in self.order:
            for other, condition in self.services[name].depends.items():
                if condition == "service_healthy":
                    self.wait_healthy(other)
            self.start(name)
            if self.services[name].one_shot:
                code = self.processes.pop(name).wait(timeout=600)
                if code != 0:
                    raise LaunchError(
                        f"{name} exited with {code}; see {self.run_dir / 'logs' / (name + '.log')}"
                    )

    def wait_healthy(self, name: str) -> None:
        service = self.services[name]
        for _ in range(service.health_retries):
            if self.processes[name].poll() is not None:
                raise LaunchError(
                    f"{name} exited with {self.processes[name].returncode} before it was healthy;"
                    f" see {self.run_dir / 'logs'}"
                )
            if subprocess.run(service.health, capture_output=True, timeout=60).returncode == 0:
                return
            time.sleep(service.health_interval_s)
        raise LaunchError(f"{name} did not become healthy: {' '.join(service.health)}")

    def resolve(self, target: str) -> str:
        """The process a chaos target names: with a standby, `merger` is whichever merger is the
        primary now (its log's last role event), `standby` the other."""
        if target not in MERGERS or "standby" not in self.services:
            return target
        running = [
            name
            for name in MERGERS
            if name in self.processes and self.processes[name].poll() is None
        ]
        primary = next(
            (
                name
                for name in running
                if merger_role(self.run_dir / "logs" / f"{name}.log") == "primary"
            ),
            None,
        )
        chosen = (
            primary
            if target == "merger"
            else next((name for name in running if name != primary), None)
        )
        if chosen is None:
            raise LaunchError(
                f"chaos: no {'primary' if target == 'merger' else 'standby'} merger is running now "
                f"(running: {', '.join(running) or 'none'})"
            )
        return chosen

    def act(self, action: str, target: str) -> int | None:
        """A chaos event: a process's (kill, lose-disk, restart) or its host's link's
        (cluster/netns.py)."""
        if not chaos.is_network(action):
            return getattr(self, action.replace("-", "_"))(target)
        # a region's processes share its host
        regions = {process: r.name for r in self.config.regions for process in r.processes}
        self.faults.act(action, target, lambda name: regions.get(name) or self.resolve(name))
        return None

    def effect(self, target: str) -> dict:
        """What the last network event on `target` measured (for chaos.jsonl)."""
        return self.faults.effect.pop(target, {}) if self.faults else {}

    def kill(self, name: str) -> int | None:
        """kill -9: no signal handler runs, nothing is flushed or drained.  Returns the exit status
        of a process that had already ended by itself (None when it was running)."""
        target, name = name, self.resolve(name)
        # not `name = self.killed_as[name] = ...`: that keys the map by the new name
        self.killed_as[target] = name
        process = self.processes[name]
        ended = process.poll()
        if ended is None:
            process.kill()
        process.wait(timeout=30)
        self.down.update(self.groups.get(name, [name]))
        return ended

    def lose_disk(self, name: str) -> int | None:
        """A merger's machine lost: kill -9, and its run directory deleted."""
        ended = self.kill(name)
        shutil.rmtree(self.run_dir / self.killed_as[name], ignore_errors=True)
        return ended

    def restart(self, name: str) -> None:
        """Start a killed process again; every process of a multi-host island, once the others of
        it have ended (they end by themselves within the group's timeout; else they are killed)."""
        name = self.killed_as.pop(name, name)
        # the killed one has been reaped: only the others are waited for
        for member in self.groups.get(name, [name]):
            if member in self.processes and self.processes[member].poll() is None:
                try:
                    self.processes[member].wait(timeout=GROUP_END_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    self.processes[member].kill()
                    self.processes[member].wait(timeout=30)
        for member in self.groups.get(name, [name]):
            self.start(member)

    def quota_summary(self) -> str | None:
        """One line on the CPU quotas (None without), with a warning when they add up to more than
        the cores this launcher may use: then they do not keep the islands from slowing each other.
        """
        if self.quotas is None:
            return None
        cores = {name: self.services[name].cpus for name in self.order if self.services[name].cpus}
        total, machine = sum(cores.values()), len(os.sched_getaffinity(0))
        line = (
            f"dloco up: CPU quotas (cgroup v{self.quotas.controller.version}, {self.quotas.root}): "
            + ", ".join(f"{name} {value:g}" for name, value in cores.items())
            + f" cores; {total:g} of {machine}"
        )
        if total > machine:
            line += (
                f"; WARNING: more than the machine's {machine} cores, so the islands still compete"
                " for CPU"
            )
        return line

    def unexpectedly_dead(self) -> list[str]:
        """Processes the run needs that ended by themselves (not killed on purpose)."""
        return [
            n
            for n, p in self.processes.items()
            if n not in self.down and n not in AUXILIARY and p.poll() is not None
        ]

    def auxiliary_ended(self) -> dict[str, int]:
        """Auxiliary processes (AUXILIARY) that ended by themselves: name -> exit status."""
        return {
            n: p.returncode
            for n, p in self.processes.items()
            if n in AUXILIARY and p.poll() is not None
        }

    def stop_all(self) -> dict[str, int]:
        """Islands first (they finish the step, send and drain), then the evaluator and the status
        page, then the merger (final checkpoint), then the broker."""
        codes = {}
        islands = [
            n for n in self.processes if not is_merger(n) and n not in ("broker", *AUXILIARY)
        ]
        # both mergers at once: a standby that outlived its primary would take over
        for group in (
            islands,
            [n for n in self.processes if n in AUXILIARY],
            [n for n in self.processes if is_merger(n)],
            ["broker"],
        ):
            for name in group:
                if name in self.processes and self.processes[name].poll() is None:
                    self.processes[name].send_signal(signal.SIGTERM)
            for name in group:
                if name in self.processes:
                    try:
                        codes[name] = self.processes[name].wait(timeout=STOP_TIMEOUT_S)
                    except subprocess.TimeoutExpired:
                        self.processes[name].kill()
                        codes[name] = self.processes[name].wait(timeout=10)
        return codes


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
    run_dir = run_dir.resolve()
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    share_compilations()
    # or each host in a network namespace of its own (cluster/netns.py)
    network = None
    if compose_file is None:
        network = netns.Network(netns.host_names(config)) if config.network == "netns" else None
        services = (
            netns.services(config, run_dir, network)
            if network
            else native_services(config, run_dir)
        )
        order = [
            "broker",
            *config.merger.processes,
            "evaluator",
            *(p for r in config.regions for p in r.processes),
        ]
    else:
        if config.network == "netns":
            raise LaunchError(
                'run.network = "netns" starts its own processes in namespaces: not with --compose'
            )
        variables = compose.port_variables(compose_file.read_text())
        ports = dict(zip(variables, map(str, free_ports(len(variables))), strict=True))
        services = compose.load(compose_file, {"DLOCO_RUN_DIR": str(run_dir), **ports})
        order = compose.start_order(services, wanted)
        unknown = [
            n
            for n in order
            if n not in ("prepare", "broker", "evaluator", "status")
            and not is_merger(n)
            and n not in config.process_names
        ]
        if unknown:
            raise LaunchError(
                f"{compose_file}: services {unknown} are not regions of the cluster file"
            )
        config = dataclasses.replace(
            config, regions=tuple(r for r in config.regions if r.name in order)
        )
    try:
        cluster = Cluster(config, run_dir, services, order, network)
    except BaseException:
        if network is not None:
            network.close()
        raise
    islands = [r.name for r in config.regions]
    interval = {region.name: config.interval_of(region) for region in config.regions}
    progress = RunProgress(run_dir, islands)
    interrupted, problems, dead = False, [], []

    def on_interrupt(*_) -> None:
        nonlocal interrupted
        interrupted = True

    previous = {sig: signal.signal(sig, on_interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    pending = list(config.chaos)
    page, warned = None, set()
    try:
        # cluster/status.py: the live page, from the run directory's files
        if status_port is not None:
            page = status.serve(run_dir, islands, status_port)
            print(
                f"dloco up: status page at http://127.0.0.1:{page.server_address[1]}/",
                file=out,
                flush=True,
            )
        print(f"dloco up: preparing {run_dir} (keys, initial model) ...", file=out, flush=True)
        if (quotas := cluster.quota_summary()) is not None:
            print(quotas, file=out, flush=True)
        if compose_file is None:
            prepare(config, run_dir)
        cluster.start_all()
        # the run's clock (duration, chaos times) starts with the processes
        started = time.monotonic()
        view = LiveView(config, run_dir, out)
        with open(run_dir / "chaos.jsonl", "a") as chaos_log:
            # where the run was when the last event fired
            armed = chaos.Progress(0.0, dict(progress.steps), 0, dict(progress.folded))
            while not interrupted:
                progress.update()
                now = chaos.Progress(
                    time.monotonic() - started,
                    dict(progress.steps),
                    progress.folds,
                    dict(progress.folded),
                )
                # before any kill: a crash must not pass for a chaos kill
                dead = cluster.unexpectedly_dead()
                # with a budget an island stops by itself once it hears the budget is spent
                if config.tokens:
                    dead = [
                        name
                        for name in dead
                        if not (
                            name.partition(".")[0] in islands
                            and cluster.processes[name].returncode == 0
                        )
                    ]
                for name, code in cluster.auxiliary_ended().items():
                    if name not in warned:
                        warned.add(name)
                        print(
                            f"dloco up: WARNING: {name} exited with {code} (see"
                            f" {run_dir / 'logs' / name}.log); the run goes on without it",
                            file=out,
                            flush=True,
                        )
                while not dead and pending and chaos.due(pending[0], now, armed):
                    event = pending.pop(0)
                    # it had ended by itself
                    if cluster.act(event.action, event.target) is not None:
                        dead = [event.target]
                        break
                    chaos_log.write(
                        json.dumps(
                            {
                                "at_s": round(now.elapsed_s, 3),
                                "wall": time.time(),
                                "action": event.action,
                                "target": event.target,
                                "process": cluster.killed_as.get(event.target, event.target),
                                "when": str(event),
                                **cluster.effect(event.target),
                            }
                        )
                        + "\n"
                    )
                    chaos_log.flush()
                    print(f"dloco up: chaos {event} done", file=out, flush=True)
                    armed = now
                if dead:
                    print(
                        f"dloco up: {', '.join(dead)} exited early; see {run_dir / 'logs'}",
                        file=out,
                        flush=True,
                    )
                    problems.append(
                        f"{', '.join(dead)} exited early"
                        f" ({', '.join(f'{n} {cluster.processes[n].returncode}' for n in dead)})"
                    )
                    break
                wanted = verdict.targets(
                    islands,
                    cluster.down,
                    config.max_steps,
                    interval,
                    armed.steps if config.chaos and not pending else None,
                )
                left = verdict.short(progress.steps, wanted)
                if config.max_steps and not left and not pending:
                    break
                spent = progress.tokens >= config.tokens or all(
                    cluster.processes[name].poll() is not None
                    for name in cluster.processes
                    if name.partition(".")[0] in islands
                )
                if config.tokens and spent and not pending:
                    break
                if now.elapsed_s >= config.duration_s:
                    if config.tokens:
                        problems += verdict.budget_unspent(
                            progress.tokens, config.tokens, config.duration_s
                        )
                        problems += verdict.unreached(
                            [str(e) for e in pending],
                            progress.steps,
                            progress.folds,
                            progress.folded,
                        )
                    if config.max_steps:
                        stages = {
                            name: island_stage(
                                run_dir / "logs" / f"{name}.log",
                                progress.last_step[name],
                                progress.steps[name],
                                target,
                            )
                            for name, target in left.items()
                        }
                        problems += verdict.unfinished(stages, config.duration_s)
                        problems += verdict.unreached(
                            [str(e) for e in pending],
                            progress.steps,
                            progress.folds,
                            progress.folded,
                        )
                    break
                view.refresh(now.elapsed_s)
                time.sleep(0.25 if pending or config.max_steps or config.tokens else 1.0)
    finally:
        print("dloco up: stopping (islands, then merger, then broker) ...", file=out, flush=True)
        codes = cluster.stop_all()
        if network is not None:
            network.close()
        if cluster.quotas is not None:
            for group in cluster.quotas.close():
                print(f"dloco up: could not remove the cgroup {group}", file=out, flush=True)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if page is not None:
            page.shutdown()
            page.server_close()
    from dloco.analysis.report import write_report

    progress.update()
    failed = {
        name: code
        for name, code in codes.items()
        if code != 0 and name not in cluster.down and name not in dead and name not in AUXILIARY
    }
    for name in sorted(set(codes) & set(AUXILIARY) - warned):
        if codes[name] != 0:
            print(
                f"dloco up: WARNING: {name} exited with {codes[name]} (see"
                f" {run_dir / 'logs' / name}.log)",
                file=out,
                flush=True,
            )
    if failed:
        problems.append(
            "exit status " + ", ".join(f"{name} {code}" for name, code in failed.items())
        )
    if not interrupted and not problems:
        problems += verdict.untrained(progress.steps, progress.folds, interval)
    report = write_report(outline(config), run_dir, codes, problems)
    for problem in problems:
        print(f"dloco up: FAILED: {problem}", file=out, flush=True)
    if "\n## WARNING: the global model\n" in report.read_text():
        print(
            "dloco up: WARNING: the global model ended worse than it started or than every island"
            f" (see {report})",
            file=out,
            flush=True,
        )
    print(f"dloco up: report at {report}", file=out, flush=True)
    if interrupted:
        return EXIT_INTERRUPTED
    return EXIT_FAILED if problems else 0
