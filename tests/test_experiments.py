"""The experiment suites' comparisons (suites/suiteresults.py) on hand-made run results, and the
suites' definitions (suites/experiments.py); the suites themselves are cluster runs (`dloco
experiment NAME --quick`, minutes each, tests/test_experiments_quick.py), recorded in
EXPERIMENTS.md.
"""

from __future__ import annotations

import dataclasses

import pytest

from dloco.cluster import config
from dloco.suites import experiments, suiteresults
from dloco.suites.suiteresults import RunResult


def result(label, evals, last, mode="decoupled"):
    base = config.load()
    return RunResult(label, base.with_mode(mode), 0, 6.0, 2.0, evals, last)


def test_time_to_target_loss_at_equal_tokens_and_bytes_per_token():
    fast = result(
        "decoupled",
        {
            "a": [
                {"since_start": 10, "tokens": 100, "eval_loss": 3.0},
                {"since_start": 20, "tokens": 300, "eval_loss": 2.0},
            ],
            "b": [{"since_start": 12, "tokens": 100, "eval_loss": 2.5}],
        },
        {
            "a": {"tokens": 300, "bytes_sent": 600, "bytes_received": 300, "compute_util": 0.99},
            "b": {"tokens": 100, "bytes_sent": 100},
        },
    )
    slow = result(
        "sync-dp",
        {
            "a": [
                {"since_start": 50, "tokens": 100, "eval_loss": 3.5},
                {"since_start": 90, "tokens": 200, "eval_loss": 2.4},
            ]
        },
        {"a": {"tokens": 200, "bytes_sent": 40_000, "bytes_received": 40_000, "compute_util": 0.3}},
        "sync-dp",
    )
    assert (
        suiteresults.time_to(fast, 2.5) == 12
        and suiteresults.time_to(slow, 2.5) == 90
        and suiteresults.time_to(slow, 1.0) is None
    )
    # a: halfway 3.0 -> 2.0; b: its only point
    assert suiteresults.loss_at_tokens(fast, 200) == pytest.approx((2.5 + 2.5) / 2)
    assert (
        suiteresults.bytes_per_token(fast) == 1000 / 400
        and suiteresults.bytes_per_token(slow) == 400
    )
    text = suiteresults.summarize("speedup", "why", [fast, slow], "dloco experiment speedup", 100.0)
    # target: the worst run's best island evaluation (2.4), reached by decoupled at 20 s (a's 2.0),
    # by sync-dp at 90 s
    assert "time to island loss ≤ 2.400" in text and "| 20.0 s |" in text and "| 90.0 s |" in text
    assert "4.5x faster to the target; 160x fewer bytes per token" in text
    # the fewest any run's cluster trained (sync-dp's 200; decoupled's 300 + 100)
    assert "global loss at 200 cluster tokens" in text


def test_one_clock_for_every_island_and_a_restarted_islands_lives(tmp_path):
    """Time to target counts from the cluster's first step by wall clock: an island that joins late
    or is restarted (its own clock and token count start again) gets no head start; its tokens and
    bytes are summed over its lives."""
    import json

    base = config.load()
    two = dataclasses.replace(base, regions=base.regions[:2])
    metrics = tmp_path / "metrics"
    metrics.mkdir()

    def line(step, time, wall, **extra):  # noqa: E306
        return json.dumps({"step": step, "time": time, "wall": wall, "tokens": 100 * step, **extra})

    a, b = two.regions[0].name, two.regions[1].name
    (metrics / f"{a}.jsonl").write_text(
        "\n".join(
            [
                line(0, 0.0, 100.0, eval_loss=6.0),
                line(1, 4.0, 104.0, bytes_sent=10, compute_util=0.9, eval_loss=5.0),
                line(2, 5.0, 105.0, bytes_sent=20, compute_util=0.9, eval_loss=4.0),
            ]
        )
        + "\n"
    )
    # joins late, killed, restarted at wall 200 from a trained model
    (metrics / f"{b}.jsonl").write_text(
        "\n".join(
            [
                line(0, 0.0, 98.0, eval_loss=6.0),
                line(1, 10.0, 108.0, bytes_sent=5, eval_loss=3.5),
                line(0, 0.0, 200.0, eval_loss=2.5),
                line(1, 2.0, 202.0, bytes_sent=7, compute_util=0.5, eval_loss=2.0),
            ]
        )
        + "\n"
    )
    evals, last = suiteresults.read_islands([a, b], tmp_path)
    r = RunResult("decoupled", two, 0, 6.0, 2.0, evals, last)
    assert (
        suiteresults.time_to(r, 4.0) == 1.0
        and suiteresults.time_to(r, 3.5) == 4.0
        and suiteresults.time_to(r, 2.0) == 98.0
    )
    assert (
        r.last[b]["tokens"] == 200
        and r.last[b]["bytes_sent"] == 12
        and r.last[b]["compute_util"] == 0.5
    )
    # b's first life only
    assert suiteresults.loss_at_tokens(r, 100) == pytest.approx((5.0 + 3.5) / 2)


