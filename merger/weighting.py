"""Contribution weights: "quantity x quality" token weighting with an optional staleness discount.

``w = tokens**2 / steps``: proportional to tokens (quantity) times tokens per step (quality: an
island that fit more tokens in each step, i.e. larger batches, gets more say).  A slow island
that trained fewer tokens is down-weighted on its own.  The optional discount multiplies by
``(1 + staleness) ** -power``.
"""

from __future__ import annotations


def token_weight(tokens: int, steps: int) -> float:
    if steps < 1 or tokens < 0:
        raise ValueError(f"token_weight needs steps >= 1 and tokens >= 0, got tokens={tokens}, steps={steps}")
    return float(tokens) * float(tokens) / float(steps)


def staleness_discount(staleness: int, power: float) -> float:
    if staleness < 0:
        raise ValueError(f"staleness must be >= 0, got {staleness}")
    return (1.0 + staleness) ** -power


def weights(counters: list[tuple[int, int, int]], power: float) -> list[float]:
    """Weights of (tokens, steps, staleness) triples, normalised to sum to 1."""
    raw = [token_weight(tokens, steps) * staleness_discount(staleness, power) for tokens, steps, staleness in counters]
    total = sum(raw)
    if total <= 0:
        return [1.0 / len(raw)] * len(raw)
    return [w / total for w in raw]
