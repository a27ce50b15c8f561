"""The merger's model during a run: rebuilt from its log at chosen wall times, and the whole
cluster's tokens at a wall time (hand-derived)."""

from __future__ import annotations

import datetime
import json

import numpy as np
import pytest

from dloco import protocol
from dloco.analysis.globalmodel import cluster_tokens_at, states_at, when_cluster_reached
from dloco.merger.config import MergeConfig, MergerConfig
from dloco.merger.log.wal import WriteAheadLog
from dloco.merger.state import checkpoint
from dloco.merger.state.core import MergerCore, ReplayError
from dloco.merger.state.recovery import checkpoint_dir, wal_dir
from tests.merger_helpers import assemble, delta_chunks, initial_params


def _iso(seconds: float) -> str:
    return (
        datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc)
        .isoformat()
        .replace("+00:00", "Z")
    )


# Over 60 lines: one log in its order: four folds, then the moments read back as the merger's log
# loses lines, and against a forged checkpoint.
def test_the_model_at_a_moment_is_every_fold_made_by_then(tmp_path):
    params = initial_params()
    parts = protocol.partition({p: a.shape for p, a in params.items()}, 2)
    wal = WriteAheadLog(wal_dir(tmp_path / "merger"), fsync="never")
    core = MergerCore(
        MergerConfig(MergeConfig(max_staleness=4)),
        protocol.model_fingerprint(params),
        parts,
        params,
        log=wal,
    )
    after, lines = [], []
    # fold k at wall time 1000 + 10 k
    for k in range(4):
        fragment = k % 2
        core.submit(
            assemble(
                delta_chunks(
                    core.fragments[fragment], "a", k + 1, fragment, core.states[fragment].version, k
                )
            ),
            now=float(k),
        )
        report, _ = core.fold(fragment)
        after.append(
            {path: np.asarray(v) for state in core.states for path, v in state.params.items()}
        )
        lines.append(
            {
                "event": "fold",
                "fragment": fragment,
                "version": report.version,
                "timestamp": _iso(1000 + 10 * k),
            }
        )
    # a fold whose log line was lost takes the time of the fold before it
    lines.pop(2)
    wal.close()
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "merger.log").write_text(
        "".join(json.dumps(line) + "\n" for line in lines)
    )

    found = states_at(tmp_path, [1005.0, 999.0, 1030.0, 1015.0, 1012.0])
    # before the first fold
    assert found[1] is None
    # fold 2 is dated 1010 (fold 1's time), fold 3 at 1030
    expected = [after[0], None, after[3], after[2], after[2]]
    for got, want in zip(found, expected):
        if want is not None:
            assert got.keys() == want.keys() and all(np.array_equal(got[p], want[p]) for p in want)
    # the moments are told apart
    assert any(not np.array_equal(after[0][p], after[2][p]) for p in after[0])

    # the first fold's line lost too: it takes the earliest logged time (fold 1's, 1010), as fold 2
    # does
    (tmp_path / "logs" / "merger.log").write_text(
        "".join(json.dumps(line) + "\n" for line in lines[1:])
    )
    early, at_1010 = states_at(tmp_path, [1005.0, 1010.0])
    assert early is None and all(np.array_equal(at_1010[p], after[2][p]) for p in after[2])
    # no fold dated at all: the moments cannot be placed, which is an error, not the final model
    # everywhere
    (tmp_path / "logs" / "merger.log").write_text("")
    with pytest.raises(ReplayError, match="dates none"):
        states_at(tmp_path, [1005.0])
    # a checkpoint the replay does not reproduce (another model than the log's): an error
    (tmp_path / "logs" / "merger.log").write_text(
        "".join(json.dumps(line) + "\n" for line in lines)
    )
    forged = MergerCore(
        MergerConfig(MergeConfig(max_staleness=4)),
        protocol.model_fingerprint(params),
        parts,
        initial_params(seed=1),
    )
    for state_index, state in enumerate(forged.states):
        forged.states[state_index] = state._replace(version=core.states[state_index].version)
    checkpoint.save(checkpoint_dir(tmp_path / "merger"), forged, 3)
    with pytest.raises(ReplayError, match="differs from the merger's checkpoint"):
        states_at(tmp_path, [1005.0])


def test_cluster_tokens_sum_every_island_and_life_at_a_moment():
    steps = {
        "a": [
            [
                {"step": 0, "wall": 0.0, "tokens": 0},
                {"step": 1, "wall": 1.0, "tokens": 100},
                {"step": 2, "wall": 3.0, "tokens": 200},
            ],
            # a restarted: counts from 0 again
            [{"step": 0, "wall": 5.0, "tokens": 0}, {"step": 1, "wall": 6.0, "tokens": 100}],
        ],
        "b": [
            [
                {"step": 0, "wall": 0.5, "tokens": 0},
                {"step": 1, "wall": 2.0, "tokens": 50},
                {"step": 2, "wall": 4.0, "tokens": 100},
            ]
        ],
    }
    assert cluster_tokens_at(steps, 0.9) == 0
    assert cluster_tokens_at(steps, 2.0) == 150
    assert cluster_tokens_at(steps, 4.0) == 300
    assert cluster_tokens_at(steps, 10.0) == 400
    assert when_cluster_reached(steps, 150) == 2.0
    assert when_cluster_reached(steps, 301) == 6.0
    assert when_cluster_reached(steps, 401) is None
