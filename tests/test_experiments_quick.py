"""Every experiment suite's `--quick` variant, end to end, checking the direction of each result:
real clusters of islands, merger and broker on loopback, the tiny model, every run bounded by work
(catalog.QUICK_STEPS).  Minutes per suite, so outside the default test run:

    .venv/bin/python -m pytest -m experiments

Asserted: what holds whatever share of the CPU a process gets (who waits on whom, who keeps
stepping, counts of steps and folds, who sends fewer bytes), and directions far above the noise of
short runs (a synchronous run on emulated links against one that never waits).  Which codec or
merge rule reaches the lower loss needs the default-length runs in EXPERIMENTS.md."""

from __future__ import annotations

import pytest

from dloco.analysis.runinfo import read_events, read_metrics
from dloco.suites import experiments, suiteresults

pytestmark = [pytest.mark.experiments, pytest.mark.timeout(1800)]
# the shipped profile's full-speed islands
FAST = ("us-east", "us-west")
SLOW = ("eu-older-hw", "asia-older-hw")


def quick(name: str, tmp_path) -> dict[str, suiteresults.RunResult]:
    text, results = experiments.run_suite(name, tmp_path, quick=True, log=lambda line: None)
    assert (
        f"## `{name}`" in text and (tmp_path / "experiments" / f"{name}_loss_vs_time.png").exists()
    )
    for r in results:
        assert r.exit_code == 0, r.label
        # bounded by work: every island trained the suite's steps (every life)
        assert all(
            sum(
                e.get("step", 0) > 0
                for e in read_metrics(r.run_dir / "metrics" / f"{island}.jsonl")
            )
            >= r.config.max_steps
            for island in r.last
        ), r.label
        assert r.global_after is not None and r.global_after < r.global_before, (
            f"{r.label} did not train"
        )
        # the merger's model rebuilt from its log during the run, and at the suite's equal cluster
        # tokens
        assert (
            len(r.global_curve) == suiteresults.GLOBAL_POINTS
            and r.global_curve[-1]["eval_loss"] < r.global_before
        ), r.label
        # at equal cluster tokens a synchronous run may not have folded yet (its model is then the
        # initial one)
        assert r.global_equal is not None and r.global_equal <= r.global_before, r.label
        # two accountings agree: the cluster's tokens at its last step are the islands' totals
        # (every life)
        tokens = [p["cluster_tokens"] for p in r.global_curve]
        assert (
            tokens == sorted(tokens) and tokens[-1] == suiteresults.cluster_tokens(r) > tokens[0]
        ), r.label
    assert (tmp_path / "experiments" / f"{name}_global.png").exists()
    return {r.label: r for r in results}


def test_speedup_decoupled_never_waits_and_sends_far_fewer_bytes_than_data_parallel(tmp_path):
    """Who waits on whom: a sync-avg island waits for the barrier at every step, a decoupled one
    never does; and the bytes.  Time to a loss and utilisation are reported in the suite's table,
    not asserted.
    """
    runs = quick("speedup", tmp_path)
    assert suiteresults.bytes_per_token(runs["sync-avg"]) > 20 * suiteresults.bytes_per_token(
        runs["decoupled"]
    )
    for island in runs["decoupled"].last:
        assert _steps(runs["decoupled"], island)[-1]["wait_s"] == 0, island
        waits = [e["wait_s"] for e in _steps(runs["sync-avg"], island)]
        waited = sum(b > a for a, b in zip(waits, waits[1:]))
        assert waited >= 0.9 * (len(waits) - 1), (island, waited, len(waits))


def _steps(result, island) -> list[dict]:
    return [
        e
        for e in read_metrics(result.run_dir / "metrics" / f"{island}.jsonl")
        if e.get("step", 0) > 0
    ]


def test_heterogeneous_only_sync_diloco_makes_fast_islands_wait_for_slow_ones(tmp_path):
    runs = quick("heterogeneous", tmp_path)
    # tabulating the suite's runs again (dloco experiment --from) gives the same table
    again, _ = experiments.run_suite(
        "heterogeneous", tmp_path / "again", quick=True, log=lambda line: None, reuse=(tmp_path,)
    )
    rows = lambda text: [line for line in text.splitlines() if line.startswith("| ")]  # noqa: E731
    # the header and a row per run
    assert rows(again) == rows((tmp_path / "heterogeneous.md").read_text()) and len(
        rows(again)
    ) == 1 + len(runs)
    interval = runs["sync-diloco-mixed"].config.effective()[0].interval
    # sync-diloco: every island at the barrier, and after the first round (which also waits out
    # compilation) the fast ones wait for the slow ones
    sync = {island: _steps(runs["sync-diloco-mixed"], island) for island in FAST + SLOW}
    assert max(len(s) for s in sync.values()) - min(len(s) for s in sync.values()) <= interval, {
        i: len(s) for i, s in sync.items()
    }
    waited = {
        island: s[-1]["wait_s"] - next(e for e in s if e["step"] == interval)["wait_s"]
        for island, s in sync.items()
    }
    assert min(waited[i] for i in FAST) > max(waited[i] for i in SLOW), waited
    # decoupled: nobody waits, so in the time the slow islands train their steps the fast ones
    # (twice the quota) train more
    decoupled = {island: _steps(runs["decoupled-mixed"], island) for island in FAST + SLOW}
    assert all(s[-1]["wait_s"] == 0 for s in decoupled.values())
    assert min(len(decoupled[i]) for i in FAST) > max(len(decoupled[i]) for i in SLOW), {
        i: len(s) for i, s in decoupled.items()
    }


def _between(events: list[dict], start: float, end: float) -> list[dict]:
    return [e for e in events if start <= e["wall"] < end]


