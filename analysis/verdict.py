"""Whether a finished run did what it was for, from counts alone (pure): every island trained at
least one interval and the merger folded; a run bounded by steps got there before its time limit
and reached every point of its chaos schedule.  `dloco up` and `dloco experiment` exit non-zero
with these reasons instead of reporting a run that did not train."""

from __future__ import annotations

from collections.abc import Mapping


def untrained(steps: Mapping[str, int], folds: int, interval: int) -> list[str]:
    """Reasons the run did not train (none: it did).  steps: training steps per island, every life;
    folds: the merger's folds; interval: H, the steps after which every fragment has been sent."""
    reasons = [f"island {name} made {count} training step{'s' * (count != 1)}, fewer than one interval (H = {interval})"
               for name, count in steps.items() if count < interval]
    if folds == 0:
        reasons.append("the merger never folded a delta: the global model did not change")
    return reasons


def unfinished(stages: Mapping[str, str], limit_s: float, max_steps: int) -> list[str]:
    """A run bounded by steps that hit its time limit: which islands were short of their steps, and
    where they were (stages: island -> what it was doing)."""
    if not stages:
        return []
    return [f"the time limit ({limit_s:g} s) passed before every island made {max_steps} steps: "
            + "; ".join(f"{name} {stage}" for name, stage in stages.items())]


def unreached(pending: list[str], steps: Mapping[str, int], folds: int) -> list[str]:
    """Chaos events whose point the run did not reach before its time limit."""
    if not pending:
        return []
    made = ", ".join(f"{name} {count}" for name, count in steps.items())
    return [f"chaos events never reached: {', '.join(pending)} (steps made: {made}; folds: {folds})"]
