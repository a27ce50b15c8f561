"""`dloco island --standalone` on the real corpus, and clear errors for bad arguments."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from dloco.analysis.runinfo import read_metrics

TINY = ["--width", "32", "--depth", "1", "--heads", "2", "--context", "32", "--batch", "8"]


def dloco(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dloco", *args], capture_output=True, text=True, timeout=180
    )


def test_standalone_trains_and_writes_metrics(tmp_path):
    metrics = tmp_path / "m.jsonl"
    run = dloco(
        "island",
        "--standalone",
        "--max-steps",
        "40",
        "--eval-every",
        "20",
        "--eval-early",
        "--metrics-out",
        str(metrics),
        *TINY,
    )
    assert run.returncode == 0, run.stderr
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    events = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [e["step"] for e in events] == list(range(41))
    assert {
        "step",
        "tokens",
        "loss",
        "compute_util",
        "bytes_sent",
        "bytes_received",
        "snapshot_version",
    } <= set(events[-1])
    evals = [e["eval_loss"] for e in events if "eval_loss" in e]
    # every 20, and early at powers of two
    assert [e["step"] for e in events if "eval_loss" in e] == [0, 1, 2, 4, 8, 16, 20, 40]
    assert evals[-1] < evals[0] - 1.0 and summary["eval_loss"] == evals[-1]
    task = next(json.loads(line) for line in run.stdout.splitlines() if '"event": "task"' in line)[
        "name"
    ]
    corpus = re.search(
        r"\(([\d,]+) files, [\d,]+ tokens, vocabulary 256, listing sha256 ([0-9a-f]{64})\)", task
    )
    # the file list's hash is logged, for comparable runs
    assert corpus and int(corpus[1].replace(",", "")) > 100, task


def test_traced_evaluations_measure_what_an_evaluation_at_the_step_would(tmp_path):
    """--eval-trace evaluates copies of the parameters after training; the same run evaluating at
    every step gives the same losses (a standalone island is deterministic)."""
    inline, traced = tmp_path / "inline.jsonl", tmp_path / "traced.jsonl"
    for metrics, flags in (
        (inline, ["--eval-every", "1"]),
        (traced, ["--eval-every", "100", "--eval-trace", "12"]),
    ):
        run = dloco(
            "island",
            "--standalone",
            "--max-steps",
            "12",
            "--metrics-out",
            str(metrics),
            *flags,
            *TINY,
        )
        assert run.returncode == 0, run.stderr
    written = [json.loads(line) for line in traced.read_text().splitlines()]
    # step 12, the last, is evaluated in the loop
    assert [e["step"] for e in written if e.get("deferred")] == list(range(1, 12))
    assert json.loads(run.stdout.strip().splitlines()[-1])["traced_evaluations"] == 11
    expected = {e["step"]: e["eval_loss"] for e in read_metrics(inline)}
    merged = read_metrics(traced)
    # the deferred events are folded back onto their steps
    assert [e["step"] for e in merged] == list(range(13))
    assert {e["step"]: e["eval_loss"] for e in merged if "eval_loss" in e} == expected
    assert [e["step"] for e in merged if e.get("eval_deferred")] == list(range(1, 12))
    # they measure training
    assert expected[11] < expected[1] - 0.5


def test_read_metrics_places_each_deferred_evaluation_on_its_own_step(tmp_path):
    """A restarted island counts steps from 1 again: step and wall time together name the step."""
    path = tmp_path / "m.jsonl"
    rows = [
        {"step": 0, "wall": 1.0, "eval_loss": 6.0},
        {"step": 1, "wall": 2.0, "loss": 5.0},
        {"step": 2, "wall": 3.0, "loss": 4.0},
        {"step": 0, "wall": 9.0, "eval_loss": 5.5},
        {"step": 1, "wall": 10.0, "loss": 4.5},
        {"step": 1, "wall": 10.0, "eval_loss": 4.4, "deferred": True},
        {"step": 1, "wall": 2.0, "eval_loss": 4.9, "deferred": True},
        # no such step: left out
        {"step": 7, "wall": 99.0, "eval_loss": 1.0, "deferred": True},
    ]
    # and a line being written
    path.write_text("\n".join(json.dumps(r) for r in rows) + '\n{"step": 3, "wa')
    merged = read_metrics(path)
    assert [(e["step"], e["wall"], e.get("eval_loss")) for e in merged] == [
        (0, 1.0, 6.0),
        (1, 2.0, 4.9),
        (2, 3.0, None),
        (0, 9.0, 5.5),
        (1, 10.0, 4.4),
    ]
    assert [e.get("eval_deferred", False) for e in merged] == [False, True, False, False, True]


@pytest.mark.parametrize(
    "args,message",
    [
        (("island", "--standalone", "--width", "30", "--heads", "4"), "multiple of model.heads"),
        (
            ("island", "--standalone", "--island-index", "3", "--islands", "2", *TINY),
            "--island-index",
        ),
        (("island", "--standalone", "--corpus", "/nonexistent", *TINY), "does not exist"),
        (("island", *TINY), "needs --delta-endpoint"),
        (("island", "--standalone", "--max-steps", "0"), "positive integer"),
        (("island", "--standalone", "--eval-trace", "-1", *TINY), "eval_trace must be an int >= 0"),
    ],
)
def test_bad_arguments_are_clear_errors(args, message):
    run = dloco(*args)
    assert run.returncode == 2 and message in run.stderr and "Traceback" not in run.stderr
