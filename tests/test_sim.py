"""The simulator (sim/) against hand-derived cases, the synchronous baselines' closed forms, the
--target-util inversion, scenario files and `dloco plan` itself."""

from __future__ import annotations

import dataclasses
import json

import pytest

from dloco.cluster.sections import MergerSection
from dloco.protocol import Codec
from dloco.protocol.errors import ConfigError
from dloco.sim import baselines, presets, targetutil
from dloco.sim.chips import CHIPS
from dloco.sim.engine import simulate
from dloco.sim.scenario import Failure, Island, Link, Scenario, step_seconds
from dloco.sim.scenariofile import load
from dloco.sim.wire import wire_bytes

NO_GRACE = MergerSection(grace_cap_s=0.0, share_window=0)


def two_islands(merger=NO_GRACE, **kwargs) -> Scenario:
    """Two islands in lockstep (1 s steps, 100 tokens each), P = 2, H = 10, unlimited links, 100
    steps."""
    return Scenario(
        (Island("a", 1.0, 100), Island("b", 1.0, 100)),
        params=1000,
        fragments=2,
        interval=10,
        duration_s=100.5,
        restart_s=0,
        merger=merger,
        **kwargs,
    )


def test_two_lockstep_islands_on_infinite_bandwidth_fold_each_delta_alone_the_second_stale_by_one():
    """Fragment 0 is due after steps 5, 15, ..., 95 and fragment 1 after 10, ..., 100: 10 deltas of
    each per island.  Both islands' deltas arrive at once; with quorum 1 and no grace the first
    folds alone (the fragment is then at the new version) and the second waits for that fold: 20
    folds per fragment, half the deltas with staleness 0 and half with 1.  Tokens: fragment 0's
    first delta carries 5 steps, every other 10: (500 + 9 x 1000 + 10 x 1000) x 2 islands.  Bytes
    up: 20 deltas of 500 int4 values (2 blocks of 4 + 128 bytes) and a 300-byte header; down: the
    join (2 fp32 fragments of 2,000 bytes + header) and every one of the 40 folds as a full fp32
    fragment."""
    result = simulate(two_islands())
    assert result.folds == [20, 20]
    assert result.staleness == {0: 20, 1: 20}
    assert result.folded_tokens == 2 * (500 + 9 * 1000 + 10 * 1000)
    assert wire_bytes(500, Codec("int4")) == 2 * (4 + 128) + 300
    for run in result.islands:
        assert (run.trained_tokens, run.lost_tokens, run.deltas_sent) == (10_000, 0, 20)
        assert run.bytes_up == 20 * 564
        assert run.bytes_down == 2 * 2300 + 40 * 2300
        # busy throughout (the last half step too), nothing lost
        assert result.utilisation(run) == pytest.approx(1.0)


def test_a_quorum_of_two_folds_both_islands_deltas_together():
    result = simulate(two_islands(MergerSection(quorum=2, grace_cap_s=0.0, share_window=0)))
    assert result.folds == [10, 10]
    assert result.staleness == {0: 40}


def test_the_adaptive_grace_waits_for_an_island_predicted_within_it():
    """With the default 1 s grace, once each island's interval is known the merger waits for the
    other lockstep island and folds both deltas at once: fewer folds than deltas, fewer stale
    ones."""
    result = simulate(two_islands(MergerSection(share_window=0)))
    assert sum(result.folds) < 40 and sum(result.staleness.values()) == 40
    assert result.staleness[0] > 20


def test_a_failed_island_loses_its_unsent_work_and_trains_again_after_its_downtime():
    """One island, P = 1, H = 10, 1 s steps: it sends after steps 10 and 20, dies at 25 s (5 steps
    unsent: 500 tokens lost), is back at 35 s and sends after its new life's steps 10..60 (at 45..95
    s): 8 folds; 25 + 65 steps trained, 8,000 folded, the last 5 steps (500) undecided at the end.
    Steady utilisation: 8,000 folded + 500 undecided over 9,000 trained + 10 s idle x 100 tokens/s,
    that is 0.9 busy x (1 - 500 / 9000) kept."""
    s = Scenario(
        (Island("a", 1.0, 100),),
        params=1000,
        fragments=1,
        interval=10,
        duration_s=100.0,
        restart_s=0,
        merger=NO_GRACE,
        failures=(Failure("a", 25.0, 10.0),),
    )
    result = simulate(s)
    run = result.islands[0]
    assert result.folds == [8]
    assert (run.trained_tokens, run.lost_tokens, run.failures) == (9000, 500, 1)
    assert (run.folded_tokens, run.undecided_tokens) == (8000, 500)
    assert result.utilisation(run) == pytest.approx(0.9 * (1 - 500 / 9000))
    assert result.window_utilisation(run) == pytest.approx(8000 / 10_000)


