"""A run's global model out of its run directory: `dloco export` (safetensors, bit for bit the
merger's checkpoint, with metadata naming the run, the checkpoint and the task), and at the end a
real run's report, export and sample under `dloco up` (-m e2e).  The run directory is
tests/run_dir_helpers.py's; text out of the model: tests/test_sampling.py."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, safe_open

from dloco.analysis import export
from dloco.analysis.runinfo import RunDirError, RunTask
from dloco.cli import main
from tests.run_dir_helpers import bits, checkpoint_params, make_run


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A run directory with two checkpoints: after a fold of fragment 0, then after one of fragment
    1."""
    return make_run(tmp_path_factory.mktemp("export"))


# ---- pure parts ----------------------------------------------------------------------------------


def test_a_checkpoints_content_becomes_flat_float32_parameters_byte_for_byte():
    a, b = np.arange(6, dtype="<f4").reshape(2, 3), np.array([-0.0, np.float32(1e-45)], dtype="<f4")
    saved = {
        "fragments": [
            {"params": {"x/a": {"dtype": "<f4", "shape": [2, 3], "data": a.tobytes()}}},
            {"params": {"y/b": {"dtype": "<f4", "shape": [2], "data": b.tobytes()}}},
        ]
    }
    flat = export.params_of(saved)
    assert (
        sorted(flat) == ["x/a", "y/b"]
        and flat["x/a"].dtype == np.float32
        and flat["x/a"].shape == (2, 3)
    )
    assert (bits(flat["y/b"]) == [0x80000000, 1]).all() and (flat["x/a"] == a).all()


def test_the_metadata_names_the_run_the_checkpoint_and_the_task():
    model = export.GlobalModel(
        {"a": np.zeros((2, 3), np.float32), "b": np.zeros(4, np.float32)}, 57, (3, 2), "abc"
    )
    task = RunTask(
        "dloco.island.bytelm:task", {"width": 32, "corpus": "/c"}, seed=7, batch=8, islands=2
    )
    assert export.metadata(Path("/runs/x"), model, task) == {
        "format": "dloco-global-model/1",
        "run_dir": "/runs/x",
        "checkpoint": "57",
        "digest": "abc",
        "fragment_versions": "[3, 2]",
        "parameters": "10",
        "task": "dloco.island.bytelm:task",
        "task_options": '{"corpus": "/c", "width": 32}',
        "seed": "7",
    }


def test_the_run_task_record_reads_back_and_a_bad_one_is_named(tmp_path):
    task = RunTask("x.py:task", {"k": 1.5, "flag": True, "name": "n"}, seed=3, batch=4, islands=5)
    task.write(tmp_path)
    assert RunTask.read(tmp_path) == task
    (tmp_path / "task.json").write_text(
        '{"task": "x.py:task", "options": {}, "seed": "3", "batch": 4, "islands": 5}'
    )
    with pytest.raises(RunDirError, match="task.json must be an object with task"):
        RunTask.read(tmp_path)
    with pytest.raises(RunDirError, match="has no task.json.*--config"):
        RunTask.read(tmp_path / "elsewhere")


# ---- a run directory -----------------------------------------------------------------------------


def test_export_writes_the_latest_checkpoint_bit_for_bit_with_its_metadata(run, tmp_path, capsys):
    out = tmp_path / "model.safetensors"
    assert main(["export", str(run.dir), "--out", str(out)]) == 0
    assert "dloco export: wrote" in capsys.readouterr().out
    loaded, expected = load_file(str(out)), checkpoint_params(run.checkpoints[-1])
    assert sorted(loaded) == sorted(expected) == sorted(run.init)
    for path in expected:
        assert (
            loaded[path].dtype == np.float32 and (bits(loaded[path]) == bits(expected[path])).all()
        ), path
    # the folds moved it from the initial model
    assert any(not np.array_equal(loaded[p], run.init[p]) for p in loaded)
    with safe_open(str(out), "np") as handle:
        meta = handle.metadata()
    assert (
        meta["checkpoint"] == str(int(run.checkpoints[-1].stem))
        and json.loads(meta["fragment_versions"]) == run.versions
    )
    assert (
        meta["task"] == "dloco.island.bytelm:task"
        and json.loads(meta["task_options"])["width"] == 32
    )
    assert meta["parameters"] == str(sum(a.size for a in run.init.values())) and meta[
        "run_dir"
    ] == str(run.dir.resolve())
    # no temporary file left
    assert not [p for p in tmp_path.iterdir() if p.name != "model.safetensors"]
    umask = os.umask(0)
    os.umask(umask)
    # as any new file, not safetensors' 0600
    assert out.stat().st_mode & 0o777 == 0o666 & ~umask


