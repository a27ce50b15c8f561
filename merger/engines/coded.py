"""Merging blockwise-quantized deltas straight from their codes: no float32 copy of any delta.

A delta tensor arrives as records (scale_b, codes q_bi) with value d_bi = scale_b * q_bi.  Then

    ||d||^2 = sum_b scale_b^2 * sum_i q_bi^2          (the inner sums are exact integers)
    u       = sum_m f_mb * q_mbi,  f_mb = c_m * scale_mb
              (RDA: c_m = w_m / ||d_m||; weighted average: c_m = w_m)

so passes over the codes give the merged direction u, and the radius/length rescaling of RDA
(merger/fold/rda.py) is one multiply on the way into the outer step.

- Dense int codecs (`dense`): the round's codes laid out once as (deltas, blocks, bytes), then
  two compiled loops over them (merger/engines/dense_loops.py): the products of levels per block
  give every norm (``||u_b||^2 = sum_mn f_mb f_nb sum_i q_mbi q_nbi``, exact integers inside), and
  one pass writes u, rescaled, into float32 values that each tensor views; the outer step takes them
  as its pseudo-gradient (`outer.make_step`).  Under Nesterov momentum a fold takes the round up
  to that pass (`dense_terms`) and steps from the codes instead (merger/engines/fused.py).
- Sparse codecs (`direction`): d_bj = scale_b * level_bj at the block's kept indices only, so u is
  a scatter-add of f_mb * level_mbj, one delta after another (each delta's indices are distinct,
  so the order of the additions is fixed), by XLA kernels over groups of up to 8 deltas (a
  round's size padded to 1, 2, 4 or 8) and tiles of blocks, so that few shapes are ever compiled
  (merger/engines/sparse_xla.py, whose outer step takes u as tiles).

The fold waits on the host between its passes, so the merger runs it on a worker thread
(merger/state/pipeline.py).  The float64 sums over blocks are numpy pairwise sums over fixed slices,
so the same log gives the same bytes (replay feeds the same records to this code).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dloco.merger.engines import dense_loops
from dloco.merger.engines.scratch import Scratch
from dloco.merger.engines.sparse_xla import (
    block_squares,
    sparse_accumulate,
    split,
)
from dloco.protocol import CodedTensor, sparse

# (first delta, deltas, padded size) of each kernel call over a round
Plan = list[tuple[int, int, int]]
# path -> (first block, end block) in the fragment
Spans = dict[str, tuple[int, int]]

# deltas per kernel call: a round of any size compiles at most these shapes
GROUPS = (1, 2, 4, 8)


def groups(count: int) -> Plan:
    """(first, used, padded size) groups covering `count` deltas: 8 at a time, then the smallest
    that fits."""
    out, first = [], 0
    while first < count:
        left = count - first
        size = GROUPS[-1] if left >= GROUPS[-1] else next(g for g in GROUPS if g >= left)
        out.append((first, min(size, left), size))
        first += size
    return out


def padded(arrays: list[np.ndarray], size: int) -> np.ndarray:
    """Stack, padding with zeros to `size` (a zero factor or a dropped row makes padding inert)."""
    return np.stack(arrays + [np.zeros_like(arrays[0])] * (size - len(arrays)))


# blocks per kernel call: fragments of any size run the same few compiled shapes
TILE_BLOCKS = 8192


def tile_blocks(blocks: int) -> int:
    """Tile size for a fragment of `blocks` blocks: TILE_BLOCKS, or the power of two >= blocks (>=
    16)."""
    return min(TILE_BLOCKS, max(16, 1 << (blocks - 1).bit_length()))


def _sum64(x: np.ndarray) -> float:
    return float(np.add.reduce(np.asarray(x, dtype=np.float64)))


def merge(
    tensors: Sequence[dict[str, CodedTensor]], weights: Sequence[float], plain: dict[str, bool]
) -> tuple[dict, list[float], float]:
    """The merged pseudo-gradient of one round (canonical order, normalised weights), the fragment
    norm of every delta, and the merged norm.  `plain[path]`: weighted average instead of RDA."""
    if not tensors[0][min(tensors[0])].codec.sparse:
        return dense(tensors, weights, plain)
    paths, tiles, block_scale, layout, delta_norms, merged_norm = direction(tensors, weights, plain)
    return dict(zip(paths, split(tiles, block_scale, layout))), delta_norms, merged_norm


class Dense(NamedTuple):
    """A round of dense codes up to its merge (`dense_terms`): u = (sum_m factors_mb q_m) * scale_b
    over the fragment's blocks, each path's blocks at `spans` (every tensor from the first value
    of its first block)."""

    # (M, blocks, C) uint8, in the scratch's memory: valid until its next round
    codes: np.ndarray
    # (M, blocks) float32
    factors: np.ndarray
    # (blocks,) float32
    scale: np.ndarray
    spans: Spans
    bits: int
    block: int
    # each delta's norm, and u's
    delta_norms: list[float]
    merged_norm: float


def dense(
    tensors: Sequence[dict[str, CodedTensor]],
    weights: Sequence[float],
    plain: dict[str, bool],
    scratch: Scratch | None = None,
    sizes: Sequence[int] | None = None,
) -> tuple[dict[str, np.ndarray], list[float], float]:
    """`merge` for the dense int codecs (`dense_terms`), u written, rescaled, into each tensor's
    float32 values by one pass over every delta's codes (in `scratch`'s memory if given, else
    fresh)."""
    scratch = Scratch() if scratch is None else scratch
    terms = dense_terms(tensors, weights, plain, scratch, sizes)
    # whole blocks: each tensor a view from its first block (the last one's padding unused)
    flat = scratch.values(terms.scale.size * terms.block * 4).view(np.float32)
    dense_loops.merge_into(flat, terms.codes, terms.factors, terms.scale, terms.bits)
    merged = {}
    for path, (b0, _) in terms.spans.items():
        tensor = tensors[0][path]
        at = b0 * terms.block
        merged[path] = flat[at : at + tensor.count].reshape(tensor.shape)
    return merged, terms.delta_norms, terms.merged_norm


def dense_terms(
    tensors: Sequence[dict[str, CodedTensor]],
    weights: Sequence[float],
    plain: dict[str, bool],
    scratch: Scratch,
    sizes: Sequence[int] | None = None,
) -> Dense:
    """A round of dense int codes up to its merge, by compiled loops over the codes
    (merger/engines/dense_loops.py): per block the products of every two deltas' levels give each
    delta's norm and u's, and so each delta's factors and RDA's rescaling.  `sizes`: how many of
    `tensors`, in order, each member is (an island's several deltas of one fold, merged as their
    sum: its norm is the sum's, from the products of its deltas' levels, and each of its deltas
    takes the member's factor); None: one each.  `weights` are the members'; the norms returned
    are each delta's."""
    sizes = [1] * len(tensors) if sizes is None else list(sizes)
    if sum(sizes) != len(tensors) or len(sizes) != len(weights) or min(sizes) < 1:
        raise ValueError(f"members of sizes {sizes}: {len(tensors)} deltas, {len(weights)} weights")
    paths = sorted(tensors[0])
    codec, count = tensors[0][paths[0]].codec, len(tensors)
    spans, _, start = _layout(tensors[0], paths)
    # every delta's codes in one (M, blocks, C) array: each loop is one call over the fragment
    # (a call per tensor handed the GIL back and forth dozens of times a fold, which a busy
    # receiving thread made cost more than the loops themselves)
    codes = scratch.codes((count, start, codec.block * codec.bits // 8))
    for m, t in enumerate(tensors):
        for path, (b0, b1) in spans.items():
            t[path].codes_into(codes[m, b0:b1])
    # (blocks, M, M): exact integers, in float64 for the sums below
    gram = dense_loops.gram(codes, codec.bits).astype(np.float64)
    scales = [np.concatenate([t[p].scales for p in paths]).astype(np.float64) for t in tensors]
    delta_norms, norms = _member_norms(scales, gram, sizes, spans)
    # each delta with its member's weight and norm
    factors = np.stack(
        _factors(_each(weights, sizes), scales, _each(norms, sizes), spans, plain, start)
    )
    # ||u_b||^2 = sum_m sum_n f_mb f_nb G_mnb, each pair once, in a fixed order
    u_squares = _sum_squares(list(factors.astype(np.float64)), gram, 0, count)
    block_scale, merged_norm = _rescale(u_squares, spans, weights, norms, plain, start)
    norms_out = [float(np.sqrt(sum(n[p] ** 2 for p in paths))) for n in delta_norms]
    return Dense(
        codes, factors, block_scale, spans, codec.bits, codec.block, norms_out, merged_norm
    )


def _member_norms(
    scales: list[np.ndarray], gram: np.ndarray, sizes: list[int], spans: Spans
) -> tuple[list[dict], list[dict]]:
    """Each delta's norm per path and each member's (the sum of its deltas), from the block
    scales and the products of levels."""
    deltas = _norms([s**2 * gram[:, m, m] for m, s in enumerate(scales)], spans)
    members, first = [], 0
    for size in sizes:
        members.append(
            deltas[first]
            if size == 1
            else _norms([_sum_squares(scales, gram, first, size)], spans)[0]
        )
        first += size
    return deltas, members


def _each(values: Sequence, sizes: list[int]) -> list:
    """Each member's value repeated for each of its deltas."""
    return [value for value, size in zip(values, sizes) for _ in range(size)]


def _sum_squares(scales: list[np.ndarray], gram: np.ndarray, first: int, size: int) -> np.ndarray:
    """Per block, the sum of squares of the values sum_m s_mb q_mb over deltas first..first+size-1
    (`scales`: each delta's per-block factor): sum_mn s_mb s_nb G_mnb, each pair once, in a fixed
    order."""
    total = np.zeros(gram.shape[0])
    for m in range(first, first + size):
        for n in range(m, first + size):
            total += (1 if m == n else 2) * scales[m] * scales[n] * gram[:, m, n]
    return total


def _norms(squares: list[np.ndarray], spans: Spans) -> list[dict]:
    """Each delta's norm per path, from its sums of squares per block."""
    return [
        {p: float(np.sqrt(_sum64(sq[b0:b1]))) for p, (b0, b1) in spans.items()} for sq in squares
    ]


def direction(
    tensors: Sequence[dict[str, CodedTensor]], weights: Sequence[float], plain: dict[str, bool]
):
    """One round's merged direction from sparse codes: (paths in order, tiles of u in value order,
    the per-block rescaling that makes it RDA's (1 on plain paths), the fragment's layout, each
    delta's norm, the merged norm).  The outer step takes the first four
    (sparse_xla.outer_step)."""
    paths = sorted(tensors[0])
    codec = tensors[0][paths[0]].codec
    spans, layout, start = _layout(tensors[0], paths)
    T = tile_blocks(start)
    n_tiles = -(-start // T)
    plan = groups(len(tensors))
    kept = [_sparse_levels([t[p] for p in paths], n_tiles * T) for t in tensors]
    scales = [s.astype(np.float64) for s, _, _ in kept]
    squares = [(levels.astype(np.int64) ** 2).sum(axis=1)[:start] for _, _, levels in kept]
    norms = _norms(
        [s[:start] ** 2 * sq.astype(np.float64) for s, sq in zip(scales, squares)], spans
    )
    factors = _factors(weights, scales, norms, spans, plain, n_tiles * T)
    tiles, sums = _accumulate_sparse(kept, factors, plan, T, n_tiles, codec.block)
    u_squares = np.concatenate([np.asarray(s) for s in sums])
    block_scale, merged_norm = _rescale(u_squares, spans, weights, norms, plain, n_tiles * T)
    delta_norms = [float(np.sqrt(sum(n[p] ** 2 for p in paths))) for n in norms]
    return paths, tiles, block_scale, tuple(layout), delta_norms, merged_norm


def _layout(first: dict[str, CodedTensor], paths: list[str]) -> tuple[Spans, list[tuple], int]:
    """Each path's blocks in the fragment (start, end), the layout ((first block, count, shape),
    ...) and the fragment's number of blocks."""
    spans, layout, start = {}, [], 0
    for path in paths:
        blocks = first[path].blocks
        spans[path] = (start, start + blocks)
        layout.append((start, first[path].count, tuple(first[path].shape)))
        start += blocks
    return spans, layout, start


def _tile(rows: list[np.ndarray], T: int, index: int, size: int) -> np.ndarray:
    """Tile `index` (T blocks) of each delta's rows, padded with zero deltas to `size`."""
    return padded([r[index * T : (index + 1) * T] for r in rows], size)


def _factors(
    weights: Sequence[float],
    scales: list[np.ndarray],
    norms: list[dict[str, float]],
    spans: Spans,
    plain: dict[str, bool],
    blocks: int,
) -> list[np.ndarray]:
    """Each delta's float32 factor per block: weight * scale on plain paths, weight / norm * scale
    (RDA) on the others."""
    # padding blocks: factor 0, inert
    factors = np.zeros((len(scales), blocks), dtype=np.float64)
    for m, (weight, scale) in enumerate(zip(weights, scales)):
        for path, (b0, b1) in spans.items():
            if plain[path]:
                factors[m, b0:b1] = weight * scale[b0:b1]
            # a zero delta contributes no direction
            elif norms[m][path] > 0:
                factors[m, b0:b1] = weight / norms[m][path] * scale[b0:b1]
    return list(factors.astype(np.float32))


def _accumulate_sparse(
    kept: list[tuple[np.ndarray, np.ndarray, np.ndarray]],
    factors: list[np.ndarray],
    plan: Plan,
    T: int,
    n_tiles: int,
    block: int,
) -> tuple[list[jax.Array], list[jax.Array]]:
    """The tiles of u from sparse deltas' kept levels, and each tile's per-block sums of u^2."""
    tiles, sums = [], []
    for i in range(n_tiles):
        u = jnp.zeros((T, block), jnp.float32)
        for a, n, g in plan:
            index = _tile([k[1] for k in kept[a : a + n]], T, i, g)
            # padding deltas: distinct positions, level 0
            index[n:] = np.arange(index.shape[-1], dtype=np.int32)
            u = sparse_accumulate(
                u,
                index,
                _tile([k[2] for k in kept[a : a + n]], T, i, g),
                _tile(factors[a : a + n], T, i, g),
            )
        tiles.append(u)
        sums.append(block_squares(u))
    return tiles, sums


def _rescale(
    u_squares: np.ndarray,
    spans: Spans,
    weights: Sequence[float],
    norms: list[dict[str, float]],
    plain: dict[str, bool],
    blocks: int,
) -> tuple[np.ndarray, float]:
    """RDA's rescaling of u per block (radius / length on each RDA path, 1 on plain ones) and the
    merged norm, from u's per-block sums of squares."""
    block_scale = np.ones(blocks, dtype=np.float32)
    merged_sq = 0.0
    for path, (b0, b1) in spans.items():
        length = float(np.sqrt(_sum64(u_squares[b0:b1])))
        if plain[path]:
            merged_sq += length**2
            continue
        radius = sum(w * n[path] for w, n in zip(weights, norms))
        factor = radius / length if length > 0 and radius > 0 else 0.0
        block_scale[b0:b1] = np.float32(factor)
        merged_sq += (factor * length) ** 2
    return block_scale, float(np.sqrt(merged_sq))


def _sparse_levels(
    tensors: Sequence[CodedTensor], blocks: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A sparse delta's (scales, indices int32, levels int8) over its tensors in order, padded with
    empty blocks (distinct positions, level 0) to `blocks`; a tensor's padding values get level 0.
    """
    parts = []
    for t in tensors:
        scale, index, levels = sparse.unpack(t.records, t.codec.block, t.codec.bits)
        levels[-1][index[-1] >= t.count - t.codec.block * (len(scale) - 1)] = 0
        parts.append((scale, index, levels))
    pad = blocks - sum(len(p[0]) for p in parts)
    k = parts[0][1].shape[1]
    parts.append(
        (
            np.zeros(pad, np.float32),
            np.broadcast_to(np.arange(k, dtype=np.int32), (pad, k)),
            np.zeros((pad, k), np.int8),
        )
    )
    return tuple(np.concatenate([p[i] for p in parts]) for i in range(3))


def mergeable(contributions_tensors: Sequence[dict]) -> bool:
    """Every tensor of every contribution is coded, with one codec and one block size."""
    codecs = {
        (t.codec.name, t.codec.block) if isinstance(t, CodedTensor) else None
        for tensors in contributions_tensors
        for t in tensors.values()
    }
    return len(codecs) == 1 and None not in codecs
