"""One island on several processes (island/group.py, jax.distributed over gloo on this machine's
CPU): the pure parts by hand; two processes of two devices step exactly as one process of four;
and in a cluster (`dloco up`, a region with hosts = 2 and two merger shards) both processes adopt
every snapshot version at the same step, a killed process takes its island down alone, the island
rejoins on restart, and each shard folds both islands and replays.  Every bound is work (steps),
never seconds."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from dloco.analysis import export
from dloco.analysis.globalmodel import states_at
from dloco.analysis.runinfo import lives, merger_folds, read_events, read_metrics, wall
from dloco.cluster import chaos, compose, localcompose, topology
from dloco.cluster.config import ClusterConfig
from dloco.cluster.ports import free_ports
from dloco.cluster.sections import Region
from dloco.island import group
from dloco.protocol.errors import ConfigError
from tests.cluster_helpers import small_profile


def test_pack_and_unpack_by_hand():
    paths, shapes = ["a", "b", "c"], {"a": (2,), "b": (1, 2), "c": (3,)}
    mask, values = group.pack(paths, {"c": np.array([5, 6, 7]), "a": np.array([1.5, 2.5])})
    assert (
        mask.tolist() == [1, 0, 1]
        and values.tolist() == [1.5, 2.5, 5, 6, 7]
        and values.dtype == np.float32
    )
    assert group.changed_size(paths, shapes, mask) == 5
    out = group.unpack(paths, shapes, mask, values)
    assert sorted(out) == ["a", "c"] and out["c"].tolist() == [5, 6, 7] and out["a"].shape == (2,)
    assert (
        group.pack(paths, {})[1].size == 0
        and group.unpack(paths, shapes, np.zeros(3, int), np.zeros(0)) == {}
    )
    with pytest.raises(group.GroupError, match="4 values for parameters holding 5"):
        group.unpack(paths, shapes, mask, values[:4])


def test_a_failed_collective_is_told_from_a_mistake_in_the_program():
    from jax.errors import JaxRuntimeError

    # What JAX raised when the other process was killed: from process_allgather's jit, a ValueError.
    gone = (
        "UNKNOWN: Gloo AllGather failed: [external/gloo/gloo/transport/tcp/pair.cc:547] Connection"
        " closed by peer [127.0.0.1]:56499"
    )
    assert group.broken(ValueError(gone)) and group.broken(JaxRuntimeError(gone))
    assert group.broken(group.GroupLost("another process of this island stopped taking part"))
    assert group.broken(JaxRuntimeError("INTERNAL: Barrier failed because: task is set to ERROR"))
    assert not group.broken(
        ValueError("operands could not be broadcast together with shapes (3,) (4,)")
    )
    assert not group.broken(ValueError("INVALID_ARGUMENT: the program passed a wrong shape"))
    assert not group.broken(RuntimeError("UNKNOWN: a RuntimeError that is not the runtime's"))


@pytest.mark.parametrize(
    "coordinator,processes,index,message",
    [
        ("h:1", 0, 0, "--num-processes must be >= 1"),
        ("h:1", 2, 2, r"--process-id must be in \[0, 2\)"),
        (None, 2, 0, "--coordinator must be HOST:PORT"),
        ("host", 2, 1, "HOST:PORT"),
        ("host:99999", 2, 1, "HOST:PORT"),
    ],
)
def test_bad_group_flags_are_named(coordinator, processes, index, message):
    with pytest.raises(group.GroupError, match=message):
        group.check(coordinator, processes, index)
    # one process needs no coordinator
    group.check(None, 1, 0)


def test_under_srun_the_group_is_read_from_slurms_environment():
    step = {"SLURM_JOB_ID": "17", "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_NTASKS": "2"}
    assert group.from_slurm({**step, "SLURM_PROCID": "1"}) == (2, 1)
    # outside srun: the variables missing are named
    with pytest.raises(group.GroupError, match=r"under srun.*SLURM_PROCID"):
        group.from_slurm(step)
    with pytest.raises(group.GroupError, match="integers"):
        group.from_slurm({**step, "SLURM_PROCID": "x"})
    # the coordinator is jax.distributed's to find: no HOST:PORT is asked for
    group.check(group.SLURM, 2, 1)
    # process 0 keeps its file, the others write beside it as NAME.I
    assert group.metrics_path(Path("run/metrics/east.jsonl"), 0) == Path("run/metrics/east.jsonl")
    assert group.metrics_path(Path("run/metrics/east.jsonl"), 2) == Path("run/metrics/east.2.jsonl")
    assert group.metrics_path(None, 1) is None


def test_a_two_host_region_is_two_processes_wired_to_one_coordinator(tmp_path):
    config = ClusterConfig(regions=(Region("east", hosts=2), Region("west")))
    assert config.process_names[:3] == ["east", "east.1", "west"]
    at = topology.Addresses(
        broker_ports=("1", "2", "3", "4"), control_port="5", coordinator_ports={"east": "7000"}
    )
    commands = topology.commands(config, at, "/run")
    assert sorted(commands) == ["broker", "east", "east.1", "evaluator", "merger", "west"]
    for index, name in enumerate(["east", "east.1"]):
        args = commands[name]
        assert args[args.index("--coordinator") + 1] == "127.0.0.1:7000" and args[
            args.index("--process-id") + 1
        ] == str(index)
        assert (
            args[args.index("--num-processes") + 1] == "2"
            and args[args.index("--metrics-out") + 1] == f"/run/metrics/{name}.jsonl"
        )
    assert "--coordinator" not in commands["west"]
    rendered = compose.render(config, "cluster.toml")
    assert "east.1:" in rendered and "east:${DLOCO_COORDINATOR_PORT_EAST:-5600}" in rendered
    # `dloco up --compose`: the coordinator is process 0 on this machine
    (tmp_path / "compose.yml").write_text(rendered)
    local = localcompose.load(tmp_path / "compose.yml", {"DLOCO_COORDINATOR_PORT_EAST": "7001"})[
        "east.1"
    ].command
    assert local[local.index("--coordinator") + 1] == "127.0.0.1:7001"
    with pytest.raises(ConfigError, match="hosts must be an int"):
        Region("east", hosts=0)
    with pytest.raises(ConfigError, match="divisible by its hosts"):
        ClusterConfig(regions=(Region("east", hosts=3),))
    with pytest.raises(ConfigError, match="eval_trace is for an island of one process"):
        ClusterConfig(regions=(Region("east", hosts=2),), eval_trace=8)


def test_a_multi_host_island_goes_down_and_comes_back_as_a_whole():
    names, groups = ["a", "a.1", "b", "merger", "broker"], {"a": ["a", "a.1"], "a.1": ["a", "a.1"]}
    chaos.check(chaos.parse("kill:a.1@b.step=5,restart:a.1@b.step=+10"), names, ["a", "b"], groups)
    # its process 0 went down with it
    with pytest.raises(ConfigError, match="waits for the steps of a, which is down"):
        chaos.check(
            chaos.parse("kill:a.1@b.step=5,restart:a.1@a.step=+10"), names, ["a", "b"], groups
        )
    with pytest.raises(ConfigError, match="a is already down"):
        chaos.check(chaos.parse("kill:a.1@b.step=5,kill:a@b.step=+10"), names, ["a", "b"], groups)


RUN_STEPS = [
    "island",
    "--standalone",
    "--max-steps",
    "6",
    "--batch",
    "8",
    "--eval-every",
    "3",
    "--width",
    "32",
    "--depth",
    "1",
    "--heads",
    "2",
    "--context",
    "32",
    "--seed",
    "3",
]


def _island(devices: int, out, *extra: str) -> subprocess.Popen:
    env = {
        **os.environ,
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
        "JAX_PLATFORMS": "cpu",
    }
    return subprocess.Popen(
        [sys.executable, "-m", "dloco", *RUN_STEPS, "--metrics-out", str(out), *extra],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def _losses(path) -> list[float]:
    return [e["loss"] for e in read_metrics(path) if e["step"] > 0]


@pytest.mark.timeout(300)
def test_two_processes_of_two_devices_step_as_one_process_of_four(tmp_path):
    one = _island(4, tmp_path / "one.jsonl")
    port = free_ports(1)[0]
    pair = [
        _island(
            2,
            tmp_path / f"two{i}.jsonl",
            "--coordinator",
            f"127.0.0.1:{port}",
            "--num-processes",
            "2",
            "--process-id",
            str(i),
        )
        for i in range(2)
    ]
    for process in (one, *pair):
        _, err = process.communicate(timeout=240)
        assert process.returncode == 0, err[-2000:]
    expected = _losses(tmp_path / "one.jsonl")
    assert len(expected) == 6
    for i in range(2):
        assert np.allclose(_losses(tmp_path / f"two{i}.jsonl"), expected, rtol=1e-4, atol=0), i


@pytest.mark.timeout(200)
def test_processes_started_with_different_settings_are_refused_not_hung(tmp_path):
    port = free_ports(1)[0]
    pair = [
        _island(
            1,
            tmp_path / f"p{i}.jsonl",
            "--coordinator",
            f"127.0.0.1:{port}",
            "--num-processes",
            "2",
            "--process-id",
            str(i),
            "--fragments",
            str(2 + 2 * i),
            "--interval",
            "4",
        )
        for i in range(2)
    ]
    for process in pair:
        _, err = process.communicate(timeout=180)
        assert (
            process.returncode == 2
            and "processes [1] of this island were started with another model or other settings"
            in err
        ), err[-1500:]


STEPS = 120
# two merger shards, one fragment each
PROFILE = small_profile(
    500,
    20,
    """
