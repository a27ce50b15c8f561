"""The built-in LM at GPT-2 small's and medium's shapes (124 M and 355 M parameters) through `dloco
up`: the shipped examples/gpt2-124m.toml and gpt2-350m.toml, shortened to one interval per island.
Deltas of ~15 and ~45 MB (int4) cross the bus, the merger folds every island's, and every island
joins and adopts the merger's snapshots.  About three minutes and 10 GB, and four minutes and 20 GB,
on 2 cores: -m e2e."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_profile(tmp_path: Path, profile: str, timeout: float) -> Path:
    """`dloco up` on `profile` (a cluster file's text); the run directory, the run passed."""
    (tmp_path / "c.toml").write_text(profile)
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
        timeout=timeout,
        cwd=ROOT,
    )
    assert up.returncode == 0, (up.stdout[-3000:], up.stderr[-3000:])
    return run


def events(run: Path, name: str, event: str) -> list[dict]:
    return [
        json.loads(line)
        for line in open(run / "logs" / f"{name}.log")
        if f'"event": "{event}"' in line
    ]


def check_joined_and_folded(run: Path, params: int) -> None:
    """Both islands built the model, every island's deltas were folded, and each joined (a full
    snapshot of every fragment) and adopted a diff."""
    from dloco.analysis.runinfo import merger_folds

    models = [m for name in ("east", "west") for m in events(run, name, "model")]
    assert [m["params"] for m in models] == [params] * 2
    folds = merger_folds(run)
    assert {name for fold in folds for name in fold["contributors"]} == {"east", "west"}
    for name in ("east", "west"):
        (done,) = events(run, name, "done")
        assert (
            done["acks"].get("folded", 0) >= 1
            and done["snapshots"].get("full", 0) >= 4
            and done["snapshots"].get("diff", 0) >= 1
        ), done


@pytest.mark.e2e
@pytest.mark.timeout(900)
def test_the_124m_preset_runs_through_dloco_up(tmp_path):
    profile = (ROOT / "examples" / "gpt2-124m.toml").read_text()
    assert 'size = "124m"' in profile and "max_steps = 8" in profile
    run = run_profile(
        tmp_path,
        profile.replace("max_steps = 8", "max_steps = 4").replace("context = 128", "context = 64"),
        860,
    )
    # 124.4 M at 1,024 positions; 64 here
    check_joined_and_folded(run, 123_665_664)


@pytest.mark.e2e
@pytest.mark.timeout(1200)
def test_the_350m_preset_runs_through_dloco_up_on_24_gb(tmp_path):
    """examples/gpt2-350m.toml, one interval per island: the islands peak at ~8.5 GB each (both
    evaluating at the end), the merger at ~3.2 GB with its 16-bit state; no evaluator process."""
    profile = (ROOT / "examples" / "gpt2-350m.toml").read_text()
    assert 'size = "350m"' in profile and "max_steps = 8" in profile
    run = run_profile(tmp_path, profile.replace("max_steps = 8", "max_steps = 4"), 1160)
    # 354.7 M at 1,024 positions; 64 here
    check_joined_and_folded(run, 353_741_824)
    assert not (run / "logs" / "evaluator.log").exists()
