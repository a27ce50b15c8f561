"""Compiled loops over blockwise int codes (int8, int4, int2) for folds merged from codes
(merger/engines/coded.py): each reads the codes once, level by level, without unpacking them into
arrays first.

- `gram`: per block, the sums of products of every two deltas' levels (exact integers; a delta
  with itself gives its squares).  Every norm a fold needs follows from these and the block
  scales: ``||u_b||^2 = sum_m sum_n f_mb f_nb G_mnb`` for ``u = sum_m f_m q_m``.
- `merge_into`: ``(sum_m f_mb q_m) * s_b`` into float32 values: the merged pseudo-gradient.
- `nesterov_into`: that pseudo-gradient g, in a block-sized buffer, taken straight into the outer
  step of Nesterov momentum (``t = g + mu m; p' = p - lr (g + mu t); m' = t``) from one
  fragment's parameters and momentum (float32, or bfloat16 rounded to nearest even) into another
  (or the same) pair: the fold's one pass over the model (merger/engines/fused.py).
- `norm`: the Euclidean norm of float32 tensors (the guard's cold reference, a fragment's norm
  before every fold that has no other reference: merger/fold/outliers.py), in a fixed order; or a
  lower bound of it from a fixed sample of its parts.

`gram`, `merge_into` and `nesterov_into` read a round's codes block by block, every delta's block
once, through a block-sized buffer in L1.

A byte's levels are those of protocol/code_loops.py (value ``per * k + j`` of a block is position
j of its byte k: PROTOCOL.md §Codecs).  The loops are numba-compiled (no fast-math: no
reassociation and no fused multiply-add, so every value is the same sequence of float32 roundings
on any CPU, as replay and a standby need) and release the GIL; `protocol.pieces.run_split` runs
them over a part of the blocks per thread.  They are compiled at their first call and cached on
disk (protocol/code_loops.py `compiled`; the merger's warm-up makes that call:
merger/fold/warmup.py). Pure functions of arrays; no I/O.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable

import numba
import numpy as np

from dloco.protocol.code_loops import LEVELS, compiled, level
from dloco.protocol.pieces import DEFAULT_THREADS, run_split


@numba.njit(inline="always")
def _merged_block(u, codes, factors, r, per, bits):  # pragma: no cover - compiled
    """u <- block r's sum over deltas of factors_mr * levels, in delta order from the first: the
    sequential float32 sum, in a block-sized buffer in L1 (`per`, `bits`: the codec's constants
    where the loops call it)."""
    f = factors[0, r]
    for k in range(codes.shape[2]):
        for j in range(per):
            u[k * per + j] = np.float32(level(codes[0, r, k], j, bits)) * f
    for m in range(1, codes.shape[0]):
        f = factors[m, r]
        for k in range(codes.shape[2]):
            for j in range(per):
                u[k * per + j] = u[k * per + j] + np.float32(level(codes[m, r, k], j, bits)) * f


def _loops(bits: int):
    """The two loops of one codec (`level(byte, j, bits)`: the level at position j of a byte).
    Both take a round's codes as one (M, B, C) array and read each block of every delta once."""
    per = LEVELS[bits][0]

    def gram(codes, out, lo, hi):  # pragma: no cover - compiled
        deltas, width = codes.shape[0], codes.shape[2] * per
        # a block's levels, delta by delta (in L1: each loop below runs over a block, vectorised)
        q = np.empty((deltas, width), np.int32)
        for r in range(lo, hi):
            for m in range(deltas):
                for k in range(codes.shape[2]):
                    for j in range(per):
                        q[m, k * per + j] = level(codes[m, r, k], j, bits)
            out[r] = 0
            for m in range(deltas):
                for n in range(m, deltas):
                    total = np.int64(0)
                    for i in range(width):
                        total += q[m, i] * q[n, i]
                    out[r, m, n] = total

    def merge(out, codes, factors, scale, lo, hi):  # pragma: no cover - compiled
        width = codes.shape[2] * per
        u = np.empty(width, np.float32)
        for r in range(lo, hi):
            _merged_block(u, codes, factors, r, per, bits)
            s = scale[r]
            for i in range(width):
                out[r, i] = u[i] * s

    return compiled(gram, f"gram_int{bits}"), compiled(merge, f"merge_int{bits}")


# each codec's loops with its levels per byte as constants, so that they vectorise (one generic
# loop over a runtime count is several times slower)
_LOOPS = {bits: _loops(bits) for bits in LEVELS}

# values per partial sum of `norm`, and its independent running sums (lanes) within a part: a
# fixed split, so that the order of additions depends on neither the threads nor the CPU
NORM_PART = 1 << 16
NORM_LANES = 8


def _square_sums(x, out, lo, hi, every):  # pragma: no cover - compiled
    for j in range(lo, hi):
        part = j * every
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
        out[j] = total


_square_sums = compiled(_square_sums, "square_sums")


def gram(codes: np.ndarray, bits: int, threads: int = DEFAULT_THREADS) -> np.ndarray:
    """(M, B, C) uint8 codes of a round's deltas -> (B, M, M) int64: per block, the sums over its
    values of the products of deltas m and n's levels (n >= m; zero below)."""
    out = np.empty((codes.shape[1], codes.shape[0], codes.shape[0]), np.int64)
    loop = _LOOPS[bits][0]
    run_split(lambda lo, hi: loop(codes, out, lo, hi), codes.shape[1], threads)
    return out