[[regions]]
name = "a"
hosts = 2
[[regions]]
name = "b"
slowdown = 2.0
""",
    max_steps=STEPS,
).replace("share_window = 8", "share_window = 8\nshards = 2")
# a's second process dies at a's step 40; it and a's process 0 come back once b has made 60 more
# steps: b cannot wait for a, or the restart never fires and the run fails.
SCHEDULE = "kill:a.1@a.step=40,restart:a.1@b.step=+60"


# Over 60 lines: one cluster run checked in its order: the group lost and rejoined, both processes
# in step, b going on alone, each shard's log, the joined global model, the report.
@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_a_two_host_island_trains_in_step_dies_alone_and_rejoins(tmp_path):
    (tmp_path / "c.toml").write_text(PROFILE)
    run = tmp_path / "run"
    up = subprocess.run(
        [
            sys.executable,
            "-m",
            "dloco",
            "up",
            "--config",
            str(tmp_path / "c.toml"),
            "--run-dir",
            str(run),
            "--chaos",
            SCHEDULE,
        ],
        capture_output=True,
        text=True,
        timeout=560,
    )
    assert up.returncode == 0, (up.stdout[-3000:], up.stderr[-3000:])
    assert [e["when"] for e in read_events(run / "chaos.jsonl")] == SCHEDULE.split(",")
    killed, restarted = (e["wall"] for e in read_events(run / "chaos.jsonl"))
    # The killed process's partner saw its group broken and ended by itself (it drained, then exit
    # 3), before the restart (which waits for it), not hanging.  (The chaos log's time is taken
    # after the kill's wait.)
    lost = [
        wall(e)
        for e in read_events(run / "logs" / "a.log")
        if isinstance(e, dict) and e.get("event") == "group_lost"
    ]
    assert len(lost) == 1 and lost[0] <= restarted, (lost, killed, restarted)
    # Both processes of a, in each life: the same loss and the same snapshot versions at every step.
    leader, other = (
        lives(read_metrics(run / "metrics" / "a.jsonl")),
        lives(read_metrics(run / "metrics" / "a.1.jsonl")),
    )
    assert len(leader) == len(other) == 2, (len(leader), len(other))
    for mine, theirs in zip(leader, other):
        common = min(len(mine), len(theirs))
        assert common > 10
        assert [(e["step"], e.get("loss"), e.get("snapshot_version")) for e in mine[:common]] == [
            (e["step"], e.get("loss"), e.get("snapshot_version")) for e in theirs[:common]
        ]
    second = [e["snapshot_version"] for e in leader[1] if e["step"] > 0]
    # rejoined from the global model, then adopted more
    assert len({tuple(v) for v in second}) >= 3 and min(second[0]) > 0, second[:3]
    # b went on alone while a was down: the restart fired only once b had made 60 steps more than
    # when the launcher last read its metrics before the kill (a quarter second's worth or less
    # may fall before the kill's record), and a was folded again after the restart.
    folds = [(wall(e), set(e["contributors"])) for e in merger_folds(run)]
    assert (
        sum(
            1
            for e in read_metrics(run / "metrics" / "b.jsonl")
            if e["step"] > 0 and killed <= e["wall"] <= restarted
        )
        >= 30
    )
    assert any("a" in c for w, c in folds if w > restarted)
    # Each merger shard folded its own fragment, from both islands, and its log replays to its
    # checkpoints.
    for shard, name in enumerate(("merger", "merger.1")):
        own = [e for e in read_events(run / "logs" / f"{name}.log") if e.get("event") == "fold"]
        assert {e["fragment"] for e in own} == {shard} and {"a", "b"} <= {
            c for e in own for c in e["contributors"]
        }, name
        replay = subprocess.run(
            [
                sys.executable,
                "-m",
                "dloco",
                "replay",
                str(run / name),
                "--verify",
                "--every",
                "1000000",
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert replay.returncode == 0 and "ok sha256=" in replay.stdout, (
            name,
            replay.stdout[-1000:],
            replay.stderr[-1000:],
        )
    # The global model is each fragment from its shard: the final checkpoints joined equal both logs
    # replayed to the end.
    final, replayed = export.load(run).params, states_at(run, [time.time() + 3600])[0]
    assert sorted(final) == sorted(replayed) and all(
        np.array_equal(final[p], replayed[p]) for p in final
    )
    with np.load(run / "init.npz") as init:
        # both shards' fragments trained
        assert all(not np.array_equal(final[p], init[p]) for p in init.files)
    done = [
        e
        for e in read_events(run / "logs" / "a.log")
        if isinstance(e, dict) and e.get("event") == "done"
    ]
    assert len(done) == 1 and done[0]["acks"].get("folded", 0) > 0, done
    report = (run / "report.md").read_text()
    assert "kill a.1" in report and "FAILED" not in report
