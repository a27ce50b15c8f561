"""The merger's choice between a full snapshot, a diff and a reply, and when a held snapshot is due,
against hand-derived cases."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dloco.merger.network.snapshot_form import DIFF, FULL, REPLY, snapshot_form
from dloco.merger.state import round_policy


@pytest.mark.parametrize(
    "version, served, on_bus, every, form",
    [
        # nothing served yet: full, on the bus ...
        (0, None, True, 0, FULL),
        # ... and as a reply
        (7, None, False, 0, FULL),
        # newer than served: the change since it
        (4, 3, True, 0, DIFF),
        # several versions newer: still one diff
        (9, 3, True, 0, DIFF),
        # not newer than served: full
        (3, 3, True, 0, FULL),
        (2, 5, True, 0, FULL),
        # a request: the served value itself
        (4, 3, False, 0, REPLY),
        (3, 3, False, 4, REPLY),
        # a request never turns into a full one, whatever full_every says
        (8, 3, False, 4, REPLY),
        # every 4th: 4 // 4 = 1 > 3 // 4 = 0
        (4, 3, True, 4, FULL),
        # 5 // 4 = 1 = 4 // 4
        (5, 4, True, 4, DIFF),
        # 1 = 1
        (7, 5, True, 4, DIFF),
        # 2 > 1: version 8 was skipped, 9 is the first past it
        (9, 7, True, 4, FULL),
        # 2 > 0
        (9, 3, True, 4, FULL),
        # 3 > 2
        (12, 8, True, 4, FULL),
        # 2 = 2
        (11, 8, True, 4, DIFF),
        # every version in full
        (4, 3, True, 1, FULL),
    ],
)
def test_snapshot_form(version, served, on_bus, every, form):
    assert snapshot_form(version, served, on_bus, every) == form


def test_an_island_silent_for_two_of_its_intervals_no_longer_holds_snapshots():
    from dloco.merger.config import MergerConfig
    from dloco.merger.state.core import MergerCore
    from dloco.protocol import model_fingerprint

    params = {"w": np.zeros(1, np.float32)}
    core = MergerCore(MergerConfig(), model_fingerprint(params), [["w"]], params)
    core.history[0]["fast"] = round_policy.ArrivalStats(last=100.0, interval=4.0)
    core.history[0]["slow"] = round_policy.ArrivalStats(last=95.0, interval=12.0)
    core.history[0]["new"] = round_policy.ArrivalStats(last=99.0, interval=None)
    assert sorted(core.arrival_intervals(), key=str) == sorted([4.0, 12.0, None], key=str)
    # slow: 10 s <= 24
    assert sorted(core.arrival_intervals(now=105.0), key=str) == sorted([4.0, 12.0, None], key=str)
    # fast: silent 15 s > 8; slow 20 s <= 24
    assert sorted(core.arrival_intervals(now=115.0), key=str) == sorted([12.0, None], key=str)
    # both gone: snapshot_due publishes at once
    assert core.arrival_intervals(now=200.0) == [None]
    assert round_policy.snapshot_due(150.0, core.arrival_intervals(now=200.0), 1.0) == -math.inf


def test_a_peers_catch_up_replies_are_budgeted():
    """2 fragments: 12 replies at once, then 2 a second."""
    from dloco.merger.state.round_policy import CatchUpBudget

    budget = CatchUpBudget(2)
    assert [budget.take(10.0) for _ in range(13)] == [True] * 12 + [False]
    # half a reply earned
    assert budget.take(10.25) is False
    assert budget.take(10.5) is True and budget.take(10.5) is False
    # refilled to the brim, not beyond
    assert [budget.take(100.0) for _ in range(13)] == [True] * 12 + [False]
