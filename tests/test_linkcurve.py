"""The links suite (suites/linkcurve.py): its runs at multiples of the profile's links, and its
tables on hand-made run results against hand-derived figures.  The suite itself is cluster runs
(`dloco experiment links`, EXPERIMENTS.md "Quality")."""

from __future__ import annotations

from dloco.cluster import config
from dloco.suites import catalog, linkcurve, transforms, wallclock
from dloco.suites.suiteresults import RunResult


def test_links_scales_every_link_and_keeps_unlimited_ones_unlimited():
    base = config.load()
    eighth = transforms.links(1 / 8)(base)
    assert [(r.uplink_mbps, r.downlink_mbps) for r in eighth.regions] == [
        (1.0, 1.0),
        (1.0, 1.0),
        (0.5, 0.5),
        (0.5, 0.5),
    ]
    assert [r.rtt_ms for r in eighth.regions] == [r.rtt_ms for r in base.regions]
    assert all(
        r.uplink_mbps is None for r in transforms.links(4)(transforms.unlinked(base)).regions
    )


def test_the_suite_runs_sync_avg_and_decoupled_at_their_multiples_of_the_links():
    base = config.load()
    runs = dict(catalog.SUITES["links"][1])
    assert list(runs) == [
        "sync-avg-x1",
        "sync-avg-x2",
        "sync-avg-x8",
        "decoupled-x1",
        "decoupled-x0.125",
        "decoupled-x0.03125",
    ]
    assert runs["sync-avg-x8"](base).mode == "sync-avg"
    assert linkcurve.slowest_mbps(runs["sync-avg-x8"](base)) == 32.0
    assert runs["decoupled-x0.03125"](base).mode == "decoupled"
    assert linkcurve.slowest_mbps(runs["decoupled-x0.03125"](base)) == 0.125
    assert linkcurve.factor_of("decoupled-x0.125 #2") == 0.125


def test_the_hub_model_at_a_multiple_of_the_links():
    # 1 s of compute; 2 x 4 B x 1,000 parameters = 64,000 bits over 16 Mbit/s = 4 ms; 0.1 s
    # round trip
    base = wallclock.Exchange(params=1000, islands=4, step_s=1.0, bps=8e6, rtt_s=0.1)
    assert abs(linkcurve.modelled_hub_step_s(base, 2.0) - 1.104) < 1e-12


def _run(label, step_s, util, links_factor, run_mode="decoupled"):
    """A run whose every island steps every `step_s` seconds (evaluated at steps 1 and 11) and
    sent 2 and received 3 bytes per token."""
    cluster = transforms.links(links_factor)(config.load().with_mode(run_mode))
    evals = {
        r.name: [
            {"step": 1, "since_start": 0.0, "eval_loss": 3.0, "life": 0},
            {"step": 11, "since_start": 10 * step_s, "eval_loss": 2.5, "life": 0},
        ]
        for r in cluster.regions
    }
    last = {
        r.name: {"tokens": 1000, "bytes_sent": 2000, "bytes_received": 3000, "compute_util": u}
        for r, u in zip(cluster.regions, util, strict=True)
    }
    return RunResult(label, cluster, 0, 6.0, 2.0, evals, last)


def test_the_tables_set_the_measured_step_beside_the_model():
    results = [
        _run("sync-avg-x1", 20.0, [0.1] * 4, 1.0, "sync-avg"),
        _run("decoupled-x1", 2.0, [0.99, 0.98, 0.97, 0.96], 1.0),
        _run("decoupled-x0.125", 2.5, [0.9, 0.8, 0.95, 0.95], 1 / 8),
    ]
    lines = linkcurve.lines(results, params=1_000_000)
    # the model: 2.0 s + 2 x 4 B x 1e6 x 8 bits / 4 Mbit/s (16 s) + 0.12 s = 18.12 s; 20 / 18.12
    (sync_row,) = [line for line in lines if line.startswith("| sync-avg-x1 ")]
    assert sync_row == "| sync-avg-x1 | 4 Mbit/s | 20.00 s | 18.12 s | 1.10 |"
    (slow_row,) = [line for line in lines if line.startswith("| decoupled-x0.125 ")]
    # per token, over the four islands: 8,000 B sent and 12,000 received for 4,000 tokens
    assert slow_row == "| decoupled-x0.125 | 0.5 Mbit/s | 2.50 s | 0.80 | 2.0 / 3.0 |"
    # without the decoupled run at 1x there is no compute to model the step with
    alone = linkcurve.lines(results[:1], params=1_000_000)
    assert "| sync-avg-x1 | 4 Mbit/s | 20.00 s | n/a | n/a |" in alone
