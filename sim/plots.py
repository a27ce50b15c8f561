"""`dloco plan --plots DIR`: utilisation against link speed for sync-DP, sync-DiLoCo and decoupled,
and goodput against failure rate."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import numpy as np

from dloco.sim.baselines import sync_diloco, sync_dp
from dloco.sim.engine import simulate
from dloco.sim.scenario import Scenario
from dloco.sim.targetutil import MODES, utilisation_at

# a failed island's downtime in the goodput sweep
DOWN_S = 600.0


def utilisation_sweep(s: Scenario, speeds_bps: list[float]) -> dict[str, list[float]]:
    """The cluster's steady utilisation that counts (targetutil.utilisation_at) at each link speed
    (every island's, both ways)."""
    return {mode: [utilisation_at(mode, s, bps) for bps in speeds_bps] for mode in MODES}


def goodput_sweep(s: Scenario, mtbf_s: list[float], down_s: float) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"decoupled": [], "sync-dp": [], "sync-diloco": []}
    for mtbf in mtbf_s:
        probe = s.with_mtbf(mtbf, down_s)
        out["decoupled"].append(simulate(probe).goodput)
        out["sync-dp"].append(sync_dp(probe).goodput)
        out["sync-diloco"].append(sync_diloco(probe).goodput)
    return out


def write(
    s: Scenario,
    folder: Path,
    progress: Callable[[str], None] = lambda line: None,
    speeds: int = 12,
    failure_rates: int = 6,
) -> list[Path]:
    """Both plots into `folder`: `speeds` link speeds from 1/20 to 100x the islands' median, and
    `failure_rates` of the mean times between failures 1,000, 300, 100, 30, 10 and 3 h per island.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    links = [i.link.up_bps for i in s.islands if i.link.up_bps is not None] or [1e9]
    middle = float(np.median(links))
    speeds = [middle * f for f in np.geomspace(0.05, 100, speeds)]
    progress(f"utilisation at {len(speeds)} link speeds ...")
    sweep = utilisation_sweep(s, speeds)
    paths = [
        _plot(
            plt,
            np.array(speeds) / 1e9,
            sweep,
            "link speed per island, both ways (Gbit/s)",
            "steady utilisation that counts",
            f"{len(s.islands)} islands, {s.params:.3g} parameters, H = {s.interval}, P ="
            f" {s.fragments}, {s.codec}",
            folder / "utilisation_vs_bandwidth.png",
        )
    ]
    hours = [1000, 300, 100, 30, 10, 3][:failure_rates]
    long = dataclasses.replace(s, duration_s=max(s.duration_s, 12 * 3600.0))
    progress(f"goodput at {len(hours)} failure rates over {long.duration_s / 3600:.0f} h ...")
    good = goodput_sweep(long, [h * 3600 for h in hours], DOWN_S)
    paths.append(
        _plot(
            plt,
            [1 / h for h in hours],
            good,
            "failures per island-hour (each down 10 min + restart)",
            "goodput (useful tokens / chips' peak)",
            f"{len(s.islands)} islands, {long.duration_s / 3600:.0f} h simulated",
            folder / "goodput_vs_failures.png",
        )
    )
    return paths


def _plot(
    plt, xs, series: dict[str, list[float]], xlabel: str, ylabel: str, title: str, path: Path
) -> Path:
    figure, axes = plt.subplots(figsize=(7, 4.5))
    for name, values in series.items():
        axes.plot(xs, values, marker="o", label=name)
    axes.set_xscale("log")
    axes.set(xlabel=xlabel, ylabel=ylabel, ylim=(0, 1.05), title=title)
    axes.grid(True, which="both", alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path