def test_export_picks_a_checkpoint_by_its_record_and_names_the_ones_there(run, tmp_path, capsys):
    first = int(run.checkpoints[0].stem)
    out = tmp_path / "first.safetensors"
    assert main(["export", str(run.dir), "--checkpoint", str(first), "--out", str(out)]) == 0
    loaded, expected = load_file(str(out)), checkpoint_params(run.checkpoints[0])
    assert all((bits(loaded[p]) == bits(expected[p])).all() for p in expected)
    assert main(["export", str(run.dir), "--checkpoint", "999", "--out", str(out)]) == 2
    records = ", ".join(str(int(p.stem)) for p in run.checkpoints)
    assert (
        capsys.readouterr()
        .err.strip()
        .endswith(f"has no checkpoint at record 999; it has {records}")
    )


def test_export_errors_exit_2_and_say_what_is_wrong(run, tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    # prepared, never checkpointed
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    run.task.write(fresh)
    cases = [
        ([str(empty), "--out", str(tmp_path / "m.st")], "is not a run directory"),
        ([str(tmp_path / "nowhere"), "--out", str(tmp_path / "m.st")], "is not a directory"),
        ([str(fresh), "--out", str(tmp_path / "m.st")], "has no checkpoint of the merger yet"),
        ([str(run.dir), "--out", str(tmp_path / "no" / "such" / "m.st")], "cannot write"),
        ([str(run.dir), "--out", str(tmp_path)], "is a directory"),
    ]
    for args, message in cases:
        assert main(["export", *args]) == 2, args
        err = capsys.readouterr().err
        assert err.startswith("dloco export: ") and message in err, err


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_a_real_run_ends_its_report_with_a_sample_and_exports_its_final_model(tmp_path):
    """`dloco up` (two islands, 20 steps each), then the commands a user runs on its directory."""
    import subprocess
    import sys

    from tests.cluster_helpers import small_profile

    (tmp_path / "c.toml").write_text(
        small_profile(400, 10, '[[regions]]\nname = "a"\n[[regions]]\nname = "b"\n', max_steps=20)
    )
    run_dir = tmp_path / "run"

    def dloco(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "dloco", *args], capture_output=True, text=True, timeout=500
        )

    up = dloco("up", "--config", str(tmp_path / "c.toml"), "--run-dir", str(run_dir))
    assert up.returncode == 0, up.stdout[-2000:]
    report = (run_dir / "report.md").read_text()
    sample = report[report.index("## Sample") :].splitlines()
    assert (
        "checkpoint at record" in sample[2]
        and sample[4] == "```text"
        and sample[5].startswith("def ")
        and sample[-1] == "```"
    )
    assert dloco("export", str(run_dir), "--out", str(tmp_path / "m.safetensors")).returncode == 0
    with np.load(run_dir / "init.npz") as init:
        assert sorted(load_file(str(tmp_path / "m.safetensors"))) == sorted(init.files)
    twice = [
        dloco("sample", str(run_dir), "--prompt", "import ", "--length", "40", "--seed", "1")
        for _ in range(2)
    ]
    assert (
        twice[0].returncode == 0
        and twice[0].stdout == twice[1].stdout
        and twice[0].stdout.startswith("import ")
    )
