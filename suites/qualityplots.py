"""The quality suite's plots (suites/qualityreport.py writes its Markdown): each mode's final test
loss against the budget, the global model's curve at the largest budget, and the planner's q(H)
where decoupled ran at several H."""

from __future__ import annotations

from pathlib import Path

from dloco.suites.qualityreport import (
    MODES,
    by_setting,
    label,
    quality_curve,
    reported,
    spread,
)
from dloco.suites.suiteresults import RunResult


def plot(results: list[RunResult], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    made = [out_dir / "quality_loss_vs_budget.png", out_dir / "quality_loss_vs_tokens.png"]
    _plot_budgets(plt, results, made[0])
    _plot_largest(plt, results, made[1])
    rows = quality_curve(results)
    if len({(budget, h) for budget, h, *_ in rows}) > len({budget for budget, *_ in rows}):
        made.append(out_dir / "quality_q_vs_interval.png")
        _plot_q(plt, rows, made[-1])
    return made


def _plot_budgets(plt, results: list[RunResult], path: Path) -> None:
    """Each mode's final test loss (mean ± sd over seeds) against the budget."""
    groups = {key: runs for key, runs in by_setting(results).items() if not key[2]}
    figure, axes = plt.subplots(figsize=(7, 4))
    for index, mode in enumerate(MODES):
        points = sorted(
            (budget, stats)
            for (m, budget, _), runs in groups.items()
            if m == mode and (stats := spread([v for r in runs if (v := reported(r)) is not None]))
        )
        if points:
            axes.errorbar(
                [b for b, _ in points],
                [st[0] for _, st in points],
                yerr=[st[1] for _, st in points],
                marker="o",
                capsize=3,
                color=f"C{index}",
                label=mode,
            )
    axes.set_xscale("log")
    axes.set_xlabel("budget: tokens trained by the whole cluster (log)")
    axes.set_ylabel("final global model's test loss (mean ± sd over seeds)")
    axes.grid(alpha=0.3, which="both")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def _plot_largest(plt, results: list[RunResult], path: Path) -> None:
    """The global model's curve of each mode's seed-0 run at the largest budget."""
    budgeted = [r for r in results if r.config.tokens and r.global_after is not None]
    largest = max((r.config.tokens for r in budgeted), default=0)
    figure, axes = plt.subplots(figsize=(7, 4))
    for index, mode in enumerate(MODES):
        r = next((r for r in budgeted if r.label == label(mode, largest)), None)
        if r is not None and r.global_curve:
            points = [(0, r.global_before)] + [
                (p["cluster_tokens"], p["eval_loss"]) for p in r.global_curve
            ]
            axes.plot(*zip(*points), marker=".", color=f"C{index}", label=mode)
    axes.set_xlabel("tokens trained by the whole cluster")
    axes.set_ylabel("global model's validation loss (8 batches)")
    axes.set_title(f"budget {largest:,} tokens, seed 0: each run decays over it")
    axes.grid(alpha=0.3)
    if axes.get_legend_handles_labels()[0]:
        axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def _plot_q(plt, rows: list[tuple], path: Path) -> None:
    """q(H) per budget and outer lr (suites/qualityreport.py quality_curve's rows)."""
    figure, axes = plt.subplots(figsize=(7, 4))
    lines = sorted({(budget, lr) for budget, _, lr, *_ in rows})
    for index, (budget, lr) in enumerate(lines):
        points = [(row[1], row[6]) for row in rows if (row[0], row[2]) == (budget, lr)]
        axes.plot(
            *zip(*points),
            marker="o",
            color=f"C{index}",
            label=f"{budget / 1e6:g} M tokens, outer lr {lr:g}",
        )
    axes.set_xscale("log", base=2)
    axes.set_xlabel("H: inner steps per delta (the half-speed islands: H / 2)")
    axes.set_ylabel("q(H): sync-dp's tokens to the same loss / budget")
    axes.set_title("a decoupled token's worth against data parallelism (validation)")
    axes.grid(alpha=0.3, which="both")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
