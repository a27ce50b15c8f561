"""`dloco evaluator`: the merger's global model evaluated while the run goes on, for the status page
and the report's global curve.

It follows the snapshot bus like an island that never trains (island/follower.py) and evaluates the
newest whole model on the islands' held-out batches, no more often than every `every_s` seconds
and spending at most `budget` of its wall time evaluating; it runs at the lowest CPU priority, so
the islands and the merger get the cores first.  Each evaluation is one JSON line:
{"wall", "versions" (per fragment), "eval_loss", "eval_<metric>", "eval_s"}.
"""

from __future__ import annotations

import time
from collections.abc import Callable

# how often a follower with nothing new is looked at again
IDLE_S = 0.2


def next_wait(spent_s: float, every_s: float, budget: float) -> float:
    """Seconds from one evaluation's start to the next: at least `every_s`, and long enough that
    evaluating (`spent_s` each) takes at most `budget` of the time."""
    return max(every_s, spent_s / budget)


def whole_model(
    held: dict[int, tuple[int, dict]], paths: set[str]
) -> tuple[list[int], dict] | None:
    """(versions by fragment, parameters) once the fragments held cover every parameter in `paths`
    (the merger's fragments, however many it has); None before."""
    params = {path: value for fragment in sorted(held) for path, value in held[fragment][1].items()}
    if not paths <= params.keys():
        return None
    return [held[fragment][0] for fragment in sorted(held)], params


def follow(
    current: Callable[[], dict],
    evaluate: Callable[[dict], dict[str, float]],
    write: Callable[[dict], None],
    paths: set[str],
    every_s: float,
    budget: float,
    stopped: Callable[[], bool],
) -> int:
    """Evaluate each new whole model `current()` offers, on the schedule of `next_wait`, until
    `stopped()`; returns how many evaluations were written."""
    evaluated, due, count = None, 0.0, 0
    while not stopped():
        model = whole_model(current(), paths)
        now = time.monotonic()
        if model is None or model[0] == evaluated or now < due:
            time.sleep(IDLE_S)
            continue
        versions, params = model
        began = time.perf_counter()
        results = evaluate(params)
        spent = time.perf_counter() - began
        write(
            {
                "wall": time.time(),
                "versions": versions,
                **{f"eval_{k}": v for k, v in results.items()},
                "eval_s": round(spent, 4),
            }
        )
        evaluated, due, count = versions, now + next_wait(spent, every_s, budget), count + 1
    return count
