"""The merger's log determines its state: recovery from checkpoint + tail and replay from genesis
both reproduce the live digest; rejected deltas never touch state."""

from __future__ import annotations

import dataclasses

import pytest

from dloco import protocol
from dloco.merger.config import MergeConfig, MergerConfig, OuterConfig
from dloco.merger.log.segments import LogCorruption, read_records
from dloco.merger.log.wal import WriteAheadLog
from dloco.merger.state import checkpoint
from dloco.merger.state.core import MergerCore, ReplayError
from dloco.merger.state.recovery import checkpoint_dir, recover, replay, wal_dir
from tests.merger_helpers import assemble, delta_chunks, initial_params

CONFIG = MergerConfig(MergeConfig(max_staleness=2))


def new_core(run_dir):
    params = initial_params()
    parts = protocol.partition({p: a.shape for p, a in params.items()}, 2)
    wal = WriteAheadLog(wal_dir(run_dir), fsync="never")
    return MergerCore(CONFIG, protocol.model_fingerprint(params), parts, params, log=wal), wal


def drive(core, rounds, seed=0, checkpoint_at=None, run_dir=None, codec="int4"):
    """Islands a, b, c send a delta of a fragment each round, based on the version they last saw."""
    delta_id = 0
    for r in range(rounds):
        fragment = r % 2
        for island in ("a", "b", "c"):
            delta_id += 1
            base = max(0, core.states[fragment].version - (delta_id % 3))
            chunks = delta_chunks(
                core.fragments[fragment],
                island,
                delta_id,
                fragment,
                base,
                seed + delta_id,
                codec=codec,
            )
            core.submit(assemble(chunks), now=float(r))
        ready, _ = core.due(now=float(r) + 100)
        for f in ready:
            core.fold(f)
        if checkpoint_at == r:
            checkpoint.save(checkpoint_dir(run_dir), core, core.log.next_index)


# folds from int codes, from sparse ones
@pytest.mark.parametrize("codec", ["int4", "topk2"])
def test_recovery_and_replay_reproduce_the_live_state(tmp_path, codec):
    core, wal = new_core(tmp_path)
    drive(core, rounds=6, checkpoint_at=3, run_dir=tmp_path, codec=codec)
    # one more admitted delta that is logged but not folded when the "crash" happens
    core.submit(
        assemble(delta_chunks(core.fragments[0], "d", 99, 0, core.states[0].version, 7)), now=50.0
    )
    wal.close()
    live = core.digest()
    recovered = recover(tmp_path)
    assert recovered.digest() == live
    assert [len(q) for q in recovered.pending] == [1, 0]
    assert [s.version for s in recovered.states] == [s.version for s in core.states]
    digests = []
    checks = list(replay(tmp_path, lambda index, record, report, c: digests.append(c.digest())))
    assert digests[-1] == live and len(checks) == 1 and checks[0][1] == checks[0][2]


def test_recovery_equals_an_uninterrupted_run_when_folding_resumes(tmp_path):
    straight, wal1 = new_core(tmp_path / "straight")
    drive(straight, rounds=8)
    wal1.close()
    crashed, wal2 = new_core(tmp_path / "crashed")
    drive(crashed, rounds=4, checkpoint_at=1, run_dir=tmp_path / "crashed")
    wal2.close()
    resumed = recover(
        tmp_path / "crashed", log=WriteAheadLog(wal_dir(tmp_path / "crashed"), fsync="never")
    )
    # continue with the same rounds 4..7 (same delta ids and seeds as the straight run)
    delta_id = 12
    for r in range(4, 8):
        fragment = r % 2
        for island in ("a", "b", "c"):
            delta_id += 1
            base = max(0, resumed.states[fragment].version - (delta_id % 3))
            resumed.submit(
                assemble(
                    delta_chunks(
                        resumed.fragments[fragment], island, delta_id, fragment, base, delta_id
                    )
                ),
                now=float(r),
            )
        for f in resumed.due(now=float(r) + 100)[0]:
            resumed.fold(f)
    assert resumed.digest() == straight.digest()


def test_rejected_and_duplicate_deltas_never_change_state(tmp_path):
    core, wal = new_core(tmp_path)
    before = core.digest()
    stale = delta_chunks(core.fragments[0], "a", 1, 0, 0, 1)
    wrong_model = [
        dataclasses.replace(c, model="0123456789abcdef")
        for c in delta_chunks(core.fragments[0], "b", 2, 0, 0, 2)
    ]
    # pretend five folds happened: base 0 is too stale
    core.states[0] = core.states[0]._replace(version=5)
    results = [core.submit(assemble(stale), 0.0), core.submit(assemble(wrong_model), 0.0)]
    assert [r.reason.split(":")[0] for r in results] == ["stale", "model_mismatch"]
    # a duplicate gets the same answer
    assert core.submit(assemble(stale), 0.0) == results[0]
    core.states[0] = core.states[0]._replace(version=0)
    assert core.digest() == before and all(not q for q in core.pending)
    assert core.rejected == {"stale": 1, "model_mismatch": 1}
    wal.close()
    # nothing rejected was logged
    assert [r["type"] for _, r in read_records(wal_dir(tmp_path))] == ["genesis"]


