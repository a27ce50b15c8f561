"""A fold's share of a round and the cap on any island's claimed weight, by hand and through
MergerCore: share-scaled folds add up to a round, and a forged token count does not take over."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from dloco.merger.config import MergeConfig, OuterConfig
from dloco.merger.fold import outer, weighting
from dloco.merger.fold.merge import Contribution, fold, init_state


def test_fold_share_by_hand():
    # d last contributed 6 versions before 7: gone for window 4
    recent = {"b": (5, 1.0), "c": (5, 2.0), "d": (1, 1.0)}
    assert weighting.fold_share([("a", 1.0)], recent, version=7, window=4) == 1.0 / (
        1.0 + 1.0 + 2.0
    )
    assert weighting.fold_share([("a", 1.0)], recent, version=7, window=6) == 1.0 / (
        1.0 + 1.0 + 2.0 + 1.0
    )
    # a whole round
    assert (
        weighting.fold_share([("a", 1.0), ("b", 3.0), ("c", 1.0)], recent, version=7, window=4)
        == 1.0
    )
    # two of a's deltas
    assert weighting.fold_share([("a", 1.0), ("a", 1.0)], recent, version=7, window=4) == 2.0 / 5.0
    # weightless: count islands
    assert weighting.fold_share([("a", 0.0)], recent, version=7, window=4) == 1.0 / 3.0
    # off
    assert weighting.fold_share([("a", 1.0)], recent, version=7, window=0) == 1.0
    # nobody else known yet
    assert weighting.fold_share([("a", 1.0)], {}, version=1, window=4) == 1.0


def test_no_islands_claimed_weight_outweighs_the_heaviest_other_more_than_the_ratio():
    # 100 > 8 x 1
    assert weighting.capped([1.0, 100.0], [], 8) == [1.0, 8.0]
    # against the recent others: 8 x 5
    assert weighting.capped([100.0], [2.0, 5.0], 8) == [40.0]
    assert weighting.capped([3.0, 4.0], [], 8) == [3.0, 4.0] and weighting.capped(
        [1.0, 100.0], [], 0
    ) == [1.0, 100.0]
    # nobody to compare to
    assert weighting.capped([5.0], [], 8) == [5.0]
    # a fold of an island claiming 1000x the tokens beside an honest one: 8/9 of it, not 1e6/(1e6 +
    # 1)
    assert weighting.weights(
        [(1000 * 640, 20, 0), (640, 20, 0)], power=0, max_ratio=8
    ) == pytest.approx([8 / 9, 1 / 9])


def test_a_forged_token_count_does_not_take_over_the_fragment():
    """Share-scaled folds: after b's honest delta (640 tokens, 20 steps), island a claims 1000 x the
    tokens.  Its weight is capped at max_weight_ratio (2) x b's: its fold's share is 2 / (2 + 1),
    its weight noted capped, and b's next fold still gets 1 / (1 + 2) of a round, not ~1e-6."""
    from dloco import protocol
    from dloco.merger.config import MergerConfig
    from dloco.merger.state.core import MergerCore
    from tests.merger_helpers import assemble, delta_chunks, initial_params

    params = initial_params()
    parts = protocol.partition({p: a.shape for p, a in params.items()}, 1)
    core = MergerCore(
        MergerConfig(MergeConfig(share_window=8)), protocol.model_fingerprint(params), parts, params
    )

    def fold(island, delta_id, tokens):
        chunks = [
            dataclasses.replace(c, tokens=tokens)
            for c in delta_chunks(parts[0], island, delta_id, 0, core.states[0].version, delta_id)
        ]
        assert core.submit(assemble(chunks), now=0.0) is None
        started = core.start_fold(0)
        core.finish_fold(started)
        return started.share

    assert fold("b", 1, 640) == 1.0
    assert fold("a", 2, 640_000) == pytest.approx(2 / 3)
    assert fold("b", 3, 640) == pytest.approx(1 / 3)


def test_a_fold_is_scaled_by_its_share():
    """Plain SGD, lr 1: the parameters move by exactly share x the merged delta (RDA of one delta:
    itself)."""
    config = OuterConfig("sgd", lr=1.0)
    anchor = {"w": np.array([1.0, 2.0], np.float32)}
    delta = {"w": np.array([0.5, -0.5], np.float32)}
    step = outer.make_step(outer.outer_optimizer(config))
    state = init_state(anchor, outer.outer_optimizer(config))
    after, report = fold(
        state, [Contribution("a", 1, 1, 0, 64, 4, delta)], MergeConfig(), step, share=0.25
    )
    np.testing.assert_array_equal(
        after.params["w"], np.array([1.0 - 0.125, 2.0 + 0.125], np.float32)
    )
    assert report.weights == (0.25,)


def test_single_island_folds_add_up_to_a_round():
    """Four equal islands folding one delta at a time, share_window 8: the first folds take whole
    steps (nobody else known yet), then each fold a quarter; a whole round in one fold: share 1."""
    from dloco import protocol
    from dloco.merger.config import MergerConfig
    from dloco.merger.state.core import MergerCore
    from tests.merger_helpers import assemble, delta_chunks, initial_params

    params = initial_params()
    parts = protocol.partition({p: a.shape for p, a in params.items()}, 1)
    core = MergerCore(
        MergerConfig(MergeConfig(share_window=8)), protocol.model_fingerprint(params), parts, params
    )
    shares, delta_id = [], 0
    for island in ("a", "b", "c", "d", "a", "b"):
        delta_id += 1
        # equal tokens
        core.submit(
            assemble(
                delta_chunks(parts[0], island, delta_id, 0, core.states[0].version, 3 * delta_id)
            ),
            now=0.0,
        )
        started = core.start_fold(0)
        shares.append(started.share)
        core.finish_fold(started)
    assert shares == [1.0, 1 / 2, 1 / 3, 1 / 4, 1 / 4, 1 / 4]
    for island in ("a", "b", "c", "d"):
        delta_id += 1
        core.submit(
            assemble(
                delta_chunks(parts[0], island, delta_id, 0, core.states[0].version, 3 * delta_id)
            ),
            now=0.0,
        )
    assert core.start_fold(0).share == 1.0
