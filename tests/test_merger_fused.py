"""Folds of dense int codes under Nesterov momentum take the outer step in the merge's pass
(merger/engines/fused.py): the model the merged direction stepped in XLA gives (to rounding), the
state folded from read and never written, the new one in buffers that come back once nothing views
them."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from dloco import protocol
from dloco.merger.config import MergeConfig, MergerConfig, OuterConfig
from dloco.merger.engines.scratch import Scratch, StateBuffers
from dloco.merger.fold import merge as fold_module
from dloco.merger.fold.merge import Contribution, fold, init_state
from dloco.merger.fold.outer import make_step, outer_optimizer
from dloco.merger.state.core import MergerCore
from dloco.protocol import Codec, CodedTensor
from tests.merger_helpers import assemble, delta_chunks, initial_params

SHAPES = {"a/w": (50, 24), "a/b": (7,), "c/w": (24, 33)}


def _members(rng, islands: int = 2, size: float = 1e-2) -> list[Contribution]:
    codec = Codec("int4", 64)

    def coded(shape):
        values = (rng.standard_normal(shape) * size).astype(np.float32).reshape(-1)
        return CodedTensor(codec, shape, codec.encode(values).reshape(-1, codec.record_nbytes))

    return [
        Contribution(f"i{m}", 1, m, 0, 50, 5, {p: coded(s) for p, s in SHAPES.items()})
        for m in range(islands)
    ]


def _params(rng) -> dict[str, np.ndarray]:
    return {p: rng.standard_normal(s).astype(np.float32) for p, s in SHAPES.items()}


def _leaves(state) -> list[np.ndarray]:
    return [np.asarray(leaf, np.float32) for leaf in jax.tree_util.tree_leaves(state.opt_state)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_fused_fold_steps_as_xla_does_over_the_merged_direction(dtype, monkeypatch):
    optimizer = outer_optimizer(OuterConfig(momentum_dtype=dtype))
    step, rng = make_step(optimizer), np.random.default_rng(1)
    rounds = [_members(rng) for _ in range(3)]
    states = []
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(fold_module, "fused_terms", lambda optimizer: None)
        state = init_state(_params(np.random.default_rng(0)), optimizer)
        for members in rounds:
            state, report = fold(state, members, MergeConfig(), step)
        states.append(state)
    fused_state, xla_state = states
    assert isinstance(fused_state.params["a/w"], np.ndarray) and report.version == 3
    # a state is replaced, never written
    assert not fused_state.params["a/w"].flags.writeable
    for p in SHAPES:
        np.testing.assert_allclose(
            fused_state.params[p], np.asarray(xla_state.params[p]), rtol=1e-6, atol=1e-7
        )
    # bfloat16: one rounding of 2^-8 apart at most
    tolerance = 1e-6 if dtype == "float32" else 2**-7
    for a, b in zip(_leaves(fused_state), _leaves(xla_state)):
        np.testing.assert_allclose(a, b, rtol=tolerance, atol=1e-7)


def test_a_fold_reads_the_state_it_starts_from_and_never_writes_it():
    optimizer = outer_optimizer(OuterConfig(momentum_dtype="bfloat16"))
    step, rng = make_step(optimizer), np.random.default_rng(2)
    scratch = Scratch()
    first, _ = fold(init_state(_params(rng), optimizer), _members(rng), MergeConfig(), step)
    before = {p: np.array(v) for p, v in first.params.items()}
    momentum = [m.copy() for m in _leaves(first)]
    members = _members(rng)
    second, _ = fold(first, members, MergeConfig(), step, scratch=scratch)
    pending, _ = fold(first, members, MergeConfig(), step, in_place=True, scratch=scratch)
    taken = pending.take(first)
    assert all(np.array_equal(first.params[p], before[p]) for p in before)
    assert all(np.array_equal(a, b) for a, b in zip(_leaves(first), momentum))
    # in place or not, the same bytes; and not the state it started from
    assert all(taken[0][p].tobytes() == second.params[p].tobytes() for p in before)
    assert any(not np.array_equal(second.params[p], before[p]) for p in before)


def test_a_fold_takes_the_buffers_of_a_state_nothing_views_any_more():
    optimizer = outer_optimizer(OuterConfig())
    step, rng, scratch = make_step(optimizer), np.random.default_rng(3), Scratch()

    def next_state(state):
        return fold(state, _members(rng), MergeConfig(), step, scratch=scratch)[0]

    def buffer(state):
        return state.params["a/w"].base

    one = next_state(init_state(_params(rng), optimizer))
    two = next_state(one)
    # one is still held: three is written elsewhere
    three = next_state(two)
    assert buffer(three) is not buffer(one) and buffer(three) is not buffer(two)
    # a host view of two keeps its buffer (and its values) through the next folds
    view, kept = two.params["c/w"], two.params["c/w"].copy()
    del one, two
    four = next_state(three)
    five = next_state(four)
    assert buffer(five) is not view.base and np.array_equal(view, kept)
    # let go of it: its buffer is taken again
    address = view.base.ctypes.data
    del view
    six = next_state(five)
    seven = next_state(six)
    assert {buffer(six).ctypes.data, buffer(seven).ctypes.data} & {address}


def test_state_buffers_reuse_what_nothing_views_and_keep_few_spare():
    buffers = StateBuffers(spare=2)
    first = buffers.take(1000)
    second = buffers.take(1000)
    assert first.base is not second.base and first.ctypes.data % 64 == 0
    assert buffers.fresh == 2
    address = first.base.ctypes.data
    del first
    # free, and large enough (at most a quarter larger than asked)
    third = buffers.take(900)
    assert third.base.ctypes.data == address and buffers.fresh == 2
    # nothing free: a new buffer, as large as the largest size asked for that is at most a
    # quarter larger
    larger = buffers.take(1100)
    fourth = buffers.take(1000)
    assert fourth.base.size == larger.base.size == 1100 + 64 and buffers.fresh == 4
    # a free buffer much larger is not taken
    del fourth
    small = buffers.take(500)
    assert small.base.size == 500 + 64 and buffers.fresh == 5
    held = [buffers.take(500) for _ in range(4)]
    del held, small
    buffers.take(500)
    # held: second, third, larger; let go: fourth (a spare of its size) and, of the five of 500,
    # two spare beside the one just taken (the others are dropped)
    assert sorted(b.size for b in buffers._buffers) == [564] * 3 + [1064] * 2 + [1164] * 2


def test_a_mergers_folds_allocate_no_state_buffer_after_the_first_rounds():
    """Each fold takes the buffers of a state the one before it replaced: after the first
    rounds (each fragment's first fold gathers its state into the flat layout), none is new."""
    params = initial_params()
    parts = protocol.partition({p: a.shape for p, a in params.items()}, 2)
    core = MergerCore(MergerConfig(), protocol.model_fingerprint(params), parts, params)
    zeros = {p: np.zeros(a.shape, np.float32) for p, a in params.items()}
    fresh = []
    for round_ in range(5):
        for fragment in (0, 1):
            chunks = delta_chunks(
                core.fragments[fragment],
                "a",
                1 + 2 * round_ + fragment,
                fragment,
                core.version(fragment),
                seed=round_,
                params=zeros,
            )
            assert core.submit(assemble(chunks), now=float(round_)) is None
            core.fold(fragment)
        fresh.append(core.scratch.states.fresh)
    assert isinstance(core.states[0].params[core.fragments[0][0]], np.ndarray)
    assert fresh[1] == fresh[-1] and fresh[0] >= 2
