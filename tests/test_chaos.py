"""The chaos schedule (parsing, checking) and the pure analysis of what an event did, against hand-made timelines."""

from __future__ import annotations

import pytest

from cluster import chaos, config
from cluster.chaos import ChaosEvent
from protocol.errors import ConfigError


def test_schedules_parse_in_time_order_and_bad_ones_name_the_event():
    assert chaos.parse("restart:a@20, kill:a@5") == (ChaosEvent(5.0, "kill", "a"), ChaosEvent(20.0, "restart", "a"))
    assert chaos.parse("") == ()
    for text, message in (("kill:a", "ACTION:TARGET@SECONDS"), ("kill@3", "ACTION:TARGET@SECONDS"), ("kill:a@soon", "ACTION:TARGET@SECONDS"),
                          ("nuke:a@3", "action must be one of"), ("kill:a@-1", ">= 0")):
        with pytest.raises(ConfigError, match=message):
            chaos.parse(text)
    processes = ["a", "b", "merger", "broker"]
    chaos.check(chaos.parse("kill:a@1,restart:a@2,kill:a@3,kill:merger@4"), processes)
    for text, message in (("kill:zz@1", "unknown process 'zz'"), ("restart:a@1", "was not killed"), ("kill:a@1,kill:a@2", "already down")):
        with pytest.raises(ConfigError, match=message):
            chaos.check(chaos.parse(text), processes)


def test_cluster_files_carry_a_checked_schedule(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[[regions]]\nname = 'a'\n[[chaos]]\nat_s = 9\naction = 'restart'\ntarget = 'a'\n"
                    "[[chaos]]\nat_s = 3\naction = 'kill'\ntarget = 'a'\n")
    assert config.load(path).chaos == (ChaosEvent(3.0, "kill", "a"), ChaosEvent(9.0, "restart", "a"))
    path.write_text("[[regions]]\nname = 'a'\n[[chaos]]\nat_s = 3\naction = 'kill'\n")
    with pytest.raises(ConfigError, match="needs exactly at_s, action and target"):
        config.load(path)
    path.write_text("[[regions]]\nname = 'merger'\n")
    with pytest.raises(ConfigError, match="not region names"):
        config.load(path)


def test_effects_compare_rates_and_folds_around_each_event():
    # Island b steps every 0.5 s throughout; c every 1 s, but only every 2 s after t=100 (it slowed down).
    steps = {"a": [90 + 0.5 * i for i in range(20)] + [125.0], "b": [80 + 0.5 * i for i in range(80)],
             "c": [80 + i for i in range(20)] + [100 + 2 * i for i in range(10)]}
    joins = {"a": [88.0, 121.0], "b": [79.0], "c": [79.0]}
    folds = [(95.0, ("a",)), (97.0, ("b",)), (104.0, ("b", "c")), (123.0, ("b",)), (126.0, ("a",))]
    executed = [{"wall": 100.0, "action": "kill", "target": "a", "at_s": 20.0},
                {"wall": 120.0, "action": "restart", "target": "a", "at_s": 40.0}]
    kill, restart = chaos.effects(executed, steps, joins, folds, window_s=10.0)
    # kill at 100: before = [90, 100), after = [100, 110)
    assert kill["others"]["b"] == {"before": 2.0, "after": 2.0, "ratio": 1.0}
    assert kill["others"]["c"] == {"before": 1.0, "after": 0.5, "ratio": 0.5}
    assert "a" not in kill["others"]
    # the whole absence, [100, 120), against [80, 100): b 40 steps in each, c 10 against 20
    assert kill["absence_s"] == 20.0 and kill["during_absence"] == {"b": 1.0, "c": 0.5}
    assert "during_absence" not in restart
    assert (kill["folds_before"], kill["folds_after"], kill["contributors_after"]) == (2, 1, ["b", "c"])
    # restart at 120: before window starts at the kill (100) only if closer than 10 s: [110, 120); after [120, 130)
    assert restart["window_s"] == (10.0, 10.0)
    assert restart["others"]["b"]["before"] == 2.0 and restart["others"]["b"]["after"] == 0.0  # b's steps end at 119.5
    assert restart["rejoined_s"] == 1.0 and restart["first_fold_s"] == 6.0
    # a merger restart reports the time to the next fold; the after-window stops at the next event
    executed = [{"wall": 100.0, "action": "restart", "target": "merger", "at_s": 1.0}, {"wall": 104.0, "action": "kill", "target": "b", "at_s": 5.0}]
    merger, _ = chaos.effects(executed, steps, joins, folds, window_s=10.0)
    assert merger["first_fold_s"] == 4.0 and merger["window_s"] == (10.0, 4.0) and merger["folds_after"] == 0