def test_unknown_suites_are_refused(tmp_path):
    with pytest.raises(experiments.ConfigError, match="unknown experiment 'nope'"):
        experiments.run("nope", tmp_path)
    with pytest.raises(
        experiments.ConfigError,
        match="experiment quantization-sync has no run int3; its runs: fp32, bf16",
    ):
        experiments.run("quantization-sync", tmp_path, only=("fp32", "int3"))
    # refused before anything ran
    assert not list(tmp_path.iterdir())
    with pytest.raises(experiments.ConfigError, match="no run of experiment heterogeneous"):
        # nothing to tabulate there
        experiments.run("heterogeneous", tmp_path / "out", reuse=(tmp_path,))


def test_every_suite_builds_valid_cluster_files():
    base = config.load()
    for name, (_, runs, *_) in experiments.SUITES.items():
        # ClusterConfig checks each (modes, chaos targets, codecs)
        configs = {label: transform(base) for label, transform in runs}
        assert len(configs) == len(runs) >= 2, name
    lean = dict(experiments.SUITES["speedup"][1])["decoupled-h96-held"](base)
    assert (
        lean.mode,
        lean.sync.interval,
        lean.merger.snapshot_every_round,
        lean.merger.max_staleness,
    ) == ("decoupled", 96, 1.0, 8)
    faults = dict(experiments.SUITES["faults"][1])["sync-diloco"](base)
    assert faults.mode == "sync-diloco" and [str(e) for e in faults.chaos] == [
        "kill:eu-older-hw@105",
        "restart:eu-older-hw@180",
        "kill:merger@225",
        "restart:merger@240",
    ]
    # a run bounded by work: keyed to progress
    bounded = dict(experiments.SUITES["faults"][1])["decoupled"](base.with_steps(200))
    assert [str(e) for e in bounded.chaos] == [
        "kill:eu-older-hw@us-east.step=70",
        "restart:eu-older-hw@us-east.step=+50",
        # one interval of its own (the profile: 6)
        "kill:merger@eu-older-hw.step=+6",
        "restart:merger@+5",
    ]
    quantization = dict(experiments.SUITES["quantization"][1])
    assert sorted(quantization) == sorted(
        f"{c}{s}" for c in ("fp32", "bf16", "int8", "int4", "int2") for s in ("", "-ef")
    )
    assert (
        quantization["int2-ef"](base).sync.error_feedback is True
        and quantization["int2"](base).sync.codec == "int2"
    )
    reproducible = dict(experiments.SUITES["quantization-sync"][1])
    assert sorted(reproducible) == sorted(
        ["fp32", "bf16", "int8", "int4", "int4-ef", "int2", "int2-ef"]
    )
    assert {c.mode for c in (t(base) for t in reproducible.values())} == {"sync-diloco"}
    assert reproducible["int4-ef"](base).sync == dataclasses.replace(
        base.sync, codec="int4", error_feedback=True
    )
    heterogeneous = {label: t(base) for label, t in experiments.SUITES["heterogeneous"][1]}
    # speeds as CPU quotas in every run of the pair
    assert {c.island_cpus for c in heterogeneous.values()} == {experiments.CAPPED_CPUS}
    cores = {label: [c.cpus_of(r) for r in c.regions] for label, c in heterogeneous.items()}
    assert cores["decoupled-mixed"] == cores["sync-diloco-mixed"] == [0.45, 0.45, 0.225, 0.225]
    # 1.8 cores: within this machine's 2, so quotas bind
    assert cores["decoupled-uniform"] == cores["sync-diloco-uniform"] == [0.45] * 4
    adoption = dict(experiments.SUITES["adoption"][1])
    assert (
        adoption["replace-uniform"](base).sync.adoption == "replace"
        and adoption["rebase-mixed"](base).sync.adoption == "rebase"
    )
    assert (
        {r.slowdown for r in adoption["rebase-uniform"](base).regions}
        == {1.0}
        < {r.slowdown for r in adoption["rebase-mixed"](base).regions}
    )
    merging = dict(experiments.SUITES["merging"][1])
    assert (
        len(merging["rda-2-islands"](base).regions) == 2
        and merging["delayed-nesterov-lr0.7-4-islands"](base).merger.outer == "delayed_nesterov"
    )
    assert (
        base.merger.share_window == 8
        and merging["delayed-nesterov-lr0.7-4-islands"](base).merger.share_window == 0
    )
    assert base.merger.outer_lr == 0.15 and merging["round-nesterov-lr0.7-4-islands"](
        base
    ).merger == dataclasses.replace(base.merger, outer="round_nesterov", outer_lr=0.7)
    assert merging["nesterov-lr0.7-4-islands"](base).merger == dataclasses.replace(
        base.merger, outer_lr=0.7
    )
    # classic DiLoCo's step, whatever the profile sets for decoupled
    assert base.with_mode("sync-diloco").effective()[1].outer_lr == 0.7
    downlink = dict(experiments.SUITES["downlink"][1])
    assert (
        downlink["bf16-full"](base).merger.snapshot_diff_codec == "none"
        and downlink["int4-diff"](base).merger.snapshot_diff_codec == "int4"
    )
    assert (
        downlink["int4-diff"](base).merger.snapshot_every_round == 0
        and downlink["int4-diff-held"](base).merger.snapshot_every_round == 1
    )
    # the former default stays what it was, whatever the profile says
    wire = dict(experiments.SUITES["bytes"][1])
    former = wire["every-fold-int4"](base)
    assert [former.interval_of(r) for r in former.regions] == [48] * 4 and [
        base.interval_of(r) for r in base.regions
    ] == [12, 12, 6, 6]
    assert (
        former.merger.snapshot_every_round,
        former.merger.max_staleness,
        former.merger.outer_lr,
    ) == (0.0, 4, 0.35)
    shipped = wire["default"](base)
    assert (
        shipped.merger.snapshot_every_round,
        shipped.merger.max_staleness,
        shipped.merger.outer_lr,
    ) == (1.0, 8, 0.15)
    assert wire["lean"](base).sync.codec == "topk2" and wire["lean"](base).merger == shipped.merger
    assert [
        r.interval
        for r in dict(experiments.SUITES["speedup"][1])["decoupled-h96-held"](base).regions
    ] == [0, 0, 48, 48]
    # --quick: each suite's runs exist, bounded by work
    for name, (_, runs) in experiments.SUITES.items():
        kept = [label for label, _ in runs if label in experiments.QUICK_RUNS.get(name, (label,))]
        assert len(kept) == len(experiments.QUICK_RUNS.get(name, kept)) >= 2, name
        # at least an interval: every fragment is sent
        quick = base.with_steps(experiments.QUICK_STEPS[name])
        assert all(
            transform(quick).max_steps == experiments.QUICK_STEPS[name]
            for label, transform in runs
            if label in kept
        ), name
    # <= 30 min each
    assert all(
        len(runs) * experiments.DEFAULT_SECONDS[name] <= 25 * 60
        for name, (_, runs) in experiments.SUITES.items()
    )


