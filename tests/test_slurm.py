"""A region's island under Slurm, on real daemons: this machine becomes a one-node Slurm cluster
(munged, slurmctld, slurmd, a configuration of their own under the test's folder), a merger runs
outside Slurm, and the batch script `dloco deploy` writes for a region (cluster/deploy.py
`island_sbatch`) runs a two-task island with `--coordinator slurm`: no address written by hand.
Both tasks join one jax.distributed program and train, the island's deltas are folded, and
`scancel` is seen by the merger as the island leaving.  Everything waited for is an event in a log
(a fold, a step, a departure), each within a deadline that only stops a hang.

Root and Debian's slurm-wlm and munge are needed (CI has them: .ci/run sets DLOCO_REQUIRE_SLURM, so
that a machine without them fails there instead of skipping)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dloco.cluster.bundle_texts import island_sbatch
from dloco.cluster.ports import free_ports
from tests.merger_process_helpers import TINY, start_bound_merger

TOOLS = ("munged", "slurmctld", "slurmd", "sbatch", "scancel", "squeue", "sinfo")
# a deadline for each awaited event: only a hang reaches it
HANG_S = 300


def unavailable() -> str | None:
    if os.geteuid() != 0:
        return "Slurm's daemons run as root here"
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    return f"not installed: {missing} (Debian's slurm-wlm and munge)" if missing else None


def until(what: str, condition, deadline_s: float = HANG_S):
    """Wait for `condition()` to be true (returned), asking every half second."""
    deadline = time.monotonic() + deadline_s
    while not (value := condition()):
        assert time.monotonic() < deadline, f"no {what} within {deadline_s} s"
        time.sleep(0.5)
    return value


# Over 60 lines: a Slurm cluster's whole configuration, one setting a line, then its daemons.
@pytest.fixture
def slurm(tmp_path_factory):
    """A one-node cluster of this machine's CPUs; yields the environment its commands need."""
    reason = unavailable()
    if reason is not None:
        if os.environ.get("DLOCO_REQUIRE_SLURM"):
            pytest.fail(f"Slurm is required here (DLOCO_REQUIRE_SLURM) but: {reason}")
        pytest.skip(reason)
    home = tmp_path_factory.mktemp("slurm")
    for folder in ("state", "spool", "log"):
        (home / folder).mkdir()
    host = socket.gethostname().split(".")[0]
    controller, daemon = free_ports(2)
    conf = home / "slurm.conf"
    conf.write_text(
        "\n".join(
            [
                "ClusterName=dloco-test",
                f"SlurmctldHost={host}",
                "SlurmUser=root",
                "SlurmdUser=root",
                f"SlurmctldPort={controller}",
                f"SlurmdPort={daemon}",
                "AuthType=auth/munge",
                f"StateSaveLocation={home}/state",
                f"SlurmdSpoolDir={home}/spool",
                f"SlurmctldPidFile={home}/slurmctld.pid",
                f"SlurmdPidFile={home}/slurmd.pid",
                f"SlurmctldLogFile={home}/log/slurmctld.log",
                f"SlurmdLogFile={home}/log/slurmd.log",
                "ProctrackType=proctrack/linuxproc",
                "TaskPlugin=task/none",
                "SchedulerType=sched/builtin",
                "SelectType=select/cons_tres",
                "SelectTypeParameters=CR_CPU",
                "MpiDefault=none",
                "ReturnToService=2",
                f"NodeName={host} CPUs={os.cpu_count()} State=UNKNOWN",
                f"PartitionName=test Nodes={host} Default=YES MaxTime=INFINITE State=UP",
                "",
            ]
        )
    )
    env = {**os.environ, "SLURM_CONF": str(conf)}
    if subprocess.run(["munge", "-n"], capture_output=True).returncode != 0:
        Path("/run/munge").mkdir(exist_ok=True)
        subprocess.run(["munged", "--force"], check=True, capture_output=True, timeout=30)
    daemons = [
        subprocess.Popen(
            [tool, "-D", "-f", str(conf)],
            env=env,
            stderr=subprocess.STDOUT,
            stdout=open(home / "log" / f"{tool}.out", "wb"),
        )
        for tool in ("slurmctld", "slurmd")
    ]
    try:
        until(
            "idle Slurm node",
            lambda: (
                "idle"
                in subprocess.run(
                    ["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True
                ).stdout
            ),
            120,
        )
        yield env
    finally:
        for process in daemons:
            process.terminate()
            process.wait(timeout=30)


def lines_of(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]


# Over 60 lines: one job's life in its order: submitted, folded, both tasks training, cancelled,
# gone from the merger's view.
@pytest.mark.e2e
@pytest.mark.timeout(1200)
def test_a_two_task_island_under_slurm_joins_by_itself_is_folded_and_leaves_on_scancel(
    tmp_path, slurm
):
    init = tmp_path / "init.npz"
    subprocess.run(
        [sys.executable, "-m", "dloco", "island", "--write-init", str(init), *TINY],
        check=True,
        capture_output=True,
        timeout=300,
    )
    ports = free_ports(3)
    merger = start_bound_merger(tmp_path, init, ports, "--cold-wait", "0")
    (tmp_path / "run" / "metrics").mkdir(parents=True)
    command = [
        "island",
        *["--name", "isl", "--island-index", "0", "--islands", "1", *TINY, "--fragments", "2"],
        *["--interval", "10", "--insecure", "--metrics-out", "run/metrics/isl.jsonl"],
        *["--delta-endpoint", f"tcp://127.0.0.1:{ports[0]}"],
        *["--snapshot-endpoint", f"tcp://127.0.0.1:{ports[1]}"],
        *["--control-endpoint", f"tcp://127.0.0.1:{ports[2]}", "--coordinator", "slurm"],
    ]
    script = tmp_path / "island.sbatch"
    script.write_text(island_sbatch("isl", command, 2, (sys.executable, "-P", "-m", "dloco")))
    job = None
    try:
        submitted = subprocess.run(
            ["sbatch", "--parsable", str(script)],
            cwd=tmp_path,
            env=slurm,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert submitted.returncode == 0, submitted.stderr
        job = submitted.stdout.strip().split(";")[0]
        merger_log = tmp_path / "merger.log"

        def folds_of_the_island():
            return [
                e
                for e in lines_of(merger_log)
                if e.get("event") == "fold" and "isl" in e.get("contributors", ())
            ]

        until("three folds of the island's deltas", lambda: len(folds_of_the_island()) >= 3)
        metrics = tmp_path / "run" / "metrics"
        # process 1 (no bus links) trains too, writing beside process 0's file
        until(
            "a step of each task",
            lambda: all(
                any(e.get("step", 0) > 0 for e in lines_of(metrics / name))
                for name in ("isl.jsonl", "isl.1.jsonl")
            ),
        )
        output = tmp_path / "run" / f"slurm-{job}.out"
        joined = {e.get("process") for e in lines_of(output) if e.get("event") == "joined"}
        assert joined == {0, 1}, output.read_text()[-3000:]
        subprocess.run(["scancel", job], env=slurm, check=True, timeout=60)
        until(
            "the job's end",
            lambda: (
                not subprocess.run(
                    ["squeue", "-h", "-j", job], env=slurm, capture_output=True, text=True
                ).stdout.strip()
            ),
        )
        job = None
        until(
            "the merger seeing the island leave",
            lambda: any(
                e.get("event") == "island_gone" and e.get("island") == "isl"
                for e in lines_of(merger_log)
            ),
        )
    finally:
        if job is not None:
            subprocess.run(["scancel", job], env=slurm, timeout=60)
        merger.terminate()
        merger.wait(timeout=60)
