"""The lean wire configuration in a real cluster (`dloco up`, three islands, one at half speed):
topk2 deltas with error feedback up, folded by the merger from their records; int2 diffs held to
one per fragment per mean round down, applied by every island with a matching digest.  Bounded by
work (steps), so what is asserted holds whatever share of the CPU a process gets: how many folds a
held snapshot carries depends on the clock (the round is measured in seconds, and a loaded merger
already folds a whole round at once), so that count is checked where the clock is the test's
(test_merger_snapshots.test_held_snapshots_carry_every_fold_and_the_last_one_goes_out)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dloco.analysis.runinfo import merger_folds, read_events
from tests.cluster_helpers import small_profile

STEPS = 80
ISLANDS = ("a", "b", "slow")
PROFILE = (
    small_profile(
        300,
        20,
        """
[[regions]]
name = "a"
[[regions]]
name = "b"
[[regions]]
name = "slow"
slowdown = 2.0
""",
        max_steps=STEPS,
    )
    .replace("interval = 10", 'interval = 10\ncodec = "topk2"\nerror_feedback = true')
    .replace(
        'snapshot_diff_codec = "int4"',
        'snapshot_diff_codec = "int2"\nsnapshot_every_round = 1.0\nmax_staleness = 8',
    )
)


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_topk2_deltas_train_and_held_int2_diffs_apply_with_matching_digests(tmp_path):
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
        ],
        capture_output=True,
        text=True,
        timeout=560,
    )
    assert up.returncode == 0, (up.stdout[-3000:], up.stderr[-3000:])
    folds = merger_folds(run)
    assert {name for fold in folds for name in fold["contributors"]} == set(ISLANDS), folds[:3]
    for name in ISLANDS:
        done = next(
            json.loads(line)
            for line in open(run / "logs" / f"{name}.log")
            if '"event": "done"' in line
        )
        # every diff applied to the value the merger served (no island asked again), each carrying
        # at least one fold
        assert (
            2 <= done["snapshots"].get("diff", 0) <= len(folds)
            and done["snapshots"].get("mismatch", 0) == 0
        ), (done, len(folds))
        last = [e for e in read_events(run / "metrics" / f"{name}.jsonl") if e.get("step", 0) > 0][
            -1
        ]
        assert 0 < last["bytes_received_values"] < last["bytes_received"], last
    report = (run / "report.md").read_text()
    row = next(line for line in report.splitlines() if line.startswith("| ") and "| {" in line)
    initial, final = (float(cell) for cell in row.split("|")[3:5])
    assert final < initial - 0.5, row