def test_sync_dp_is_extrapolated_from_its_loss_per_step_at_full_speed_and_its_time_per_step_over_the_links():
    """sync-dp over the emulated links: steps 1 and 3 at 0 and 20 s (10 s per step).  At full speed
    its mean island loss is 4.0, 3.0, 2.0 at steps 10, 20, 30 (islands a and b: 4.2/3.8, 3.0/3.0,
    2.1/1.9). The decoupled run's final loss is its best island's last evaluation, 2.5 (a's 2.5 at
    40 s; b ends at 2.8), reached at 40 s; sync-dp gets there at step 25 (halfway from 3.0 to 2.0):
    250 s, 6.2x."""
    from dloco.suites import speedup

    emulated = {
        "a": [
            {"step": 1, "since_start": 0.0, "eval_loss": 5.0},
            {"step": 3, "since_start": 20.0, "eval_loss": 4.5},
        ]
    }
    full = {
        "a": [
            {"step": s, "since_start": s / 10, "eval_loss": x}
            for s, x in ((10, 4.2), (20, 3.0), (30, 2.1))
        ],
        "b": [
            {"step": s, "since_start": s / 10, "eval_loss": x}
            for s, x in ((10, 3.8), (20, 3.0), (30, 1.9))
        ],
    }
    assert speedup.seconds_per_step(emulated) == 10.0
    assert speedup.mean_curve(full) == [
        (10, pytest.approx(4.0)),
        (20, 3.0),
        (30, pytest.approx(2.0)),
    ]
    assert speedup.steps_to(speedup.mean_curve(full), 2.5) == pytest.approx(25.0)
    assert (
        speedup.steps_to(speedup.mean_curve(full), 5.0) == 10.0
        and speedup.steps_to(speedup.mean_curve(full), 1.0) is None
    )
    assert speedup.extrapolated_seconds(full, emulated, 2.5) == pytest.approx(250.0)
    decoupled = result(
        "decoupled",
        {
            "a": [
                {"step": 10, "since_start": 15.0, "tokens": 100, "eval_loss": 3.2},
                {"step": 30, "since_start": 40.0, "tokens": 300, "eval_loss": 2.5},
            ],
            "b": [{"step": 20, "since_start": 38.0, "tokens": 200, "eval_loss": 2.8}],
        },
        {"a": {"tokens": 300, "bytes_sent": 30}, "b": {"tokens": 200, "bytes_sent": 20}},
    )
    assert speedup.final_loss(decoupled.evals) == 2.5
    dp = result(
        "sync-dp",
        {"a": [{**e, "tokens": 10 * e["step"]} for e in emulated["a"]]},
        {"a": {"tokens": 30, "bytes_sent": 3000}},
        "sync-dp",
    )
    fast = result(
        speedup.FULL_SPEED,
        {k: [{**e, "tokens": 10 * e["step"]} for e in v] for k, v in full.items()},
        {"a": {"tokens": 300, "bytes_sent": 30000}, "b": {"tokens": 300, "bytes_sent": 30000}},
        "sync-dp",
    )
    text = suiteresults.summarize(
        "speedup", "why", [decoupled, dp, fast], "dloco experiment speedup", 100.0
    )
    assert (
        "decoupled vs sync-dp to decoupled's final loss 2.500: 40.0 s vs 250.0 s extrapolated:"
        " 6.2x." in text
    )
    assert "at sync-dp's 10.00 s per step over the emulated links" in text


