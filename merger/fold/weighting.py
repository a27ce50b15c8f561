"""Contribution weights: "quantity x quality" token weighting with an optional staleness discount,
and the share of a round that one fold stands for.

``w = tokens**2 / steps``: proportional to tokens (quantity) times tokens per step (quality: an
island that fit more tokens in each step, i.e. larger batches, gets more say).  A slow island
that trained fewer tokens is down-weighted on its own.  The optional discount multiplies by
``(1 + staleness) ** -power``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence


def token_weight(tokens: int, steps: int) -> float:
    if steps < 1 or tokens < 0:
        raise ValueError(
            f"token_weight needs steps >= 1 and tokens >= 0, got tokens={tokens}, steps={steps}"
        )
    return float(tokens) * float(tokens) / float(steps)


def staleness_discount(staleness: int, power: float) -> float:
    if staleness < 0:
        raise ValueError(f"staleness must be >= 0, got {staleness}")
    return (1.0 + staleness) ** -power


def capped(weights: Sequence[float], others: Sequence[float], ratio: float) -> list[float]:
    """Each weight at most `ratio` times the largest of the rest (the other entries and `others`,
    the recent weights of islands not in the list): an island's weight is what it claims (tokens,
    steps), so no island may outweigh the heaviest other one more than `ratio` times.  Unchanged
    with ratio 0, or with nobody else to compare to."""
    if ratio <= 0:
        return list(weights)
    out = []
    for i, weight in enumerate(weights):
        rest = [x for j, x in enumerate(weights) if j != i] + list(others)
        out.append(min(weight, ratio * max(rest)) if rest and max(rest) > 0 else weight)
    return out


def weights(
    counters: list[tuple[int, int, int]], power: float, max_ratio: float = 0.0
) -> list[float]:
    """Weights of (tokens, steps, staleness) triples, capped (`capped`, within the list), normalised
    to sum to 1."""
    raw = capped(raw_weights(counters, power), (), max_ratio)
    total = sum(raw)
    if total <= 0:
        return [1.0 / len(raw)] * len(raw)
    return [w / total for w in raw]


def raw_weights(counters: list[tuple[int, int, int]], power: float) -> list[float]:
    """Unnormalised weights of (tokens, steps, staleness) triples."""
    return [
        token_weight(tokens, steps) * staleness_discount(staleness, power)
        for tokens, steps, staleness in counters
    ]


def fold_share(
    members: Sequence[tuple[str, float]],
    last_contributions: Mapping[str, tuple[int, float]],
    version: int,
    window: int,
) -> float:
    """The fraction of a whole round's weight that a fold of `members` ((island, raw weight) pairs)
    carries, when it makes the fragment's `version`.

    A whole round: the fold's members plus every other island that contributed to this fragment
    within the last `window` versions (`last_contributions`: island -> (version of the fold that
    took its last delta, that delta's raw weight)).  A fold of every active island's delta (a
    synchronous round) has share 1; one island's delta out of four equal ones, 1/4; an island gone
    for more than `window` versions stops counting.  window = 0: always 1 (every fold a whole step).
    """
    if window == 0:
        return 1.0
    islands = {island for island, _ in members}
    active = recent_others(last_contributions, islands, version, window)
    own = sum(weight for _, weight in members)
    # weightless deltas (no tokens): count islands instead, as `weights` does
    if own <= 0:
        return len(islands) / (len(islands) + len(active))
    return own / (own + sum(active))


def recent_others(
    last_contributions: Mapping[str, tuple[int, float]],
    islands: set[str],
    version: int,
    window: int,
) -> list[float]:
    """The last raw weights of the islands not in `islands` that contributed within `window`
    versions."""
    return [
        weight
        for island, (at, weight) in last_contributions.items()
        if island not in islands and version - at <= window
    ]
