"""`dloco plan` counts what is useful: folded tokens weighted by the real interval, an overloaded
merger's backlog, one question per --target-util, and baselines at their best practice.  Each case
is derived by hand from the simulator's rules (sim/engine.py, sim/baselines.py)."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest

from dloco.cluster.sections import MergerSection
from dloco.protocol import Codec
from dloco.protocol.errors import ConfigError
from dloco.sim import plan, planreport, targetutil
from dloco.sim.engine import simulate
from dloco.sim.quality import MEASURED, QualityCurve, factor_from_loss, slope_per_doubling
from dloco.sim.scenario import Island, Link, Scenario
from dloco.sim.scenariofile import load
from dloco.sim.wire import wire_bytes

NO_GRACE = MergerSection(grace_cap_s=0.0, share_window=0)
PROFILE = MergerSection(
    max_staleness=8,
    share_window=8,
    outer_lr=0.15,
    snapshot_codec="int8",
    snapshot_diff_codec="int4",
    snapshot_every_round=1.0,
)
# q(10) = 0.8, q(20) = 0.6, q(40) = 0.6 - 0.2 = 0.4 (linear in ln H)
Q = QualityCurve.of([10, 20], [0.8, 0.6], "by hand")
# one fragment of 1,000 int4 values: 4 blocks of 132 bytes, one 300-byte header
DELTA_BYTES = wire_bytes(1000, Codec("int4"))


def one_island(up_bps: float | None = None, **kwargs) -> Scenario:
    """One island, 1 s steps of 100 tokens, P = 1, H = 10, 100 steps; the merger folds at once."""
    return Scenario(
        (Island("a", 1.0, 100, Link(up_bps=up_bps)),),
        params=1000,
        fragments=1,
        interval=10,
        duration_s=100.5,
        restart_s=0,
        merger=NO_GRACE,
        quality=Q,
        **kwargs,
    )


def test_the_quality_curve_is_linear_in_log_h_between_its_points_and_goes_on_past_the_last():
    assert DELTA_BYTES == 4 * 132 + 300
    assert [Q(h) for h in (1, 10, 20)] == [1.0, 0.8, 0.6]
    # the floor
    assert Q(40) == pytest.approx(0.4) and Q(10_000) == 0.05
    assert QualityCurve.flat()(500) == 1.0
    # one doubling of sync-DP's budget: 2.0 at 1 M tokens, 1.6 at 4 M falls 0.2 per doubling
    slope = slope_per_doubling((1_000_000, 2.0), (4_000_000, 1.6))
    assert slope == pytest.approx(0.2)
    assert factor_from_loss(1.5, 1.6, slope) == 1.0
    assert factor_from_loss(1.6 + 0.2, 1.6, slope) == pytest.approx(0.5)
    with pytest.raises(ConfigError, match="slope"):
        slope_per_doubling((4_000_000, 1.6), (1_000_000, 2.0))
    assert MEASURED(1) == 1.0 and MEASURED(384) < MEASURED(48) < MEASURED(12) < 1.0
    with pytest.raises(ConfigError, match="ascend"):
        QualityCurve(((1, 1.0), (48, 0.9), (24, 0.95)))


def test_an_island_on_a_link_too_slow_for_its_deltas_loses_useful_tokens_as_its_interval_grows():
    """A delta takes 20 s on the uplink while one falls due every 10 s.  Sends at 10 s (steps 1-10),
    30 s (11-20), 50 s (21-40, the outbox summed two), 70 s (41-60) and 90 s (61-80, still on the
    wire at the end); 81-100 wait in the outbox.  Folded: 1,000 + 1,000 tokens at q(10) and 2,000 +
    2,000 at q(20): 6,000 folded, 4,000 useful; 4,000 undecided: 2,000 on the wire at q(20), and
    2,000 in the outbox, which leaves when the wire is free at 110 s, having summed 9.5 more steps
    by then: q(29.5). Steady utilisation: (4,000 + 1,200 + 2,000 q(29.5)) over 10,000 x q(10).
    A link half as fast again sums more and keeps less."""
    s = one_island(DELTA_BYTES * 8 / 20)
    result = simulate(s)
    run = result.islands[0]
    assert run.intervals == [10, 10, 20, 20]
    assert (run.trained_tokens, run.folded_tokens, run.undecided_tokens) == (10_000, 6000, 4000)
    assert run.useful_tokens == pytest.approx(4000)
    assert run.undecided_useful == pytest.approx(1200 + 2000 * Q(29.5)) and Q(
        29.5
    ) == pytest.approx(0.6 - 0.2 * math.log2(29.5 / 20))
    assert result.utilisation(run) == pytest.approx((4000 + 1200 + 2000 * Q(29.5)) / (10_000 * 0.8))
    fast = simulate(one_island(None))
    assert fast.islands[0].intervals == [10] * 10 and fast.utilisation(
        fast.islands[0]
    ) == pytest.approx(1.0)
    slower = simulate(one_island(DELTA_BYTES * 8 / 40))
    assert max(slower.islands[0].intervals) >= 30
    assert slower.utilisation(slower.islands[0]) < result.utilisation(run)
    report = plan.report(result, *_baselines(s))
    assert (
        report["islands"][0]["real_interval"]["median"] == 15.0
        and report["cluster"]["tokens"]["useful"] == 4000
    )


def test_an_overloaded_merger_cuts_useful_tokens_and_says_so():
    """Every fold takes a hair over 20 s (its overhead and its bytes), one in flight per fragment; a
    delta arrives every 10 s, so the one arriving as a fold ends waits for the next.  Folds end at
    30 (delta 1), 50 (2, 3), 70 (4, 5), 90 (6, 7); 8 and 9 fold until 110, 10 waits: 7,000 tokens
    folded, 3,000 queued at the end, none undecided, utilisation 0.7.  The worker was busy 100 of
    100.5 s: overloaded, 9.5 s of folding ahead of it at the end.  Two shards of a two-fragment
    model halve each worker's load."""
    s = one_island(None, merger_bytes_s=1e15, fold_overhead_s=20.0)
    result = simulate(s)
    run = result.islands[0]
    assert (run.folded_tokens, result.queued_tokens, run.undecided_tokens) == (7000, 3000, 0)
    assert result.utilisation(run) == pytest.approx(0.7)
    report = plan.report(result, *_baselines(s))
    assert (
        report["merger"]["overloaded"]
        and report["merger"]["queued_tokens"] == 3000
        and report["merger"]["backlog_s"] == pytest.approx(9.5)
    )
    assert "**overloaded**" in planreport.markdown(report)
    two = Scenario(
        (Island("a", 1.0, 100),),
        params=1000,
        fragments=2,
        interval=10,
        duration_s=100.5,
        merger=NO_GRACE,
        merger_bytes_s=1e15,
        fold_overhead_s=2.0,
    )
    assert simulate(dataclasses.replace(two, merger_shards=2)).fold_load == pytest.approx(
        simulate(two).fold_load / 2
    )


