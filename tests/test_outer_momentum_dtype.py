"""The outer momentum kept in bfloat16 (`outer.momentum_dtype`): the step is computed in float32,
only what is kept between folds is rounded; checkpoints keep its dtype."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dloco import protocol
from dloco.merger.config import ConfigError, MergerConfig, OuterConfig
from dloco.merger.fold import outer
from dloco.merger.state import checkpoint
from dloco.merger.state.core import MergerCore
from tests.merger_helpers import assemble, delta_chunks, initial_params
from tests.test_merger_math import run_outer, run_outer_shares

THIRD = float(np.float32(1 / 3))


def test_nesterov_keeps_its_momentum_rounded_to_bfloat16_by_hand():
    # bf16(1/3) = 1.0101011b x 2^-2 = 0.333984375 (8 significant bits, rounded up).
    # fold 1: trace g (float32), step -0.7 (g + 0.9 g) = -1.33 g; kept m1 = 0.333984375.
    # fold 2: trace g + 0.9 m1 = 0.6339192..., step -0.7 (g + 0.9 trace) = -0.6327025...
    m1 = 0.333984375
    first = -0.7 * 1.9 * THIRD
    second = first - 0.7 * (THIRD + 0.9 * (THIRD + 0.9 * m1))
    config = OuterConfig("nesterov", lr=0.7, momentum=0.9, momentum_dtype="bfloat16")
    assert run_outer(config, [THIRD, THIRD]) == pytest.approx([first, second], rel=1e-6)
    # float32 keeps 1/3: its second step differs by 0.7 * 0.81 * (m1 - g) = 3.7e-4
    exact = run_outer(OuterConfig("nesterov", lr=0.7, momentum=0.9), [THIRD, THIRD])
    assert exact[1] - second == pytest.approx(0.7 * 0.81 * (m1 - THIRD), rel=1e-3)


def test_round_nesterov_keeps_its_pending_sum_and_momentum_in_bfloat16_by_hand():
    # halves: fold 1 a plain step -0.7 g, pending sum kept as bf16(g) = 0.333984375; fold 2
    # completes the round: m = bf16(g) + g (float32), step -0.7 (g + 0.9 m)
    kept = 0.333984375
    config = OuterConfig("round_nesterov", lr=0.7, momentum=0.9, momentum_dtype="bfloat16")
    first = -0.7 * THIRD
    second = first - 0.7 * (THIRD + 0.9 * (kept + THIRD))
    assert run_outer_shares(config, [THIRD, THIRD], [0.5, 0.5]) == pytest.approx(
        [first, second], rel=1e-6
    )


@pytest.mark.parametrize("kind", ["nesterov", "round_nesterov", "delayed_nesterov"])
def test_the_state_is_half_the_bytes_and_the_steps_stay_close(kind):
    rng = np.random.default_rng(3)
    grads = [rng.standard_normal(4096).astype(np.float32) for _ in range(8)]
    results, states = [], []
    for dtype in ("float32", "bfloat16"):
        optimizer = outer.outer_optimizer(OuterConfig(kind, momentum_dtype=dtype))
        step = outer.make_step(optimizer)
        params, state = {"w": jnp.zeros(4096)}, optimizer.init([jnp.zeros(4096)])
        for g in grads:
            params, state = step(params, state, {"w": jnp.asarray(g)}, 0.5)
        results.append(np.asarray(params["w"]))
        states.append(
            sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(state) if leaf.size > 1)
        )
    assert states[1] * 2 == states[0]
    # bfloat16 keeps 8 significant bits: the kept state is off by at most 2^-9 relative per fold
    scale = np.abs(results[0]).max()
    assert 0 < np.abs(results[1] - results[0]).max() < 0.02 * scale


def test_a_checkpoint_keeps_the_momentum_dtype_and_a_core_of_the_other_dtype_reads_it(tmp_path):
    params = initial_params()
    parts = protocol.partition({p: a.shape for p, a in params.items()}, 2)

    def core(dtype):
        config = MergerConfig(outer=OuterConfig(momentum_dtype=dtype))
        return MergerCore(config, protocol.model_fingerprint(params), parts, params)

    folded = core("bfloat16")
    for delta_id in (1, 2):
        chunks = delta_chunks(
            folded.fragments[0], "a", delta_id, 0, folded.version(0), seed=delta_id
        )
        assert folded.submit(assemble(chunks), now=float(delta_id)) is None
        folded.fold(0)
    path = checkpoint.save(tmp_path, folded, next_index=3)
    leaves = jax.tree_util.tree_leaves(folded.states[0].opt_state)
    momentum = next(leaf for leaf in leaves if leaf.dtype == jnp.bfloat16 and leaf.size > 1)
    assert np.any(np.asarray(momentum) != 0)
    for dtype, reader in (("bfloat16", core("bfloat16")), ("float32", core("float32"))):
        checkpoint.import_state(reader, checkpoint.read(path))
        read = jax.tree_util.tree_leaves(reader.states[0].opt_state)
        assert [leaf.dtype for leaf in read if leaf.size > 1] == [jnp.dtype(dtype)] * len(
            [leaf for leaf in leaves if leaf.size > 1]
        )
        # bf16 -> float32 is exact: the values are the ones kept
        assert [np.asarray(a, np.float32).tobytes() for a in read] == [
            np.asarray(a, np.float32).tobytes() for a in leaves
        ]
        assert reader.digest() == folded.digest()


def test_an_unknown_momentum_dtype_is_a_config_error():
    with pytest.raises(ConfigError, match="momentum_dtype"):
        OuterConfig(momentum_dtype="float16")
