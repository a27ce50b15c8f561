"""A fresh merger's first folds (merger/outliers.py): until a fragment has a fold movement on
record, its fold waits for a second live island (round.cold_quorum, at most the quorum timeout), a
part clipped there sets no reference and holds no share, and logs from before this judge as they
did.  Hand-derived values against the core and the round policy."""

from __future__ import annotations

import pytest

from dloco.benchmarks import attacks
from dloco.merger.config import ConfigError, MergeConfig, MergerConfig, RoundConfig
from dloco.merger.fold import FoldReport
from dloco.merger.outliers import NormHistory, movement_history, note_fold, peer_quorum
from dloco.merger.round_policy import Decision, decide


def test_the_quorum_is_raised_until_a_fragment_has_a_movement_on_record():
    moves = [NormHistory(min_own=1), NormHistory(min_own=1)]
    config = RoundConfig(quorum=1, cold_quorum=2)
    quorum = peer_quorum(moves, config, live=3)
    assert quorum(0, {"a"}) == 2 and quorum(1, {"a"}) == 2
    moves[0].record("b", 0.5)
    assert quorum(0, {"a"}) == 1 and quorum(1, {"a"}) == 2
    # one live island, or cold_quorum 1, or a quorum already as high: nothing to raise
    assert peer_quorum(moves, config, live=1) is None
    assert peer_quorum(moves, RoundConfig(cold_quorum=1), live=3) is None
    assert peer_quorum(moves, RoundConfig(quorum=3, cold_quorum=2), live=3) is None
    # at most the live islands
    assert peer_quorum(moves, RoundConfig(cold_quorum=5), live=3)(1, {"a"}) == 3


def test_the_round_policy_takes_a_quorum_for_this_fragment():
    config = RoundConfig(quorum=1, quorum_timeout_s=30.0, grace_cap_s=0.0)
    pending = [("a", 10.0)]
    assert decide(12.0, pending, {}, config) == Decision(True, None)
    assert decide(12.0, pending, {}, config, quorum=2) == Decision(False, 40.0)
    assert decide(40.0, pending, {}, config, quorum=2) == Decision(True, None)
    assert decide(12.0, [*pending, ("b", 11.0)], {}, config, quorum=2) == Decision(True, None)


def test_a_fresh_cores_first_fold_waits_for_a_second_live_island_then_folds_both(tmp_path):
    cluster = attacks._Cluster(1, tmp_path, seed=0)
    core = cluster.core
    cluster.now = 5.0
    cluster.send("attacker", 1e6 * attacks.HONEST_NORM * cluster.hostile)
    # alone in the run: no one to wait for
    assert core.due(5.0, (), live=1)[0] == [0]
    # another island heard from: wait for it, up to the quorum timeout (30 s)
    assert core.due(5.0, (), live=2) == ([], 35.0)
    assert core.due(35.0, (), live=2)[0] == [0]
    cluster.send("honest-0", cluster.honest_delta("honest-0"))
    assert core.due(5.0, (), live=2)[0] == [0]
    report, _ = core.fold(0)
    assert sorted(set(report.contributors)) == ["attacker", "honest-0"]
    assert report.clipped == ("attacker",)
    moved = dict(report.movements)
    # cut to the honest part, which nothing cut
    assert moved["attacker"] == pytest.approx(moved["honest-0"])
    # the cut part set no reference, and holds no share of the next rounds
    assert list(core.moves[0].norms) == ["honest-0"]
    assert list(core.last_contributions[0]) == ["honest-0"]
    # a movement is on record: the next folds wait for nobody
    cluster.send("honest-0", cluster.honest_delta("honest-0"))
    assert core.due(6.0, (), live=2)[0] == [0]
    core.log.close()


def _report(clipped=()):
    return FoldReport(
        version=3,
        contributors=("a", "b"),
        delta_ids=(1, 1),
        staleness=(0, 0),
        steps=(1, 1),
        weights=(0.5, 0.5),
        delta_norms=(1.0, 1.0),
        merged_norm=1.0,
        movements=(("a", 2.0), ("b", 1.0)),
        clipped=tuple(clipped),
    )


def test_a_part_clipped_without_a_reference_is_not_noted_but_a_judged_one_is():
    moves, recent = NormHistory(min_own=1), {"a": (3, 8.0), "b": (3, 4.0)}
    note_fold(moves, recent, _report(clipped=["a"]), peer_guard=True)
    assert moves.export() == {"b": [1.0]} and recent == {"b": (3, 4.0)}
    # now a has a reference (b's): clipped again, it is judged, noted, and keeps its share
    recent["a"] = (3, 8.0)
    note_fold(moves, recent, _report(clipped=["a"]), peer_guard=True)
    assert moves.export() == {"a": [2.0], "b": [1.0, 1.0]} and recent["a"] == (3, 8.0)
    # logs from before peer_guard: every movement noted
    old, kept = NormHistory(), {"a": (3, 8.0)}
    note_fold(old, kept, _report(clipped=["a"]), peer_guard=False)
    assert old.export() == {"a": [2.0], "b": [1.0]} and kept == {"a": (3, 8.0)}


def test_logs_from_before_the_peer_guard_replay_with_it_off():
    config = MergerConfig().to_dict()
    assert config["merge"]["peer_guard"] is True and config["round"]["cold_quorum"] == 2
    del config["merge"]["peer_guard"]
    assert MergerConfig.from_dict(config).merge.peer_guard is False
    assert movement_history(False).min_own == 4 and movement_history(True).min_own == 1


def test_bad_settings_are_refused_by_name():
    with pytest.raises(ConfigError, match="round.cold_quorum"):
        RoundConfig(cold_quorum=0)
    with pytest.raises(ConfigError, match="merge.peer_guard"):
        MergeConfig(peer_guard="yes")
