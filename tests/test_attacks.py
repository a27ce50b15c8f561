"""Poisoning by one island key, against the merger's own core and log (benchmarks/attacks.py): every
attack of issue 36's table is stopped or bounded to less than 3x what as many honest folds move the
model, honest deltas are all folded, and the defence's references survive a restart and a takeover.
Plus the guard and its caps against hand-derived values."""

from __future__ import annotations

import numpy as np
import pytest

from dloco import protocol
from dloco.benchmarks import attacks
from dloco.merger.config import MergeConfig, MergerConfig
from dloco.merger.core import MergerCore
from dloco.merger.fold import Contribution, guard
from dloco.merger.outliers import COLD_LIMIT
from dloco.merger.trained_tokens import CLAIM_RATIO

POISONING = ["ramp-1.2", "ramp-1.4", "ramp-2", "burst", "single-19x", "tokens"]


@pytest.mark.parametrize("islands", [2, 4])
@pytest.mark.parametrize("key", POISONING)
def test_a_poisoning_attack_moves_the_model_less_than_3x_honest_folds(key, islands):
    outcome = attacks.run_attack(key, honest=islands - 1)
    assert outcome.attacker_folds >= 1 and outcome.honest_refused == 0
    assert outcome.ratio < 3.0, outcome


def test_tokens_claimed_as_2_to_the_40_count_a_few_honest_deltas_each():
    """The merger's trained-token count (a budgeted run's schedule) holds one key's claims to
    CLAIM_RATIO times the other islands' tokens per delta, with the room its earlier honest deltas
    left: ten claims of 2^40 count as 58 honest deltas, not 11 million each."""
    outcome = attacks.run_attack("tokens", honest=1)
    assert outcome.attacker_deltas == 10
    assert 1.0 <= outcome.tokens_counted / outcome.attacker_deltas <= CLAIM_RATIO + 2


@pytest.mark.parametrize("key", ["restart-1e6", "takeover-1e6"])
def test_a_1e6x_delta_after_a_restart_or_takeover_is_rejected(key):
    """The references come back from the checkpoint (restart) or from replaying the log (a standby):
    no cold-start window opens."""
    outcome = attacks.run_attack(key, honest=1)
    assert (outcome.rejected, outcome.attacker_folds, outcome.honest_refused) == (1, 0, 0)
    assert outcome.ratio < 0.01


def test_a_1e6x_delta_on_a_fresh_merger_moves_a_fragment_by_at_most_half_its_norm():
    """Before any other island has a reference, the cold limit: one part moves a fragment by at most
    COLD_LIMIT of its norm (the outer momentum carries it on: the norm after stays under twice it).
    """
    outcome = attacks.run_attack("fresh-1e6", honest=1)
    assert outcome.clipped == 1 and outcome.norm_after < 2.0 * outcome.norm_before


def _member(island, values, tokens=100, steps=10):
    return Contribution(island, 1, 1, 0, tokens, steps, {"w": np.asarray(values, np.float32)})


def test_the_guard_scales_a_part_down_to_its_cap():
    """Weights 0.5 and 0.5, deltas of norm 5 and 2: movements 2.5 and 1.0; caps 1.0 for a (it is
    scaled by 0.4 to norm 2) and none for b."""
    members, movements, clipped = guard(
        [_member("a", [3.0, 4.0]), _member("b", [0.0, 2.0])], [0.5, 0.5], [5.0, 2.0], {"a": 1.0}
    )
    assert movements == [1.0, 1.0] and clipped == ["a"]
    assert np.allclose(members[0].tensors["w"], [1.2, 1.6]) and members[1].tensors[
        "w"
    ].tolist() == [0.0, 2.0]
    same, movements, clipped = guard([_member("a", [3.0, 4.0])], [0.5], [5.0], {"a": 2.5})
    assert movements == [2.5] and clipped == [] and same[0].tensors["w"].tolist() == [3.0, 4.0]


def test_a_parts_norm_is_the_sum_of_its_deltas_norms_as_admitted():
    """Two float deltas of norms 5 and 2: 7 (their sum's norm is at most that); an int4 delta: its
    scales' bound, as admission measured it."""
    from dloco.merger.admission import delta_norm
    from dloco.merger.fold import part_norm

    assert part_norm([_member("a", [3.0, 4.0]), _member("a", [0.0, 2.0])]) == 7.0
    codec = protocol.Codec("int4")
    values = np.linspace(-1, 1, 300, dtype=np.float32)
    coded = Contribution(
        "a",
        1,
        1,
        0,
        1,
        1,
        {
            "w": protocol.CodedTensor(
                codec, (300,), codec.encode(values).reshape(-1, codec.record_nbytes)
            )
        },
    )
    assert part_norm([coded]) == delta_norm(coded.tensors) >= float(np.linalg.norm(values))


def test_the_caps_follow_the_other_islands_movements_and_start_cold():
    # norm 10
    params = {"w": np.array([6.0, 8.0], np.float32)}
    core = MergerCore(
        MergerConfig(MergeConfig(clip_factor=2.0)),
        protocol.model_fingerprint(params),
        [["w"]],
        params,
    )
    members = [_member("a", [0.0, 0.0]), _member("b", [0.0, 0.0])]
    assert core._caps(0, members) == {"a": COLD_LIMIT * 10.0, "b": COLD_LIMIT * 10.0}
    for value in (1.0, 3.0, 2.0, 2.0):
        # median 2.0
        core.moves[0].record("a", value)
    for value in (5.0, 5.0, 5.0, 7.0):
        # median 5.0
        core.moves[0].record("c", value)
    # a: 2 x c's 5; b: 2 x the larger of a's 2 and c's 5
    assert core._caps(0, members) == {"a": 10.0, "b": 10.0}
    # 2 x a's 2: c's own history does not count
    assert core._caps(0, [_member("c", [0.0, 0.0])]) == {"c": 4.0}
    off = MergerCore(
        MergerConfig(MergeConfig(clip_factor=0.0)),
        protocol.model_fingerprint(params),
        [["w"]],
        params,
    )
    assert off._caps(0, members) is None
