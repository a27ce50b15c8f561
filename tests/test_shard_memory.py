"""A merger shard holds only its share of the model (merger/starting.py, merger/state/core.py): it
reads its own fragments' values from the initial values, logs and checkpoints them alone, holds
empty states for the other shards' fragments, and refuses their deltas and catch-up requests.  What
the shards hold together is the model, and an export joins their checkpoints into it.  (The same
bytes as one merger, through real processes: test_merger_shards.py, `-m e2e`.)"""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from dloco import protocol
from dloco.analysis.export import combine, params_of
from dloco.merger.config import MergeConfig, MergerConfig, RoundConfig
from dloco.merger.log import records
from dloco.merger.log.wal import WriteAheadLog
from dloco.merger.starting import initial_core, load_initial, npz_shapes
from dloco.merger.state import checkpoint
from dloco.merger.state.recovery import initial_states, recover, wal_dir
from tests.merger_helpers import assemble, delta_chunks

CONFIG = MergerConfig(MergeConfig(max_staleness=3), round=RoundConfig(quorum=1, grace_cap_s=0.0))
# sixteen tensors of 64 KiB: four fragments of four each
SHAPES = {f"layer{i:02d}/kernel": (128, 128) for i in range(16)}


@pytest.fixture
def init_npz(tmp_path):
    rng = np.random.default_rng(0)
    values = {path: rng.standard_normal(shape).astype(np.float32) for path, shape in SHAPES.items()}
    path = tmp_path / "init.npz"
    np.savez(path, **values)
    return path, values


def test_a_shard_reads_its_own_fragments_values_and_every_shape(init_npz):
    path, values = init_npz
    assert npz_shapes(path) == SHAPES
    parts = protocol.partition(SHAPES, 4)
    tracemalloc.start()
    params, shapes = load_initial(path, 4, shard=1, shards=2)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    mine = {p for f in (1, 3) for p in parts[f]}
    assert set(params) == mine and shapes == SHAPES
    assert all(np.array_equal(params[p], values[p]) for p in mine)
    # its half (512 KiB), read an array at a time: never the whole model (1 MiB)
    assert peak < (8 + 3) * 64 * 1024
    whole, _ = load_initial(path, 4)
    assert set(whole) == set(SHAPES)


def test_a_shards_core_holds_logs_and_checkpoints_its_own_fragments(init_npz, tmp_path):
    path, values = init_npz
    cores = []
    for shard in range(2):
        params, shapes = load_initial(path, 4, shard, 2)
        wal = WriteAheadLog(wal_dir(tmp_path / f"s{shard}"), fsync="never")
        core = initial_core(CONFIG, params, 4, shapes)(wal)
        cores.append((core, wal))
    core, wal = cores[1]
    # the islands' fingerprint: every tensor's shape, whoever holds the values
    assert core.model == protocol.model_fingerprint(values)
    assert core.owned == frozenset({1, 3})
    assert [bool(s.params) for s in core.states] == [False, True, False, True]
    assert [bool(layout) for layout in core.layouts] == [False, True, False, True]
    held = sum(v.nbytes for s in core.states for v in s.params.values())
    assert held == sum(values[p].nbytes for f in (1, 3) for p in core.fragments[f])
    # another shard's fragment: refused before its tensors are looked at
    other = delta_chunks(core.fragments[0], "a", 1, 0, 0, seed=1, params=values)
    assert core.submit(assemble(other), now=0.0).status == "rejected"
    assert core.rejected["other_shard"] == 1
    mine = delta_chunks(core.fragments[1], "a", 2, 1, 0, seed=2, params=values)
    assert core.submit(assemble(mine), now=0.0) is None
    core.fold(1)
    # its log's genesis holds its values only; recovery rebuilds the same core
    wal.close()
    recovered = recover(tmp_path / "s1")
    assert recovered.digest() == core.digest() and recovered.owned == frozenset({1, 3})
    assert [bool(s.params) for s in initial_states(tmp_path / "s1")] == [False, True, False, True]
    # checkpoints: its own fragments' values; joined with the other shard's, the whole model
    saved = [checkpoint.export_state(c, 0) for c, _ in cores]
    restored = recover(tmp_path / "s0")
    checkpoint.import_state(restored, saved[0])
    assert restored.digest() == cores[0][0].digest()
    model = params_of(combine(saved))
    assert set(model) == set(SHAPES)
    assert not np.array_equal(model[core.fragments[1][0]], values[core.fragments[1][0]])
    assert np.array_equal(model[core.fragments[0][0]], values[core.fragments[0][0]])
    cores[0][1].close()


def test_initial_values_given_for_part_of_a_fragment_are_refused():
    with pytest.raises(ValueError, match="1 of fragment 0's 2 tensors"):
        records.held_fragments([["a", "b"], ["c"]], {"a": np.zeros(1), "c": np.zeros(1)})
