"""`dloco refold`: a run's logged deltas folded again with the outer momentum in another dtype."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from dloco.analysis.refold import refolded
from dloco.merger.log.wal import WriteAheadLog
from dloco.merger.state.recovery import recover, wal_dir
from tests.merger_helpers import assemble, delta_chunks
from tests.run_dir_helpers import make_run


def test_a_first_fold_reads_no_momentum_and_later_ones_differ_by_its_rounding(tmp_path):
    run = make_run(tmp_path)
    # one fold of each fragment: Nesterov's first step is -lr (g + 0.9 g), no kept momentum read
    # (float32 rounding aside: optax's arithmetic and this transformation's fuse differently)
    merger = run.dir / "merger"
    folds, logged = refolded(merger, "float32")
    _, other = refolded(merger, "bfloat16")
    assert folds == 2 and all(
        np.allclose(logged[p], other[p], rtol=1e-6, atol=1e-7) for p in logged
    )
    # three more folds of fragment 0 read the momentum kept after the one before
    core = recover(merger, log=WriteAheadLog(wal_dir(merger), fsync="never"))
    for delta_id in (10, 11, 12):
        chunks = delta_chunks(
            core.fragments[0], "a", delta_id, 0, core.version(0), seed=delta_id, params=run.init
        )
        assert core.submit(assemble(chunks), now=float(delta_id)) is None
        core.fold(0)
    core.log.close()
    folds, logged = refolded(merger, "float32")
    _, other = refolded(merger, "bfloat16")
    # bfloat16 keeps 8 significant bits: fragment 0 moves by its rounding, far more than float32
    # rounding; fragment 1 (one fold) does not
    assert folds == 5
    moved = [np.abs(other[p] - logged[p]).max() / np.abs(logged[p]).max() for p in logged]
    assert 1e-5 < max(moved) < 0.01
    assert all(np.allclose(logged[p], other[p], rtol=1e-6, atol=1e-7) for p in core.fragments[1])


# the command line in a process of its own, which compiles the task's model: -m e2e
@pytest.mark.e2e
def test_the_command_prints_json_and_names_a_run_without_a_log(tmp_path):
    run = make_run(tmp_path)
    done = subprocess.run(
        [sys.executable, "-m", "dloco", "refold", str(run.dir), "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout)
    assert result["momentum_dtype"] == "bfloat16" and result["folds"] == 2
    # first folds read no kept momentum: the same model, float32 rounding aside
    assert result["relative_distance"] < 1e-6
    assert result["loss_refolded"] == pytest.approx(result["loss_logged"], rel=1e-5)
    missing = subprocess.run(
        [sys.executable, "-m", "dloco", "refold", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert missing.returncode == 1 and "has no merger log" in missing.stderr


@pytest.fixture(autouse=True)
def _cpu(monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
