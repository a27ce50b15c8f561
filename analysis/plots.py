"""The PNG plots of a run's report (analysis/report.py): held-out loss against wall clock and
tokens, bytes on the wire and compute utilisation, one line per island and life, and the global
model's held-out loss (the evaluator's curve) over time and against the tokens the whole cluster
trained."""

from __future__ import annotations

from pathlib import Path

from dloco.analysis.globalmodel import cluster_tokens_at
from dloco.analysis.runinfo import lives

CLOCK = "seconds since the cluster's first step"
# per plot: file name, x ("time" or a metric), y metric, x label, y label
SPECS = [
    ("eval_loss_vs_time.png", "time", "eval_loss", CLOCK, "held-out loss (the task's)"),
    (
        "eval_loss_vs_tokens.png",
        "tokens",
        "eval_loss",
        "tokens trained by the island (each life from 0)",
        "held-out loss (the task's)",
    ),
    (
        "bytes_on_wire.png",
        "time",
        "bytes_sent",
        CLOCK,
        "bytes sent (solid) / received (dashed)",
    ),
    ("compute_util.png", "time", "compute_util", CLOCK, "compute utilisation"),
]


def write_plots(
    run_dir: Path, metrics: dict[str, list[dict]], global_curve: list[dict]
) -> list[str]:
    """The islands' curves, with `global_curve` (the evaluator's lines: wall, eval_loss) on the loss
    over time and on its own plot; the files written, relative to `run_dir`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plots = run_dir / "plots"
    plots.mkdir(exist_ok=True)
    made = []
    # One clock for every island (wall time from the cluster's first step), one line per island and
    # life: a restarted island's own clock, tokens and byte counters start again from 0.
    split = {
        name: lives([e for e in events if "step" in e and "wall" in e])
        for name, events in metrics.items()
    }
    began = min(
        (e["wall"] for runs in split.values() for life in runs for e in life if e["step"] > 0),
        default=0.0,
    )
    for filename, x_key, y_key, x_label, y_label in SPECS:
        figure, axes = plt.subplots(figsize=(7, 4))
        _island_curves(axes, split, began, x_key, y_key)
        if filename == "eval_loss_vs_time.png" and global_curve:
            axes.plot(
                [p["wall"] - began for p in global_curve],
                [p["eval_loss"] for p in global_curve],
                color="black",
                linewidth=2.5,
                marker=".",
                label="global model (merger's)",
            )
        axes.set_xlabel(x_label)
        axes.set_ylabel(y_label)
        axes.grid(alpha=0.3)
        if axes.get_legend_handles_labels()[0]:
            axes.legend(fontsize=8)
        figure.tight_layout()
        figure.savefig(plots / filename, dpi=100)
        plt.close(figure)
        made.append(f"plots/{filename}")
    # the one model the cluster trains, against the compute the whole cluster spent
    if global_curve:
        made.append(_global_plot(plt, plots, split, global_curve))
    return made


def _global_plot(
    plt, plots: Path, split: dict[str, list[list[dict]]], global_curve: list[dict]
) -> str:
    """The global model's held-out loss against the tokens the whole cluster had trained."""
    figure, axes = plt.subplots(figsize=(7, 4))
    axes.plot(
        [cluster_tokens_at(split, p["wall"]) for p in global_curve],
        [p["eval_loss"] for p in global_curve],
        color="black",
        marker=".",
    )
    axes.set_xlabel("tokens trained by the whole cluster (every island, every life)")
    axes.set_ylabel("held-out loss of the global model")
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(plots / "global_loss_vs_cluster_tokens.png", dpi=100)
    plt.close(figure)
    return "plots/global_loss_vs_cluster_tokens.png"


def _island_curves(
    axes, split: dict[str, list[list[dict]]], began: float, x_key: str, y_key: str
) -> None:
    """One line per island and life, an island's lives in one colour under one label; on the bytes
    plot, the bytes received dashed beside the bytes sent."""

    def x(event: dict, key: str) -> float:
        return event["wall"] - began if key == "time" else event[key]

    for index, (name, runs) in enumerate(split.items()):
        labelled = False
        for life in runs:
            points = [(x(e, x_key), e[y_key]) for e in life if y_key in e]
            if points:
                axes.plot(*zip(*points), color=f"C{index}", label=None if labelled else name)
                labelled = True
            if y_key == "bytes_sent" and (
                received := [
                    (x(e, "time"), e["bytes_received"]) for e in life if "bytes_received" in e
                ]
            ):
                axes.plot(*zip(*received), linestyle="--", color=f"C{index}")