def test_target_util_with_every_link_scaled_falls_with_link_speed_in_every_mode():
    """Two identical islands (1 s steps, 1e6 parameters, P = 2, H = 10, the profile's merger): as
    every link gets slower the steady utilisation falls in every mode (the decoupled islands' deltas
    sum into longer intervals, the synchronous ones wait), and a higher target needs a faster link.
    (With every fold sent down, a slow downlink makes deltas stale and utilisation is not monotone:
    the bisection reads the grid from the fast end.)"""
    s = Scenario(
        (Island("a", 1.0, 100), Island("b", 1.0, 100)),
        params=10**6,
        fragments=2,
        interval=10,
        duration_s=400.0,
        merger=PROFILE,
        quality=Q,
    )
    speeds = [1e9, 1e6, 3e5, 1e5]
    for mode in targetutil.MODES:
        utils = [targetutil.utilisation_at(mode, s, bps) for bps in speeds]
        assert all(a >= b - 1e-9 for a, b in itertools.pairwise(utils)), (mode, utils)
        assert utils[0] > 0.9 and utils[-1] < 0.6, (mode, utils)
    answer = targetutil.target_util(s, [0.5, 0.9])
    for mode in targetutil.MODES:
        assert answer["gbps"]["0.5"]["all"][mode] < answer["gbps"]["0.9"]["all"][mode], mode


def test_sync_dp_with_overlap_needs_less_bandwidth_than_without_by_the_overlapped_share():
    """4 islands, 1e9 parameters, 1 s steps, no latency, U = 0.95: the exposed all-reduce may take
    1/19 s. Without overlap that is the whole ring (3e9 bytes: 456 Gbit/s); with a share f
    overlapped (the backward pass, 2/3 s, hides f of it; f x 1/(19 (1 - f)) s fits in it for f <=
    0.9) the ring may take 1 / (19 (1 - f)) s: (1 - f) x 456 Gbit/s."""
    s = Scenario(tuple(Island(f"i{k}", 1.0, 1000) for k in range(4)), params=10**9, dp_overlap=0.0)
    none = targetutil.target_util(s, [0.95])["gbps"]["0.95"]["all"]["sync-dp"]
    assert none == pytest.approx(456, rel=2e-3)
    for share in (0.5, 0.9):
        varied = dataclasses.replace(s, dp_overlap=share)
        overlapped = targetutil.target_util(varied, [0.95])["gbps"]["0.95"]["all"]["sync-dp"]
        assert overlapped == pytest.approx((1 - share) * none, rel=3e-3)


