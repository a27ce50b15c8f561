"""What a suite's runs measured (suites/experiments.py runs them, suites/experimentplots.py draws
them): each run's results read back from its directory, the comparisons between runs (time to a
target loss, loss at equal tokens, bytes per token, the merger's model at equal cluster tokens) and
the suite's Markdown table."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from dloco.analysis.runinfo import chaos_effects, last_step, lives, read_metrics
from dloco.cluster.config import ClusterConfig
from dloco.cluster.records import run_task
from dloco.protocol.errors import DlocoError
from dloco.suites import linkcurve, speedup, wirebytes

# The merger's model is evaluated at this many moments of each run, and at equal cluster tokens
# (measure_global: one replay of the merger's log and ~1 s per evaluation, after the runs).
GLOBAL_POINTS = 6


@dataclasses.dataclass
class RunResult:
    label: str
    config: ClusterConfig
    exit_code: int
    global_before: float | None
    global_after: float | None
    # island -> evaluation events (since_start: seconds from the cluster's first step, tokens,
    # eval_loss)
    evals: dict[str, list[dict]]
    # island -> last step event
    last: dict[str, dict]
    # cluster.chaos.effects rows
    chaos: list[dict] = dataclasses.field(default_factory=list)
    run_dir: Path | None = None
    # the merger's model: since_start, cluster_tokens, eval_loss
    global_curve: list[dict] = dataclasses.field(default_factory=list)
    # the merger's model when the cluster had trained the suite's equal cluster tokens
    global_equal: float | None = None
    # the final model on the whole validation and test splits ({"validation": ..., "test": ...})
    final: dict = dataclasses.field(default_factory=dict)


def collect(label: str, config: ClusterConfig, run_dir: Path, code: int) -> RunResult:
    """A finished run's results, read from its directory."""
    from dloco.analysis.report import global_eval

    evals, last = read_islands([r.name for r in config.regions], run_dir)
    before, after = global_eval(run_task(config), run_dir)
    return RunResult(
        label,
        config,
        code,
        before["loss"],
        after and after["loss"],
        evals,
        last,
        chaos_effects(run_dir, [r.name for r in config.regions]),
        run_dir,
    )


def cluster_tokens(result: RunResult) -> int:
    """Tokens the whole cluster trained in the run (every island, every life)."""
    return sum(e.get("tokens", 0) for e in result.last.values())


def measure_global(
    results: list[RunResult], points: int = GLOBAL_POINTS, log=lambda line: None
) -> int:
    """The merger's model during each run, rebuilt from its log: at `points` evenly spaced moments
    from the cluster's first step to its last, and when the cluster had trained the suite's equal
    cluster tokens (the fewest any run trained, which is therefore the same compute in every run).
    Fills each result's global_curve and global_equal; returns the equal cluster tokens.  A run
    whose log cannot be replayed faithfully keeps n/a (and is named through `log`): one broken
    run never costs a suite the others' table."""
    equal = min(cluster_tokens(r) for r in results)
    for r in results:
        if r.run_dir is None or not (r.run_dir / "merger").exists():
            continue
        try:
            _measure_global_run(r, equal, points)
        except (DlocoError, OSError, ValueError) as error:
            r.global_curve, r.global_equal = [], None
            log(
                f"dloco experiment: {r.label}: the merger's model was not rebuilt ({error}); its"
                " global columns say n/a"
            )
    return equal


def _measure_global_run(r: RunResult, equal: int, points: int) -> None:
    """measure_global for one run (raises when its merger's log cannot be replayed faithfully)."""
    from dloco.analysis.globalmodel import (
        Evaluator,
        cluster_tokens_at,
        states_at,
        when_cluster_reached,
    )

    steps = {
        name: lives(
            [
                e
                for e in read_metrics(r.run_dir / "metrics" / f"{name}.jsonl")
                if "step" in e and "wall" in e
            ]
        )
        for name in r.last
    }
    walls = sorted(
        e["wall"] for runs in steps.values() for life in runs for e in life if e["step"] > 0
    )
    if not walls:
        return
    began, ended = walls[0], walls[-1]
    moments = [began + (ended - began) * k / points for k in range(1, points + 1)]
    reached = when_cluster_reached(steps, equal)
    evaluator = Evaluator(run_task(r.config), r.run_dir)
    params = states_at(r.run_dir, moments + [reached if reached is not None else ended])
    # before the merger's first fold its model is the initial one (global_before)
    losses = [r.global_before if p is None else evaluator.loss(p) for p in params]
    r.global_curve = [
        {
            "since_start": at - began,
            "cluster_tokens": cluster_tokens_at(steps, at),
            "eval_loss": loss,
        }
        for at, loss in zip(moments, losses)
    ]
    r.global_equal = losses[-1] if reached is not None else None


