"""The quality suite's measures and write-up (suites/quality.py runs it): the table of the global
model's final held-out loss per mode and budget with the gap to sync-dp, the wall-clock claim both
ways, and two plots: loss against budget per mode, and the global model against cluster tokens at
the largest budget."""

from __future__ import annotations

import math
from pathlib import Path

from dloco.suites import speedup
from dloco.suites.suiteresults import RunResult, cluster_tokens

MODES = ("sync-dp", "sync-diloco", "decoupled")
# a short sync-dp run over the emulated links: its seconds per step
LINKED = "sync-dp-linked"


def label(mode: str, budget: int) -> str:
    """A budgeted run's label, e.g. decoupled@4M."""
    for unit, size in (("M", 1_000_000), ("k", 1_000)):
        if budget >= size and budget % (size // 10) == 0:
            return f"{mode}@{budget / size:g}{unit}"
    return f"{mode}@{budget}"


def wall_clock(results: list[RunResult]) -> dict:
    """The speedup both ways at the largest budget (None where a run is missing or never got
    there): sync-dp's seconds over the emulated links to decoupled's final loss, decoupled's to
    sync-dp's, and their ratios to the other mode's own time."""
    by_label = {r.label: r for r in results}
    linked = by_label.get(LINKED)
    budget = max((r.config.tokens for r in results), default=0)
    dp, dec = by_label.get(label("sync-dp", budget)), by_label.get(label("decoupled", budget))
    if (
        linked is None
        or dp is None
        or dec is None
        or dp.global_after is None
        or dec.global_after is None
    ):
        return {}
    per_step = speedup.seconds_per_step(linked.evals)
    curve = speedup.mean_curve(dp.evals)
    dp_steps = max((e.get("step", 0) for e in dp.last.values()), default=0)
    dp_to_dec = speedup.steps_to(curve, dec.global_after)
    dec_seconds = max((p["since_start"] for p in dec.global_curve), default=None)
    dec_to_dp = _time_on_curve(dec.global_curve, dp.global_after)
    out = {
        "budget": budget,
        "seconds_per_step_linked": per_step,
        "decoupled_seconds": dec_seconds,
        "sync_dp_seconds": per_step * dp_steps if per_step else None,
        "sync_dp_to_decoupled_final_s": (
            dp_to_dec * per_step if dp_to_dec is not None and per_step else None
        ),
        "decoupled_to_sync_dp_final_s": dec_to_dp,
    }
    if out["sync_dp_to_decoupled_final_s"] and dec_seconds:
        out["speedup_to_decoupled_final"] = out["sync_dp_to_decoupled_final_s"] / dec_seconds
    if out["sync_dp_seconds"] and dec_to_dp:
        out["speedup_to_sync_dp_final"] = out["sync_dp_seconds"] / dec_to_dp
    return out


def _time_on_curve(curve: list[dict], target: float) -> float | None:
    """The first `since_start` at which a global curve reaches `target`, linearly between points."""
    previous = None
    for point in curve:
        if point["eval_loss"] <= target:
            if previous is None or previous["eval_loss"] == point["eval_loss"]:
                return point["since_start"]
            share = (previous["eval_loss"] - target) / (previous["eval_loss"] - point["eval_loss"])
            return previous["since_start"] + share * (
                point["since_start"] - previous["since_start"]
            )
        previous = point
    return None


def gap(loss: float | None, reference: float | None) -> float | None:
    """(loss - reference) / reference: how much worse than the reference (negative: better)."""
    if loss is None or reference is None or not math.isfinite(loss) or reference <= 0:
        return None
    return (loss - reference) / reference


def _cell(value: float | None, form: str = ".3f") -> str:
    return "n/a" if value is None else format(value, form)


def table(results: list[RunResult]) -> list[str]:
    by_label = {r.label: r for r in results}
    budgets = sorted({r.config.tokens for r in results if r.config.tokens})
    modes = [m for m in MODES if any(label(m, b) in by_label for b in budgets)]
    lines = [
        "| budget (cluster tokens) | "
        + " | ".join(f"{m}: global held-out loss" for m in modes)
        + " | decoupled vs sync-dp | decoupled vs sync-diloco | decoupled islands busy |",
        "|---|" + "---|" * (len(modes) + 3),
    ]
    for budget in budgets:
        runs = {m: by_label.get(label(m, budget)) for m in modes}
        losses = {m: r.global_after if r is not None else None for m, r in runs.items()}
        decoupled = runs.get("decoupled")
        busy = (
            min((e.get("compute_util", 0.0) for e in decoupled.last.values()), default=None)
            if decoupled
            else None
        )
        trained = ", ".join(f"{m} {cluster_tokens(r):,}" for m, r in runs.items() if r is not None)
        lines.append(
            f"| {budget:,} ({trained}) | "
            + " | ".join(_cell(losses[m]) for m in modes)
            + f" | {_cell(gap(losses.get('decoupled'), losses.get('sync-dp')), '+.1%')}"
            + f" | {_cell(gap(losses.get('decoupled'), losses.get('sync-diloco')), '+.1%')} |"
            f" {_cell(busy, '.2f')} |"
        )
    return lines


# decoupled within 1.5 % of sync-dp; >= 20x sooner to a final loss
QUALITY_GOAL, SPEEDUP_GOAL = 0.015, 20.0


def goal_lines(results: list[RunResult]) -> list[str]:
    """The suite's goals at the largest budget, each met or missed and by how much (a goal whose
    runs are missing is not judged)."""
    budget = max((r.config.tokens for r in results), default=0)
    final = {
        mode: r.global_after
        for mode in MODES
        if (r := {x.label: x for x in results}.get(label(mode, budget))) is not None
    }
    lines = []
    if (behind := gap(final.get("decoupled"), final.get("sync-dp"))) is not None:
        lines.append(
            f"- goal, decoupled within {QUALITY_GOAL:.1%} of sync-dp:"
            f" {'met' if behind <= QUALITY_GOAL else 'MISSED'} ({behind:+.1%})"
        )
    if (against := gap(final.get("decoupled"), final.get("sync-diloco"))) is not None:
        lines.append(
            f"- goal, decoupled no worse than sync-diloco: {'met' if against <= 0 else 'MISSED'}"
            f" ({against:+.1%})"
        )
    clock = wall_clock(results)
    best = max(
        (
            clock[k]
            for k in ("speedup_to_decoupled_final", "speedup_to_sync_dp_final")
            if clock.get(k)
        ),
        default=None,
    )
    if best is not None:
        verdict = "met" if best >= SPEEDUP_GOAL else f"MISSED by {SPEEDUP_GOAL / best:.1f}x"
        lines.append(
            f"- goal, decoupled >= {SPEEDUP_GOAL:g}x sooner to a final loss: {verdict} (best of the"
            f" two ways: {best:.1f}x)"
        )
    return [*lines, ""] if lines else []


def claim_lines(results: list[RunResult]) -> list[str]:
    clock = wall_clock(results)
    if not clock:
        return [
            "The wall-clock claim needs the largest budget's sync-dp and decoupled runs and"
            f" `{LINKED}`."
        ]
    return [
        (
            f"At {clock['budget']:,} cluster tokens, with sync-dp's"
            f" {_cell(clock['seconds_per_step_linked'], '.1f')} s per step over the profile's"
            f" emulated links (`{LINKED}`):"
        ),
        "",
        (
            "- sync-dp would reach decoupled's final loss in"
            f" {_cell(clock['sync_dp_to_decoupled_final_s'], ',.0f')} s, against decoupled's"
            f" {_cell(clock['decoupled_seconds'], ',.0f')} s:"
            f" **{_cell(clock.get('speedup_to_decoupled_final'), '.1f')}x**;"
        ),
        (
            "- decoupled reached sync-dp's final loss in"
            f" {_cell(clock['decoupled_to_sync_dp_final_s'], ',.0f')} s (n/a: never), against"
            f" sync-dp's {_cell(clock['sync_dp_seconds'], ',.0f')} s:"
            f" **{_cell(clock.get('speedup_to_sync_dp_final'), '.1f')}x**."
        ),
        "",
    ]


def plot(results: list[RunResult], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    budgeted = [r for r in results if r.config.tokens and r.global_after is not None]
    made = []
    figure, axes = plt.subplots(figsize=(7, 4))
    for index, mode in enumerate(MODES):
        points = sorted(
            (r.config.tokens, r.global_after) for r in budgeted if r.config.mode == mode
        )
        if points:
            axes.plot(*zip(*points), marker="o", color=f"C{index}", label=mode)
    axes.set_xscale("log")
    axes.set_xlabel("budget: tokens trained by the whole cluster (log)")
    axes.set_ylabel("global model's held-out loss at the budget")
    axes.grid(alpha=0.3, which="both")
    axes.legend()
    figure.tight_layout()
    made.append(out_dir / "quality_loss_vs_budget.png")
    figure.savefig(made[-1], dpi=100)
    plt.close(figure)
    largest = max((r.config.tokens for r in budgeted), default=0)
    figure, axes = plt.subplots(figsize=(7, 4))
    for index, mode in enumerate(MODES):
        r = next(
            (r for r in budgeted if r.config.mode == mode and r.config.tokens == largest), None
        )
        if r is not None and r.global_curve:
            points = [(0, r.global_before)] + [
                (p["cluster_tokens"], p["eval_loss"]) for p in r.global_curve
            ]
            axes.plot(*zip(*points), marker=".", color=f"C{index}", label=mode)
    axes.set_xlabel("tokens trained by the whole cluster")
    axes.set_ylabel("global model's held-out loss")
    axes.set_title(f"budget {largest:,} tokens: each run decays over it")
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    made.append(out_dir / "quality_loss_vs_tokens.png")
    figure.savefig(made[-1], dpi=100)
    plt.close(figure)
    return made


def write_up(results: list[RunResult], command: str, seconds: float, out_dir: Path) -> str:
    """OUT/quality.md and OUT/experiments/quality_*.png; returns the Markdown."""
    plots = plot(results, out_dir / "experiments")
    text = "\n".join(
        [
            "## Quality at equal tokens, each run decayed over its budget",
            "",
            (
                "The merger's final global model, evaluated on the islands' held-out batches, at"
                " the end of runs bounded by a cluster token budget; every island's inner rate"
                " decays over the cluster's progress towards it (PROTOCOL.md §6.1). sync-dp is"
                " trained in one process, the cluster's arithmetic without the bus"
                " (suites/inprocess.py; its loss per step depends on neither the link nor the bus),"
                " unless run with --sync-dp-on-bus."
            ),
            "",
            *table(results),
            "",
            *goal_lines(results),
            *claim_lines(results),
            *(f"![{p.name}](experiments/{p.name})" for p in plots),
            "",
            f"Command: `{command}` ({seconds / 60:.0f} min).",
            "",
        ]
    )
    (out_dir / "quality.md").write_text(text)
    return text