def test_sync_diloco_is_an_all_reduce_among_the_islands_at_the_scenarios_codec_or_bf16():
    """2 islands, 1e6 parameters, 1 Gbit/s, no latency: each moves 2 x 1/2 of the delta each round,
    int4 (the scenario's codec) or bf16; an overlap depth of tau steps hides tau steps of it; its
    tokens count q(H)."""
    s = Scenario(
        (Island("a", 1.0, 100, Link(1e9, 1e9)), Island("b", 1.0, 100, Link(1e9, 1e9))),
        params=10**6,
        interval=10,
        quality=Q,
    )
    int4 = plan.sync_diloco(s)
    assert int4.exchange_s == pytest.approx(wire_bytes(10**6, Codec("int4")) * 8 / 1e9)
    bf16 = plan.sync_diloco(dataclasses.replace(s, diloco_codec="bf16"))
    assert bf16.exchange_s == pytest.approx(wire_bytes(10**6, Codec("bf16")) * 8 / 1e9)
    assert plan.sync_diloco(
        dataclasses.replace(s, diloco_codec="bf16", overlap_steps=1)
    ).exchange_s == pytest.approx(max(0, bf16.exchange_s - 1))
    assert int4.useful_tokens_s == pytest.approx(int4.tokens_s * 0.8)
    assert "int4" in int4.practice and "bf16" in bf16.practice


def test_an_island_holding_the_model_starts_at_once_and_the_mergers_link_delays_what_crosses_it():
    s = Scenario(
        (
            Island("a", 1.0, 100, Link(1e5, 1e5)),
            Island("b", 1.0, 100, Link(1e5, 1e5), holds_model=True),
        ),
        params=1000,
        fragments=1,
        interval=10,
        duration_s=100.0,
        merger=NO_GRACE,
        quality=Q,
    )
    a, b = simulate(s).islands
    full = wire_bytes(1000, Codec(s.snapshots.snapshot_codec))
    assert a.startup_s == pytest.approx(full * 8 / 1e5) and b.startup_s == 0
    behind = simulate(dataclasses.replace(s, merger_link_bps=1e4)).islands[0]
    assert behind.startup_s == pytest.approx(full * 8 / 1e4 + full * 8 / 1e5)


def test_a_scenario_file_sets_the_new_keys_and_names_its_mistakes(tmp_path, capsys):
    path = tmp_path / "s.toml"
    path.write_text(
        "[model]\nparams = 1e6\n[sync]\nfragments = 2\ninterval = 10\n[sim]\nduration_s ="
        " 200\nmerger_shards = 2\nmerger_link_gbps = 1\nfold_overhead_s = 0.01\ndp_overlap ="
        " 0.5\ndiloco_codec = 'bf16'\noverlap_steps = 2\n[quality]\nintervals = [10, 100]\nfactors"
        " = [0.95, 0.9]\n[[islands]]\nname = 'x'\ncount = 2\nstep_s = 1.0\ntokens_per_step ="
        " 100\nholds_model = true\n"
    )
    s = load(path)
    assert (
        s.merger_shards,
        s.merger_link_bps,
        s.fold_overhead_s,
        s.dp_overlap,
        s.diloco_codec,
        s.overlap_steps,
    ) == (2, 1e9, 0.01, 0.5, "bf16", 2)
    assert (
        s.quality.points == ((1, 1.0), (10, 0.95), (100, 0.9))
        and s.islands[1].holds_model
        and s.merger_bytes_s is None
    )
    from dloco.cli import main

    assert (
        main(
            [
                "plan",
                str(path),
                "--target-util",
                "0.5,0.9",
                "--scale",
                "x-1",
                "--window-rounds",
                "5",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "assumed: `dloco bench merger`" in out and "| 0.9 | x-1 |" in out and "useful" in out
    assert main(["plan", str(path), "--target-util", "0.5", "--scale", "nobody"]) == 2
    assert "--scale must be all, each or an island's name" in capsys.readouterr().err
    for bad, match in (
        ("merger_shards = 3", "merger_shards"),
        ("dp_overlap = 1.5", "dp_overlap"),
        ("diloco_codec = 'x'", "diloco_codec"),
    ):
        path.write_text(
            f"[model]\nparams = 1e6\n[sync]\nfragments = 2\ninterval = 10\n[sim]\n{bad}\n"
            "[[islands]]\nname = 'x'\nstep_s = 1.0\ntokens_per_step = 100\n"
        )
        with pytest.raises(ConfigError, match=match):
            load(path)


def _baselines(s: Scenario):
    return plan.sync_dp(s), plan.sync_diloco(s)
