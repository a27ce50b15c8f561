"""The chaos schedule (parsing, checking) and the pure analysis of what an event did, against
hand-made timelines."""

from __future__ import annotations

import pytest

from dloco.analysis import chaoseffects
from dloco.cluster import chaos, config, sections
from dloco.cluster.chaos import ChaosEvent
from dloco.protocol.errors import ConfigError


def test_schedules_parse_in_time_order_and_bad_ones_name_the_event():
    assert chaos.parse("restart:a@20, kill:a@5") == (
        ChaosEvent(5.0, "kill", "a"),
        ChaosEvent(20.0, "restart", "a"),
    )
    assert chaos.parse("kill:a@7.5s") == (ChaosEvent(7.5, "kill", "a"),)
    assert chaos.parse("") == ()
    for text, message in (
        ("kill:a", "ACTION:TARGET@WHEN"),
        ("kill@3", "ACTION:TARGET@WHEN"),
        ("kill:a@soon", "ACTION:TARGET@WHEN"),
        ("kill:a@step=x", "ACTION:TARGET@WHEN"),
        ("kill:a@b.folds=x", "ACTION:TARGET@WHEN"),
        ("nuke:a@3", "action must be one of"),
        ("kill:a@-1", ">= 0"),
        ("kill:a@step=0", "at_step must be an int >= 1"),
    ):
        with pytest.raises(ConfigError, match=message):
            chaos.parse(text)
    processes = ["a", "b", "merger", "broker"]
    chaos.check(chaos.parse("kill:a@1,restart:a@2,kill:a@3,kill:merger@4"), processes)
    for text, message in (
        ("kill:zz@1", "unknown process 'zz'"),
        ("restart:a@1", "was not killed"),
        ("kill:a@1,kill:a@2", "already down"),
    ):
        with pytest.raises(ConfigError, match=message):
            chaos.check(chaos.parse(text), processes)


def test_schedules_by_progress_keep_their_order_and_wait_only_for_running_islands():
    schedule = chaos.parse(
        "kill:c@step=40, restart:c@a.step=120, kill:merger@folds=12, restart:merger@30"
    )
    assert schedule == (
        ChaosEvent(None, "kill", "c", at_step=40),
        ChaosEvent(None, "restart", "c", at_step=120, island="a"),
        # as given, not sorted
        ChaosEvent(None, "kill", "merger", at_folds=12),
        ChaosEvent(30.0, "restart", "merger"),
    )
    assert [str(e) for e in schedule] == [
        "kill:c@step=40",
        "restart:c@a.step=120",
        "kill:merger@folds=12",
        "restart:merger@30",
    ]
    assert [e.stepper for e in schedule] == ["c", "a", None, None]
    processes = ["a", "c", "merger", "broker"]
    chaos.check(schedule, processes)
    for text, message in (
        ("kill:c@step=5,restart:c@step=9", "waits for the steps of c, which is down"),
        ("kill:merger@step=5", "'merger' makes no training steps"),
        ("kill:c@broker.step=5", "'broker' makes no training steps"),
    ):
        with pytest.raises(ConfigError, match=message):
            chaos.check(chaos.parse(text), processes)
    with pytest.raises(ConfigError, match="exactly one of"):
        ChaosEvent(3.0, "kill", "a", at_step=4)
    with pytest.raises(ConfigError, match="island names whose steps or folds count"):
        ChaosEvent(2.0, "kill", "a", island="b")
    with pytest.raises(ConfigError, match="'z' sends no deltas"):
        chaos.check(chaos.parse("partition:a@z.folds=+2"), processes)


