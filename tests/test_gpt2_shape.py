"""The built-in LM at GPT-2 small's shape (124 M parameters) through `dloco up`: the shipped
examples/gpt2-124m.toml, shortened to one interval per island.  Deltas of ~15 MB (int4) cross the
bus, the merger folds every island's, and every island adopts the merger's snapshots.  About
three minutes and 10 GB on 2 cores: -m e2e."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.e2e
@pytest.mark.timeout(900)
def test_the_124m_preset_runs_through_dloco_up(tmp_path):
    from dloco.analysis.runinfo import merger_folds

    profile = (ROOT / "examples" / "gpt2-124m.toml").read_text()
    assert 'size = "124m"' in profile and "max_steps = 8" in profile
    (tmp_path / "c.toml").write_text(
        profile.replace("max_steps = 8", "max_steps = 4").replace("context = 128", "context = 64")
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
        ],
        capture_output=True,
        text=True,
        timeout=860,
        cwd=ROOT,
    )
    assert up.returncode == 0, (up.stdout[-3000:], up.stderr[-3000:])
    models = [
        json.loads(line)
        for name in ("east", "west")
        for line in open(run / "logs" / f"{name}.log")
        if '"event": "model"' in line
    ]
    # 124.4 M at 1,024 positions; 64 here
    assert [m["params"] for m in models] == [123_665_664] * 2
    folds = merger_folds(run)
    assert {name for fold in folds for name in fold["contributors"]} == {"east", "west"}
    for name in ("east", "west"):
        done = next(
            json.loads(line)
            for line in open(run / "logs" / f"{name}.log")
            if '"event": "done"' in line
        )
        assert (
            done["acks"].get("folded", 0) >= 1
            and done["snapshots"].get("full", 0) >= 4
            and done["snapshots"].get("diff", 0) >= 1
        ), done
