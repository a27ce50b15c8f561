"""The like-for-like wall clock (suites/wallclock.py) by hand: a data-parallel step's cost as built
and at best practice, its time to decoupled's final loss, and the ratio against bandwidth."""

from __future__ import annotations

import pytest

from dloco.suites import wallclock
from dloco.suites.wallclock import Exchange

# 1 M parameters, 4 islands, 0.5 s a step, 8 Mbit/s each way, 40 ms round trips
BASE = Exchange(params=1_000_000, islands=4, step_s=0.5, bps=8e6, rtt_s=0.04)
# sync-dp: loss 3.0 at step 100, 2.0 at step 300; decoupled: 3.0 at 100 s, 2.2 (its end) at 200 s
DP = [(100, 3.0), (300, 2.0)]
DECOUPLED = [
    {"since_start": 100.0, "eval_loss": 3.0},
    {"since_start": 200.0, "eval_loss": 2.2},
]


def test_a_data_parallel_step_as_built_and_at_best_practice():
    # the hub: 4 MB up then 4 MB down at 1 MB/s, a round trip: 0.5 + 8 + 0.04
    assert wallclock.dp_step_s(BASE, "hub") == pytest.approx(8.54)
    # the ring: 2 x 3/4 x 2 MB = 3 MB at 1 MB/s and 6 half round trips = 3.12 s, of which 1/3 s
    # hides behind the backward pass
    assert wallclock.dp_step_s(BASE, "ring") == pytest.approx(0.5 + 3.12 - 1 / 3)
    # fast enough links: the ring hides entirely, a step is its compute
    fast = Exchange(1_000_000, 4, 0.5, 8e12, 0.0)
    assert wallclock.dp_step_s(fast, "ring") == 0.5
    with pytest.raises(ValueError):
        wallclock.dp_step_s(BASE, "mesh")


def test_the_ratio_to_decoupled_final_loss_against_bandwidth():
    rows = wallclock.curve_rows(DP, DECOUPLED, BASE, factors=(1, 8))
    # sync-dp reaches 2.2 at step 260 (100 + 0.8 x 200): 260 x 8.54 s against decoupled's 200 s
    assert rows[0]["hub_s"] == pytest.approx(260 * 8.54)
    assert rows[0]["hub_ratio"] == pytest.approx(260 * 8.54 / 200)
    assert rows[0]["decoupled_s"] == 200.0 and rows[0]["mbps"] == 8.0
    # at 64 Mbit/s the hub's step is 0.5 + 1 + 0.04
    assert rows[1]["hub_ratio"] == pytest.approx(260 * 1.54 / 200)
    # the ratio falls below 10x somewhere at or under 64 Mbit/s, for the hub
    assert wallclock.crossing(rows, "hub", 10.0) == 64.0
    assert wallclock.crossing(rows, "hub", 1.0) is None
    # a target the data-parallel curve never reaches: no time, no ratio
    never = wallclock.curve_rows(DP, [{"since_start": 5.0, "eval_loss": 1.0}], BASE, (1,))
    assert never[0]["hub_s"] is None and never[0]["hub_ratio"] is None


def test_the_bandwidth_for_a_compute_utilisation():
    # hub at 50 %: 0.5 s of exchange, 0.04 s of it the round trip: 64 Mbit in 0.46 s
    assert wallclock.bandwidth_for(BASE, 0.5, "hub") == pytest.approx(64e6 / 0.46)
    # ring at 80 %: 0.125 s shown + 1/3 s behind the backward pass, less 3 round trips (0.12 s):
    # 24 Mbit (3 MB) in 0.3383 s
    assert wallclock.bandwidth_for(BASE, 0.8, "ring") == pytest.approx(
        24e6 / (0.125 + 1 / 3 - 0.12)
    )
    # inverse of the step: at that bandwidth the step is compute / utilisation
    bps = wallclock.bandwidth_for(BASE, 0.9, "hub")
    assert wallclock.dp_step_s(Exchange(1_000_000, 4, 0.5, bps, 0.04), "hub") == pytest.approx(
        0.5 / 0.9
    )
    # 99 % leaves 5 ms of exchange, less than the 40 ms round trip: no bandwidth does it
    assert wallclock.bandwidth_for(BASE, 0.99, "hub") == float("inf")
    table = wallclock.utilisation_table(BASE)
    assert table[4].startswith("| hub, fp32 | 139.1 | ") and table[4].endswith("unreachable |")
    with pytest.raises(ValueError):
        wallclock.bandwidth_for(BASE, 0.0, "hub")
