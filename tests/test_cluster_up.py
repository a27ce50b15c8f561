"""`dloco up` end to end (small model, two regions, ~45 s): every process starts and stops cleanly,
both islands' deltas are folded, the global model's held-out loss falls, the report and plots exist."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from cluster import config
from protocol.errors import ConfigError

SMALL = """
[run]
duration_s = 45
eval_every = 20

[model]
width = 32
depth = 1
heads = 2
context = 32
batch = 8

[sync]
fragments = 2
interval = 10

[[regions]]
name = "fast"
uplink_mbps = 8
rtt_ms = 20

[[regions]]
name = "old-hw"
slowdown = 2.0
uplink_mbps = 4
rtt_ms = 60
"""


@pytest.mark.timeout(400)
def test_up_runs_a_two_region_cluster_and_leaves_a_report(tmp_path):
    profile = tmp_path / "small.toml"
    profile.write_text(SMALL)
    run_dir = tmp_path / "run"
    up = subprocess.run([sys.executable, "-m", "cluster.cli", "up", "--config", str(profile), "--run-dir", str(run_dir)],
                        capture_output=True, text=True, timeout=360)
    assert up.returncode == 0, (up.stdout[-3000:], up.stderr[-3000:])
    assert "fast" in up.stdout and "old-hw" in up.stdout and "report at" in up.stdout  # the live view printed the islands
    folds = [json.loads(line) for line in (run_dir / "logs" / "merger.log").read_text().splitlines() if '"event": "fold"' in line]
    assert {name for fold in folds for name in fold["contributors"]} == {"fast", "old-hw"}  # every island's deltas are folded
    report = (run_dir / "report.md").read_text()
    row = next(line for line in report.splitlines() if line.startswith("| ") and "| {" in line)  # the global model's row
    initial, final = (float(cell) for cell in row.split("|")[3:5])
    assert final < initial - 1.0, row  # the global model learned
    for plot in ("eval_loss_vs_time.png", "eval_loss_vs_tokens.png", "bytes_on_wire.png", "compute_util.png"):
        assert (run_dir / "plots" / plot).stat().st_size > 5000
    assert "exited early" not in up.stdout


def test_cluster_files_are_checked(tmp_path):
    default = config.load()
    assert [r.name for r in default.regions] == ["us-east", "us-west", "eu-older-hw", "asia-older-hw"]
    assert [r.slowdown for r in default.regions] == [1.0, 1.0, 2.0, 2.0]
    bad = tmp_path / "bad.toml"
    for text, message in (("[run]\nspeed = 3\n", "unknown keys in \\[run\\]"), ("[[regions]]\nname = 'a'\nslowdown = 0.5\n", "slowdown"),
                          ("[[regions]]\nname = 'a'\ncolor = 'red'\n", "unknown keys in \\[\\[regions\\]\\]"), ("not toml", "cannot read"),
                          ("[sync]\ncodec = 'int3'\n[[regions]]\nname = 'a'\n", "sync.codec")):
        bad.write_text(text)
        with pytest.raises(ConfigError, match=message):
            config.load(bad)
    with pytest.raises(ConfigError, match="duration_s"):
        default.with_duration(-1)
