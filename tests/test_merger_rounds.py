"""When the merger folds: the quorum, its timeout and the grace window for late islands, the arrival
EMA, when a snapshot is due, and MergerCore asking the round policy about nearby islands only."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dloco.merger.config import RoundConfig
from dloco.merger.fold import admission
from dloco.merger.state import round_policy


def test_quorum_one_folds_immediately():
    assert round_policy.decide(
        5.0, [("a", 5.0)], {}, RoundConfig(quorum=1)
    ) == round_policy.Decision(True, None)


def test_quorum_waits_but_never_past_the_timeout():
    config = RoundConfig(quorum=2, quorum_timeout_s=30)
    assert round_policy.decide(1.0, [("a", 0.0)], {}, config) == round_policy.Decision(False, 30.0)
    assert round_policy.decide(30.0, [("a", 0.0)], {}, config).fold


def test_the_quorum_counts_islands_not_deltas():
    config = RoundConfig(quorum=2, quorum_timeout_s=30)
    # a's second delta (it gave up waiting for a fold and sent its next) does not stand in for b
    assert round_policy.decide(5.0, [("a", 0.0), ("a", 4.0)], {}, config) == round_policy.Decision(
        False, 30.0
    )
    # the timeout still holds
    assert round_policy.decide(30.0, [("a", 0.0), ("a", 4.0)], {}, config).fold
    # b arrives: quorum met at b's arrival, and with no grace window the round folds
    assert round_policy.decide(
        6.0, [("a", 0.0), ("a", 4.0), ("b", 6.0)], {}, RoundConfig(quorum=2, grace_cap_s=0.0)
    ).fold
    # the grace cap counts from the moment the K-th island arrived (6.0), not the K-th delta (4.0)
    # c due at 6.5
    history = {"c": round_policy.ArrivalStats(0.0, 6.5)}
    decision = round_policy.decide(
        6.0,
        [("a", 0.0), ("a", 4.0), ("b", 6.0)],
        history,
        RoundConfig(quorum=2, grace_cap_s=1.0, grace_slack_s=0.05),
    )
    assert decision == round_policy.Decision(False, pytest.approx(6.55))


def test_a_late_island_within_the_grace_window_is_waited_for():
    config = RoundConfig(quorum=1, grace_cap_s=1.0, grace_slack_s=0.05)
    # b due at 10.3
    history = {"a": round_policy.ArrivalStats(10.0, 1.0), "b": round_policy.ArrivalStats(9.5, 0.8)}
    decision = round_policy.decide(10.0, [("a", 10.0)], history, config)
    assert decision == round_policy.Decision(False, pytest.approx(10.35))
    # b arrives in time and is included; nobody else is due: fold
    history["b"] = round_policy.observe(history["b"], 10.3, config.ema_alpha)
    assert round_policy.decide(10.3, [("a", 10.0), ("b", 10.3)], history, config).fold
    # had b not come, the round is decided again at the wait's end and the passed prediction no
    # longer holds it
    assert round_policy.decide(
        decision.wait_until,
        [("a", 10.0)],
        {**history, "b": round_policy.ArrivalStats(9.5, 0.8)},
        config,
    ).fold


def test_islands_predicted_after_the_cap_are_not_waited_for():
    history = {"slow": round_policy.ArrivalStats(0.0, 50.0)}
    assert round_policy.decide(10.0, [("a", 10.0)], history, RoundConfig(grace_cap_s=1.0)).fold


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.floats(0, 100), min_size=1, max_size=5),
    st.dictionaries(
        st.sampled_from("abcdefgh"), st.tuples(st.floats(0, 100), st.floats(0.01, 20)), max_size=6
    ),
    st.floats(0, 120),
    st.integers(1, 4),
    st.floats(0, 5),
)
def test_the_grace_window_never_exceeds_its_cap(arrivals, history, now, quorum, cap):
    pending = [(f"p{i}", t) for i, t in enumerate(sorted(arrivals))]
    config = RoundConfig(quorum=quorum, grace_cap_s=cap)
    stats = {
        k: round_policy.ArrivalStats(last, interval) for k, (last, interval) in history.items()
    }
    decision = round_policy.decide(max(now, pending[0][1]), pending, stats, config)
    if decision.wait_until is not None:
        limit = (
            pending[quorum - 1][1] + cap
            if len(pending) >= quorum
            else pending[0][1] + config.quorum_timeout_s
        )
        assert decision.wait_until <= limit + 1e-9


def test_observe_updates_the_ema():
    stats = round_policy.observe(None, 1.0, 0.5)
    # first gap 2
    stats = round_policy.observe(stats, 3.0, 0.5)
    # 0.5*1 + 0.5*2
    stats = round_policy.observe(stats, 4.0, 0.5)
    assert stats == round_policy.ArrivalStats(4.0, 1.5)


def test_snapshot_due_by_hand():
    due = round_policy.snapshot_due
    # a fast island, a slow one, one seen once (no interval yet)
    intervals = [4.0, 8.0, None]
    # once per mean round of the islands ((4 + 8) / 2 s)
    assert due(100.0, intervals, 1.0) == 106.0
    assert due(100.0, intervals, 0.5) == 103.0
    # off: after every fold
    assert due(100.0, intervals, 0.0) == -math.inf
    # nothing published yet
    assert due(None, intervals, 1.0) == -math.inf
    # no interval known yet: no reason to hold
    assert due(100.0, [None, None], 1.0) == -math.inf
    assert due(100.0, [], 1.0) == -math.inf


def test_the_merger_asks_the_round_policy_about_nearby_islands_only_and_decides_as_over_all():
    """MergerCore keeps the islands' predicted arrivals sorted and gives `decide` only those within
    (now - slack, now + grace_cap]; over random arrivals of 40 islands its decisions are those of
    `decide` over every island's history."""
    from dloco.merger.config import MergerConfig
    from dloco.merger.state.core import MergerCore
    from dloco.protocol import model_fingerprint

    rng = random.Random(7)
    params = {"w": np.zeros(1, np.float32)}
    for quorum, cap in ((1, 1.0), (3, 2.5), (2, 0.0)):
        core = MergerCore(
            MergerConfig(round=RoundConfig(quorum=quorum, grace_cap_s=cap)),
            model_fingerprint(params),
            [["w"]],
            params,
        )
        now, delta_id = 0.0, 0
        for _ in range(600):
            now += rng.expovariate(4.0)
            island = f"i{rng.randrange(40)}"
            delta_id += 1
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
                    {"w": np.ones(1, np.float32)},
                ),
                now,
            )
            for probe in (now, now + rng.uniform(0, 3)):
                pending = [(p.contribution.island, p.arrived) for p in core.pending[0]]
                full = round_policy.decide(probe, pending, core.history[0], core.config.round)
                ready, wake = core.due(probe)
                assert (bool(ready), wake) == (full.fold, full.wait_until)
            if rng.random() < 0.3:
                core.start_fold(0)
