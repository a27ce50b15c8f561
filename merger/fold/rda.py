"""Merging several deltas of one tensor: weighted average, and radial-directional averaging (RDA).

A plain weighted mean of M near-orthogonal deltas shrinks like 1/sqrt(M); RDA keeps the mean
*length* and the mean *direction* apart (Decoupled DiLoCo, 2026):

    r = sum_m w_m ||d_m||            (weights normalised to sum 1)
    u = sum_m w_m d_m / ||d_m||      (zero deltas contribute no direction)
    merged = r * u / ||u||           (0 if u = 0)

With one delta, RDA returns it unchanged.  Arithmetic is float32 elementwise in a fixed order
with float64 norms (numpy pairwise sums over fixed pieces, no BLAS, whose threading could change
the summation order), so equal inputs give equal bytes on any machine.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

# values per partial sum: keeps the squared temporaries in cache
_PIECE = 1 << 16


def norm(x: np.ndarray) -> float:
    flat = np.asarray(x, dtype=np.float32).reshape(-1)
    total = 0.0
    for start in range(0, flat.size, _PIECE):
        piece = flat[start : start + _PIECE]
        total += float(np.add.reduce(piece * piece, dtype=np.float64))
    return float(np.sqrt(total))


def fragment_norm(tensors: Mapping[str, np.ndarray]) -> float:
    """Euclidean norm of all tensors of a fragment taken as one vector."""
    return float(np.sqrt(sum(norm(t) ** 2 for t in tensors.values())))


def weighted_average(deltas: Sequence[np.ndarray], weights: Sequence[float]) -> np.ndarray:
    out = np.zeros(np.shape(deltas[0]), dtype=np.float32)
    scratch = np.empty_like(out)
    for delta, weight in zip(deltas, weights):
        out += np.multiply(delta, np.float32(weight), out=scratch)
    return out


def radial_directional_average(
    deltas: Sequence[np.ndarray], weights: Sequence[float]
) -> np.ndarray:
    norms = [norm(d) for d in deltas]
    radius = sum(w * n for w, n in zip(weights, norms))
    direction = np.zeros(np.shape(deltas[0]), dtype=np.float32)
    scratch = np.empty_like(direction)
    for delta, weight, length in zip(deltas, weights, norms):
        if length > 0:
            direction += np.multiply(delta, np.float32(weight / length), out=scratch)
    length = norm(direction)
    if length == 0 or radius == 0:
        return np.zeros_like(direction)
    direction *= np.float32(radius / length)
    return direction
