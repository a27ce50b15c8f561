"""Whether a finished run did what it was for, from counts alone (pure): every island trained at
least one interval and the merger folded; a run bounded by steps got there before its time limit
and reached every point of its chaos schedule, and one bounded by a token budget spent it.  `dloco
up` and `dloco experiment` exit non-zero with these reasons instead of reporting a run that did not
train."""

from __future__ import annotations

from collections.abc import Mapping


def untrained(steps: Mapping[str, int], folds: int, interval: int | Mapping[str, int]) -> list[str]:
    """Reasons the run did not train (none: it did).  steps: training steps per island, every life;
    folds: the merger's folds; interval: H, the steps after which every fragment has been sent (or
    each island's)."""
    reasons = [
        f"island {name} made {count} training step{'s' * (count != 1)}, fewer than one interval (H"
        f" = {_h(interval, name)})"
        for name, count in steps.items()
        if count < _h(interval, name)
    ]
    if folds == 0:
        reasons.append("the merger never folded a delta: the global model did not change")
    return reasons


def targets(
    islands: list[str],
    down: set[str],
    max_steps: int,
    interval: int | Mapping[str, int],
    after_chaos: Mapping[str, int] | None,
) -> dict[str, int]:
    """When a run bounded by steps may end: the steps (every life) each island that is up must have
    made.  max_steps each, and, once a chaos schedule has run, two intervals (2 H) more than each
    had when its last event fired (`after_chaos`; None without chaos), so that the recovery is part
    of the run.  An island that is down (killed, not to be restarted) has no target."""
    return {
        name: max(
            max_steps, after_chaos[name] + 2 * _h(interval, name) if after_chaos is not None else 0
        )
        for name in islands
        if name not in down
    }


def _h(interval: int | Mapping[str, int], name: str) -> int:
    """An island's H: the one for all, or its own."""
    return interval if isinstance(interval, int) else interval[name]


def short(steps: Mapping[str, int], wanted: Mapping[str, int]) -> dict[str, int]:
    """The islands still short of their targets, with the target."""
    return {name: target for name, target in wanted.items() if steps.get(name, 0) < target}


def unfinished(stages: Mapping[str, str], limit_s: float) -> list[str]:
    """A run bounded by steps that hit its time limit: which islands were short of their steps, and
    where they were (stages: island -> what it was doing, with its steps made and wanted)."""
    if not stages:
        return []
    return [
        f"the time limit ({limit_s:g} s) passed before every island had made its steps: "
        + "; ".join(f"{name} {stage}" for name, stage in stages.items())
    ]


def unreached(
    pending: list[str],
    steps: Mapping[str, int],
    folds: int,
    folded: Mapping[str, int] | None = None,
) -> list[str]:
    """Chaos events whose point the run did not reach before its time limit.  `folded`: per island,
    the folds that took one of its deltas."""
    if not pending:
        return []
    made = ", ".join(f"{name} {count}" for name, count in steps.items())
    per_island = (
        f" ({', '.join(f'{name} {count}' for name, count in folded.items())})" if folded else ""
    )
    return [
        f"chaos events never reached: {', '.join(pending)} (steps made: {made}; folds:"
        f" {folds}{per_island})"
    ]


def budget_unspent(tokens: int, budget: int, limit_s: float) -> list[str]:
    """A run bounded by a token budget that hit its time limit first."""
    if tokens >= budget:
        return []
    return [
        f"the time limit ({limit_s:g} s) passed with {tokens:,} of the budget's {budget:,} tokens"
        f" trained ({tokens / budget:.0%}): give a longer --duration, or a smaller --tokens"
    ]
