"""The bandwidth curve, measured (`dloco experiment links`): the links' effect on each mode's step,
run at several multiples of the profile's links rather than modelled.

- `sync-avg` moves what data parallelism through this system's hub moves (every island's fp32
  change up, the average down, a barrier each step): its measured seconds per step at 1x, 2x and
  8x the links, beside suites/wallclock.py's model of the same step (the island's measured compute,
  taken from the decoupled run at 1x, plus 2 x 4 bytes per parameter over the slowest link and the
  longest round trip).  The quality suite's wall-clock table rests on that model.
- decoupled at 1x, 1/8 and 1/32 of the links: whether its islands still train without waiting
  (their compute utilisation and seconds per step), which the wall-clock table assumes at every
  bandwidth.
"""

from __future__ import annotations

import dataclasses

from dloco.suites import speedup, wallclock
from dloco.suites.transforms import Transform, chain, links, mode

SYNC_FACTORS = (1.0, 2.0, 8.0)
DECOUPLED_FACTORS = (1.0, 1 / 8, 1 / 32)


def label(run_mode: str, factor: float) -> str:
    """`sync-avg-x2`, `decoupled-x0.125`."""
    return f"{run_mode}-x{factor:g}"


def runs() -> list[tuple[str, Transform]]:
    """The suite's runs: sync-avg at SYNC_FACTORS, decoupled at DECOUPLED_FACTORS."""
    return [(label("sync-avg", f), chain(mode("sync-avg"), links(f))) for f in SYNC_FACTORS] + [
        (label("decoupled", f), links(f)) for f in DECOUPLED_FACTORS
    ]


def factor_of(run_label: str) -> float:
    """The multiple of the profile's links a run of the suite ran at (its label's `-xF`)."""
    return float(run_label.rsplit("-x", 1)[1].split(" ")[0])


def slowest_mbps(config) -> float | None:
    """The slowest link of a run's regions, Mbit/s each way (None: unlimited)."""
    rates = [b for r in config.regions for b in (r.uplink_mbps, r.downlink_mbps) if b is not None]
    return min(rates) if rates else None


def busy(result) -> float | None:
    """The least busy island's compute utilisation."""
    utils = [e["compute_util"] for e in result.last.values() if "compute_util" in e]
    return min(utils) if utils else None


def up_down_per_token(result) -> tuple[float, float]:
    """Bytes each island sent and received per token it trained, summed over the islands."""
    tokens = sum(e.get("tokens", 0) for e in result.last.values()) or 1
    sent = sum(e.get("bytes_sent", 0) for e in result.last.values())
    received = sum(e.get("bytes_received", 0) for e in result.last.values())
    return sent / tokens, received / tokens


def modelled_hub_step_s(base: wallclock.Exchange, factor: float) -> float:
    """suites/wallclock.py's data-parallel step through the hub, at `factor` times the links."""
    return wallclock.dp_step_s(dataclasses.replace(base, bps=base.bps * factor), "hub")


def lines(results: list, params: int | None = None) -> list[str]:
    """The suite's two tables: sync-avg's step measured against the hub model, decoupled's
    islands against the links."""
    by_label = {r.label: r for r in results}
    reference = by_label.get(label("decoupled", 1.0))
    base = None
    if reference is not None and any(reference.evals.values()):
        base = wallclock.exchange_of(
            reference, params if params is not None else wallclock.params_of(reference.config)
        )
    out = ["", "The links' effect on a step, measured:", ""]
    sync = [r for r in results if r.label.startswith("sync-avg-x")]
    if sync:
        out += [
            "| run | slowest link | sync-avg: seconds per step, measured | the hub model's"
            " data-parallel step | measured / model |",
            "|---|---|---|---|---|",
        ]
        for r in sync:
            measured = speedup.seconds_per_step(r.evals)
            model = None if base is None else modelled_hub_step_s(base, factor_of(r.label))
            ratio = "n/a" if measured is None or model is None else f"{measured / model:.2f}"
            out.append(
                f"| {r.label} | {_mbps(slowest_mbps(r.config))} | {_s(measured)} | {_s(model)} |"
                f" {ratio} |"
            )
        out += [
            "",
            "The model's compute per step is the slowest island's in the decoupled run at 1x"
            + (f" ({base.step_s:.2f} s)" if base is not None else " (not run: n/a)")
            + "; sync-avg's step is measured from its islands' first to last evaluation.",
            "",
        ]
    decoupled = [r for r in results if r.label.startswith("decoupled-x")]
    if decoupled:
        out += [
            "| run | slowest link | decoupled: seconds per step (median island) | least busy"
            " island | bytes up / down per token |",
            "|---|---|---|---|---|",
        ]
        for r in decoupled:
            up, down = up_down_per_token(r)
            least = busy(r)
            out.append(
                f"| {r.label} | {_mbps(slowest_mbps(r.config))} |"
                f" {_s(speedup.seconds_per_step(r.evals))} |"
                f" {'n/a' if least is None else f'{least:.2f}'} | {up:,.1f} / {down:,.1f} |"
            )
        out.append("")
    return out


def _s(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f} s"


def _mbps(value: float | None) -> str:
    return "unlimited" if value is None else f"{value:g} Mbit/s"
