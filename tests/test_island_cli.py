"""`dloco island --standalone` on the real corpus, and clear errors for bad arguments."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

TINY = ["--width", "32", "--depth", "1", "--heads", "2", "--context", "32", "--batch", "8"]


def dloco(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cluster.cli", *args], capture_output=True, text=True, timeout=180)


def test_standalone_trains_and_writes_metrics(tmp_path):
    metrics = tmp_path / "m.jsonl"
    run = dloco("island", "--standalone", "--max-steps", "40", "--eval-every", "20", "--eval-early", "--metrics-out", str(metrics), *TINY)
    assert run.returncode == 0, run.stderr
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    events = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [e["step"] for e in events] == list(range(41))
    assert {"step", "tokens", "loss", "compute_util", "bytes_sent", "bytes_received", "snapshot_version"} <= set(events[-1])
    evals = [e["eval_loss"] for e in events if "eval_loss" in e]
    assert [e["step"] for e in events if "eval_loss" in e] == [0, 1, 2, 4, 8, 16, 20, 40]  # every 20, and early at powers of two
    assert evals[-1] < evals[0] - 1.0 and summary["eval_loss"] == evals[-1]
    corpus = next(json.loads(line) for line in run.stdout.splitlines() if '"event": "corpus"' in line)
    assert len(corpus["sha256"]) == 64 and corpus["files"] > 100  # the file list's hash is logged, for comparable runs


@pytest.mark.parametrize("args,message", [
    (("island", "--standalone", "--width", "30", "--heads", "4"), "multiple of model.heads"),
    (("island", "--standalone", "--island-index", "3", "--islands", "2", *TINY), "--island-index"),
    (("island", "--standalone", "--corpus", "/nonexistent", *TINY), "does not exist"),
    (("island", *TINY), "needs --delta-endpoint"),
    (("island", "--standalone", "--max-steps", "0"), "positive integer"),
])
def test_bad_arguments_are_clear_errors(args, message):
    run = dloco(*args)
    assert run.returncode == 2 and message in run.stderr and "Traceback" not in run.stderr
