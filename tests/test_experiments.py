"""The experiment suites' comparisons (suites/suiteresults.py) on hand-made run results, and the
suites' definitions (suites/catalog.py, suites/transforms.py); the speedup and bytes suites' own
tables are in tests/test_suite_tables.py.  The suites themselves are cluster runs (`dloco
experiment NAME --quick`, minutes each, tests/test_experiments_quick.py), recorded in
EXPERIMENTS.md.
"""

from __future__ import annotations

import dataclasses

import pytest

from dloco.cluster import config
from dloco.suites import catalog, experiments, suiteresults, transforms
from dloco.suites.suiteresults import RunResult


def result(label, evals, last, mode="decoupled"):
    """A run of the default profile in `mode` with these evaluations and last metrics per island."""
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
        "sync-avg",
        {
            "a": [
                {"since_start": 50, "tokens": 100, "eval_loss": 3.5},
                {"since_start": 90, "tokens": 200, "eval_loss": 2.4},
            ]
        },
        {"a": {"tokens": 200, "bytes_sent": 40_000, "bytes_received": 40_000, "compute_util": 0.3}},
        "sync-avg",
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
    # by sync-avg at 90 s
    assert "time to island loss ≤ 2.400" in text and "| 20.0 s |" in text and "| 90.0 s |" in text
    assert "4.5x faster to the target; 160x fewer bytes per token" in text
    # the fewest any run's cluster trained (sync-avg's 200; decoupled's 300 + 100)
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


# Over 60 lines: every suite's runs checked suite by suite, then the --quick variants and the
# suites' time.
def test_every_suite_builds_valid_cluster_files():
    base = config.load()
    for name, (_, runs, *_) in catalog.SUITES.items():
        # ClusterConfig checks each (modes, chaos targets, codecs)
        configs = {label: transform(base) for label, transform in runs}
        assert len(configs) == len(runs) >= 2, name
    lean = dict(catalog.SUITES["speedup"][1])["decoupled-h96-held"](base)
    assert (
        lean.mode,
        lean.sync.interval,
        lean.merger.snapshot_every_round,
        lean.merger.max_staleness,
    ) == ("decoupled", 96, 1.0, 8)
    faults = dict(catalog.SUITES["faults"][1])["sync-diloco"](base)
    assert faults.mode == "sync-diloco" and [str(e) for e in faults.chaos] == [
        "kill:eu-older-hw@105",
        "restart:eu-older-hw@180",
        "kill:merger@225",
        "restart:merger@240",
    ]
    # a run bounded by work: keyed to progress
    bounded = dict(catalog.SUITES["faults"][1])["decoupled"](base.with_steps(200))
    assert [str(e) for e in bounded.chaos] == [
        "kill:eu-older-hw@us-east.step=70",
        "restart:eu-older-hw@us-east.step=+50",
        # one interval of its own (the profile: 6)
        "kill:merger@eu-older-hw.step=+6",
        "restart:merger@+5",
    ]
    quantization = dict(catalog.SUITES["quantization"][1])
    assert sorted(quantization) == sorted(
        f"{c}{s}" for c in ("fp32", "bf16", "int8", "int4", "int2") for s in ("", "-ef")
    )
    assert (
        quantization["int2-ef"](base).sync.error_feedback is True
        and quantization["int2"](base).sync.codec == "int2"
    )
    reproducible = dict(catalog.SUITES["quantization-sync"][1])
    assert sorted(reproducible) == sorted(
        ["fp32", "bf16", "int8", "int4", "int4-ef", "int2", "int2-ef"]
    )
    assert {c.mode for c in (t(base) for t in reproducible.values())} == {"sync-diloco"}
    assert reproducible["int4-ef"](base).sync == dataclasses.replace(
        base.sync, codec="int4", error_feedback=True
    )
    heterogeneous = {label: t(base) for label, t in catalog.SUITES["heterogeneous"][1]}
    # speeds as CPU quotas in every run of the pair
    assert {c.island_cpus for c in heterogeneous.values()} == {transforms.CAPPED_CPUS}
    cores = {label: [c.cpus_of(r) for r in c.regions] for label, c in heterogeneous.items()}
    assert cores["decoupled-mixed"] == cores["sync-diloco-mixed"] == [0.45, 0.45, 0.225, 0.225]
    # 1.8 cores: within this machine's 2, so quotas bind
    assert cores["decoupled-uniform"] == cores["sync-diloco-uniform"] == [0.45] * 4
    adoption = dict(catalog.SUITES["adoption"][1])
    assert (
        adoption["replace-uniform"](base).sync.adoption == "replace"
        and adoption["rebase-mixed"](base).sync.adoption == "rebase"
    )
    assert (
        {r.slowdown for r in adoption["rebase-uniform"](base).regions}
        == {1.0}
        < {r.slowdown for r in adoption["rebase-mixed"](base).regions}
    )
    merging = dict(catalog.SUITES["merging"][1])
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
    downlink = dict(catalog.SUITES["downlink"][1])
    assert (
        downlink["bf16-full"](base).merger.snapshot_diff_codec == "none"
        and downlink["int4-diff"](base).merger.snapshot_diff_codec == "int4"
    )
    assert (
        downlink["int4-diff"](base).merger.snapshot_every_round == 0
        and downlink["int4-diff-held"](base).merger.snapshot_every_round == 1
    )
    # the former default stays what it was, whatever the profile says
    wire = dict(catalog.SUITES["bytes"][1])
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
        r.interval for r in dict(catalog.SUITES["speedup"][1])["decoupled-h96-held"](base).regions
    ] == [0, 0, 48, 48]
    # --quick: each suite's runs exist, bounded by work
    for name, (_, runs) in catalog.SUITES.items():
        kept = [label for label, _ in runs if label in catalog.QUICK_RUNS.get(name, (label,))]
        assert len(kept) == len(catalog.QUICK_RUNS.get(name, kept)) >= 2, name
        # at least an interval: every fragment is sent
        quick = base.with_steps(catalog.QUICK_STEPS[name])
        assert all(
            transform(quick).max_steps == catalog.QUICK_STEPS[name]
            for label, transform in runs
            if label in kept
        ), name
    # <= 30 min each
    assert all(
        len(runs) * catalog.DEFAULT_SECONDS[name] <= 25 * 60
        for name, (_, runs) in catalog.SUITES.items()
    )
