"""The inner learning rate over a run's token budget (PROTOCOL.md §6.1).

Without a budget an island's schedule follows its own steps (warmup, then cosine to 10 % of the
peak at `max_steps`: island/train.py).  With a budget of N cluster tokens it warms up over its own
first steps and then decays over the cluster's progress p = min(1, tokens / N), the same p for a
fast island and a slow one, as every island learns the cluster's tokens from the merger's acks:

    rate(step, tokens) = peak · warmup(step) · decay(p)
    decay(p) = f + (1 − f) · ½ (1 + cos π p)

with f = FLOOR, the cosine's end as in the step schedule.  `decay` is applied as a multiplier on
the optimizer's update (`Trainer.set_rate_scale`), so it reaches a task's own optimizer too.
"""

from __future__ import annotations

import math

# the decay ends at this fraction of the peak, as the step schedule's cosine does
FLOOR = 0.1


def progress(cluster_tokens: int, budget: int) -> float:
    """p in [0, 1]: the cluster's share of its budget."""
    if budget <= 0:
        raise ValueError(f"a budget is a positive number of tokens, got {budget}")
    return min(1.0, max(0, cluster_tokens) / budget)


def decay(p: float) -> float:
    """The budget's multiplier on the learning rate at progress p: 1 at 0, FLOOR at 1."""
    return FLOOR + (1.0 - FLOOR) * 0.5 * (1.0 + math.cos(math.pi * min(1.0, max(0.0, p))))


def cluster_view(heard: int, own: int) -> int:
    """What an island takes as the cluster's tokens: the most the merger has said (acks), never
    less than what this island trained in this life itself."""
    return max(heard, own)
