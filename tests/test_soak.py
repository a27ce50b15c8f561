"""The soak (suites/soak.py): its seeded schedule, and the invariant checker's rules
(analysis/soakcheck.py) against hand-made logs; under `-m e2e`, a 4-minute soak of a real
cluster."""

from __future__ import annotations

import collections
import itertools
import os
import shutil
import subprocess
import sys

import pytest

from dloco.analysis import soakcheck
from dloco.analysis.runinfo import read_events
from dloco.cluster import chaos, netns
from dloco.suites import soak


def test_a_schedule_is_the_seeds_a_takeover_first_one_fault_at_a_time_and_healed_before_the_tail():
    islands = ["a", "b", "c"]
    faults = soak.plan(11, 1800, islands, network=True, etcd=True)
    assert faults == soak.plan(11, 1800, islands, network=True, etcd=True) and faults != soak.plan(
        12, 1800, islands, network=True, etcd=True
    )
    assert faults[0].kind == "merger-kill" and faults[0].start_s == soak.WARMUP_S
    assert {f.kind for f in faults[: len(soak.KINDS)]} == set(
        soak.KINDS
        # every kind once before any repeats
    )
    for before, after in itertools.pairwise(faults):
        assert after.start_s >= before.start_s + before.length_s + soak.GAP_S[0]
    assert faults[-1].start_s + faults[-1].length_s <= 1800 - soak.TAIL_S
    for fault in faults:
        low, high = soak.KINDS[fault.kind].length_s
        assert low <= fault.length_s <= high and fault.target in (
            *islands,
            "merger",
            "standby",
            "broker",
        )
    # the schedule string parses back into the same events, and passes the launcher's checks
    events = chaos.parse(soak.schedule(faults))
    assert events == tuple(e for f in faults for e in f.events())
    chaos.check(events, [*islands, "merger", "standby", "broker"])
    # with the pair's own lease, the standby is never cut off from everyone (it would lose acks)
    assert "standby-partition" not in {f.kind for f in soak.plan(11, 1800, islands, network=True)}
    # without namespaces: process faults only
    assert {f.kind for f in soak.plan(11, 1800, islands, network=False)} == {
        "merger-kill",
        "island-kill",
        "broker-kill",
    }
    assert (
        soak.plan(11, soak.WARMUP_S + soak.TAIL_S, islands, network=True) == []
        # no room for a fault
    )


def test_folds_and_versions_by_hand():
    assert soakcheck.folded_once([("a", 1, 1), ("a", 1, 2), ("b", 9, 1)]).ok
    twice = soakcheck.folded_once([("a", 1, 1), ("b", 9, 1), ("a", 1, 1)])
    assert not twice.ok and "('a', 1, 1)" in twice.detail
    # nothing folded: nothing shown
    assert not soakcheck.folded_once([]).ok
    assert soakcheck.versions_increase([(0, 1), (1, 1), (0, 2), (1, 5)]).ok
    back = soakcheck.versions_increase([(0, 1), (0, 3), (1, 1), (0, 3)])
    assert not back.ok and "(0, 3, 3)" in back.detail


def test_acked_deltas_against_the_log_by_hand():
    logged = collections.Counter({("a", 7): 5, ("a", 3): 40, ("b", 8): 6})
    done = {
        "a": {"epoch": 7, "deltas_sent": 7, "acks": {"folded": 5, "rejected": 1, "unknown": 1}},
        "b": {"epoch": 8, "deltas_sent": 7, "acks": {"folded": 5, "unknown": 2}},
    }
    assert soakcheck.acked_in_log(
        done,
        logged,
        # b: 5 acked folded, 6 in the log (one ack never came)
    ).ok
    lost = {
        **done,
        "a": {**done["a"], "acks": {"folded": 6, "unknown": 1}},
        # a counted 6 folded, the log has 5 of its life
    }
    assert not soakcheck.acked_in_log(lost, logged).ok
    unsettled = {
        **done,
        "b": {**done["b"], "deltas_sent": 8},
        # one send neither folded, rejected nor unknown
    }
    assert not soakcheck.acked_in_log(unsettled, logged).ok


def test_announced_folds_set_aside_by_hand():
    # the merger announced (0, 5) and (1, 5), then set aside (0, 6) and (1, 6): nothing acked lost
    assert soakcheck.nothing_acked_discarded(
        {"merger": [({(0, 5), (1, 5)}, {(0, 6), (1, 6)})], "standby": []}
    ).ok
    # it had announced (1, 6) before stepping down
    lost = soakcheck.nothing_acked_discarded({"merger": [({(0, 5), (1, 6)}, {(0, 6), (1, 6)})]})
    assert not lost.ok and "(1, 6)" in lost.detail


def test_one_primary_and_monotone_epochs_by_hand():
    merger = [
        {"event": "genesis"},
        {"event": "fold", "version": 1, "fragment": 0},
        {"event": "fenced", "epoch": 10, "by_epoch": 20},
        {"event": "stepped_down"},
        {"event": "following"},
        {"event": "taking_over", "term": 3, "timestamp": "2026-01-01T00:02:00Z"},
        {"event": "fold", "version": 9, "fragment": 0},
    ]
    standby = [
        {"event": "following"},
        {"event": "taking_over", "term": 2, "timestamp": "2026-01-01T00:01:00Z"},
        {"event": "fold", "version": 2, "fragment": 0},
    ]
    assert soakcheck.one_primary({"merger": merger, "standby": standby}).ok
    folding_standby = [{"event": "following"}, {"event": "fold", "version": 2, "fragment": 0}]
    assert not soakcheck.one_primary({"merger": merger, "standby": folding_standby}).ok
    same_term = [
        {"event": "following"},
        {"event": "taking_over", "term": 3, "timestamp": "2026-01-01T00:03:00Z"},
    ]
    assert (
        "terms not increasing"
        in soakcheck.one_primary({"merger": merger, "standby": same_term}).detail
    )
    fenced_by_older = [{"event": "genesis"}, {"event": "fenced", "epoch": 20, "by_epoch": 10}]
    assert not soakcheck.one_primary({"merger": fenced_by_older}).ok
    assert soakcheck.epochs_monotone(
        {"a": [("merger", 10), ("merger", 20), ("merger", 20)], "b": [("merger", 20)]}
    ).ok
    back = soakcheck.epochs_monotone({"a": [("merger", 10), ("merger", 20), ("merger", 10)]})
    assert not back.ok and "adopted epoch 10 of merger after 20" in back.detail
    assert soakcheck.epochs_monotone(
        {"a": [("merger", 20), ("merger.1", 10)]}
        # each shard has its own epochs
    ).ok