def read_islands(names: list[str], run_dir: Path) -> tuple[dict[str, list[dict]], dict[str, dict]]:
    """Each island's evaluations, on one clock (`since_start`: seconds since the cluster's first
    training step), and its last step event (tokens and bytes summed over its lives)."""
    by_island = {
        name: lives([e for e in read_metrics(run_dir / "metrics" / f"{name}.jsonl") if "step" in e])
        for name in names
    }
    began = min(
        (e["wall"] for runs in by_island.values() for life in runs for e in life if e["step"] == 1),
        default=None,
    )
    evals, last = {}, {}
    for name, runs in by_island.items():
        evals[name] = (
            [
                {**e, "since_start": e["wall"] - began, "life": i}
                for i, life in enumerate(runs)
                for e in life
                if "eval_loss" in e and e["step"] > 0
            ]
            if began
            else []
        )
        last[name] = last_step(runs)
    return evals, last


def time_to(result: RunResult, target: float) -> float | None:
    """Seconds from the cluster's first training step (the earliest island's step 1, by wall clock)
    to the first island evaluation at or below `target` (`since_start`).  Start-up (JAX import,
    compilation, joining: ~10-15 s here) is left out: it is the same in every mode and does not grow
    with the length of a run.  One clock for every island: a late-joining or restarted island, which
    starts from a model the others have trained, gets no head start."""
    times = [
        e["since_start"]
        for events in result.evals.values()
        for e in events
        if e["eval_loss"] <= target
    ]
    return min(times) if times else None


def _first_life(events: list[dict]) -> list[dict]:
    return [e for e in events if e.get("life", 0) == 0]


def loss_at_tokens(result: RunResult, tokens: float) -> float:
    """Mean over islands of the held-out loss at `tokens` (linear interpolation of their
    evaluations; a restarted island's first life only: its token count starts again from 0)."""
    values = []
    for events in result.evals.values():
        first = _first_life(events)
        if first:
            xs, ys = [e["tokens"] for e in first], [e["eval_loss"] for e in first]
            values.append(float(np.interp(tokens, xs, ys)))
    return float(np.mean(values)) if values else float("nan")


def bytes_per_token(result: RunResult) -> float:
    sent = sum(e.get("bytes_sent", 0) + e.get("bytes_received", 0) for e in result.last.values())
    tokens = sum(e.get("tokens", 0) for e in result.last.values())
    return sent / tokens if tokens else float("nan")


# a suite's own tables, after the common one
SUITE_LINES = {"bytes": wirebytes.lines, "links": linkcurve.lines}


def summarize(
    name: str, description: str, results: list[RunResult], command: str, seconds: float
) -> str:
    """The suite's Markdown: its table, a row per run, each decoupled run against sync-avg, the
    extrapolated sync-avg, the bytes suite's goals, each fault's effect, and the plots."""
    target = max(
        min(e["eval_loss"] for events in r.evals.values() for e in events)
        for r in results
        if any(r.evals.values())
    )
    equal_tokens = min(
        max(e["tokens"] for e in first)
        for r in results
        for events in r.evals.values()
        if (first := _first_life(events))
    )
    lines = [
        f"## `{name}`",
        "",
        description,
        "",
        f"Command: `{command}` ({seconds:.0f} s of wall clock for the suite, "
        + (
            f"{results[0].config.max_steps} steps per island per run, "
            if results[0].config.max_steps
            else f"{results[0].config.duration_s:.0f} s per run, "
        )
        + f"{'/'.join(str(n) for n in sorted({len(r.config.regions) for r in results}))} islands; "
        f"{_speeds(results)}).",
        "",
        (
            "| run | global held-out loss (initial → final) | global loss at"
            f" {min(cluster_tokens(r) for r in results):,} cluster tokens | time to island loss ≤"
            f" {target:.3f} (from the cluster's first step) | island loss at {equal_tokens:,}"
            " tokens | compute utilisation per island | bytes on the wire per token | exit |"
        ),
        "|---|---|---|---|---|---|---|---|",
    ]
    lines += [_row(r, target, equal_tokens) for r in results]
    dp = next((r for r in results if r.label == "sync-avg"), None)
    if dp is not None:
        lines += _against_sync_dp(results, dp, target, equal_tokens)
    full = next((r for r in results if r.label == speedup.FULL_SPEED), None)
    if dp is not None and full is not None:
        lines += [""] + _extrapolated(results, dp, full, target)
    lines += SUITE_LINES.get(name, lambda _: [])(results)
    lines += [line for r in results for line in _fault_lines(r)]
    lines += [
        "",
        f"![{name}: loss vs tokens](experiments/{name}_loss_vs_tokens.png) ![{name}: loss vs"
        f" time](experiments/{name}_loss_vs_time.png)"
        + (
            f" ![{name}: the merger's model](experiments/{name}_global.png)"
            if any(r.global_curve for r in results)
            else ""
        ),
        "",
    ]
    return "\n".join(lines)