def test_a_thin_uplink_sums_deltas_in_the_outbox():
    """A delta of 500 int4 values (564 bytes) takes 4.5 s on a 1 kbit/s uplink, while a fragment
    falls due every 5 steps of 0.1 s: the outbox sums a fragment's unsent deltas (Outbox.put), and
    far fewer deltas go out than fell due."""
    slow = Link(up_bps=1000.0)
    s = Scenario(
        (Island("a", 0.1, 100, slow),),
        params=1000,
        fragments=2,
        interval=10,
        duration_s=60.0,
        merger=NO_GRACE,
    )
    run = simulate(s).islands[0]
    assert run.deltas_summed > 0
    # far fewer deltas than fell due
    assert run.bytes_up < 60 / 0.5 * 564


def test_the_simulator_runs_the_mergers_admission_a_stale_delta_is_rejected_and_its_work_lost():
    """b's link adds 30 s of latency each way, a's none: by the time b's delta arrives a has moved
    the fragment on by more than max_staleness = 1 versions, so b's work is lost (rejected
    'stale')."""
    far = Link(rtt_s=60.0)
    s = Scenario(
        (Island("a", 1.0, 100), Island("b", 1.0, 100, far)),
        params=1000,
        fragments=1,
        interval=5,
        duration_s=300.0,
        merger=MergerSection(max_staleness=1, grace_cap_s=0.0, share_window=0),
    )
    result = simulate(s)
    a, b = result.islands
    assert b.rejected["stale"] > 0 and a.rejected == {}
    assert result.utilisation(b) < 0.2 < 0.9 < result.utilisation(a)


def test_sync_dp_is_a_ring_all_reduce_of_bf16_gradients_every_step():
    """4 islands, 1e9 parameters, 1 Gbit/s, no latency: each moves 2 x 3/4 x 2e9 bytes = 3e9 bytes
    (24 s) per step; a 1 s step then leaves utilisation 1 / 25 with no overlap.  With the default
    overlap (90 %), only the backward pass (2/3 of the step) can hide it: 24 - 2/3 s exposed."""
    s = Scenario(
        tuple(Island(f"i{k}", 1.0, 1000, Link(1e9, 1e9)) for k in range(4)),
        params=10**9,
        dp_overlap=0.0,
    )
    assert baselines.sync_dp(dataclasses.replace(s, dp_overlap=0.9)).exchange_s == pytest.approx(
        24 - 2 / 3
    )
    dp = baselines.sync_dp(s)
    assert dp.exchange_s == pytest.approx(24.0)
    assert dp.utilisation["i0"] == pytest.approx(1 / 25)
    assert dp.tokens_s == pytest.approx(4000 / 25)
    assert dp.bytes_up_per_token == pytest.approx(3e9 / 1000)


def test_sync_rounds_are_paced_by_the_slowest_island():
    s = Scenario((Island("fast", 1.0, 100), Island("slow", 2.0, 100)), params=10**6, interval=10)
    diloco = baselines.sync_diloco(s)
    assert diloco.utilisation["fast"] == pytest.approx(diloco.utilisation["slow"] / 2)


def test_target_util_inverts_utilisation_to_a_link_speed():
    """The speed --target-util finds for one island gives at least the target, and 10 % less does
    not (the bisection stops within 5 %); a second, identical island is answered from the first's
    bisection.
    """
    s = Scenario(
        (Island("a", 0.5, 100), Island("b", 0.5, 100)),
        params=200_000,
        fragments=2,
        interval=10,
        duration_s=200.0,
        merger=MergerSection(max_staleness=1, grace_cap_s=0.0, share_window=0),
    )
    target = targetutil.target_util(s, [0.9], scale="each")
    bps = target["gbps"]["0.9"]["a"]["decoupled"] * 1e9
    assert target["gbps"]["0.9"]["b"] is target["gbps"]["0.9"]["a"]

    def util(speed: float) -> float:
        return targetutil.utilisation_at("decoupled", s, speed, "a")

    assert util(bps) >= 0.9 > util(bps / 1.1)


def test_sync_target_util_is_the_closed_form_inverse():
    """4 islands, 1e9 parameters, 1 s steps: sync-DP at utilisation 0.5 may take 1 s per step for
    its all-reduce; with no overlap, 3e9 bytes in 1 s = 24 Gbit/s, whatever the links were."""
    s = Scenario(
        tuple(Island(f"i{k}", 1.0, 1000, Link(1e9, 1e9)) for k in range(4)),
        params=10**9,
        dp_overlap=0.0,
    )
    bps = targetutil.target_util(s, [0.5])["gbps"]["0.5"]["all"]["sync-dp"] * 1e9
    assert bps == pytest.approx(24e9, rel=2e-3)
    assert targetutil.target_util(s.with_links(1e7), [0.5])["gbps"]["0.5"]["all"][
        "sync-dp"
    ] * 1e9 == pytest.approx(bps, rel=2e-3)


def test_step_time_comes_from_flops_and_the_chip_presets():
    """6 N D / (chips x peak x MFU): 12e9 x 2^20 tokens x 6 over 256 v6e chips at 40 %."""
    assert step_seconds(12e9, 2**20, 256, CHIPS["tpu-v6e"].bf16_flops, 0.4) == pytest.approx(
        6 * 12e9 * 2**20 / (256 * 918e12 * 0.4)
    )
    seed = presets.seed()
    assert len(seed.islands) == 4 and seed.params == 12 * 10**9
    # v5p: half v6e's peak
    assert seed.islands[2].step_s == pytest.approx(2 * seed.islands[0].step_s)