# Over 60 lines: a by-hand table of every kind of point (a process's steps, folds, seconds;
# absolute, relative, an island's folds), each checked just before it and at it.
def test_an_event_is_due_once_the_run_reaches_its_point():
    P, start = chaos.Progress, chaos.Progress(0.0, {}, 0)
    kill_c, restart_c, kill_merger, restart_merger = chaos.parse(
        "kill:c@step=40,restart:c@a.step=120,kill:merger@folds=12,restart:merger@30"
    )
    # c's own steps, whatever the clock and the others
    assert not chaos.due(kill_c, P(1000.0, {"a": 500, "c": 39}, 99), start)
    assert chaos.due(kill_c, P(0.0, {"a": 0, "c": 40}, 0), start)
    assert not chaos.due(restart_c, P(0.0, {"a": 119, "c": 400}, 0), start) and chaos.due(
        restart_c, P(0.0, {"a": 121}, 0), start
    )
    assert not chaos.due(kill_merger, P(500.0, {"a": 999}, 11), start) and chaos.due(
        kill_merger, P(0.0, {}, 12), start
    )
    assert not chaos.due(restart_merger, P(29.9, {"a": 999}, 99), start) and chaos.due(
        restart_merger, P(30.0, {}, 0), start
    )
    # relative points count from where the run was when the event before fired (`armed`), absolute
    # ones ignore it
    armed = P(100.0, {"a": 300, "c": 40}, 20)
    restart_c, kill_merger, restart_merger = chaos.parse(
        "restart:c@a.step=+60,kill:merger@folds=+5,restart:merger@+4.5"
    )
    assert [str(e) for e in (restart_c, kill_merger, restart_merger)] == [
        "restart:c@a.step=+60",
        "kill:merger@folds=+5",
        "restart:merger@+4.5",
    ]
    assert not chaos.due(restart_c, P(999.0, {"a": 359}, 99), armed) and chaos.due(
        restart_c, P(0.0, {"a": 360}, 0), armed
    )
    assert not chaos.due(kill_merger, P(0.0, {}, 24), armed) and chaos.due(
        kill_merger, P(0.0, {}, 25), armed
    )
    assert not chaos.due(restart_merger, P(104.4, {}, 0), armed) and chaos.due(
        restart_merger, P(104.5, {}, 0), armed
    )
    # absolute: c's 40th step, not 40 more
    assert chaos.due(chaos.parse("kill:c@step=40")[0], P(0.0, {"c": 40}, 0), armed)
    # an island's folded deltas: folds that took one of a's deltas, counted from the event before
    # with a +
    heal_a, heal_again = chaos.parse("heal:a@a.folds=+2,heal:a@c.folds=3")
    assert [str(e) for e in (heal_a, heal_again)] == ["heal:a@a.folds=+2", "heal:a@c.folds=3"]
    armed = P(100.0, {"a": 300}, 20, {"a": 7, "c": 1})
    # others' folds and a's steps do not count
    assert not chaos.due(heal_a, P(0.0, {"a": 999}, 99, {"a": 8, "c": 50}), armed)
    assert chaos.due(heal_a, P(0.0, {}, 0, {"a": 9}), armed)
    assert not chaos.due(heal_again, P(0.0, {}, 0, {"c": 2}), armed) and chaos.due(
        heal_again, P(0.0, {}, 0, {"c": 3}), armed
    )
    for text in (
        "kill:c@inf",
        "kill:c@nan",
        "kill:c@infs",
        "kill:c@+",
        "kill:c@step=+",
        "kill:c@a.folds=+",
        "kill:c@a.b.folds=1",
    ):
        with pytest.raises(ConfigError, match="ACTION:TARGET@WHEN"):
            chaos.parse(text)