def _row(r: RunResult, target: float, equal_tokens: int) -> str:
    """A run's row of the suite's table."""
    reach = time_to(r, target)
    utils = ", ".join(
        f"{name} {e.get('compute_util', float('nan')):.2f}" for name, e in r.last.items()
    )
    after = "n/a" if r.global_after is None else f"{r.global_after:.3f}"
    at_equal = "n/a" if r.global_equal is None else f"{r.global_equal:.3f}"
    return (
        f"| {r.label} | {r.global_before:.3f} → {after} | {at_equal} |"
        f" {'not reached' if reach is None else f'{reach:.1f} s'} |"
        f" {loss_at_tokens(r, equal_tokens):.3f} | {utils} | {bytes_per_token(r):,.0f} |"
        f" {r.exit_code} |"
    )


def _against_sync_dp(
    results: list[RunResult], dp: RunResult, target: float, equal_tokens: int
) -> list[str]:
    """Each decoupled run that reached the target against sync-avg: speed, bytes, loss."""
    lines = []
    for r in results:
        if r.label.startswith("decoupled") and time_to(r, target) and time_to(dp, target):
            equal = loss_at_tokens(r, equal_tokens) / loss_at_tokens(dp, equal_tokens) - 1
            lines += [
                "",
                (
                    f"{r.label} vs sync-avg: {time_to(dp, target) / time_to(r, target):.1f}x faster"
                    " to the target; "
                    f"{bytes_per_token(dp) / bytes_per_token(r):.0f}x fewer bytes per token; "
                    f"loss at equal tokens {100 * equal:+.1f} %."
                ),
            ]
    return lines


def _fault_lines(r: RunResult) -> list[str]:
    """A line per fault of run `r`: the other islands' step rate after against before, folds."""
    lines = []
    for row in r.chaos:
        rates = (
            ", ".join(
                f"{n} {v['ratio']:.2f}" for n, v in row["others"].items() if v["ratio"] is not None
            )
            or "-"
        )
        extra = (
            f"; next fold after {row['first_fold_s']:.1f} s"
            if row.get("first_fold_s") is not None
            else ""
        )
        if row.get("during_absence"):
            extra += (
                f"; over its whole {row['absence_s']:.0f} s absence vs as long before: "
                + ", ".join(
                    f"{n} {v:.2f}" for n, v in row["during_absence"].items() if v is not None
                )
            )
        lines.append(
            f"- {r.label}, {row['action']} {row['target']} at {row['at_s']:.0f} s: other"
            f" islands' step rate after/before {rates}; folds {row['folds_before']} before /"
            f" {row['folds_after']} after{extra}"
        )
    return lines


def _extrapolated(
    results: list[RunResult], dp: RunResult, full: RunResult, target: float
) -> list[str]:
    """sync-avg's time to each decoupled run's final loss, from its loss per step at full speed and
    its time per step over the emulated links (suites/speedup.py)."""
    per_step, curve = speedup.seconds_per_step(dp.evals), speedup.mean_curve(full.evals)
    if per_step is None or not curve:
        return [f"{speedup.FULL_SPEED}: too few evaluations to extrapolate sync-avg"]
    check = speedup.extrapolated_seconds(full.evals, dp.evals, target)
    lines = [
        (
            f"sync-avg extrapolated: {speedup.FULL_SPEED}'s loss per step ({curve[-1][0]} steps,"
            f" mean island loss {curve[0][1]:.3f} → {curve[-1][1]:.3f}) at sync-avg's"
            f" {per_step:.2f} s per step over the emulated links. Check: to the target above"
            f" {'never' if check is None else f'{check:.1f} s'} extrapolated,"
            f" {_seconds_or(time_to(dp, target))} measured."
        )
    ]
    for r in results:
        final = speedup.final_loss(r.evals) if r.label.startswith("decoupled") else None
        if final is None:
            continue
        own, theirs = time_to(r, final), speedup.extrapolated_seconds(full.evals, dp.evals, final)
        if own and theirs:
            ratio = f"{theirs / own:.1f}x"
        # sync-avg did not get there in the steps it ran: at least that long
        else:
            ratio = f"more than {curve[-1][0] * per_step / own:.1f}x" if own else "n/a"
        lines.append(
            f"{r.label} vs sync-avg to {r.label}'s final loss {final:.3f}: {_seconds_or(own)} vs "
            f"{_seconds_or(theirs, f'not within {curve[-1][0]} steps')} extrapolated: {ratio}."
        )
    return lines


def _seconds_or(seconds: float | None, otherwise: str = "not reached") -> str:
    return otherwise if seconds is None else f"{seconds:.1f} s"


def _speeds(results: list[RunResult]) -> str:
    """How the runs emulated slow hardware: CPU quotas (their cores) or sleeps."""
    cores = sorted({r.config.island_cpus for r in results})
    if cores == [0.0]:
        return "a slow region sleeps its slowdown, its CPU free for the others"
    return (
        f"CPU quotas: {'/'.join(f'{c:g}' for c in cores)} cores per full-speed island, divided by a"
        " region's slowdown"
    )
