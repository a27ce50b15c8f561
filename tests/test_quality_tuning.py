"""The tuning grids of the quality suite (`dloco experiment quality --tune`) and the planner's q(H)
that decoupled's grid measures (suites/qualityplan.py, suites/qualityreport.py, by hand)."""

from __future__ import annotations

import dataclasses

import pytest

from dloco.cluster import config as cluster_config
from dloco.protocol.errors import ConfigError
from dloco.suites import qualityplan, qualityplots, qualityreport
from dloco.suites.suiteresults import RunResult


def test_the_tuning_grids_name_each_setting():
    base = cluster_config.load()
    dp = dict(qualityplan.tuning_plan(base, 2_000_000, False, "sync-dp"))
    assert list(dp) == [
        "sync-dp@2M-lr0.0015",
        "sync-dp@2M-lr0.003",
        "sync-dp@2M-lr0.006",
        "sync-dp@2M-lr0.012",
    ]
    assert [c.model.lr for c in dp.values()] == [0.0015, 0.003, 0.006, 0.012]
    diloco = dict(qualityplan.tuning_plan(base, 2_000_000, False, "sync-diloco"))
    assert len(diloco) == 16 and "sync-diloco@2M-h48-lr0.35-m0.9" in diloco
    chosen = diloco["sync-diloco@2M-h48-lr0.35-m0.9"]
    sync, merger = chosen.effective()
    assert (sync.interval, sync.fragments, merger.outer_lr, merger.outer_momentum) == (
        48,
        1,
        0.35,
        0.9,
    )
    with pytest.raises(ConfigError, match="--tune"):
        qualityplan.tuning_plan(base, 2_000_000, False, "sync-avg")


def test_decoupled_grid_scales_each_regions_interval_with_h():
    # the profile: H = 12, half-speed regions at 6, four fragments, outer lr 0.15
    base = cluster_config.load()
    grid = dict(qualityplan.tuning_plan(base, 2_000_000, False, "decoupled"))
    assert list(grid) == [
        "decoupled@2M-h6-lr0.15",
        "decoupled@2M-h12-lr0.15",
        "decoupled@2M-h24-lr0.15",
        "decoupled@2M-h48-lr0.15",
        "decoupled@2M-h96-lr0.15",
        "decoupled@2M-h192-lr0.15",
        "decoupled@2M-h384-lr0.15",
        "decoupled@2M-h12-lr0.07",
        "decoupled@2M-h12-lr0.35",
        "decoupled@2M-h12-lr0.7",
        "decoupled@2M-h384-lr0.35",
        "decoupled@2M-h384-lr0.7",
        "decoupled@2M-h12-lr0.35-m0",
        "decoupled@2M-h12-lr0.7-m0",
        "decoupled@2M-h12-lr1-m0",
        "decoupled@2M-h12-lr1.4-m0",
        "decoupled@2M-h12-lr0.15-p1",
        "decoupled@2M-h12-lr0.15-p2",
        "decoupled@2M-h12-lr0.15-p6",
    ]
    intervals = {
        name: (c.effective()[0].interval, [r.interval for r in c.regions])
        for name, c in grid.items()
    }
    # a region without its own H (0) follows the cluster's; 6 / 2 = 3 is raised to one step per
    # fragment
    assert intervals["decoupled@2M-h384-lr0.15"] == (384, [0, 0, 192, 192])
    assert intervals["decoupled@2M-h6-lr0.15"] == (6, [0, 0, 4, 4])
    chosen = grid["decoupled@2M-h12-lr0.7"]
    assert chosen.effective()[1].outer_lr == 0.7 and chosen.mode == "decoupled"
    far = grid["decoupled@2M-h384-lr0.35"].effective()
    assert (far[0].interval, far[1].outer_lr) == (384, 0.35)
    assert (chosen.tokens, chosen.seed) == (2_000_000, 0)
    # the momentum lever: the profile's H, no momentum; every other run keeps the profile's 0.9
    plain = grid["decoupled@2M-h12-lr1-m0"].effective()
    assert (plain[0].interval, plain[1].outer_lr, plain[1].outer_momentum) == (12, 1.0, 0.0)
    assert {c.effective()[1].outer_momentum for n, c in grid.items() if "-m" not in n} == {0.9}
    # the fragments lever: the profile's H and outer step, the model in 1, 2 or 6 parts;
    # every other run keeps the profile's four fragments, and the regions' H is the profile's
    whole = grid["decoupled@2M-h12-lr0.15-p1"]
    sync, merger = whole.effective()
    assert (sync.interval, sync.fragments, merger.outer_lr, merger.outer_momentum) == (
        12,
        1,
        0.15,
        0.9,
    )
    assert [r.interval for r in whole.regions] == [0, 0, 6, 6]
    assert grid["decoupled@2M-h12-lr0.15-p2"].effective()[0].fragments == 2
    # six fragments fit the half-speed regions' H = 6: each due at its own step
    most = grid["decoupled@2M-h12-lr0.15-p6"]
    assert most.effective()[0].fragments == 6 and [r.interval for r in most.regions][2:] == [6, 6]
    assert {c.effective()[0].fragments for n, c in grid.items() if "-p" not in n} == {4}


