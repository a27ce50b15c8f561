"""Merging several deltas of one tensor: weighted average, and radial-directional averaging (RDA).

A plain weighted mean of M near-orthogonal deltas shrinks like 1/sqrt(M); RDA keeps the mean
*length* and the mean *direction* apart (Decoupled DiLoCo, 2026):

    r = sum_m w_m ||d_m||            (weights normalised to sum 1)
    u = sum_m w_m d_m / ||d_m||      (zero deltas contribute no direction)
    merged = r * u / ||u||           (0 if u = 0)

With one delta, RDA returns it unchanged.  Arithmetic is float32 elementwise in a fixed order
with float64 norms (numpy pairwise sums, no BLAS), so equal inputs give equal bytes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np


def norm(x: np.ndarray) -> float:
    flat = np.asarray(x, dtype=np.float32).reshape(-1)
    return float(np.sqrt(np.add.reduce(flat.astype(np.float64) ** 2)))


def fragment_norm(tensors: Mapping[str, np.ndarray]) -> float:
    """Euclidean norm of all tensors of a fragment taken as one vector."""
    return float(np.sqrt(sum(norm(t) ** 2 for t in tensors.values())))


def weighted_average(deltas: Sequence[np.ndarray], weights: Sequence[float]) -> np.ndarray:
    out = np.zeros(np.shape(deltas[0]), dtype=np.float32)
    for delta, weight in zip(deltas, weights):
        out += np.float32(weight) * delta
    return out


def radial_directional_average(deltas: Sequence[np.ndarray], weights: Sequence[float]) -> np.ndarray:
    norms = [norm(d) for d in deltas]
    radius = sum(w * n for w, n in zip(weights, norms))
    direction = np.zeros(np.shape(deltas[0]), dtype=np.float32)
    for delta, weight, length in zip(deltas, weights, norms):
        if length > 0:
            direction += np.float32(weight / length) * delta
    length = norm(direction)
    if length == 0 or radius == 0:
        return np.zeros_like(direction)
    return direction * np.float32(radius / length)