def test_faults_survivors_keep_stepping_in_decoupled_and_stall_in_sync_diloco(tmp_path):
    runs = quick("faults", tmp_path)

    def during_island_kill(label):
        """Each surviving fast island's (steps, seconds waited) while the killed island was away."""
        executed = read_events(runs[label].run_dir / "chaos.jsonl")
        kill, restart = (e["wall"] for e in executed if e["target"] not in ("merger", "broker"))
        out = {}
        for island in FAST:
            steps = _steps(runs[label], island)
            inside = _between(steps, kill, restart)
            before = [e for e in steps if e["wall"] < kill]
            out[island] = (
                len(inside),
                (inside[-1]["wait_s"] if inside else 0.0)
                - (before[-1]["wait_s"] if before else 0.0),
            )
        return out

    decoupled, sync = during_island_kill("decoupled"), during_island_kill("sync-diloco")
    # decoupled: the schedule waited for us-east's steps; us-west, as fast, kept stepping too, and
    # neither ever waited
    assert all(steps >= 10 and waited == 0 for steps, waited in decoupled.values()), decoupled
    # sync-diloco: a round without the killed island waits for the merger's quorum timeout before it
    # folds
    timeout = runs["sync-diloco"].config.effective()[1].quorum_timeout_s
    assert all(waited >= 0.5 * timeout for _, waited in sync.values()), sync


def test_quantization_fewer_bits_fewer_bytes(tmp_path):
    runs = quick("quantization", tmp_path)
    per_token = {label: suiteresults.bytes_per_token(r) for label, r in runs.items()}
    assert per_token["fp32"] > per_token["int4"] > per_token["int2"], per_token


def test_quantization_sync_int4_sends_fewer_bytes(tmp_path):
    """sync-diloco: int4 deltas cost less than half of fp32's bytes per token."""
    runs = quick("quantization-sync", tmp_path)
    assert suiteresults.bytes_per_token(runs["int4"]) < 0.5 * suiteresults.bytes_per_token(
        runs["fp32"]
    )


def test_adoption_rebase_keeps_every_step_of_work_and_replace_drops_some(tmp_path):
    """The merger's fold log says how many inner steps each delta carries.  With rebase every delta
    after an island's first of a fragment carries a whole interval (H steps, or more when the
    outbox summed two); with replace, adopting the other islands' folds drops some."""
    import json

    runs = quick("adoption", tmp_path)
    interval = runs["rebase-uniform"].config.sync.interval

    def later_deltas_short_of_an_interval(label: str) -> tuple[int, int]:
        seen, later, short = set(), 0, 0
        for line in open(tmp_path / "adoption" / label / "logs" / "merger.log"):
            event = json.loads(line) if line.startswith("{") else {}
            if event.get("event") != "fold":
                continue
            for island, steps in zip(event["contributors"], event["steps"]):
                key = (island, event["fragment"])
                if key in seen:
                    later += 1
                    short += steps < interval
                seen.add(key)
        return later, short

    (later, short), (later_replaced, short_replaced) = (
        later_deltas_short_of_an_interval(label) for label in ("rebase-uniform", "replace-uniform")
    )
    assert later >= 8 and short == 0, (later, short)
    assert later_replaced >= 8 and short_replaced >= 1, (later_replaced, short_replaced)


def test_merging_every_rule_trains(tmp_path):
    # quick() checks each lowered the global held-out loss
    runs = quick("merging", tmp_path)
    assert set(runs) == {"average-4-islands", "rda-4-islands", "round-nesterov-lr0.7-4-islands"}


def test_downlink_diffs_cut_the_bytes(tmp_path):
    runs = quick("downlink", tmp_path)
    assert suiteresults.bytes_per_token(runs["int4-diff"]) < 0.7 * suiteresults.bytes_per_token(
        runs["bf16-full"]
    )
    # The held run only has to train here (quick() checks it): with the tiny model a round lasts
    # about a second and few folds are held. Holding is tested in tests/test_merger_snapshots.py.


def test_quality_a_larger_budget_gives_every_mode_a_better_global_model(tmp_path):
    """The quality suite, quick: three modes at two budgets, each run decayed over its own budget
    and ended by it; direction only (magnitudes need the full suite, EXPERIMENTS.md "Quality")."""
    from dloco.suites import quality, qualityplan, qualityreport

    text, results = quality.run_suite(tmp_path, quick=True, log=lambda line: None)
    by_label = {r.label: r for r in results}
    small, large = qualityplan.QUICK_BUDGETS
    for mode in qualityreport.MODES:
        runs = [by_label[qualityreport.label(mode, budget)] for budget in (small, large)]
        for r in runs:
            # ended by its budget, not by the clock
            assert suiteresults.cluster_tokens(r) >= r.config.tokens, r.label
            assert r.global_after is not None and r.global_after < r.global_before, r.label
        assert runs[1].global_after < runs[0].global_after, mode
        # the reported figure: the final model on the whole test split
        assert all(set(r.final) == {"validation", "test"} for r in runs), mode
        assert runs[1].final["test"] < runs[0].final["test"], mode
    assert "| decoupled vs sync-dp | decoupled vs sync-diloco |" in text
    # every run's record, as it landed; the write-up again from the records alone
    records = quality.qualityrecords.load_all(tmp_path / "results")
    assert {r["label"] for r in records} == {r.label for r in results if r.config.tokens}
    again = quality.run_from_results([tmp_path / "results"], tmp_path / "again")
    assert again.splitlines()[4:8] == text.splitlines()[4:8]
    assert (tmp_path / "experiments" / "quality_loss_vs_budget.png").exists() and (
        tmp_path / "quality.md"
    ).exists()
    assert qualityreport.wall_clock(results)["seconds_per_step_linked"] > 0
