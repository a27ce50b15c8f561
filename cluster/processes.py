"""The processes of a run under `dloco up`: each started with its log file (and, for an island,
its CPU quota), in dependency order with the health checks awaited; killed, restarted and cut off
by chaos; stopped in order at the end (islands first, so they send their last deltas, then the
evaluator and the status page, then the mergers, then the broker).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from dloco.analysis.runinfo import merger_role
from dloco.cluster import chaos, cpuquota, netns
from dloco.cluster.chaos import MERGERS, is_merger
from dloco.cluster.config import ClusterConfig
from dloco.cluster.localcompose import Service
from dloco.protocol.errors import DlocoError

# their end is reported, never a run's failure: the islands and the merger train without them
AUXILIARY = ("evaluator", "status")
# stopped last, after the mergers
HUB = ("broker", "etcd")
# an island drains (up to 30 s), then may evaluate its --eval-trace (up to 90 s)
STOP_TIMEOUT_S = 150.0
# the rest of a multi-host island whose process was killed: it drains (up to 30 s) and exits
GROUP_END_TIMEOUT_S = 60.0
# in a started process's environment: the launcher it dies with
LAUNCHER_PID = "DLOCO_LAUNCHER_PID"


class LaunchError(DlocoError):
    """The cluster could not be prepared or started."""


class Cluster:
    """The run's processes by name, their services and what chaos did to them."""

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
        # ended by stop_all's SIGTERM itself: still starting, before their own handler was in place
        # (a process restarted by chaos near the run's end), so stopped as asked, not failed
        self.stopped_starting: set[str] = set()
        # A multi-host island's processes (cluster.sections Region.processes) go down and come back
        # together: when one dies the others end by themselves (island/group.py), and a restart
        # starts them all.
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
        # The process stops itself if this launcher dies, however it dies (commands/cli.py:
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
        primary now (its log's last role event), `standby` the other; `merger.I` and `standby.I`
        the same of shard I's pair."""
        base, dot, index = target.partition(".")
        pair = [f"{name}{dot}{index}" for name in MERGERS]
        if base not in MERGERS or pair[1] not in self.services:
            return target
        running = [
            name for name in pair if name in self.processes and self.processes[name].poll() is None
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
            if base == "merger"
            else next((name for name in running if name != primary), None)
        )
        if chosen is None:
            raise LaunchError(
                f"chaos: no {'primary' if base == 'merger' else 'standby'} of {pair[0]} is running"
                " now "
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
        page, then the merger (final checkpoint), then the broker and etcd."""
        codes = {}
        islands = [n for n in self.processes if not is_merger(n) and n not in (*HUB, *AUXILIARY)]
        # both mergers at once: a standby that outlived its primary would take over
        for group in (
            islands,
            [n for n in self.processes if n in AUXILIARY],
            [n for n in self.processes if is_merger(n)],
            list(HUB),
        ):
            signalled = [
                name
                for name in group
                if name in self.processes and self.processes[name].poll() is None
            ]
            for name in signalled:
                self.processes[name].send_signal(signal.SIGTERM)
            for name in group:
                if name in self.processes:
                    try:
                        codes[name] = self.processes[name].wait(timeout=STOP_TIMEOUT_S)
                    except subprocess.TimeoutExpired:
                        self.processes[name].kill()
                        codes[name] = self.processes[name].wait(timeout=10)
            self.stopped_starting.update(
                name for name in signalled if codes[name] == -signal.SIGTERM
            )
        return codes