def merge_into(
    out: np.ndarray,
    codes: np.ndarray,
    factors: np.ndarray,
    scale: np.ndarray,
    bits: int,
    threads: int = DEFAULT_THREADS,
) -> None:
    """out (a tensor's N float32 values, flat) <- (sum over m in order of factors_mb * level_m)
    times scale_b, in float32; codes (M, B, C) with B = ceil(N / block), factors (M, B) and scale
    (B,) float32."""
    width = codes.shape[2] * (8 // bits)
    full, rest = divmod(out.shape[0], width)
    if full + (rest > 0) != codes.shape[1]:
        raise ValueError(f"{codes.shape[1]} blocks of codes for {out.shape[0]} values")
    loop = _LOOPS[bits][1]
    # blocks as rows: the compiled loop indexes two dimensions (faster than a flat index)
    values = out[: full * width].reshape(full, width)
    run_split(lambda lo, hi: loop(values, codes, factors, scale, lo, hi), full, threads)
    if rest:
        # the tensor's last block, partly padding: through a block-sized buffer
        tail = np.empty((1, width), np.float32)
        loop(tail, codes[:, full:], factors[:, full:], scale[full:], 0, 1)
        out[full * width :] = tail[0, :rest]


def norm(tensors: Iterable[np.ndarray], threads: int = DEFAULT_THREADS, every: int = 1) -> float:
    """Euclidean norm of float32 tensors taken as one vector: squares in float64, summed in parts
    of NORM_PART values (each over NORM_LANES running sums), the parts' sums added exactly
    (`math.fsum`): the same float on any machine and any number of threads.  `every` > 1: only
    parts 0, every, 2 x every... of each tensor, the same part sums, fewer of them, so the float is
    never above the whole norm's (an exact sum of fewer non-negative terms, correctly rounded)."""
    sums = []
    for tensor in tensors:
        x = np.ascontiguousarray(tensor, dtype=np.float32).reshape(-1)
        parts = -(-x.size // NORM_PART)
        out = np.empty(-(-parts // every), np.float64)
        run_split(lambda lo, hi: _square_sums(x, out, lo, hi, every), out.size, threads)
        sums.append(out)
    return math.sqrt(math.fsum(np.concatenate(sums))) if sums else 0.0


@functools.cache
def _nesterov_loop(bits: int, wide: bool):
    """The fused loop of one codec; `wide`: the momentum is bfloat16 (held as uint16)."""
    per = LEVELS[bits][0]

    def step(
        new_params, new_momentum, params, momentum, codes, factors, scale, terms, lo, hi
    ):  # pragma: no cover - compiled
        width = codes.shape[2] * per
        u = np.empty(width, np.float32)
        # the block's momentum in float32 (bfloat16: its bits widened), then the new one
        words = np.empty(width, np.uint32)
        held = words.view(np.float32)
        rate, mu = terms[0], terms[1]
        for r in range(lo, hi):
            _merged_block(u, codes, factors, r, per, bits)
            s = scale[r]
            for i in range(width):
                if wide:
                    words[i] = np.uint32(momentum[r, i]) << 16
                else:
                    held[i] = momentum[r, i]
            for i in range(width):
                g = u[i] * s
                t = g + mu * held[i]
                new_params[r, i] = params[r, i] - rate * (g + mu * t)
                held[i] = t
            for i in range(width):
                if wide:
                    x = words[i]
                    # round to nearest even; a NaN stays a (quiet) NaN
                    even = (x + np.uint32(0x7FFF) + ((x >> 16) & np.uint32(1))) >> 16
                    nan = (x >> 16) | np.uint32(0x40)
                    new_momentum[r, i] = np.uint16(
                        nan if (x & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000) else even
                    )
                else:
                    new_momentum[r, i] = held[i]

    return compiled(step, f"nesterov_int{bits}_{'bf16' if wide else 'fp32'}")


def nesterov_into(
    new: tuple[np.ndarray, np.ndarray],
    old: tuple[np.ndarray, np.ndarray],
    codes: np.ndarray,
    factors: np.ndarray,
    scale: np.ndarray,
    bits: int,
    terms: tuple[float, float],
    threads: int = DEFAULT_THREADS,
) -> None:
    """new (parameters, momentum) <- the Nesterov step of `terms` (lr, mu) from old, with the
    pseudo-gradient g = (sum over m in order of factors_mb * level_m) * scale_b.  Each array is
    (B, values per block), over whole blocks; parameters float32, momentum float32 or bfloat16's
    bits (uint16); `new` may be `old` (each value is read before it is written).  codes (M, B, C),
    factors (M, B), scale (B,) as `merge_into`'s.  Every value is the float32 roundings of
    ``t = g + mu m; p - lr (g + mu t)`` in that order."""
    wide = old[1].dtype == np.uint16
    if new[1].dtype != old[1].dtype or old[1].dtype not in (np.uint16, np.float32):
        raise ValueError(f"momentum of {old[1].dtype} into {new[1].dtype}")
    rows = codes.shape[1]
    if any(a.shape != (rows, codes.shape[2] * (8 // bits)) for a in (*new, *old)):
        raise ValueError(f"arrays of {[a.shape for a in (*new, *old)]} for codes {codes.shape}")
    loop = _nesterov_loop(bits, wide)
    rate_mu = np.array(terms, np.float32)
    run_split(
        lambda lo, hi: loop(*new, *old, codes, factors, scale, rate_mu, lo, hi), rows, threads
    )
