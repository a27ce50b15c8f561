"""The in-place outer step of a 16-bit optimizer state runs as two programs (merger/fold/outer.py
`make_step`): the same bytes as the one program the step runs out of place, fold after fold, for
every outer optimizer, and the state's buffers written over themselves."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from dloco.merger.config import OuterConfig
from dloco.merger.fold.outer import _narrow, make_step, outer_optimizer

SHAPES = {"a": (64, 48), "b": (300,)}


def _tree_bytes(tree) -> list[bytes]:
    return [np.asarray(leaf).tobytes() for leaf in jax.tree_util.tree_leaves(tree)]


@pytest.mark.parametrize("kind", ["nesterov", "delayed_nesterov", "round_nesterov", "sgd"])
def test_two_programs_step_as_one(kind):
    config = OuterConfig(kind=kind, delay=2, momentum_dtype="bfloat16")
    optimizer = outer_optimizer(config)
    rng = np.random.default_rng(5)
    params = {p: rng.standard_normal(s).astype(np.float32) for p, s in SHAPES.items()}
    fused, split = make_step(optimizer), make_step(optimizer, in_place=True)
    state = optimizer.init([params[p] for p in sorted(params)])
    assert _narrow(state) == (kind != "sgd")
    ours = (
        {p: jax.device_put(v.copy()) for p, v in params.items()},
        jax.tree_util.tree_map(lambda x: jax.device_put(np.array(x)), state),
    )
    theirs = (params, state)
    for fold in range(5):
        gradient = {p: rng.standard_normal(s).astype(np.float32) * 0.01 for p, s in SHAPES.items()}
        share = 0.5 if fold % 2 else 1.0
        theirs = fused(*theirs, gradient, share)
        ours = split(*ours, gradient, share)
        assert _tree_bytes(ours) == _tree_bytes(theirs), f"fold {fold}"


def test_the_split_step_writes_the_state_over_itself():
    """Donated: the state's old arrays are gone after the step (their buffers hold the new)."""
    optimizer = outer_optimizer(OuterConfig(momentum_dtype="bfloat16"))
    params = {p: jax.device_put(np.ones(s, np.float32)) for p, s in SHAPES.items()}
    state = optimizer.init([params[p] for p in sorted(params)])
    old = jax.tree_util.tree_leaves(state) + list(params.values())
    make_step(optimizer, in_place=True)(params, state, _ones(), 1.0)
    assert all(leaf.is_deleted() for leaf in old)


def _ones() -> dict:
    return {p: np.ones(s, np.float32) for p, s in SHAPES.items()}
