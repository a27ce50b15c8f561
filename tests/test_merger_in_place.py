"""A fold's outer step in XLA taken in place when it is installed: the new parameters and momentum
are written over the fragment's previous ones (no second copy of the state), with the bytes of a
fold that allocates, and never under a host view someone still holds.  (Folds of dense codes under
Nesterov momentum take their step in the merge's pass instead: tests/test_merger_fused.py; these
cores run an optimizer that does not.)"""

from __future__ import annotations

import gc
import weakref

import jax
import numpy as np
import pytest

from dloco import protocol
from dloco.merger.config import MergerConfig, OuterConfig
from dloco.merger.fold.merge import FragmentState, PendingStep, fold
from dloco.merger.starting import initial_core
from dloco.merger.state.core import MergerCore, ReplayError
from tests.merger_helpers import assemble, delta_chunks, initial_params

BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"


# Nesterov momentum stepped in XLA (merger/fold/outer.py's delayed variant with a delay of 1)
XLA_STEP = MergerConfig(outer=OuterConfig(kind="delayed_nesterov", delay=1))


def _core(params=None) -> MergerCore:
    params = initial_params() if params is None else params
    parts = protocol.partition({p: a.shape for p, a in params.items()}, 2)
    return MergerCore(XLA_STEP, protocol.model_fingerprint(params), parts, params)


def _send(core: MergerCore, fragment: int, island: str, delta_id: int, seed: int) -> None:
    """A delta of `fragment` of the core's model (its shapes from the core's layouts)."""
    paths = core.fragments[fragment]
    params = {
        path: np.zeros(shape, np.float32)
        for layout in core.layouts
        for path, shape in layout.items()
    }
    chunks = delta_chunks(
        paths, island, delta_id, fragment, core.version(fragment), seed, params=params
    )
    assert core.submit(assemble(chunks), now=float(delta_id)) is None


def _params(shapes: dict[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {p: (rng.standard_normal(s) * 0.1).astype(np.float32) for p, s in shapes.items()}


def _compiles_in_first_folds(core: MergerCore) -> int:
    """XLA compilations during a first fold of each of the core's two fragments."""
    compiled = []

    def listen(event: str, seconds: float, **kwargs) -> None:
        if event == BACKEND_COMPILE:
            compiled.append(seconds)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        for fragment in (0, 1):
            _send(core, fragment, "a", 1 + fragment, seed=fragment)
            core.fold(fragment)
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    return len(compiled)


def _host(state: FragmentState) -> dict[str, bytes]:
    return {path: np.asarray(value).tobytes() for path, value in state.params.items()}


def test_the_step_is_taken_over_the_previous_state_with_the_bytes_of_one_that_allocates():
    core = _core()
    for delta_id in (1, 2):
        _send(core, 0, "a", delta_id, seed=delta_id)
        core.fold(0)
    _send(core, 0, "a", 3, seed=3)
    started = core.start_fold(0)
    pending, report = core.compute_fold(started)
    assert isinstance(pending, PendingStep) and pending.version == 3
    before = core.states[0]
    where = {path: value.unsafe_buffer_pointer() for path, value in before.params.items()}
    # the same fold, allocating its result, from a copy of the state it starts from
    copy = FragmentState(before.version, {p: np.array(v) for p, v in before.params.items()}, None)
    copy = copy._replace(opt_state=[np.array(leaf) for leaf in _leaves(before.opt_state)])
    copy = copy._replace(opt_state=_rebuild(before.opt_state, copy.opt_state))
    expected, _ = fold(
        copy,
        started.members,
        core.config.merge,
        core._step,
        started.share,
        started.caps,
    )
    installed = core.install(0, pending, report)
    assert installed is core.states[0] and installed.version == 3
    assert {p: v.unsafe_buffer_pointer() for p, v in installed.params.items()} == where
    assert all(value.is_deleted() for value in before.params.values())
    assert _host(installed) == _host(expected)


def test_a_host_view_taken_before_the_step_keeps_its_values():
    core = _core()
    for delta_id in (1, 2):
        _send(core, 0, "a", delta_id, seed=delta_id)
        core.fold(0)
    views = {p: np.asarray(v) for p, v in core.states[0].params.items()}
    held = {p: v.copy() for p, v in views.items()}
    _send(core, 0, "a", 3, seed=3)
    core.fold(0)
    assert all(np.array_equal(views[p], held[p]) for p in views)
    assert any(not np.array_equal(np.asarray(core.states[0].params[p]), held[p]) for p in held)


def test_a_pending_step_is_taken_only_on_the_state_it_was_computed_from():
    core = _core()
    _send(core, 0, "a", 1, seed=1)
    pending, report = core.compute_fold(core.start_fold(0))
    core.install(0, pending, report)
    with pytest.raises(ReplayError, match="to version 1 taken on version 1"):
        core.install(0, pending, report)


def test_warm_up_compiles_the_step_a_fold_takes_without_reading_the_state():
    # shapes no other test folds (compilations are cached for the process)
    warmed = _core(_params({"a/w": (40, 24), "a/b": (24,), "c/w": (24, 56)}))
    warmed.warm_up()
    assert _compiles_in_first_folds(warmed) == 0
    # the count can fail: a core not warmed up compiles its outer steps on its first folds
    cold = _core(_params({"a/w": (44, 24), "a/b": (24,), "c/w": (24, 60)}))
    assert _compiles_in_first_folds(cold) >= 2


def test_initial_values_read_by_the_factory_are_freed_by_the_first_folds():
    """`dloco merger --init-npz` hands the factory a reader, not the values: values kept outside
    the core would stay beside its state for the whole run."""
    read = []

    def load():
        read.append(initial_params())
        return read[-1]

    factory = initial_core(
        MergerConfig(), load, 2, {p: a.shape for p, a in initial_params().items()}
    )
    core = factory(None)
    loaded = [weakref.ref(value) for value in read.pop().values()]
    assert all(ref() is not None for ref in loaded)
    for fragment in (0, 1):
        _send(core, fragment, "a", 1 + fragment, seed=fragment)
        core.fold(fragment)
    gc.collect()
    assert [ref() for ref in loaded] == [None] * len(loaded)


def _leaves(tree):
    return jax.tree_util.tree_leaves(tree)


def _rebuild(like, leaves):
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(like), leaves)
