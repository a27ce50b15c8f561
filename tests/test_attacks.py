"""Poisoning by one island key, against the merger's own core and log (benchmarks/attacks.py): every
attack of issue 36's table is stopped or bounded to less than 3x what as many honest folds move the
model, honest deltas are all folded, and the defence's references survive a restart and a takeover.
Plus the guard and its caps against hand-derived values."""

from __future__ import annotations

import numpy as np
import pytest

from dloco import protocol
from dloco.benchmarks import attacks
from dloco.merger.config import MergeConfig, MergerConfig, RoundConfig
from dloco.merger.fold import admission
from dloco.merger.fold.clipping import guard, part_allowed
from dloco.merger.fold.merge import Contribution
from dloco.merger.fold.outliers import COLD_LIMIT, NormHistory, delta_limits, holds, unjudged
from dloco.merger.state.core import MergerCore
from dloco.merger.state.trained_tokens import CLAIM_RATIO

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


@pytest.mark.parametrize("islands", [2, 4])
@pytest.mark.parametrize("key", ["fresh-1e6", "fresh-burst", "first-1e6", "first-burst"])
def test_1e6x_deltas_on_a_fresh_merger_count_as_twice_an_honest_islands(key, islands):
    """On a fresh merger, an island without a movement reference has each delta counted at most
    cold_factor (2) times the largest delta norm the other islands have on record; a key that sends
    before any honest island ("first-") has its fold held until one has (round.cold_wait_s).  One
    1e6x delta moves the model about as much as one honest-norm delta along its direction (the
    control), ten at most about twice what ten of those do, and the fragment's norm stays within
    5 % (it went 12.8 -> 344,000 with no limit, and to 150-188 with only the fragment's norm as
    one)."""
    outcome = attacks.run_attack(key, honest=islands - 1)
    assert outcome.clipped == outcome.attacker_folds >= 1 and outcome.honest_refused == 0
    assert outcome.vs_control < 2.5, outcome
    assert outcome.norm_after < 1.05 * outcome.norm_before, outcome


def test_a_1e6x_delta_first_of_all_on_a_fresh_merger_moves_it_by_at_most_half_its_norm():
    """A key that sends before any other island has sent a delta to the fragment meets only the cold
    limit: its part of the fold (its pseudo-gradient, before the outer step) is at most COLD_LIMIT
    of the fragment's norm."""
    # norm 10
    params = {"w": np.full(4, 5.0, np.float32)}
    core = MergerCore(MergerConfig(), protocol.model_fingerprint(params), [["w"]], params)
    report = core._apply_fold(0, [_member("a", [1e6, 0.0, 0.0, 0.0])])
    assert report.clipped == ("a",) and np.isclose(dict(report.movements)["a"], COLD_LIMIT * 10.0)


def _member(island, values, tokens=100, steps=10):
    return Contribution(island, 1, 1, 0, tokens, steps, {"w": np.asarray(values, np.float32)})


def test_the_guard_scales_a_part_down_to_its_cap():
    """Weights 0.5 and 0.5, deltas of norm 5 and 2: movements 2.5 and 1.0; caps 1.0 for a (it is
    scaled by 0.4 to norm 2) and none for b."""
    members, movements, clipped, _ = guard(
        [_member("a", [3.0, 4.0]), _member("b", [0.0, 2.0])], [0.5, 0.5], [5.0, 2.0], {"a": 1.0}
    )
    assert movements == [1.0, 1.0] and clipped == ["a"]
    assert np.allclose(members[0].tensors["w"], [1.2, 1.6]) and members[1].tensors[
        "w"
    ].tolist() == [0.0, 2.0]
    same, movements, clipped, _ = guard([_member("a", [3.0, 4.0])], [0.5], [5.0], {"a": 2.5})
    assert movements == [2.5] and clipped == [] and same[0].tensors["w"].tolist() == [3.0, 4.0]


def test_a_cold_islands_deltas_count_at_most_their_limit_each():
    """Limit 2: deltas of norms 5 and 1 may keep 2 + 1 = 3 of their 6; with weight 0.5 the part is
    scaled by 0.5 (it moves 1.5), and a cap of 1.0 scales it to 1/3 of its values.  The history
    records the movement before the limit, after the cap (3.0, then 1.0): what the limit cut does
    not lower the references after it."""
    group = [_member("a", [3.0, 4.0]), _member("a", [0.0, 1.0])]
    assert part_allowed(group, 2.0) == 3.0 and part_allowed(group, None) == 6.0
    member = _member("a", [3.0, 5.0])
    kept, movements, clipped, _ = guard([member], [0.5], [6.0], {}, [3.0])
    assert movements == [3.0] and clipped == ["a"]
    assert np.allclose(kept[0].tensors["w"], [1.5, 2.5])
    kept, movements, clipped, _ = guard([member], [0.5], [6.0], {"a": 1.0}, [3.0])
    assert movements == [1.0] and np.allclose(kept[0].tensors["w"], [1.0, 5.0 / 3])


