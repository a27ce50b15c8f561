"""The synchronous baselines as run modes of the same cluster: a fast and a half-speed island, 60
steps each.  Every fold waits for both islands (the barrier), so the fast island waits for the slow
one and not the other way round; sync-dp moves the full fp32 model every step."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from dloco.analysis.runinfo import merger_folds, read_events
from dloco.cluster import config, topology
from dloco.protocol.errors import ConfigError
from tests.cluster_helpers import small_profile

STEPS = 60
PROFILE = small_profile(
    25,
    20,
    """
[[regions]]
name = "fast"
[[regions]]
name = "slow"
slowdown = 2.0
""",
)


def test_modes_set_what_synchronisation_means(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text(PROFILE)
    decoupled = config.load(path)
    assert decoupled.effective() == (decoupled.sync, decoupled.merger)
    sync, merger = decoupled.with_mode("sync-dp").effective()
    assert (sync.fragments, sync.interval, sync.codec, sync.blocking) == (1, 1, "fp32", True)
    assert (merger.quorum, merger.merge, merger.outer, merger.outer_lr) == (
        2,
        "average",
        "sgd",
        1.0,
    )
    sync, merger = decoupled.with_mode("sync-diloco").effective()
    assert (sync.fragments, sync.interval, sync.blocking, merger.quorum) == (1, 10, True, 2)
    # a profile that serves bf16 diffs: sync-dp's full fp32 snapshots keep no served value
    path.write_text(PROFILE.replace("[merger]", "[merger]\nserved_dtype = 'bf16'"))
    served = config.load(path)
    assert served.merger.served_dtype == "bf16" and served.merger.snapshot_diff_codec != "none"
    assert served.with_mode("sync-dp").effective()[1].served_dtype == "fp32"
    path.write_text(PROFILE)
    path.write_text(PROFILE.replace("eval_every = 20", "eval_every = 20\nmode = 'lockstep'"))
    with pytest.raises(ConfigError, match="run.mode must be one of"):
        config.load(path)


def test_a_synchronous_island_waits_for_its_round_as_long_as_the_merger_does(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text(PROFILE.replace("[merger]\n", "[merger]\nquorum_timeout_s = 90.0\n"))
    # islands never wait for a fold there
    assert config.load(path).mode == "decoupled"
    with pytest.raises(
        ConfigError,
        match=(
            r"sync.settle_timeout_s \(60.0\) must exceed merger.quorum_timeout_s \(90.0\) in mode"
            r" sync-diloco"
        ),
    ):
        config.load(path).with_mode("sync-diloco")
    path.write_text(
        PROFILE.replace("interval = 10", "interval = 10\nsettle_timeout_s = 120.0").replace(
            "[merger]\n", "[merger]\nquorum_timeout_s = 90.0\n"
        )
    )
    waiting = config.load(path).with_mode("sync-diloco")
    for bad in ("true", "'60'", "-1.0"):
        path.write_text(
            PROFILE.replace("interval = 10", f"interval = 10\nsettle_timeout_s = {bad}")
        )
        with pytest.raises(
            ConfigError, match="sync.settle_timeout_s must be a number of seconds > 0"
        ):
            config.load(path)
    island = topology.commands(waiting, topology.Addresses(("1", "2", "3", "4"), "5"), "/run")[
        "slow"
    ]
    assert island[island.index("--settle-timeout") + 1] == "120.0"


# Over 60 lines: one synchronous run checked in its order: a fold per round, lockstep, who waited,
# the bytes sent, the report.
@pytest.mark.e2e
@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", ["sync-diloco", "sync-avg"])
def test_a_synchronous_mode_holds_every_island_at_the_barrier(tmp_path, mode):
    # The barrier waits as long as it takes (a slow start on a busy machine must not split a round).
    (tmp_path / "c.toml").write_text(
        PROFILE.replace("interval = 10", "interval = 10\nsettle_timeout_s = 500.0").replace(
            "[merger]\n", "[merger]\nquorum_timeout_s = 400.0\n"
        )
    )
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
            "--mode",
            mode,
            "--steps",
            str(STEPS),
            "--duration",
            "300",
        ],
        capture_output=True,
        text=True,
        timeout=560,
    )
    assert up.returncode == 0, (up.stdout[-3000:], up.stderr[-3000:])
    interval = 1 if mode == "sync-avg" else 10
    folds = merger_folds(run)
    # one fold per round, each with both islands (the islands go on until the launcher sees both at
    # STEPS: a last round may be cut)
    assert len(folds) >= STEPS // interval and [fold["version"] for fold in folds] == list(
        range(1, len(folds) + 1)
    ), folds[:3]
    assert all(sorted(fold["contributors"]) == ["fast", "slow"] for fold in folds[:-1]), folds[:3]
    steps = {
        name: [e for e in read_events(run / "metrics" / f"{name}.jsonl") if e.get("step", 0) > 0]
        for name in ("fast", "slow")
    }
    last = {name: events[-1] for name, events in steps.items()}
    # lockstep
    assert abs(last["fast"]["step"] - last["slow"]["step"]) <= interval, last
    # Who waits on whom, after the first round (which also waits out the other's compilation): the
    # fast island for the slow one.
    waited = {
        name: last[name]["wait_s"] - next(e for e in events if e["step"] == interval)["wait_s"]
        for name, events in steps.items()
    }
    assert waited["fast"] > waited["slow"], waited
    with np.load(run / "init.npz") as init:
        params = sum(init[name].size for name in init.files)
    # a full fp32 model up every step, as an all-reduce of gradients would move (the stop may cut a
    # later step)
    if mode == "sync-avg":
        assert (
            next(e for e in steps["fast"] if e["step"] == STEPS)["bytes_sent"] >= STEPS * 4 * params
        )
    report = (run / "report.md").read_text()
    row = next(line for line in report.splitlines() if line.startswith("| ") and "| {" in line)
    initial, final = (float(cell) for cell in row.split("|")[3:5])
    assert final < initial - 1.0, row
    assert f"mode `{mode}`" in report and f"dloco up ({mode})" in up.stdout