def test_cluster_files_carry_a_checked_schedule(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text(
        "[[regions]]\nname = 'a'\n[[chaos]]\nat_s = 9\naction = 'restart'\ntarget = 'a'\n"
        "[[chaos]]\nat_s = 3\naction = 'kill'\ntarget = 'a'\n"
    )
    assert config.load(path).chaos == (
        ChaosEvent(3.0, "kill", "a"),
        ChaosEvent(9.0, "restart", "a"),
    )
    path.write_text(
        "[[regions]]\nname = 'a'\n[[regions]]\nname = 'b'\n[[chaos]]\nat_step = 20\naction ="
        " 'kill'\ntarget = 'a'\n[[chaos]]\nat_step = 50\nisland = 'b'\naction = 'restart'\ntarget ="
        " 'a'\n[[chaos]]\nat_folds = 7\naction = 'kill'\ntarget = 'merger'\n[[chaos]]\nat_s ="
        " 2.5\nrelative = true\naction = 'restart'\ntarget = 'merger'\n[[chaos]]\nat_folds ="
        " 2\nisland = 'b'\nrelative = true\naction = 'kill'\ntarget = 'merger'\n"
    )
    assert [str(e) for e in config.load(path).chaos] == [
        "kill:a@step=20",
        "restart:a@b.step=50",
        "kill:merger@folds=7",
        "restart:merger@+2.5",
        "kill:merger@b.folds=+2",
    ]
    for entry, message in (
        ("at_s = 3\naction = 'kill'\n", "needs action, target and one of at_s, at_step"),
        (
            "at_s = 3\nat_step = 4\naction = 'kill'\ntarget = 'a'\n",
            "needs action, target and one of",
        ),
        (
            "at_s = 3\nisland = 'a'\naction = 'kill'\ntarget = 'merger'\n",
            "needs action, target and one of",
        ),
        ("at_step = 2.5\naction = 'kill'\ntarget = 'a'\n", "at_step must be an int"),
        ("at_s = 'soon'\naction = 'kill'\ntarget = 'a'\n", "at_s must be a number of seconds"),
        (
            "at_s = 3\nrelative = 'yes'\naction = 'kill'\ntarget = 'a'\n",
            "relative must be true or false",
        ),
    ):
        path.write_text("[[regions]]\nname = 'a'\n[[chaos]]\n" + entry)
        with pytest.raises(ConfigError, match=message):
            config.load(path)
    path.write_text("[[regions]]\nname = 'merger'\n")
    with pytest.raises(ConfigError, match="'merger': not a region name"):
        config.load(path)


def test_effects_compare_rates_and_folds_around_each_event():
    # Island b steps every 0.5 s throughout; c every 1 s, but only every 2 s after t=100 (it slowed
    # down).
    steps = {
        "a": [90 + 0.5 * i for i in range(20)] + [125.0],
        "b": [80 + 0.5 * i for i in range(80)],
        "c": [80 + i for i in range(20)] + [100 + 2 * i for i in range(10)],
    }
    joins = {"a": [88.0, 121.0], "b": [79.0], "c": [79.0]}
    folds = [(95.0, ("a",)), (97.0, ("b",)), (104.0, ("b", "c")), (123.0, ("b",)), (126.0, ("a",))]
    executed = [
        {"wall": 100.0, "action": "kill", "target": "a", "at_s": 20.0},
        {"wall": 120.0, "action": "restart", "target": "a", "at_s": 40.0},
    ]
    kill, restart = chaoseffects.effects(executed, steps, joins, folds, window_s=10.0)
    # kill at 100: before = [90, 100), after = [100, 110)
    assert kill["others"]["b"] == {"before": 2.0, "after": 2.0, "ratio": 1.0}
    assert kill["others"]["c"] == {"before": 1.0, "after": 0.5, "ratio": 0.5}
    assert "a" not in kill["others"]
    # the whole absence, [100, 120), against [80, 100): b 40 steps in each, c 10 against 20
    assert kill["absence_s"] == 20.0 and kill["during_absence"] == {"b": 1.0, "c": 0.5}
    assert "during_absence" not in restart
    assert (kill["folds_before"], kill["folds_after"], kill["contributors_after"]) == (
        2,
        1,
        ["b", "c"],
    )
    # restart at 120: before window starts at the kill (100) only if closer than 10 s: [110, 120);
    # after [120, 130)
    assert restart["window_s"] == (10.0, 10.0)
    # b's steps end at 119.5
    assert restart["others"]["b"]["before"] == 2.0 and restart["others"]["b"]["after"] == 0.0
    assert restart["rejoined_s"] == 1.0 and restart["first_fold_s"] == 6.0
    # a merger restart reports the time to the next fold; the after-window stops at the next event
    executed = [
        {"wall": 100.0, "action": "restart", "target": "merger", "at_s": 1.0},
        {"wall": 104.0, "action": "kill", "target": "b", "at_s": 5.0},
    ]
    merger, _ = chaoseffects.effects(executed, steps, joins, folds, window_s=10.0)
    assert (
        merger["first_fold_s"] == 4.0
        and merger["window_s"] == (10.0, 4.0)
        and merger["folds_after"] == 0
    )


def test_a_links_fault_is_measured_until_its_heal_and_the_heal_by_the_islands_next_fold():
    """The steps and folds of test_effects_compare_rates_and_folds_around_each_event: a partitioned
    from 100 to 120 s.  Over the cut b made 40 steps against 40 in [80, 100), c 10 against 20; a's
    work is next folded 6 s after the heal (at 126 s)."""
    steps = {
        "a": [90 + 0.5 * i for i in range(20)] + [125.0],
        "b": [80 + 0.5 * i for i in range(80)],
        "c": [80 + i for i in range(20)] + [100 + 2 * i for i in range(10)],
    }
    folds = [(95.0, ("a",)), (97.0, ("b",)), (104.0, ("b", "c")), (123.0, ("b",)), (126.0, ("a",))]
    executed = [
        {"wall": 100.0, "action": "partition", "target": "a", "at_s": 20.0},
        {"wall": 120.0, "action": "heal", "target": "a", "at_s": 40.0},
    ]
    cut, heal = chaoseffects.effects(executed, steps, {}, folds, window_s=10.0)
    assert cut["absence_s"] == 20.0 and cut["during_absence"] == {"b": 1.0, "c": 0.5}
    assert heal["first_fold_s"] == 6.0 and "during_absence" not in heal


def test_a_kill_of_the_primary_and_its_restart_name_the_same_process_whichever_it_is(tmp_path):
    """With a standby, `kill:merger` kills whichever merger is the primary (its log's last role
    event), and `restart:merger` starts that same process again, not the one that took over (a
    soak found the restart hitting the new primary when the standby process had been the primary).
    """
    import json
    import sys

    from dloco.cluster.localcompose import Service
    from dloco.cluster.processes import Cluster

    (tmp_path / "logs").mkdir()
    # the merger process follows
    (tmp_path / "logs" / "merger.log").write_text(json.dumps({"event": "following"}) + "\n")
    # the standby process leads
    (tmp_path / "logs" / "standby.log").write_text(json.dumps({"event": "taking_over"}) + "\n")
    asleep = Service([sys.executable, "-c", "import time; time.sleep(120)"])
    regions = config.ClusterConfig(regions=(sections.Region(name="a"),))
    cluster = Cluster(
        regions, tmp_path, {"merger": asleep, "standby": asleep}, ["merger", "standby"]
    )
    try:
        for name in ("merger", "standby"):
            cluster.start(name)
        merger, standby = cluster.processes["merger"], cluster.processes["standby"]
        assert cluster.act("kill", "merger") is None
        assert (
            standby.poll() is not None
            and merger.poll() is None
            and cluster.killed_as == {"merger": "standby"}
        )
        cluster.act("restart", "merger")
        # the new primary untouched
        assert cluster.processes["merger"] is merger and merger.poll() is None
        assert (
            cluster.processes["standby"] is not standby
            and cluster.processes["standby"].poll() is None
        )
        assert cluster.killed_as == {} and not cluster.down
    finally:
        for process in cluster.processes.values():
            process.kill()
            process.wait(timeout=30)


def test_a_process_still_starting_when_the_run_stops_is_stopped_not_failed(tmp_path):
    """stop_all's SIGTERM ends a process that has no handler yet (a merger restarted by chaos near
    the end, still importing) by the signal itself: it is recorded as stopped while starting, while
    one whose handler exits 0 is not, and neither is one that had already ended by itself."""
    import sys
    import time

    from dloco.cluster.localcompose import Service
    from dloco.cluster.processes import Cluster

    starting = Service(
        [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(120)"]
    )
    handled = Service(
        [
            sys.executable,
            "-c",
            "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *_: sys.exit(0));"
            " print('up', flush=True); time.sleep(120)",
        ]
    )
    ended = Service(
        [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGTERM)"]
    )
    regions = config.ClusterConfig(regions=(sections.Region(name="a"),))
    services = {"merger": starting, "broker": handled, "a": ended}
    cluster = Cluster(regions, tmp_path, services, list(services))
    (tmp_path / "logs").mkdir()
    try:
        for name in services:
            cluster.start(name)
        cluster.processes["a"].wait(timeout=60)
        # the handled one's handler is in place once it printed
        deadline = time.monotonic() + 60
        while b"up" not in (tmp_path / "logs" / "broker.log").read_bytes():
            assert time.monotonic() < deadline, "the broker stand-in never started"
            time.sleep(0.05)
        codes = cluster.stop_all()
        assert codes == {"a": -15, "merger": -15, "broker": 0}
        assert cluster.stopped_starting == {"merger"}
    finally:
        for process in cluster.processes.values():
            process.kill()
            process.wait(timeout=30)