def test_replay_and_improvement_by_hand():
    assert soakcheck.replay_matches(
        {"merger": [(10, "x", "x"), (20, "y", "y")], "standby": [(20, "y", "y")]}
    ).ok
    assert not soakcheck.replay_matches({"merger": [(10, "x", "z")]}).ok
    assert (
        not soakcheck.replay_matches({"merger": []}).ok
        and not soakcheck.replay_matches({"merger": "torn record 4"}).ok
    )
    assert soakcheck.stopped_cleanly(
        {"merger": "stopped", "standby": "stopped", "broker": "broker_stopped", "a": "done"}
    ).ok
    # a shard's pair, and a region's second host
    assert soakcheck.stopped_cleanly(
        {"merger.1": "stopped", "standby.1": "stopped", "a": "done", "a.1": "done"}
    ).ok
    never_back = soakcheck.stopped_cleanly(
        {"merger": "stopped", "standby": "fold", "a": "done"}
        # killed mid-run, never restarted
    )
    assert (
        not never_back.ok
        and "'standby': 'fold'" in never_back.detail
        and not soakcheck.stopped_cleanly({}).ok
    )
    assert (
        soakcheck.improved(5.5, 2.4).ok
        and not soakcheck.improved(5.5, 5.6).ok
        and not soakcheck.improved(5.5, None).ok
    )


def test_rate_ratios_by_hand():
    # a fault of c from 10 to 20 s (a kill: restarted at 20, rejoined at 25),
    # a heal-ended fault of b from 40 to 50
    executed = [
        {"wall": 10.0, "action": "kill", "target": "c"},
        {"wall": 20.0, "action": "restart", "target": "c"},
        {"wall": 40.0, "action": "partition", "target": "b"},
        {"wall": 50.0, "action": "heal", "target": "b"},
    ]
    faults = soakcheck.fault_intervals(executed, {"c": [0.0, 25.0]}, end=100.0)
    assert faults == [("c", 10.0, 25.0), ("b", 40.0, 50.0)]
    # over 0-100 s: 75 s clean, 25 s faulted.
    # a steps once a second in clean time, twice in faulted time
    clean = [t + 0.5 for t in range(100) if not (10 <= t < 25 or 40 <= t < 50)]
    faulted = [t + q for t in range(100) if 10 <= t < 25 or 40 <= t < 50 for q in (0.25, 0.75)]
    # b: its own fault (40-50) excluded: it steps once a second outside it, not at all inside
    b = [t + 0.5 for t in range(100) if not 40 <= t < 50]
    ratios = soakcheck.rate_ratios({"a": sorted(clean + faulted), "b": b}, faults, (0.0, 100.0))
    assert ratios["a"] == pytest.approx(2.0) and ratios["b"] == pytest.approx(
        1.0
        # b's faulted time: c's 15 s only
    )
    assert soakcheck.rate_ratios({"a": clean}, [], (0.0, 100.0)) == {
        "a": None
        # nothing faulted: no ratio
    }
    check = soakcheck.rates_kept({"a": 0.95, "b": 0.85, "c": None})
    assert (
        not check.ok
        and check.timing
        and "b 0.85x" in check.detail
        and soakcheck.rates_kept({"a": 0.95}).ok
    )


@pytest.mark.e2e
@pytest.mark.timeout(900)
def test_a_four_minute_soak_keeps_every_invariant(tmp_path):
    """Random faults of a seeded schedule (a takeover first) over a real cluster with a standby, in
    namespaces where the machine allows (CI: DLOCO_REQUIRE_NETNS); every correctness check holds.
    The step-rate check measures the shared machine: printed, not asserted here."""
    if os.environ.get("DLOCO_REQUIRE_NETNS") and (reason := netns.unavailable()) is not None:
        pytest.fail(f"network namespaces are required here (DLOCO_REQUIRE_NETNS) but: {reason}")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "dloco",
            "experiment",
            "soak",
            "--minutes",
            "4",
            "--seed",
            "7",
            "--out",
            str(tmp_path),
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=840,
    )
    report = (tmp_path / "soak.md").read_text()
    print(report)
    assert done.returncode == 0, (report, done.stderr[-3000:])
    run = tmp_path / "soak"
    network = netns.unavailable() is None
    islands = [region.name for region in soak.soak_config(None, 240, network).regions]
    planned = soak.schedule(soak.plan(7, 240, islands, network, shutil.which("etcd") is not None))
    assert [e["when"] for e in read_events(run / "chaos.jsonl")] == planned.split(
        ","
        # every fault and recovery happened
    )
    took = [
        e
        for name in ("merger", "standby")
        for e in read_events(run / "logs" / f"{name}.log")
        if e.get("event") == "taking_over"
    ]
    # the first fault, the primary's kill, was a takeover
    assert took
    failed = [line for line in report.splitlines() if "| **no** |" in line]
    assert all("(timing)" in row for row in failed), failed
