"""A run's logged deltas folded again with the outer momentum kept in another dtype
(`dloco refold`): what the dtype's arithmetic alone changes in the merger's model, every delta the
same.  It does not re-run the islands, whose deltas would follow the other model.  Reads the
merger's log (the run's only merger: shards are not combined) and evaluates on the islands'
held-out batches."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from dloco.analysis.globalmodel import Evaluator
from dloco.analysis.runinfo import RunDirError, RunTask
from dloco.merger.config import MergerConfig
from dloco.merger.log.segments import read_records
from dloco.merger.state.core import MergerCore
from dloco.merger.state.recovery import genesis_record, wal_dir


def refolded(merger_dir: Path, momentum_dtype: str) -> tuple[int, dict[str, np.ndarray]]:
    """Folds replayed and the parameters they end at, the outer momentum kept in
    `momentum_dtype`."""
    genesis = genesis_record(merger_dir)
    config = MergerConfig.from_dict(genesis["config"])
    config = dataclasses.replace(
        config, outer=dataclasses.replace(config.outer, momentum_dtype=momentum_dtype)
    )
    core = MergerCore.from_genesis({**genesis, "config": config.to_dict()})
    folds = 0
    for index, record in read_records(wal_dir(merger_dir), 1, allow_torn_tail=True):
        folds += core.apply_record(record, index) is not None
    return folds, _params(core)


def _params(core: MergerCore) -> dict[str, np.ndarray]:
    return {p: np.array(v, np.float32) for s in core.states for p, v in s.params.items()}


def compare(run_dir: Path, momentum_dtype: str) -> dict:
    """The run as logged against its deltas refolded with `momentum_dtype`: the refolded model's
    distance from the logged one, relative to how far the logged one moved, and both held-out
    losses."""
    merger_dir = Path(run_dir) / "merger"
    if not wal_dir(merger_dir).is_dir():
        raise RunDirError(f"{run_dir} has no merger log at {wal_dir(merger_dir)}")
    genesis = genesis_record(merger_dir)
    logged_dtype = MergerConfig.from_dict(genesis["config"]).outer.momentum_dtype
    start = _params(MergerCore.from_genesis(genesis))
    folds, logged = refolded(merger_dir, logged_dtype)
    _, other = refolded(merger_dir, momentum_dtype)

    def norm(pairs) -> float:
        return float(np.sqrt(sum(float(np.sum((a - b) ** 2)) for a, b in pairs)))

    moved = norm((logged[p], start[p]) for p in logged)
    evaluator = Evaluator(RunTask.read(run_dir), Path(run_dir))
    return {
        "folds": folds,
        "logged_dtype": logged_dtype,
        "momentum_dtype": momentum_dtype,
        "relative_distance": norm((other[p], logged[p]) for p in logged) / moved if moved else 0.0,
        "loss_logged": evaluator.loss(logged),
        "loss_refolded": evaluator.loss(other),
    }
