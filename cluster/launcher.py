"""`dloco up`: a broker, a merger and one island per region as separate OS processes on this
machine, CURVE on, logs per process under the run directory; a live view while it runs; a clean
stop at the end or on Ctrl-C (islands first, so they send their last deltas, then merger, broker);
then the report.

Run directory: keys/, allow/{broker,merger}/, init.npz, logs/<process>.log,
metrics/<region>.jsonl, merger/ (write-ahead log, checkpoints), report.md, plots/*.png.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from broker.security import create_keys
from cluster.config import ClusterConfig
from cluster.liveview import LiveView
from cluster.ports import free_ports
from protocol.errors import DlocoError

STOP_TIMEOUT_S = 60.0


class LaunchError(DlocoError):
    """The cluster could not be prepared or started."""


def dloco(*args: str) -> list[str]:
    return [sys.executable, "-m", "cluster.cli", *map(str, args)]


class Cluster:
    def __init__(self, config: ClusterConfig, run_dir: Path) -> None:
        self.config, self.run_dir = config, run_dir
        self.processes: dict[str, subprocess.Popen] = {}
        self.commands: dict[str, list] = {}
        self.down: set[str] = set()  # killed on purpose (chaos), not yet restarted
        ports = free_ports(5)
        self.broker_endpoints = [f"tcp://127.0.0.1:{p}" for p in ports[:4]]
        self.control_port = ports[4]

    # ---- setup ---------------------------------------------------------------------------------
    def prepare(self) -> None:
        for folder in ("logs", "metrics", "allow/broker", "allow/merger"):
            (self.run_dir / folder).mkdir(parents=True, exist_ok=True)
        names = [r.name for r in self.config.regions]
        create_keys(self.run_dir / "keys", ["broker", "merger", *names])
        for name in ["merger", *names]:
            shutil.copy(self.run_dir / "keys" / f"{name}.key", self.run_dir / "allow" / "broker")
        for name in names:
            shutil.copy(self.run_dir / "keys" / f"{name}.key", self.run_dir / "allow" / "merger")
        init = subprocess.run(dloco("island", "--write-init", self.run_dir / "init.npz", *self.model_args()),
                              capture_output=True, text=True, timeout=300)
        if init.returncode != 0:
            raise LaunchError(f"could not create the initial model: {init.stderr[-500:]}")

    def model_args(self) -> list[str]:
        m = self.config.model
        return ["--width", m["width"], "--depth", m["depth"], "--heads", m["heads"], "--context", m["context"],
                "--batch", m["batch"], "--seed", self.config.seed]

    # ---- processes -----------------------------------------------------------------------------
    def start(self, name: str, command: list) -> None:
        self.commands[name] = command
        with open(self.run_dir / "logs" / f"{name}.log", "ab") as log:
            # A session of its own: a terminal's Ctrl-C reaches only the launcher, which stops the rest in order.
            self.processes[name] = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.down.discard(name)

    def kill(self, name: str) -> None:
        """kill -9: no signal handler runs, nothing is flushed or drained."""
        process = self.processes[name]
        if process.poll() is None:
            process.kill()
        process.wait(timeout=30)
        self.down.add(name)

    def restart(self, name: str) -> None:
        self.start(name, self.commands[name])

    def unexpectedly_dead(self) -> list[str]:
        return [n for n, p in self.processes.items() if n not in self.down and p.poll() is not None]

    def start_all(self) -> None:
        keys, b = self.run_dir / "keys", self.broker_endpoints
        self.start("broker", dloco("broker", "--keys", keys, "--allow", self.run_dir / "allow" / "broker", "--delta-in", b[0],
                                   "--delta-out", b[1], "--snapshot-in", b[2], "--snapshot-out", b[3], "--stats-every", 5))
        mc, sc = self.config.merger, self.config.sync
        self.start("merger", dloco("merger", "--run-dir", self.run_dir / "merger", "--init-npz", self.run_dir / "init.npz",
                                   "--fragments", sc["fragments"], "--keys", keys, "--allow", self.run_dir / "allow" / "merger",
                                   "--delta-endpoint", b[1], "--snapshot-endpoint", b[2], "--control-endpoint", f"@tcp://127.0.0.1:{self.control_port}",
                                   "--max-staleness", mc["max_staleness"], "--quorum", mc["quorum"], "--grace-cap", mc["grace_cap_s"],
                                   "--outer", mc["outer"], "--outer-lr", mc["outer_lr"], "--snapshot-codec", mc["snapshot_codec"]))
        for index, region in enumerate(self.config.regions):
            links = []
            for flag, value in (("--uplink-mbps", region.uplink_mbps), ("--downlink-mbps", region.downlink_mbps)):
                links += [flag, value] if value else []
            self.start(region.name, dloco(
                "island", "--name", region.name, "--region", region.name, "--islands", len(self.config.regions), "--island-index", index,
                *self.model_args(), "--max-steps", 10**9, "--eval-every", self.config.eval_every,
                "--fragments", sc["fragments"], "--interval", sc["interval"], "--codec", sc["codec"], "--alpha", sc["alpha"],
                "--slowdown", region.slowdown, *links, "--rtt-ms", region.rtt_ms, "--keys", keys,
                "--delta-endpoint", b[0], "--snapshot-endpoint", b[3], "--control-endpoint", f"tcp://127.0.0.1:{self.control_port}",
                "--metrics-out", self.run_dir / "metrics" / f"{region.name}.jsonl", "--join-timeout", 300))

    def stop_all(self) -> dict[str, int]:
        """Islands first (they finish the step, send and drain), then the merger (final checkpoint), then the broker."""
        codes = {}
        order = [r.name for r in self.config.regions] + ["merger", "broker"]
        for group in (order[:-2], ["merger"], ["broker"]):
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


def run(config: ClusterConfig, run_dir: Path, out=sys.stdout) -> int:
    """Start, watch, stop, report.  Returns the exit status (0 when every process stopped cleanly)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    cluster = Cluster(config, run_dir)
    interrupted = False

    def on_interrupt(*_) -> None:
        nonlocal interrupted
        interrupted = True

    previous = {sig: signal.signal(sig, on_interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    pending = list(config.chaos)
    try:
        print(f"dloco up: preparing {run_dir} (keys, initial model) ...", file=out, flush=True)
        cluster.prepare()
        cluster.start_all()
        started = time.monotonic()  # the run's clock (duration, chaos times) starts with the processes
        view = LiveView(config, run_dir, out)
        with open(run_dir / "chaos.jsonl", "a") as chaos_log:
            while not interrupted and time.monotonic() - started < config.duration_s:
                while pending and time.monotonic() - started >= pending[0].at_s:
                    event = pending.pop(0)
                    getattr(cluster, event.action)(event.target)
                    chaos_log.write(json.dumps({"at_s": round(time.monotonic() - started, 3), "wall": time.time(),
                                                "action": event.action, "target": event.target}) + "\n")
                    chaos_log.flush()
                    print(f"dloco up: chaos {event} done", file=out, flush=True)
                dead = cluster.unexpectedly_dead()
                if dead:
                    print(f"dloco up: {', '.join(dead)} exited early; see {run_dir / 'logs'}", file=out, flush=True)
                    break
                view.refresh(time.monotonic() - started)
                time.sleep(0.25 if pending else 1.0)
    finally:
        print("dloco up: stopping (islands, then merger, then broker) ...", file=out, flush=True)
        codes = cluster.stop_all()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    from cluster.report import write_report

    report = write_report(config, run_dir, codes)
    print(f"dloco up: report at {report}", file=out, flush=True)
    return 0 if all(code == 0 or name in cluster.down for name, code in codes.items()) else 1
