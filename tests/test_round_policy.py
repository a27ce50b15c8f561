"""The round policy's arrival history (merger/state/round_policy.py observe), by hand."""

from __future__ import annotations

from dloco.merger.state.round_policy import observe


def test_an_islands_arrival_history_starts_again_after_an_absence():
    """EMA alpha 0.5: gaps of 10, then 30 (3x: a slow round, folded into the EMA: 20), then 100
    (5x the EMA: an absence, the history starts again), then 12 (the first interval of the new
    start).
    """
    stats = observe(observe(None, 0.0, 0.5), 10.0, 0.5)
    assert stats.interval == 10.0
    stats = observe(stats, 40.0, 0.5)
    assert stats.interval == 20.0
    stats = observe(stats, 140.0, 0.5)
    assert (stats.last, stats.interval) == (140.0, None)
    assert observe(stats, 152.0, 0.5).interval == 12.0