def test_the_cold_limits_follow_the_other_islands_largest_delta_norm_until_a_movement_reference():
    """a, b, c with largest delta norms 2, 3 (one value is enough) and none: each island's limit is
    2 x the largest of the others'; a zero (a warm-up's first delta) sets none; once another island
    has four movements on record, an island has a movement reference and no limit."""
    norms, moves = NormHistory(), NormHistory()
    for value in (1.0, 0.5, 2.0):
        norms.record("a", value)
    norms.record("b", 3.0)
    norms.record("z", 0.0)
    assert delta_limits(norms, moves, ["a", "b", "c"], 2.0) == {"a": 6.0, "b": 4.0, "c": 6.0}
    assert delta_limits(norms, moves, ["a"], 0.0) is None
    alone = NormHistory()
    alone.record("a", 1.0)
    alone.record("z", 0.0)
    assert delta_limits(alone, moves, ["a"], 2.0) == {}
    for value in (1.0, 1.0, 1.0, 1.0):
        moves.record("b", value)
    assert delta_limits(norms, moves, ["a", "b"], 2.0) == {"b": 4.0}


def _offer(core, island, delta_id, values, now):
    core.offer(
        admission.Candidate(
            island,
            1,
            delta_id,
            0,
            core.version(0),
            10,
            100,
            core.model,
            {"w": np.asarray(values, np.float32)},
        ),
        now,
    )


def test_a_fresh_merger_holds_a_keys_first_fold_for_another_islands_nonzero_delta():
    """b sends a 1e6-norm delta first: with two islands live, its fold waits (until 0 + cold_wait_s
    = 30); a's zero delta (a warm-up's first) neither ends the wait nor waits itself; a's delta of
    norm 1 ends it, and
    the fold that takes all three counts b's delta at 2 x 1 (cold_factor x a's largest).  With one
    island live, or past the wait, nothing is held."""
    params = {"w": np.full(4, 5.0, np.float32)}
    core = MergerCore(MergerConfig(), protocol.model_fingerprint(params), [["w"]], params)
    _offer(core, "b", 1, [1e6, 0.0, 0.0, 0.0], 0.0)
    assert core.due(1.0, live=2) == ([], 30.0)
    assert core.due(1.0, live=1)[0] == [0] and core.due(30.0, live=2)[0] == [0]
    _offer(core, "a", 1, [0.0, 0.0, 0.0, 0.0], 2.0)
    assert core.due(3.0, live=2) == ([], 30.0)
    _offer(core, "a", 2, [0.0, 1.0, 0.0, 0.0], 4.0)
    assert core.due(5.0, live=2)[0] == [0]
    started = core.start_fold(0)
    assert started.limits == {"a": 2e6, "b": 2.0}
    report = core.finish_fold(started)
    assert report.clipped == ("b",)
    # and never again in this fragment: both have a reference now
    _offer(core, "b", 2, [1.0, 0.0, 0.0, 0.0], 6.0)
    assert core.due(6.5, live=2)[0] == [0]


def test_unjudged_means_a_nonzero_delta_with_no_reference_and_no_other_nonzero_delta():
    norms, moves = NormHistory(), NormHistory()
    # nothing sent, or only zeros: nothing to hold
    assert not unjudged(norms, moves, ["a"])
    norms.record("a", 0.0)
    norms.record("b", 0.0)
    assert not unjudged(norms, moves, ["a", "b"])
    norms.record("a", 2.0)
    assert unjudged(norms, moves, ["a"]) and not unjudged(norms, moves, ["b"])
    norms.record("b", 0.5)
    assert not unjudged(norms, moves, ["a", "b"])
    alone = NormHistory()
    alone.record("a", 2.0)
    for value in (1.0, 1.0, 1.0, 1.0):
        moves.record("c", value)
    # a movement reference (c's) is enough
    assert not unjudged(alone, moves, ["a"])
    off = MergerConfig(round=RoundConfig(cold_wait_s=0.0))
    assert holds(MergerConfig(), 2) and not holds(MergerConfig(), 1) and not holds(off, 2)
    assert not holds(MergerConfig(MergeConfig(cold_factor=0.0)), 2)
