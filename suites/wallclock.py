"""The wall-clock claim like for like: data parallelism's time to a loss against decoupled's, at
equal per-island compute, as a function of the links' bandwidth.

Both modes' islands compute at the same pace: one inner step of an island's batch takes `step_s`,
measured on the decoupled run's islands under their CPU quota (a data-parallel step computes each
island's share of the global batch on that island, so it takes as long, then waits for the
exchange).  Data parallelism's step then costs, over links of `bps` each way and `rtt_s`:

- as this system runs it (`hub`): every island sends its fp32 gradient to the hub and receives the
  result, 4N bytes each way over its own link, one after the other, plus a round trip;
- at best practice (`ring`): a ring all-reduce of bf16 gradients, 2 (n - 1) / n x 2N bytes each way
  and 2 (n - 1) half round trips, of which up to 2/3 of a step hides behind the backward pass
  (sim/baselines.py's model of the same).

Its time to a loss is the steps its curve needs (sync-dp's loss per step, which no link changes)
times that step.  Decoupled's time is read off its global model's curve as it ran; its islands do
not wait on the links, so at other bandwidths its time is taken as the same: `dloco experiment
links` (suites/linkcurve.py) measures both assumptions against runs at several multiples of the
links: decoupled's islands' utilisation, and this system's hub step against the model here
(EXPERIMENTS.md, "Quality", has the figures).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from dloco.suites import speedup

FP32_BYTES, BF16_BYTES = 4, 2
# of a step, the backward pass, behind which a bucketed all-reduce can run
BACKWARD_SHARE = 2 / 3


@dataclasses.dataclass(frozen=True)
class Exchange:
    """What a data-parallel step moves and waits for."""

    # parameters
    params: int
    islands: int
    # seconds of one island's inner step, measured
    step_s: float
    # each island's link, each way, bits per second; and its round trip
    bps: float
    rtt_s: float


def dp_step_s(x: Exchange, practice: str) -> float:
    """Seconds of one data-parallel step: the step's compute and the exchange that does not hide
    behind it (`practice`: "hub" as built, "ring" at best practice)."""
    if practice == "hub":
        return x.step_s + 2 * FP32_BYTES * x.params * 8 / x.bps + x.rtt_s
    if practice == "ring":
        n = x.islands
        moved = 2 * (n - 1) / n * BF16_BYTES * x.params
        ring = moved * 8 / x.bps + 2 * (n - 1) * x.rtt_s / 2
        return x.step_s + max(0.0, ring - BACKWARD_SHARE * x.step_s)
    raise ValueError(f"practice must be hub or ring, got {practice!r}")


def bandwidth_for(x: Exchange, util: float, practice: str) -> float:
    """The bandwidth each way (bit/s) at which a data-parallel step computes `util` of its time
    (dp_step_s inverted; DiLoCo's scaling-laws paper, Table 6, in this model): inf where the round
    trips alone leave less than that."""
    if not 0 < util <= 1:
        raise ValueError(f"util must be in (0, 1], got {util}")
    # seconds of exchange a step may show beside its compute
    shown = x.step_s * (1 / util - 1)
    if practice == "hub":
        moved, latency = 2 * FP32_BYTES * x.params, x.rtt_s
    elif practice == "ring":
        n = x.islands
        moved, latency = 2 * (n - 1) / n * BF16_BYTES * x.params, (n - 1) * x.rtt_s
        shown += BACKWARD_SHARE * x.step_s
    else:
        raise ValueError(f"practice must be hub or ring, got {practice!r}")
    return moved * 8 / (shown - latency) if shown > latency else math.inf


UTILISATIONS = (0.5, 0.8, 0.9, 0.95, 0.99)


def utilisation_table(x: Exchange) -> list[str]:
    """Data parallelism's bandwidth for each compute utilisation in UTILISATIONS, in Table 6's
    format, Mbit/s each way."""

    def cell(practice: str, util: float) -> str:
        bps = bandwidth_for(x, util, practice)
        return "unreachable" if math.isinf(bps) else f"{bps / 1e6:,.1f}"

    return [
        "Bandwidth each way (Mbit/s) data parallelism needs for a compute utilisation, at that"
        f" step ({x.step_s:.2f} s) and round trip ({x.rtt_s * 1000:.0f} ms):",
        "",
        "| practice | " + " | ".join(f"{u:.0%}" for u in UTILISATIONS) + " |",
        "|---|" + "---|" * len(UTILISATIONS),
        *(
            f"| {name} | " + " | ".join(cell(practice, u) for u in UTILISATIONS) + " |"
            for practice, name in (("hub", "hub, fp32"), ("ring", "ring, bf16, overlapped"))
        ),
        "",
    ]


def dp_seconds_to(
    curve: Sequence[tuple[int, float]], target: float, x: Exchange, practice: str
) -> float | None:
    """Data parallelism's seconds to `target` along its curve of (step, loss); None if never."""
    steps = speedup.steps_to(curve, target)
    return None if steps is None else steps * dp_step_s(x, practice)


def seconds_on(curve: Sequence[dict], target: float) -> float | None:
    """The first `since_start` at which a global curve reaches `target`, linearly between points;
    None if never."""
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


def curve_rows(
    dp_curve: Sequence[tuple[int, float]],
    decoupled_curve: Sequence[dict],
    base: Exchange,
    factors: Sequence[float] = (1 / 32, 1 / 16, 1 / 8, 1 / 4, 1 / 2, 1, 2, 4, 8),
) -> list[dict]:
    """At each multiple of the base links' bandwidth: data parallelism's seconds to decoupled's
    final loss (hub and ring) and its step, decoupled's own seconds to it, and the ratios."""
    final = decoupled_curve[-1]["eval_loss"]
    decoupled_s = seconds_on(decoupled_curve, final)
    rows = []
    for factor in factors:
        x = dataclasses.replace(base, bps=base.bps * factor)
        row = {"factor": factor, "mbps": x.bps / 1e6, "decoupled_s": decoupled_s}
        for practice in ("hub", "ring"):
            seconds = dp_seconds_to(dp_curve, final, x, practice)
            row[f"{practice}_step_s"] = dp_step_s(x, practice)
            row[f"{practice}_s"] = seconds
            row[f"{practice}_ratio"] = (
                seconds / decoupled_s if seconds is not None and decoupled_s else None
            )
        rows.append(row)
    return rows


def crossing(rows: Sequence[dict], practice: str, ratio: float) -> float | None:
    """The lowest bandwidth (Mbit/s) of `rows` at which `practice`'s ratio is below `ratio`, or
    None if it never is."""
    below = [r["mbps"] for r in rows if (r[f"{practice}_ratio"] or math.inf) < ratio]
    return min(below) if below else None


def exchange_of(result, params: int) -> Exchange:
    """A data-parallel step's exchange at the links and island speeds of a decoupled run: the
    slowest island's measured seconds per step (a data-parallel step waits for it), the slowest
    link, the longest round trip."""
    regions = result.config.regions
    rates = [speedup.seconds_per_step({name: events}) for name, events in result.evals.items()]
    links = [b for r in regions for b in (r.uplink_mbps, r.downlink_mbps) if b is not None]
    return Exchange(
        params=params,
        islands=len(regions),
        step_s=max(rate for rate in rates if rate is not None),
        bps=min(links) * 1e6 if links else math.inf,
        rtt_s=max(r.rtt_ms for r in regions) / 1000,
    )


def params_of(config) -> int:
    """The parameters of a cluster's model, built as an island builds it."""
    import numpy as np

    from dloco.analysis.globalmodel import build_task
    from dloco.cluster.records import run_task
    from dloco.island.train import flat_params

    return int(sum(np.size(v) for v in flat_params(build_task(run_task(config)).model).values()))


def _seconds(value: float | None) -> str:
    return "never" if value is None else f"{value:,.0f} s"


def _ratio(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}x"


def table(rows: Sequence[dict], x: Exchange) -> list[str]:
    """The bandwidth curve as Markdown: per link bandwidth, data parallelism's step and its time to
    decoupled's final loss as built and at best practice, and the ratio to decoupled's time."""
    lines = [
        (
            f"Data parallelism at equal per-island compute ({x.islands} islands, the slowest"
            f" {x.step_s:.2f} s a step as measured; {x.params:,} parameters), to decoupled's final"
            " loss, against the links' bandwidth (each way; the profile's slowest link is the"
            " 1x row):"
        ),
        "",
        "| link | DP step, hub fp32 | DP step, ring bf16 | DP time (hub / ring) | decoupled |"
        " ratio (hub / ring) |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['mbps']:g} Mbit/s ({r['factor']:g}x) | {r['hub_step_s']:.2f} s |"
            f" {r['ring_step_s']:.2f} s | {_seconds(r['hub_s'])} / {_seconds(r['ring_s'])} |"
            f" {_seconds(r['decoupled_s'])} | {_ratio(r['hub_ratio'])} /"
            f" {_ratio(r['ring_ratio'])} |"
        )
    return [*lines, ""]
