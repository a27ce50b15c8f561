"""The quality suite's plots (suites/qualityreport.py writes its Markdown): each mode's final test
loss against the budget, and the global model's curve at the largest budget."""

from __future__ import annotations

from pathlib import Path

from dloco.suites.qualityreport import MODES, by_setting, label, reported, spread
from dloco.suites.suiteresults import RunResult


def plot(results: list[RunResult], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    budgeted = [r for r in results if r.config.tokens and r.global_after is not None]
    groups = {key: runs for key, runs in by_setting(results).items() if not key[2]}
    made = []
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
    made.append(out_dir / "quality_loss_vs_budget.png")
    figure.savefig(made[-1], dpi=100)
    plt.close(figure)
    largest = max((r.config.tokens for r in budgeted), default=0)
    figure, axes = plt.subplots(figsize=(7, 4))
    for index, mode in enumerate(MODES):
        r = next(
            (r for r in budgeted if r.label == label(mode, largest)),
            None,
        )
        if r is not None and r.global_curve:
            points = [(0, r.global_before)] + [
                (p["cluster_tokens"], p["eval_loss"]) for p in r.global_curve
            ]
            axes.plot(*zip(*points), marker=".", color=f"C{index}", label=mode)
    axes.set_xlabel("tokens trained by the whole cluster")
    axes.set_ylabel("global model's validation loss (8 batches)")
    axes.set_title(f"budget {largest:,} tokens, seed 0: each run decays over it")
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    made.append(out_dir / "quality_loss_vs_tokens.png")
    figure.savefig(made[-1], dpi=100)
    plt.close(figure)
    return made
