"""The plots of an experiment suite (suites/experiments.py, results from suites/suiteresults.py):
the islands' held-out loss against tokens and against time, one colour per run and one line per
island life, and the merger's model rebuilt from its log (`<suite>_global.png`)."""

from __future__ import annotations

from pathlib import Path

from dloco.suites.suiteresults import RunResult


def plot(name: str, results: list[RunResult], out_dir: Path) -> list[Path]:
    """The suite's plots in OUT_DIR: island loss against tokens and against time, and the merger's
    model when it was measured."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    made = [
        _island_losses(plt, name, results, x_key, label, out_dir)
        for x_key, label in (
            ("tokens", "tokens trained by the island"),
            ("since_start", "seconds since the cluster's first step"),
        )
    ]
    if any(r.global_curve for r in results):
        made.append(_global_model(plt, name, results, out_dir))
    return made


def _island_losses(
    plt, name: str, results: list[RunResult], x_key: str, label: str, out_dir: Path
) -> Path:
    """Every island's held-out loss against `x_key`, one colour per run."""
    figure, axes = plt.subplots(figsize=(7, 4))
    for index, r in enumerate(results):
        color = f"C{index}"
        segments = [
            [e for e in events if e.get("life", 0) == life]
            for events in r.evals.values()
            for life in sorted({e.get("life", 0) for e in events})
        ]
        # one line per island and life (a restarted island's tokens start at 0 again)
        for i, segment in enumerate(segments):
            axes.plot(
                [e[x_key] for e in segment],
                [e["eval_loss"] for e in segment],
                color=color,
                alpha=0.8,
                label=r.label if i == 0 else None,
            )
    axes.set_xlabel(label)
    axes.set_ylabel("island held-out loss (nats/byte)")
    axes.set_title(f"{name}: one line per island, one colour per run")
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    return _save(
        plt, figure, out_dir / f"{name}_loss_vs_{'tokens' if x_key == 'tokens' else 'time'}.png"
    )


def _global_model(plt, name: str, results: list[RunResult], out_dir: Path) -> Path:
    """The merger's model, rebuilt from its log, against cluster tokens and against time."""
    figure, (by_tokens, by_time) = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for index, r in enumerate(results):
        for axes, x_key in ((by_tokens, "cluster_tokens"), (by_time, "since_start")):
            axes.plot(
                [p[x_key] for p in r.global_curve],
                [p["eval_loss"] for p in r.global_curve],
                marker="o",
                color=f"C{index}",
                label=r.label,
            )
    by_tokens.set_xlabel("tokens trained by the whole cluster")
    by_time.set_xlabel("seconds since the cluster's first step")
    by_tokens.set_ylabel("held-out loss of the merger's model (nats/byte)")
    figure.suptitle(
        f"{name}: the merger's global model, rebuilt from its log (initial loss"
        f" {results[0].global_before:.2f})"
    )
    for axes in (by_tokens, by_time):
        axes.grid(alpha=0.3)
    by_tokens.legend(fontsize=8)
    return _save(plt, figure, out_dir / f"{name}_global.png")


def _save(plt, figure, path: Path) -> Path:
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path