def test_a_scenario_file_is_read_and_its_mistakes_named(tmp_path):
    path = tmp_path / "s.toml"
    path.write_text(
        "[model]\nparams = 1e9\n[sync]\nfragments = 4\ninterval = 32\n[sim]\nduration_s ="
        " 600\nmtbf_s = 300\ndown_s = 30\n[merger]\nmax_staleness = 6\n[[islands]]\nname ="
        ' "x"\ncount = 3\nchip = "h100"\nchips = 8\ntokens_per_step = 65536\nup_gbps = 1\nrtt_ms ='
        " 30\n"
    )
    s = load(path)
    assert [i.name for i in s.islands] == ["x-0", "x-1", "x-2"]
    assert s.islands[0].step_s == pytest.approx(6e9 * 65536 / (8 * 989e12 * 0.4))
    assert s.islands[0].link == Link(1e9, None, 0.03)
    assert s.merger.max_staleness == 6 and s.failures
    path.write_text(
        "[model]\nparams = 1e9\n[[islands]]\nname = 'x'\nchip = 'tpu-v9'\ntokens_per_step = 1\n"
    )
    with pytest.raises(ConfigError, match="chip"):
        load(path)
    path.write_text("[model]\nparams = 1e9\n[merger]\nmax_stalenes = 3\n")
    with pytest.raises(ConfigError, match="max_stalenes"):
        load(path)
    with pytest.raises(ConfigError, match="interval"):
        Scenario((Island("a", 1.0, 1),), params=100, fragments=8, interval=4)


def test_dloco_plan_prints_json_and_refuses_a_bad_target(capsys):
    """The command itself (dloco.cli.main, in this process: the simulator's JAX is imported
    already)."""
    from dloco.cli import main

    assert main(["plan", "--hours", "0.05", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert {i["name"] for i in report["islands"]} == {i.name for i in presets.seed().islands}
    assert report["cluster"]["speedup_vs_sync_dp"] > 1 and report["merger"]["folds"] > 0
    assert (
        report["cluster"]["tokens"]["useful"]
        <= report["cluster"]["tokens"]["folded"]
        <= report["cluster"]["tokens"]["trained"]
    )
    assert (
        report["islands"][0]["real_interval"]["median"] == 24
        and report["merger"]["overloaded"] is False
    )
    assert main(["plan", "--target-util", "1.5"]) == 2
    assert "--target-util must be in (0, 1)" in capsys.readouterr().err


def test_plots_are_written(tmp_path):
    """Utilisation against link speed and goodput against failure rate, as PNGs (a small scenario:
    10 s steps, so 12 simulated hours are a few thousand events)."""
    s = Scenario(
        (Island("a", 10.0, 100, Link(1e6, 1e6)), Island("b", 20.0, 100, Link(1e6, 1e6))),
        params=100_000,
        fragments=2,
        interval=10,
        duration_s=3600.0,
    )
    from dloco.sim import plots

    paths = plots.write(s, tmp_path, speeds=3, failure_rates=2)
    assert [p.name for p in paths] == ["utilisation_vs_bandwidth.png", "goodput_vs_failures.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in paths)


def test_forgetting_snapshots_every_island_has_seen_changes_nothing(monkeypatch):
    """The simulator drops published snapshots that every island that is up has looked past (memory
    for long runs); a run pruning every 8 publishes gives what one that never prunes gives."""
    from dloco.sim import delivery

    s = Scenario(
        (
            Island("a", 1.0, 100, Link(1e5, 1e5, 0.05), step_cv=0.2),
            Island("b", 1.7, 100, Link(1e5, 5e4, 0.2), step_cv=0.2),
        ),
        params=20_000,
        fragments=2,
        interval=10,
        duration_s=2000.0,
        failures=(Failure("b", 700.0, 100.0),),
    )
    kept = simulate(s)
    monkeypatch.setattr(delivery, "PRUNE_EVERY", 8)
    pruned = simulate(s)
    assert (pruned.folds, pruned.staleness, pruned.islands) == (
        kept.folds,
        kept.staleness,
        kept.islands,
    )
    assert sum(kept.folds) > 100 and kept.islands[1].failures == 1


def test_the_merger_memory_counts_the_state_in_its_dtypes():
    from dloco.sim.plan import merger_bytes_per_value

    # value 4 + Nesterov's momentum 4 + the served value of diff snapshots 4
    section = MergerSection(snapshot_diff_codec="int4", snapshot_codec="int8")
    assert merger_bytes_per_value(section) == 12
    halves = dataclasses.replace(section, momentum_dtype="bfloat16", served_dtype="bf16")
    assert merger_bytes_per_value(halves) == 4 + 2 + 2
    # Round Nesterov keeps a round's sum beside its momentum; sgd keeps nothing; full snapshots
    # keep no served value
    assert merger_bytes_per_value(dataclasses.replace(halves, outer="round_nesterov")) == 10
    assert merger_bytes_per_value(MergerSection(outer="sgd")) == 4