def test_replay_names_a_corrupt_record(tmp_path):
    core, wal = new_core(tmp_path)
    drive(core, rounds=3)
    wal.close()
    (segment,) = wal_dir(tmp_path).glob("*.seg")
    data = bytearray(segment.read_bytes())
    data[len(data) // 2] ^= 0x01
    segment.write_bytes(bytes(data))
    with pytest.raises(LogCorruption, match=r"log record \d+ .* is corrupt"):
        list(replay(tmp_path, lambda *a: None))


@pytest.mark.parametrize(
    "outer,dtype",
    [("nesterov", "float32"), ("round_nesterov", "float32"), ("round_nesterov", "bfloat16")],
)
def test_fold_shares_survive_a_checkpoint_and_replay(tmp_path, outer, dtype):
    """share_window on, one island's delta per fold: the recent-contributor state that sets each
    fold's share is checkpointed, so recovery (checkpoint + tail) and replay from genesis land on
    the live digest, and the shares really were below 1.  round_nesterov: its share credit and
    pending sum are optimizer state, checkpointed and replayed with the rest (bfloat16: kept in
    it, and read back as it was)."""
    config = MergerConfig(
        MergeConfig(max_staleness=4, share_window=6),
        outer=OuterConfig(outer, momentum_dtype=dtype),
    )

    def core_at(run_dir):
        params = initial_params()
        parts = protocol.partition({p: a.shape for p, a in params.items()}, 2)
        wal = WriteAheadLog(wal_dir(run_dir), fsync="never")
        return MergerCore(config, protocol.model_fingerprint(params), parts, params, log=wal), wal

    def single_folds(core, first, last, checkpoint_at=None, run_dir=None):
        shares = []
        for delta_id in range(first, last):
            fragment, island = delta_id % 2, "abc"[delta_id % 3]
            chunks = delta_chunks(
                core.fragments[fragment],
                island,
                delta_id,
                fragment,
                core.states[fragment].version,
                delta_id,
            )
            core.submit(assemble(chunks), now=float(delta_id))
            started = core.start_fold(fragment)
            core.finish_fold(started)
            shares.append(started.share)
            if delta_id == checkpoint_at:
                checkpoint.save(checkpoint_dir(run_dir), core, core.log.next_index)
        return shares

    straight, wal1 = core_at(tmp_path / "straight")
    shares = single_folds(straight, 1, 19)
    wal1.close()
    assert min(shares) < 0.5 and shares[0] == 1.0
    crashed, wal2 = core_at(tmp_path / "crashed")
    single_folds(crashed, 1, 11, checkpoint_at=7, run_dir=tmp_path / "crashed")
    wal2.close()
    resumed = recover(
        tmp_path / "crashed", log=WriteAheadLog(wal_dir(tmp_path / "crashed"), fsync="never")
    )
    assert resumed.last_contributions == crashed.last_contributions
    assert {str(leaf.dtype) for leaf in _state_leaves(resumed)} >= {dtype}
    assert single_folds(resumed, 11, 19) == shares[10:]
    assert resumed.digest() == straight.digest()
    digests = []
    list(replay(tmp_path / "straight", lambda index, record, report, c: digests.append(c.digest())))
    assert digests[-1] == straight.digest()


def _state_leaves(core):
    import jax

    return [leaf for s in core.states for leaf in jax.tree_util.tree_leaves(s.opt_state)]


def test_the_log_says_which_fold_kernels_and_jax_wrote_it(tmp_path):
    """Replay reproduces bytes only with the same kernels and jax: the genesis record names them,
    and a log written with others (or before the record named them) gets a note instead of
    silence."""
    import jax

    from dloco.merger.engines.sparse_xla import KERNELS_VERSION
    from dloco.merger.log import records
    from dloco.merger.state.recovery import software_mismatch

    core, wal = new_core(tmp_path)
    wal.close()
    ((_, genesis),) = list(read_records(wal_dir(tmp_path)))
    assert genesis["software"] == {"fold_kernels": KERNELS_VERSION, "jax": jax.__version__}
    assert software_mismatch(tmp_path) is None
    older = records.software_mismatch({**genesis, "software": {"fold_kernels": 1, "jax": "0.4.30"}})
    assert (
        "fold kernels v1, jax 0.4.30" in older
        and f"v{KERNELS_VERSION}, jax {jax.__version__}" in older
    )
    assert "not recorded" in records.software_mismatch(
        {k: v for k, v in genesis.items() if k != "software"}
    )


def test_a_checkpoint_beyond_the_end_of_the_log_is_an_error_not_a_silent_restart(tmp_path):
    """A checkpoint is written after a sync, so the records it covers were durable: a log that ends
    before it lost acknowledged records, and recovery says so instead of resuming from the
    checkpoint.
    """
    core, wal = new_core(tmp_path)
    drive(core, rounds=4)
    # at the very end: a clean shutdown
    checkpoint.save(checkpoint_dir(tmp_path), core, core.log.next_index)
    wal.close()
    assert recover(tmp_path).digest() == core.digest()
    (segment,) = wal_dir(tmp_path).glob("*.seg")
    with open(segment, "r+b") as handle:
        # the last record, covered by the checkpoint, damaged
        handle.truncate(segment.stat().st_size - 5)
    with pytest.raises(
        ReplayError, match=f"checkpoint at record {core.log.next_index} lies beyond the end"
    ):
        recover(tmp_path)


def test_the_genesis_record_carries_the_model_as_blobs_without_copying_it(tmp_path):
    """The model goes into the log as one raw blob per tensor, viewing the parameters themselves
    (no msgpack copy of the model), and comes back exactly, as views of what was read;
    a log written before the blobs (tensors as bytes in a `params` map) still reads; a standby,
    which gets the blobs beside the record, names the run as the log's reader does."""
    import msgpack
    import numpy as np

    from dloco.merger.log import records
    from dloco.merger.log.logmatch import genesis_id, genesis_of

    params = {
        "a": np.arange(6, dtype=np.float32).reshape(2, 3),
        "b/c": np.full(5, -1.5, np.float32),
    }
    record, blobs = records.genesis_record({}, "m", [["a"], ["b/c"]], params)
    assert "params" not in record and record["tensors"] == [["a", [2, 3]], ["b/c", [5]]]
    assert [
        np.shares_memory(np.frombuffer(b, np.float32), params[p])
        for (b, _), p in zip(blobs, ("a", "b/c"))
    ] == [True, True]
    # the map names the tensors; the values are the blobs'
    assert len(msgpack.packb(record)) < 300

    wal = WriteAheadLog(tmp_path / "wal", fsync="never")
    wal.append(record, blobs)
    wal.close()
    ((_, read),) = list(read_records(tmp_path / "wal"))
    back = records.params_from_genesis(read)
    assert {p: v.tolist() for p, v in back.items()} == {p: v.tolist() for p, v in params.items()}
    # copied only where a blob lies at an odd offset
    assert all(v.dtype == np.float32 and v.flags.aligned for v in back.values())
    assert (
        genesis_id({**record, "blobs": [b for b, _ in blobs]})
        == genesis_id(read)
        == genesis_of(tmp_path)
    )
    other, other_blobs = records.genesis_record(
        {}, "m", [["a"], ["b/c"]], {**params, "b/c": np.zeros(5, np.float32)}
    )
    # the values count
    assert genesis_id(
        {**other, "run": record["run"], "blobs": [b for b, _ in other_blobs]}
    ) != genesis_id(read)

    older = {k: v for k, v in record.items() if k != "tensors"}
    older["params"] = {p: {"shape": list(v.shape), "data": v.tobytes()} for p, v in params.items()}
    assert {p: v.tolist() for p, v in records.params_from_genesis(older).items()} == {
        p: v.tolist() for p, v in params.items()
    }


def test_a_checkpoint_writes_its_arrays_as_blobs_and_reads_them_back_verified(tmp_path):
    """A checkpoint's arrays go to the file as raw blobs (the map stays small) and come back as
    views with their bytes unchanged; one flipped byte in a blob, or a blob cut short, makes the
    file unreadable (None: recovery takes an older one); a checkpoint from before the blobs still
    loads.
    """
    import msgpack
    import numpy as np

    core, wal = new_core(tmp_path)
    drive(core, rounds=4)
    wal.close()
    path = checkpoint.save(checkpoint_dir(tmp_path), core, wal.next_index)
    data = path.read_bytes()
    (length,) = np.frombuffer(data[:4], "<u4")
    arrays = sum(int(np.asarray(v).nbytes) for s in core.states for v in s.params.values())
    # the values are outside the map
    assert length < 4096 < arrays < len(data)
    saved = checkpoint.read(path)
    assert saved["digest"] == core.digest()
    fresh = new_core(tmp_path / "fresh")[0]
    checkpoint.import_state(fresh, saved)
    assert fresh.digest() == core.digest() and [s.version for s in fresh.states] == [
        s.version for s in core.states
    ]

    for damaged in (data[:-1], data[:-5] + bytes([data[-5] ^ 1]) + data[-4:]):
        path.write_bytes(damaged)
        assert checkpoint.read(path) is None

    # the former layout: every array's bytes in the map
    older = checkpoint.export_state(core, wal.next_index)
    for fragment in older["fragments"]:
        for entry in [*fragment["params"].values(), *fragment["opt_leaves"]]:
            entry["data"] = bytes(entry["data"])
    payload = msgpack.packb(older, use_bin_type=True)
    path.write_bytes(np.array([len(payload), checkpoint.crc32(payload)], "<u4").tobytes() + payload)
    fresh = new_core(tmp_path / "older")[0]
    checkpoint.import_state(fresh, checkpoint.read(path))
    assert fresh.digest() == core.digest()
