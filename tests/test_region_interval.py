"""A region's own H ([[regions]] interval): what reaches its island's command line, what the
synchronous modes make of it, the checks, the run verdicts per island, and the simulator."""

from __future__ import annotations

import pytest

from dloco.analysis import verdict
from dloco.cluster import config, topology
from dloco.cluster.records import RunCluster
from dloco.protocol.errors import ConfigError
from dloco.sim.engine import simulate
from dloco.sim.scenario import Island, Scenario
from dloco.sim.scenariofile import load
from tests import test_cluster_modes as modes
from tests.test_sim import NO_GRACE

# a fast region and a half-speed one
PROFILE = modes.PROFILE.replace("slowdown = 2.0", "slowdown = 2.0\ninterval = 6")


def _interval_flag(cluster: config.ClusterConfig, island: str) -> str:
    command = topology.commands(cluster, topology.Addresses(("1", "2", "3", "4"), "5"), "/run")[
        island
    ]
    return command[command.index("--interval") + 1]


def test_a_region_trains_at_its_own_interval_in_the_decoupled_mode_only(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text(PROFILE)
    cluster = config.load(path)
    # [sync] interval = 10 for the one without
    assert [cluster.interval_of(r) for r in cluster.regions] == [10, 6]
    assert (_interval_flag(cluster, "fast"), _interval_flag(cluster, "slow")) == ("10", "6")
    # a round needs one H: the mode's, for every island
    for mode, h in (("sync-diloco", "10"), ("sync-dp", "1")):
        assert (
            _interval_flag(cluster.with_mode(mode), "fast"),
            _interval_flag(cluster.with_mode(mode), "slow"),
        ) == (h, h)
    # what a run records (cluster.json, which calibration simulates): the H its islands got
    assert [r.interval for r in RunCluster.of(cluster).regions] == [0, 6]
    assert [r.interval for r in RunCluster.of(cluster.with_mode("sync-diloco")).regions] == [0, 0]


@pytest.mark.parametrize(
    "value, message",
    [
        ("1", r"region slow: interval \(1\) must be >= sync.fragments \(2\)"),
        ("-3", "region slow: interval must be an int >= 0"),
        ("6.5", "region slow: interval must be an int >= 0"),
    ],
)
def test_a_bad_region_interval_is_named(tmp_path, value, message):
    path = tmp_path / "c.toml"
    path.write_text(PROFILE.replace("interval = 6", f"interval = {value}"))
    with pytest.raises(ConfigError, match=message):
        config.load(path)


def test_a_run_bounded_by_steps_covers_the_longest_interval(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text(PROFILE.replace("interval = 6", "interval = 40"))
    with pytest.raises(
        ConfigError, match=r"run.max_steps \(20\) must be at least the longest interval \(H = 40"
    ):
        config.load(path).with_steps(20)
    path.write_text(PROFILE)
    assert config.load(path).with_steps(10).max_steps == 10
    path.write_text(PROFILE.replace("interval = 6", "interval = 40"))
    # the mode's H = 10 for every island
    assert config.load(path).with_mode("sync-diloco").with_steps(20).max_steps == 20


def test_the_verdicts_take_each_islands_interval():
    assert verdict.untrained({"fast": 9, "slow": 7}, folds=1, interval={"fast": 10, "slow": 6}) == [
        "island fast made 9 training steps, fewer than one interval (H = 10)"
    ]
    assert verdict.targets(
        ["fast", "slow"], set(), 0, {"fast": 10, "slow": 6}, {"fast": 100, "slow": 50}
    ) == {"fast": 120, "slow": 62}


def test_the_simulator_sends_each_islands_deltas_at_its_own_interval():
    """Two lockstep islands, P = 2, 100 steps: H = 10 sends each fragment 10 times; H = 5 (due after
    steps 2, 5, 7, 10, ...) 20 times, so the second island sends twice the deltas and bytes."""
    scenario = Scenario(
        (Island("a", 1.0, 100), Island("b", 1.0, 100, interval=5)),
        params=1000,
        fragments=2,
        interval=10,
        duration_s=100.5,
        restart_s=0,
        merger=NO_GRACE,
    )
    a, b = simulate(scenario).islands
    assert (a.deltas_sent, b.deltas_sent) == (20, 40)
    assert b.bytes_up == 2 * a.bytes_up
    with pytest.raises(
        ConfigError, match=r"island b: interval H \(1\) must be >= fragments P \(2\)"
    ):
        Scenario(
            (Island("a", 1.0, 100), Island("b", 1.0, 100, interval=1)),
            params=1000,
            fragments=2,
            interval=10,
        )


def test_a_scenario_file_gives_an_island_its_own_interval_and_the_longest_round_counts(tmp_path):
    path = tmp_path / "s.toml"
    islands = (
        '[[islands]]\nname = "fast"\nstep_s = 1.0\ntokens_per_step = 1\n[[islands]]\nname ='
        ' "slow"\nstep_s = 2.0\ntokens_per_step = 1\n'
    )
    path.write_text(
        "[model]\nparams = 1000\n[sync]\nfragments = 2\ninterval = 10\n"
        + islands
        + "interval = 8\n"
    )
    scenario = load(path)
    assert [i.interval for i in scenario.islands] == [0, 8]
    # the slow island's 8 steps of 2 s, not 10 x 2 s
    assert scenario.longest_round_s() == 16.0
    for bad in ("6.5", "'8'", "-1"):
        path.write_text(
            "[model]\nparams = 1000\n[sync]\nfragments = 2\ninterval = 10\n"
            + islands
            + f"interval = {bad}\n"
        )
        with pytest.raises(ConfigError, match="island slow: interval must be an int >= 0"):
            load(path)
