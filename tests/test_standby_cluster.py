"""A hot-standby merger in a whole cluster under `dloco up`: the primary's machine is lost with its
disk, the standby takes over with every acknowledged delta, the old primary comes back empty and
follows it (where the islands' work leaves it the time), and the report and replays agree
(-m e2e)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from dloco.analysis.runinfo import chaos_effects, merger_folds, read_events, read_metrics, wall
from tests.cluster_helpers import small_profile
from tests.test_standby import replay_verify

STANDBY_PROFILE = small_profile(
    400,
    25,
    """
[[regions]]
name = "a"
slowdown = 2.0

[[regions]]
name = "b"
slowdown = 2.0
""",
    max_steps=200,
).replace("share_window = 8", "share_window = 8\nstandby = true")


# The primary's machine is lost after 10 folds; once a has made 60 more steps (the standby took over
# meanwhile) it comes back, empty.
STANDBY_SCHEDULE = "lose-disk:merger@folds=10,restart:merger@a.step=+60"


def up_with_chaos(config: Path, run: Path) -> subprocess.CompletedProcess:
    """`dloco up` of `config` into `run` under STANDBY_SCHEDULE, its output captured."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "dloco",
            "up",
            "--config",
            str(config),
            "--run-dir",
            str(run),
            "--chaos",
            STANDBY_SCHEDULE,
            "--status-port",
            "-1",
        ],
        capture_output=True,
        text=True,
        timeout=800,
    )


@pytest.mark.e2e
@pytest.mark.timeout(900)
def test_dloco_up_with_a_standby_survives_the_loss_of_the_primary_and_its_disk(tmp_path):
    (tmp_path / "standby.toml").write_text(STANDBY_PROFILE)
    run = tmp_path / "run"
    up = up_with_chaos(tmp_path / "standby.toml", run)
    assert up.returncode == 0, (up.stdout[-3000:], up.stderr[-3000:])
    lost, back = read_events(run / "chaos.jsonl")
    # the primary at the time was the merger process
    assert (lost["process"], back["process"]) == ("merger", "merger")
    took = [e for e in read_events(run / "logs" / "standby.log") if e.get("event") == "taking_over"]
    assert len(took) == 1 and took[0]["length"] > 0
    merger_log = read_events(run / "logs" / "merger.log")
    # its second life follows the standby, where it started before the islands' work was done
    second = [e.get("event") for e in merger_log if wall(e) > back["wall"]]
    assert [e.get("event") for e in merger_log].count("genesis") == 1
    assert "taking_over" not in second and (not second or "following" in second)
    # the islands trained on through the loss, and the new primary folded both of them
    steps = {
        name: [
            e["wall"]
            for e in read_metrics(run / "metrics" / f"{name}.jsonl")
            if e.get("step", 0) > 0
        ]
        for name in "ab"
    }
    # b trained on while no merger was there
    assert sum(lost["wall"] <= w < back["wall"] for w in steps["b"]) >= 30
    after = [set(e["contributors"]) for e in merger_folds(run) if wall(e) > lost["wall"]]
    assert {"a", "b"} <= set().union(*after)
    # every delta each island sent was settled: none acknowledged and lost
    for island in "ab":
        done = [e for e in read_events(run / "logs" / f"{island}.log") if e.get("event") == "done"][
            -1
        ]
        assert (
            done["acks"].get("folded", 0) + done["acks"].get("rejected", 0)
            == done["deltas_sent"]
            > 0
        ), done
    row = next(r for r in chaos_effects(run, ["a", "b"]) if r["action"] == "lose-disk")
    assert row["first_fold_s"] is not None
    # the new primary's log, and the copy the old one rebuilt from it once the new primary had it
    # in sync (the run may end while it still copies)
    caught_up = [
        e
        for e in read_events(run / "logs" / "standby.log")
        if e.get("event") == "replication" and e.get("state") == "sync" and wall(e) > back["wall"]
    ]
    for merger in ("standby", "merger") if caught_up else ("standby",):
        replay = replay_verify(run / merger)
        assert replay.returncode == 0, replay.stderr
    assert "FAILED" not in (run / "report.md").read_text()
    # the live view names each merger's role
    assert any(line.startswith("mergers: merger ") for line in up.stdout.splitlines())
