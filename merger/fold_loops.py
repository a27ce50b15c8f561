"""Compiled loops over blockwise int codes (int8, int4, int2) for folds merged from codes
(merger/coded.py): each reads a delta's codes once, level by level, without unpacking them into
arrays first.

- `products`: per block, the sum of a product of two deltas' levels (exact integers; a delta with
  itself gives its squares).  Every norm a fold needs follows from these and the block scales:
  ``||u_b||^2 = sum_m sum_m' f_mb f_m'b G_mm'b`` for ``u = sum_m f_m q_m``.
- `accumulate_into`: ``out += f_b * q`` into a tensor's float32 values, and on the last delta
  ``out *= s_b``: the merged pseudo-gradient written straight into the tensor's shape.
- `norm`: the Euclidean norm of float32 tensors (the guard's cold reference, a fragment's norm
  before every fold that has no other reference: merger/outliers.py), in a fixed order.

A byte's levels are those of protocol/code_loops.py (value ``per * k + j`` of a block is position
j of its byte k: PROTOCOL.md §Codecs).  The loops are numba-compiled (no fast-math: no
reassociation and no fused multiply-add, so every value is the same sequence of float32 roundings
on any CPU, as replay and a standby need) and release the GIL; `protocol.pieces.run_split` runs
them over a part of the blocks per thread.  They are compiled at their first call (about a second
a codec; the merger's warm-up makes that call: merger/warmup.py).  Pure functions of arrays; no
I/O.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numba
import numpy as np

from dloco.protocol.code_loops import LEVELS
from dloco.protocol.pieces import DEFAULT_THREADS, run_split


def _loops(level, per):
    """The two loops of one codec: `level(byte, j)` is the level at position j of a byte."""

    @numba.njit(nogil=True)
    def products(a, b, out, lo, hi):  # pragma: no cover - compiled
        for r in range(lo, hi):
            total = np.int64(0)
            for k in range(a.shape[1]):
                for j in range(per):
                    total += level(a[r, k], j) * level(b[r, k], j)
            out[r] = total

    @numba.njit(nogil=True)
    def accumulate(out, codes, factor, scale, first, last, lo, hi):  # pragma: no cover
        for r in range(lo, hi):
            f, s = factor[r], scale[r]
            for k in range(codes.shape[1]):
                for j in range(per):
                    v = np.float32(level(codes[r, k], j)) * f
                    if not first:
                        v = out[r, k * per + j] + v
                    if last:
                        v = v * s
                    out[r, k * per + j] = v

    return products, accumulate


# each codec's loops with its levels per byte as constants, so that they vectorise (one generic
# loop over a runtime count was 5-25x slower)
_LOOPS = {bits: _loops(level, per) for bits, (level, per, _) in LEVELS.items()}

# values per partial sum of `norm`, and its independent running sums (lanes) within a part: a
# fixed split, so that the order of additions depends on neither the threads nor the CPU
NORM_PART = 1 << 16
NORM_LANES = 8


@numba.njit(nogil=True)
def _square_sums(x, out, lo, hi):  # pragma: no cover - compiled
    for part in range(lo, hi):
        start, end = part * NORM_PART, min(x.shape[0], (part + 1) * NORM_PART)
        lanes = np.zeros(NORM_LANES, np.float64)
        full = start + (end - start) // NORM_LANES * NORM_LANES
        for i in range(start, full, NORM_LANES):
            for lane in range(NORM_LANES):
                v = np.float64(x[i + lane])
                lanes[lane] += v * v
        for i in range(full, end):
            v = np.float64(x[i])
            lanes[0] += v * v
        total = 0.0
        for lane in range(NORM_LANES):
            total += lanes[lane]
        out[part] = total


def products(a: np.ndarray, b: np.ndarray, bits: int, threads: int = DEFAULT_THREADS) -> np.ndarray:
    """(B, C) uint8 codes of two deltas -> (B,) int64: per block, the sum over its values of the
    product of their levels."""
    if a.shape != b.shape:
        raise ValueError(f"codes of shapes {a.shape} and {b.shape} do not pair")
    out = np.empty(a.shape[0], np.int64)
    loop = _LOOPS[bits][0]
    run_split(lambda lo, hi: loop(a, b, out, lo, hi), a.shape[0], threads)
    return out


def accumulate_into(
    out: np.ndarray,
    codes: np.ndarray,
    factor: np.ndarray,
    scale: np.ndarray,
    bits: int,
    first: bool,
    last: bool,
    threads: int = DEFAULT_THREADS,
) -> None:
    """out (a tensor's N float32 values, flat) <- (first ? 0 : out) + factor_b * level, then times
    scale_b if `last`; codes (B, C) with B = ceil(N / block), factor and scale (B,) float32."""
    width = codes.shape[1] * (8 // bits)
    full, rest = divmod(out.shape[0], width)
    if full + (rest > 0) != codes.shape[0]:
        raise ValueError(f"{codes.shape[0]} blocks of codes for {out.shape[0]} values")
    loop = _LOOPS[bits][1]
    # blocks as rows: the compiled loop indexes two dimensions (a flat index was 2x slower)
    values = out[: full * width].reshape(full, width)
    run_split(lambda lo, hi: loop(values, codes, factor, scale, first, last, lo, hi), full, threads)
    if rest:
        # the tensor's last block, partly padding: through a block-sized buffer
        tail = np.empty((1, width), np.float32)
        if not first:
            tail[0, :rest] = out[full * width :]
        loop(tail, codes[full:], factor[full:], scale[full:], first, last, 0, 1)
        out[full * width :] = tail[0, :rest]


def norm(tensors: Iterable[np.ndarray], threads: int = DEFAULT_THREADS) -> float:
    """Euclidean norm of float32 tensors taken as one vector: squares in float64, summed in parts
    of NORM_PART values (each over NORM_LANES running sums), the parts' sums added exactly
    (`math.fsum`): the same float on any machine and any number of threads."""
    sums = []
    for tensor in tensors:
        x = np.ascontiguousarray(tensor, dtype=np.float32).reshape(-1)
        out = np.empty(-(-x.size // NORM_PART), np.float64)
        run_split(lambda lo, hi: _square_sums(x, out, lo, hi), out.size, threads)
        sums.append(out)
    return math.sqrt(math.fsum(np.concatenate(sums))) if sums else 0.0