def _curve_runs():
    base = cluster_config.load()
    small = dict(qualityplan.plan(base, (1_000_000,), quick=False))
    large = dict(qualityplan.plan(base, (4_000_000,), quick=False))
    grid = dict(qualityplan.tuning_plan(base, 1_000_000, False, "decoupled"))

    def run(name, config, validation):
        result = RunResult(name, config, 0, 6.0, validation, {}, {})
        result.final = {"validation": validation, "test": validation + 0.5}
        return result

    return [
        # sync-dp: 2.0 at 1 M, 1.6 at 4 M: 0.2 per doubling of its budget
        run("sync-dp@1M", small["sync-dp@1M"], 2.0),
        run("sync-dp@4M", large["sync-dp@4M"], 1.6),
        # the suite's own decoupled runs are at the profile's H = 12: seeds 2.2 and 2.4
        run("decoupled@1M", small["decoupled@1M"], 2.2),
        run("decoupled@1M-s1", dataclasses.replace(small["decoupled@1M"], seed=1), 2.4),
        run("decoupled@1M-h48-lr0.15", grid["decoupled@1M-h48-lr0.15"], 2.6),
        # another outer lr is a row of its own; sync-diloco is not on the curve
        run("decoupled@1M-h12-lr0.7", grid["decoupled@1M-h12-lr0.7"], 2.1),
        # another outer momentum is not on the profile's curve
        run("decoupled@1M-h12-lr0.7-m0", grid["decoupled@1M-h12-lr0.7-m0"], 1.0),
        # nor are fewer fragments
        run("decoupled@1M-h12-lr0.15-p1", grid["decoupled@1M-h12-lr0.15-p1"], 1.0),
        run("sync-diloco@1M", small["sync-diloco@1M"], 2.1),
        # a budget sync-dp has not run has no reference
        run("decoupled@2M", dataclasses.replace(small["decoupled@1M"], tokens=2_000_000), 1.9),
    ]


def test_the_planners_quality_curve_from_runs_by_hand():
    results = _curve_runs()
    rows = qualityreport.quality_curve(results)
    # H = 12: mean 2.3, 0.3 above sync-dp = 1.5 doublings: q = 2^-1.5; H = 48: 3 doublings; at
    # lr 0.7 half a doubling
    assert [row[:4] for row in rows] == [
        (1_000_000, 12, 0.15, 2),
        (1_000_000, 12, 0.7, 1),
        (1_000_000, 48, 0.15, 1),
    ]
    assert [row[6] for row in rows] == [
        pytest.approx(2**-1.5),
        pytest.approx(2**-0.5),
        pytest.approx(0.125),
    ]
    assert rows[0][4:6] == (pytest.approx(2.3), 2.0)
    assert qualityreport.quality_curve(results[2:]) == []


def test_the_quality_curve_is_plotted_where_decoupled_ran_at_two_intervals(tmp_path):
    results = _curve_runs()
    made = qualityplots.plot(results, tmp_path / "two")
    assert made[-1].name == "quality_q_vs_interval.png"
    assert made[-1].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    one = [r for r in results if "h48" not in r.label and "lr0.7" not in r.label]
    assert "quality_q_vs_interval.png" not in [p.name for p in qualityplots.plot(one, tmp_path)]


def test_a_record_keeps_the_outer_step_it_ran_whatever_the_cluster_file_says():
    from dloco.suites import qualityrecords

    # a cluster file whose outer step is not the one the record's run had
    base = cluster_config.load()
    base = dataclasses.replace(
        base, merger=dataclasses.replace(base.merger, outer_lr=1.0, outer_momentum=0.0)
    )

    def record(mode, settings):
        return {
            "label": f"{mode}@2M",
            "mode": mode,
            "budget": 2_000_000,
            "seed": 0,
            "settings": settings,
            "before": 5.5,
            "after": 2.2,
            "evals": {},
            "last": {},
            "curve": [],
            "final": {"validation": 2.2, "test": 2.3},
        }

    ran = {"interval": 12, "outer_lr": 0.15, "outer_momentum": 0.9}
    former = qualityrecords.result_of(record("decoupled", ran), base)
    assert qualityreport.decoupled_setting(former) == (12, 0.15)
    assert former.config.effective()[1].outer_momentum == 0.9
    # a record without its settings reads the file's; another mode keeps its own step
    assert qualityrecords.result_of(record("decoupled", {}), base).config.merger.outer_lr == 1.0
    diloco = qualityrecords.result_of(record("sync-diloco", ran), base)
    assert diloco.config.effective()[1].outer_lr == 0.7


def test_the_tuning_table_gives_each_setting_its_spread_over_seeds():
    runs = _curve_runs()
    seed1 = dataclasses.replace(runs[4].config, seed=1)
    again = RunResult("decoupled@1M-h48-lr0.15-s1", seed1, 0, 6.0, 2.8, {}, {})
    again.final = {"validation": 2.8, "test": 3.3}
    lines = qualityreport.tuning_table([*runs, again])
    # decoupled's settings best first; H = 48 over seeds 0 and 1: 2.6 and 2.8, sd 0.1414; the
    # suite's own runs (no tag) are not a tuning row
    assert lines[2:] == [
        "| decoupled@1M | h12-lr0.7-m0 | 1.0000 |",
        "| decoupled@1M | h12-lr0.15-p1 | 1.0000 |",
        "| decoupled@1M | h12-lr0.7 | 2.1000 |",
        "| decoupled@1M | h48-lr0.15 | 2.7000 ± 0.1414 (2) |",
        "",
    ]
