"""Speedup against the synchronous baseline past what a 300 s `sync-avg` run reaches.

Over the emulated WAN a `sync-avg` run trains ~19 steps in 300 s, so a time-to-target against it can
only use an early-training loss.  Its loss per step, however, does not depend on the link (every
step is one barrier-averaged step, however long the barrier takes).  So the `speedup` suite also
runs `sync-avg-full-speed`, the same cluster without link emulation, for as many steps as the
decoupled run's cluster tokens take, and each of its steps is given the wall-clock time a step took
in the emulated `sync-avg` run.  Pure functions of the runs' island evaluations (`RunResult.evals`).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

# the suite's run of sync-avg without link emulation
FULL_SPEED = "sync-avg-full-speed"


def first_life(events: Sequence[dict]) -> list[dict]:
    return [e for e in events if e.get("life", 0) == 0]


def seconds_per_step(evals: dict[str, list[dict]]) -> float | None:
    """A run's seconds per step (the median over islands of the time between their first and last
    evaluation over the steps between them; deferred evaluations carry their step's time)."""
    rates = []
    for events in evals.values():
        points = sorted(first_life(events), key=lambda e: e["step"])
        if len(points) >= 2 and points[-1]["step"] > points[0]["step"]:
            rates.append(
                (points[-1]["since_start"] - points[0]["since_start"])
                / (points[-1]["step"] - points[0]["step"])
            )
    return statistics.median(rates) if rates else None


def mean_curve(evals: dict[str, list[dict]]) -> list[tuple[int, float]]:
    """(step, mean held-out loss over the islands that evaluated at that step), by step."""
    by_step: dict[int, list[float]] = {}
    for events in evals.values():
        for e in first_life(events):
            by_step.setdefault(e["step"], []).append(e["eval_loss"])
    return [(step, statistics.fmean(losses)) for step, losses in sorted(by_step.items())]


def steps_to(curve: Sequence[tuple[int, float]], target: float) -> float | None:
    """The step at which `curve` first reaches `target`, linearly between evaluations; None if
    never."""
    for (s0, l0), (s1, l1) in zip([(0, math.inf), *curve], curve):
        if l1 <= target:
            if not math.isfinite(l0) or l0 == l1:
                return float(s1)
            return s0 + (l0 - target) / (l0 - l1) * (s1 - s0)
    return None


def final_loss(evals: dict[str, list[dict]]) -> float | None:
    """A run's final loss: the best of its islands' last evaluations (first life)."""
    finals = [
        max(first_life(events), key=lambda e: e["step"])["eval_loss"]
        for events in evals.values()
        if first_life(events)
    ]
    return min(finals) if finals else None


def extrapolated_seconds(
    full_speed: dict[str, list[dict]], emulated: dict[str, list[dict]], target: float
) -> float | None:
    """Seconds `sync-avg` would take over the emulated links to reach `target`: the full-speed run's
    steps to it times the emulated run's seconds per step.  None when either is unknown."""
    steps, per_step = steps_to(mean_curve(full_speed), target), seconds_per_step(emulated)
    return None if steps is None or per_step is None else steps * per_step
