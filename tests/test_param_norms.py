"""The guard's cold reference (merger/state/param_norms.py): a lower bound of the norm of a
fragment's new parameters starts on its own thread when a fold leaves an island without a movement
reference, the next fold takes it, and the exact norm is read only for a part beyond the bound's
cap."""

from __future__ import annotations

import threading
from collections.abc import Mapping

import numpy as np
import pytest

from dloco import protocol
from dloco.merger.config import MergerConfig
from dloco.merger.engines.dense_loops import NORM_PART
from dloco.merger.fold.merge import Contribution, FragmentState, ReplayError
from dloco.merger.fold.outliers import COLD_LIMIT, NormHistory, ParamNorm
from dloco.merger.state.core import MergerCore
from dloco.merger.state.param_norms import LOWER_EVERY, ParamNorms, norm_of


class Watched(Mapping):
    """Parameters that note which thread read their values."""

    def __init__(self, params: dict) -> None:
        self.params, self.readers = params, []

    def __getitem__(self, key):
        return self.params[key]

    def __iter__(self):
        return iter(self.params)

    def __len__(self) -> int:
        return len(self.params)

    def values(self):
        self.readers.append(threading.current_thread().name)
        return self.params.values()


def test_a_lower_bound_started_ahead_is_taken_and_others_are_computed_on_the_spot():
    norms = ParamNorms()
    # 8 parts of the first tensor (the bound reads its first), one of the second
    w = np.ones(LOWER_EVERY * NORM_PART, np.float32)
    ahead = Watched({"w": w, "b": np.array([3.0, 4.0], np.float32)})
    norms.ahead(0, ahead)
    norms.settle(0)
    assert norms.lower(0, ahead) == np.sqrt(NORM_PART + 25.0)
    assert len(ahead.readers) == 1 and ahead.readers[0].startswith("guard-norm")
    # the exact norm only when asked for, on the asking thread, of the state then held
    states = [FragmentState(3, ahead, None)]
    bounds = norms.bounds(0, states)
    assert bounds.lower() == np.sqrt(NORM_PART + 25.0) and len(ahead.readers) == 1
    assert bounds.exact() == np.sqrt(LOWER_EVERY * NORM_PART + 25.0)
    assert ahead.readers[1] == threading.current_thread().name
    states[0] = FragmentState(4, ahead, None)
    with pytest.raises(ReplayError, match="fragment 0 at version 3; it holds 4"):
        bounds.exact()
    # other parameters of the fragment (a state replaced since): computed here
    other = Watched({"w": np.array([6.0, 8.0], np.float32)})
    assert norms.lower(0, other) == 10.0 and other.readers == [threading.current_thread().name]
    # another fragment: nothing was started for it
    assert norms.lower(1, ahead) == np.sqrt(NORM_PART + 25.0) and len(ahead.readers) == 3


def test_a_norm_starts_only_while_an_island_of_the_fold_has_no_reference():
    norms, moves = ParamNorms(), NormHistory()
    started = Watched({"w": np.ones(4, np.float32)})
    norms.installed(0, started, moves, [("a", 1.0)])
    norms.settle(0)
    assert len(started.readers) == 1
    # b and c have movement histories: each has the other's as its reference
    for _ in range(moves.min_own):
        moves.record("b", 1.0)
        moves.record("c", 2.0)
    skipped = Watched({"w": np.ones(4, np.float32)})
    norms.installed(0, skipped, moves, [("b", 1.0), ("c", 2.0)])
    norms.settle(0)
    assert skipped.readers == []


def test_a_lone_islands_cap_is_half_the_norm_of_the_parameters_before_its_fold():
    """One island, so never a movement reference: each fold's cap is COLD_LIMIT times the norm of
    the fragment's parameters as the previous fold left them, the norm computed ahead equal to one
    computed now, bit for bit."""
    rng = np.random.default_rng(3)
    params = {"w": rng.normal(size=(64, 33)).astype(np.float32), "b": np.ones(7, np.float32)}
    core = MergerCore(MergerConfig(), protocol.model_fingerprint(params), [["b", "w"]], params)

    def member(delta_id: int, scale: float) -> Contribution:
        tensors = {
            p: (rng.normal(size=v.shape) * scale).astype(np.float32) for p, v in params.items()
        }
        return Contribution("a", 1, delta_id, 0, 100, 10, tensors)

    core._apply_fold(0, [member(1, 0.01)])
    for delta_id in (2, 3):
        before = norm_of(dict(core.states[0].params))
        report = core._apply_fold(0, [member(delta_id, 1e6)])
        assert report.clipped == ("a",)
        assert dict(report.movements)["a"] == COLD_LIMIT * before


def test_a_lone_honest_island_never_needs_the_exact_norm_and_folds_as_with_it():
    """The fold's cap asks for the exact norm only for a part beyond the lower bound's cap: an
    honest island's folds read the parameters once per fold, for the bound, ahead; and each fold is
    the one that the exact norm gives, bit for bit."""
    rng = np.random.default_rng(5)
    shapes = {"w": (3 * NORM_PART + 5,), "b": (7,)}
    params = {p: rng.normal(size=s).astype(np.float32) for p, s in shapes.items()}
    deltas = [
        {p: (rng.normal(size=s) * 0.01).astype(np.float32) for p, s in shapes.items()}
        for _ in range(4)
    ]
    cores = [
        MergerCore(MergerConfig(), protocol.model_fingerprint(params), [["b", "w"]], params)
        for _ in range(2)
    ]
    asked, exact_asked = [], []
    bounded = cores[0].param_norms.bounds
    cores[0].param_norms.bounds = lambda fragment, states: ParamNorm(
        lambda: exact_asked.append(1) or bounded(fragment, states).exact(),
        bounded(fragment, states).lower,
    )
    # the second core's guard is given the exact norm as its bound
    exact = cores[1].param_norms
    exact.bounds = lambda fragment, states: ParamNorm(
        lambda: norm_of(states[fragment].params),
        lambda: asked.append(1) or norm_of(states[fragment].params),
    )
    for delta_id, tensors in enumerate(deltas, 1):
        member = Contribution("a", 1, delta_id, 0, 100, 10, tensors)
        reports = [core._apply_fold(0, [member]) for core in cores]
        assert reports[0].movements == reports[1].movements and not reports[0].clipped
        for path in shapes:
            assert np.array_equal(
                np.asarray(cores[0].states[0].params[path]),
                np.asarray(cores[1].states[0].params[path]),
            )
    assert len(asked) == 4 and exact_asked == []