def test_the_full_speed_sync_dp_run_trains_the_decoupled_runs_cluster_tokens():
    base = config.load()
    full = dict(experiments.SUITES["speedup"][1])[experiments.speedup.FULL_SPEED](base)
    assert full.mode == "sync-dp" and all(
        r.uplink_mbps is None and r.rtt_ms == 0 for r in full.regions
    )
    decoupled = result(
        "decoupled", {}, {r.name: {"tokens": 2048 * 100, "step": 100} for r in base.regions}
    )
    bounded = experiments._as_many_tokens(full, [decoupled])
    # 4 islands x 100 steps of 2,048 tokens
    assert bounded.max_steps == 100 and bounded.duration_s == experiments.FULL_SPEED_LIMIT_S


def test_the_bytes_suite_tabulates_up_down_quality_and_its_goals():
    from dloco.suites import wirebytes

    def run(label, up, down, values, curve, util):
        r = result(
            label,
            {"a": [{"since_start": 1, "tokens": 1000, "eval_loss": 3.0}]},
            {
                "a": {
                    "tokens": 1000,
                    "bytes_sent": up,
                    "bytes_received": down,
                    "bytes_received_values": values,
                    "compute_util": util,
                }
            },
        )
        r.global_curve = [
            {"since_start": t, "cluster_tokens": n, "eval_loss": v} for t, n, v in curve
        ]
        return r

    dp = run("sync-dp", 2_000_000, 2_000_000, 0, [(100, 150, 3.0)], 0.05)
    ref = run("every-fold-int4", 5_000, 20_000, 1_000, [(50, 500, 2.5), (100, 1000, 2.0)], 0.99)
    lean = run("lean", 1_000, 3_000, 1_500, [(40, 300, 2.4), (80, 700, 2.1)], 0.98)
    assert wirebytes.per_token(lean) == (1.0, 3.0) and wirebytes.down_over_up(lean) == {
        "a": (3.0, 1.5)
    }
    # from the initial model (6.0) at 0 s
    assert wirebytes.global_at_time(lean, 20) == pytest.approx((6.0 + 2.4) / 2)
    # past its last moment
    assert (
        wirebytes.global_at_time(lean, 90) is None and wirebytes.global_at_tokens(lean, 800) is None
    )
    # sync-dp's 150 left out
    assert wirebytes.equal_tokens([dp, ref, lean]) == 700
    lines = "\n".join(wirebytes.lines([dp, ref, lean]))
    # at 700 cluster tokens ref is 2.5 - 0.5 * 200 / 500 = 2.3, lean 2.1: -8.7 %; at 80 s (the
    # earliest last moment) ref is 2.5 - 0.5 * 30 / 50 = 2.2: -4.5 %; past full values 4,000 / (4 -
    # 1.5) = 1,600x
    assert "merger's model at 700 cluster tokens" in lines
    assert (
        "| lean | 1.00 | 3.00 (1.50) | 1,000x (1,600x) | 3.00 (1.50) | 2.100 | 2.100 | -8.7 %, -4.5"
        " % | 0.98 |" in lines
    )
    assert "| every-fold-int4 | 5.00 | 20.00 (1.00) | 160x (167x) | 4.00 (3.80) | 2.300 |" in lines
    assert (
        "- lean: met: 1,000x fewer bytes than sync-dp (goal 800x; 1,600x past the full values"
        in lines
    )
    assert "met: merger's model -8.7 % against every-fold-int4" in lines
    worse = run("lean", 4_000, 3_000, 0, [(80, 700, 2.415)], 0.9)
    assert (
        "NOT met: 571x fewer bytes" in (text := "\n".join(wirebytes.goals([dp, ref, worse])))
        and "NOT met: merger's model +5.0 %" in text
        and "NOT met: least busy island 0.90" in text
    )
    # repeats ("--from" two folders): each run against its own repeat's references
    ref2, lean2 = (
        run("every-fold-int4 #2", 5_000, 20_000, 1_000, [(50, 700, 2.1), (100, 1000, 2.0)], 0.99),
        run("lean #2", 1_000, 3_000, 1_500, [(80, 700, 2.1)], 0.98),
    )
    for r, k in ((dp, " #1"), (ref, " #1"), (lean, " #1")):
        r.label += k
    text = "\n".join(wirebytes.goals([dp, ref, lean, ref2, lean2]))
    assert (
        "- lean #1: met: 1,000x" in text
        and "-8.7 % against" in text
        and "- lean #2: met: 1,000x" in text
        and "+0.0 % against" in text
    )
