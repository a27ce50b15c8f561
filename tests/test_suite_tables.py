"""Two suites' own tables on hand-made run results: speedup (suites/speedup.py: sync-avg
extrapolated from its full-speed run, which trains as many cluster tokens as the decoupled run) and
bytes (suites/wirebytes.py: bytes up and down per token, the merger's model's quality, and its
goals)."""

from __future__ import annotations

import pytest

from dloco.cluster import config
from dloco.suites import catalog, experiments, suiteresults
from tests.test_experiments import result


# Over 60 lines: one worked example in its order: the emulated and full-speed curves by hand, then
# the summary's claim built from them.
def test_sync_avg_is_extrapolated_from_its_full_speed_loss_and_its_time_per_step_on_the_links():
    """sync-avg over the emulated links: steps 1 and 3 at 0 and 20 s (10 s per step).  At full speed
    its mean island loss is 4.0, 3.0, 2.0 at steps 10, 20, 30 (islands a and b: 4.2/3.8, 3.0/3.0,
    2.1/1.9). The decoupled run's final loss is its best island's last evaluation, 2.5 (a's 2.5 at
    40 s; b ends at 2.8), reached at 40 s; sync-avg gets there at step 25 (halfway from 3.0 to 2.0):
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
        "sync-avg",
        {"a": [{**e, "tokens": 10 * e["step"]} for e in emulated["a"]]},
        {"a": {"tokens": 30, "bytes_sent": 3000}},
        "sync-avg",
    )
    fast = result(
        speedup.FULL_SPEED,
        {k: [{**e, "tokens": 10 * e["step"]} for e in v] for k, v in full.items()},
        {"a": {"tokens": 300, "bytes_sent": 30000}, "b": {"tokens": 300, "bytes_sent": 30000}},
        "sync-avg",
    )
    text = suiteresults.summarize(
        "speedup", "why", [decoupled, dp, fast], "dloco experiment speedup", 100.0
    )
    assert (
        "decoupled vs sync-avg to decoupled's final loss 2.500: 40.0 s vs 250.0 s extrapolated:"
        " 6.2x." in text
    )
    assert "at sync-avg's 10.00 s per step over the emulated links" in text


def test_the_full_speed_sync_avg_run_trains_the_decoupled_runs_cluster_tokens():
    base = config.load()
    full = dict(catalog.SUITES["speedup"][1])[experiments.speedup.FULL_SPEED](base)
    assert full.mode == "sync-avg" and all(
        r.uplink_mbps is None and r.rtt_ms == 0 for r in full.regions
    )
    decoupled = result(
        "decoupled", {}, {r.name: {"tokens": 2048 * 100, "step": 100} for r in base.regions}
    )
    bounded = experiments._as_many_tokens(full, [decoupled])
    # 4 islands x 100 steps of 2,048 tokens
    assert bounded.max_steps == 100 and bounded.duration_s == experiments.FULL_SPEED_LIMIT_S


def bytes_run(label, up, down, values, curve, util):
    """A run of island "a" only: its bytes up and down (and down in full values), its compute
    use, and its merger's model's curve of (seconds, cluster tokens, loss)."""
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
    r.global_curve = [{"since_start": t, "cluster_tokens": n, "eval_loss": v} for t, n, v in curve]
    return r


def test_the_bytes_suite_tabulates_up_down_quality_and_its_goals():
    from dloco.suites import wirebytes

    dp = bytes_run("sync-avg", 2_000_000, 2_000_000, 0, [(100, 150, 3.0)], 0.05)
    ref = bytes_run(
        "every-fold-int4", 5_000, 20_000, 1_000, [(50, 500, 2.5), (100, 1000, 2.0)], 0.99
    )
    lean = bytes_run("lean", 1_000, 3_000, 1_500, [(40, 300, 2.4), (80, 700, 2.1)], 0.98)
    assert wirebytes.per_token(lean) == (1.0, 3.0) and wirebytes.down_over_up(lean) == {
        "a": (3.0, 1.5)
    }
    # from the initial model (6.0) at 0 s
    assert wirebytes.global_at_time(lean, 20) == pytest.approx((6.0 + 2.4) / 2)
    # past its last moment
    assert (
        wirebytes.global_at_time(lean, 90) is None and wirebytes.global_at_tokens(lean, 800) is None
    )
    # sync-avg's 150 left out
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
        "- lean: met: 1,000x fewer bytes than sync-avg (goal 800x; 1,600x past the full values"
        in lines
    )
    assert "met: merger's model -8.7 % against every-fold-int4" in lines
    worse = bytes_run("lean", 4_000, 3_000, 0, [(80, 700, 2.415)], 0.9)
    assert (
        "NOT met: 571x fewer bytes" in (text := "\n".join(wirebytes.goals([dp, ref, worse])))
        and "NOT met: merger's model +5.0 %" in text
        and "NOT met: least busy island 0.90" in text
    )
    # repeats ("--from" two folders): each run against its own repeat's references
    ref2, lean2 = (
        bytes_run(
            "every-fold-int4 #2", 5_000, 20_000, 1_000, [(50, 700, 2.1), (100, 1000, 2.0)], 0.99
        ),
        bytes_run("lean #2", 1_000, 3_000, 1_500, [(80, 700, 2.1)], 0.98),
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
