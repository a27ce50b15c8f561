"""Folds started on the loop's thread and computed on the pipeline's worker: the same state as
folding in place, one fold per fragment in flight, announced in order once the log is durable."""

from __future__ import annotations

import jax
import numpy as np
import pytest
import zmq

from dloco import protocol
from dloco.merger.config import MergeConfig, MergerConfig, RoundConfig
from dloco.merger.log.wal import WriteAheadLog
from dloco.merger.state.core import MergerCore
from dloco.merger.state.pipeline import FoldPipeline
from dloco.merger.state.recovery import replay, wal_dir
from tests.merger_helpers import assemble, delta_chunks, initial_params

CONFIG = MergerConfig(MergeConfig(max_staleness=3), round=RoundConfig(quorum=1, grace_cap_s=0.0))


def new_core(run_dir, fsync="never"):
    params = initial_params()
    parts = protocol.partition({p: a.shape for p, a in params.items()}, 2)
    wal = WriteAheadLog(wal_dir(run_dir), fsync=fsync)
    return MergerCore(CONFIG, protocol.model_fingerprint(params), parts, params, log=wal), wal


def deltas(core, count):
    """Islands a and b alternate deltas of both fragments, each based on the version before it."""
    out = []
    for i in range(count):
        fragment, island = i % 2, "ab"[(i // 2) % 2]
        out.append((fragment, island, i + 1, max(0, i // 2 - 1)))
    return out


def test_pipelined_folds_reach_the_same_state_as_folding_in_place(tmp_path):
    in_place, wal_a = new_core(tmp_path / "a")
    piped, wal_b = new_core(tmp_path / "b", fsync="batch")
    pipeline = FoldPipeline(piped, wal_b)
    announced = []
    for fragment, island, delta_id, base in deltas(in_place, 12):
        for core in (in_place, piped):
            chunks = delta_chunks(
                core.fragments[fragment], island, delta_id, fragment, base, seed=delta_id
            )
            assert core.submit(assemble(chunks), now=float(delta_id)) is None
        for f in in_place.due(now=float(delta_id))[0]:
            in_place.fold(f)
        pipeline.dispatch(now=float(delta_id))
        announced += pipeline.finished(wait=True)
    assert [f.report.version for f in announced if f.fragment == 0] == list(range(1, 7))
    assert all(f.state.version == f.report.version for f in announced)
    # nothing announced before it is on disk
    assert wal_b.durable >= announced[-1].durable
    pipeline.close()
    wal_a.close()
    wal_b.close()
    assert piped.digest() == in_place.digest()
    folds = []
    list(
        replay(
            tmp_path / "b", on_fold=lambda index, record, report, core: folds.append(core.digest())
        )
    )
    # the log alone gives it too
    assert len(folds) == len(announced) and folds[-1] == piped.digest()


def test_a_fragment_has_one_fold_in_flight_and_admission_counts_it(tmp_path):
    core, wal = new_core(tmp_path)
    context = zmq.Context()
    pipeline = FoldPipeline(core, wal, context)
    try:
        core.submit(assemble(delta_chunks(core.fragments[0], "a", 1, 0, 0, seed=1)), now=0.0)
        pipeline.dispatch(now=0.0)
        # the round's version, computed or not
        assert len(pipeline.in_flight) == 1 and core.version(0) == 1
        core.submit(assemble(delta_chunks(core.fragments[0], "b", 2, 0, 0, seed=2)), now=0.0)
        # counted against the started fold
        assert core.pending[0][0].contribution.staleness == 1
        # still computing: the second round waits for it
        if pipeline.in_flight:
            pipeline.dispatch(now=0.0)
            assert len(pipeline.in_flight) <= 1
        # the worker says when a fold is done
        assert pipeline.signal.poll(10_000)
        done = pipeline.finished(wait=True)
        pipeline.dispatch(now=0.0)
        done += pipeline.finished(wait=True)
        assert [f.report.version for f in done] == [1, 2] and [
            f.report.contributors for f in done
        ] == [("a",), ("b",)]
    finally:
        pipeline.close()
        context.destroy(linger=0)
        wal.close()


def test_a_failed_fold_stops_the_pipeline_and_is_raised_on_the_loop_thread(tmp_path, monkeypatch):
    core, wal = new_core(tmp_path)
    pipeline = FoldPipeline(core, wal)

    def broken(started):
        raise RuntimeError("kernel failed")

    monkeypatch.setattr(core, "compute_fold", broken)
    core.submit(assemble(delta_chunks(core.fragments[1], "a", 1, 1, 0, seed=3)), now=0.0)
    before = core.states[1]
    pipeline.dispatch(now=0.0)
    with pytest.raises(RuntimeError, match="kernel failed"):
        pipeline.finished(wait=True)
    with pytest.raises(RuntimeError, match="kernel failed"):
        # nothing more is started
        pipeline.dispatch(now=1.0)
    # never installed: a checkpoint now would lie
    assert pipeline.close() == [] and core.states[1] is before
    wal.close()


def test_the_worker_never_installs_a_fold_before_it_is_announced(tmp_path):
    core, wal = new_core(tmp_path, fsync="batch")
    pipeline = FoldPipeline(core, wal)
    core.submit(assemble(delta_chunks(core.fragments[0], "a", 1, 0, 0, seed=4)), now=0.0)
    pipeline.dispatch(now=0.0)
    # computed, not yet handed over
    pipeline.in_flight[0].done.wait(60)
    # catch-up requests still get version 0
    assert core.states[0].version == 0 and core.version(0) == 1
    (fold,) = pipeline.finished()
    assert core.states[0] is fold.state and fold.state.version == 1 and wal.durable >= fold.durable
    pipeline.close()
    wal.close()


def test_the_worker_computes_the_next_fold_once_the_last_one_is_installed(tmp_path):
    """Each computed fold holds its merged direction (fragment-sized) until it is installed: the
    worker lets one wait at a time (HELD_COMPUTED), so a loop busy elsewhere never has a model's
    worth of them held.  Fragments 0 and 1 fold; nothing is installed until `finished()`."""
    core, wal = new_core(tmp_path)
    pipeline = FoldPipeline(core, wal)
    for fragment in (0, 1):
        chunks = delta_chunks(core.fragments[fragment], "a", fragment + 1, fragment, 0, seed=5)
        core.submit(assemble(chunks), now=0.0)
    pipeline.dispatch(now=0.0)
    first, second = pipeline.in_flight
    assert first.done.wait(60)
    # waits for the first one's install (a wrong worker computes this small fold in milliseconds)
    assert not second.done.wait(2.0)
    (fold,) = pipeline.finished()
    assert fold is first and core.states[0] is first.state
    assert pipeline.finished(wait=True) == [second] and core.states[1] is second.state
    pipeline.close()
    wal.close()


def test_closing_after_a_failed_fold_does_not_wait_for_an_install(tmp_path, monkeypatch):
    """A fold computed after a failed one is never installed: closing still ends the worker."""
    core, wal = new_core(tmp_path)
    pipeline = FoldPipeline(core, wal)
    compute = core.compute_fold

    def first_fails(started):
        if started.fragment == 0:
            raise RuntimeError("kernel failed")
        return compute(started)

    monkeypatch.setattr(core, "compute_fold", first_fails)
    for fragment in (0, 1):
        chunks = delta_chunks(core.fragments[fragment], "a", fragment + 1, fragment, 0, seed=6)
        core.submit(assemble(chunks), now=0.0)
    pipeline.dispatch(now=0.0)
    with pytest.raises(RuntimeError, match="kernel failed"):
        pipeline.finished(wait=True)
    assert pipeline.close() == [] and not pipeline._worker.is_alive()
    wal.close()


def test_a_barrier_that_raises_does_not_leave_the_worker_waiting(tmp_path):
    """A fenced primary's replication barrier raises on the first computed fold: the second is
    still computed and closing ends the worker (it once waited for an install that never came)."""
    core, wal = new_core(tmp_path)
    pipeline = FoldPipeline(core, wal)

    def fenced(ticket):
        raise RuntimeError("fenced")

    pipeline.barrier = fenced
    for fragment in (0, 1):
        chunks = delta_chunks(core.fragments[fragment], "a", fragment + 1, fragment, 0, seed=7)
        core.submit(assemble(chunks), now=0.0)
    pipeline.dispatch(now=0.0)
    second = pipeline.in_flight[1]
    with pytest.raises(RuntimeError, match="fenced"):
        pipeline.finished(wait=True)
    assert second.done.wait(60)
    pipeline.barrier = None
    pipeline.close()
    assert not pipeline._worker.is_alive()
    wal.close()


def test_a_fold_given_up_before_its_install_leaves_the_state_as_it_was(tmp_path):
    """The outer step is taken in place when a fold is installed, or into buffers of the fold's own
    (merger/engines/fused.py): a fold given up before its install (a fenced primary's barrier
    raises, or the log cannot be made durable) has not touched the fragment's parameters."""
    core, wal = new_core(tmp_path)
    pipeline = FoldPipeline(core, wal)
    # a first fold installed: the fragment's arrays are the folds' now (the next could take them)
    core.submit(assemble(delta_chunks(core.fragments[0], "a", 1, 0, 0, seed=8)), now=0.0)
    pipeline.dispatch(now=0.0)
    pipeline.finished(wait=True)
    before = core.states[0]
    values = {path: np.array(value) for path, value in before.params.items()}

    def fenced(ticket):
        raise RuntimeError("fenced")

    pipeline.barrier = fenced
    core.submit(assemble(delta_chunks(core.fragments[0], "a", 2, 0, 1, seed=9)), now=1.0)
    pipeline.dispatch(now=1.0)
    with pytest.raises(RuntimeError, match="fenced"):
        pipeline.finished(wait=True)
    assert core.states[0] is before and before.version == 1
    assert not any(
        isinstance(value, jax.Array) and value.is_deleted() for value in before.params.values()
    )
    assert all(np.array_equal(before.params[p], values[p]) for p in values)
    pipeline.barrier = None
    pipeline.close()
    wal.close()


def test_an_install_that_fails_stops_the_pipeline(tmp_path, monkeypatch):
    """Its step had the fragment's buffers: nothing more is installed or checkpointed."""
    core, wal = new_core(tmp_path)
    pipeline = FoldPipeline(core, wal)

    def broken(fragment, state, report):
        raise RuntimeError("step failed")

    monkeypatch.setattr(core, "install", broken)
    core.submit(assemble(delta_chunks(core.fragments[0], "a", 1, 0, 0, seed=10)), now=0.0)
    pipeline.dispatch(now=0.0)
    with pytest.raises(RuntimeError, match="step failed"):
        pipeline.finished(wait=True)
    assert isinstance(pipeline.failed, RuntimeError)
    with pytest.raises(RuntimeError, match="step failed"):
        pipeline.dispatch(now=1.0)
    assert pipeline.close() == [] and not pipeline._worker.is_alive()
    wal.close()
