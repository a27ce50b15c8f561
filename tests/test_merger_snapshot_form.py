"""The merger's choice between a full snapshot, a diff and a reply, and when a held snapshot is due, against hand-derived cases."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dloco.merger import round_policy
from dloco.merger.snapshot_form import DIFF, FULL, REPLY, snapshot_form


@pytest.mark.parametrize("version, served, on_bus, every, form", [
    (0, None, True, 0, FULL),  # nothing served yet: full, on the bus ...
    (7, None, False, 0, FULL),  # ... and as a reply
    (4, 3, True, 0, DIFF),  # newer than served: the change since it
    (9, 3, True, 0, DIFF),  # several versions newer: still one diff
    (3, 3, True, 0, FULL),  # not newer than served: full
    (2, 5, True, 0, FULL),
    (4, 3, False, 0, REPLY),  # a request: the served value itself
    (3, 3, False, 4, REPLY),
    (8, 3, False, 4, REPLY),  # a request never turns into a full one, whatever full_every says
    (4, 3, True, 4, FULL),  # every 4th: 4 // 4 = 1 > 3 // 4 = 0
    (5, 4, True, 4, DIFF),  # 5 // 4 = 1 = 4 // 4
    (7, 5, True, 4, DIFF),  # 1 = 1
    (9, 7, True, 4, FULL),  # 2 > 1: version 8 was skipped, 9 is the first past it
    (9, 3, True, 4, FULL),  # 2 > 0
    (12, 8, True, 4, FULL),  # 3 > 2
    (11, 8, True, 4, DIFF),  # 2 = 2
    (4, 3, True, 1, FULL),  # every version in full
])
def test_snapshot_form(version, served, on_bus, every, form):
    assert snapshot_form(version, served, on_bus, every) == form


def test_an_island_silent_for_two_of_its_intervals_no_longer_holds_snapshots():
    from dloco.merger.config import MergerConfig
    from dloco.merger.core import MergerCore
    from dloco.protocol import model_fingerprint

    params = {"w": np.zeros(1, np.float32)}
    core = MergerCore(MergerConfig(), model_fingerprint(params), [["w"]], params)
    core.history[0]["fast"] = round_policy.ArrivalStats(last=100.0, interval=4.0)
    core.history[0]["slow"] = round_policy.ArrivalStats(last=95.0, interval=12.0)
    core.history[0]["new"] = round_policy.ArrivalStats(last=99.0, interval=None)
    assert sorted(core.arrival_intervals(), key=str) == sorted([4.0, 12.0, None], key=str)
    assert sorted(core.arrival_intervals(now=105.0), key=str) == sorted([4.0, 12.0, None], key=str)  # slow: 10 s <= 24
    assert sorted(core.arrival_intervals(now=115.0), key=str) == sorted([12.0, None], key=str)  # fast: silent 15 s > 8; slow 20 s <= 24
    assert core.arrival_intervals(now=200.0) == [None]  # both gone: snapshot_due publishes at once
    assert round_policy.snapshot_due(150.0, core.arrival_intervals(now=200.0), 1.0) == -math.inf


def test_a_peers_catch_up_replies_are_budgeted():
    """2 fragments: 12 replies at once, then 2 a second."""
    from dloco.merger.round_policy import CatchUpBudget

    budget = CatchUpBudget(2)
    assert [budget.take(10.0) for _ in range(13)] == [True] * 12 + [False]
    assert budget.take(10.25) is False  # half a reply earned
    assert budget.take(10.5) is True and budget.take(10.5) is False
    assert [budget.take(100.0) for _ in range(13)] == [True] * 12 + [False]  # refilled to the brim, not beyond
