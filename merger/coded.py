"""Merging blockwise-quantized deltas straight from their codes: no float32 copy of any delta.

A delta tensor arrives as records (scale_b, codes q_bi) with value d_bi = scale_b * q_bi.  Then

    ||d||^2 = sum_b scale_b^2 * sum_i q_bi^2          (the inner sums are exact integers)
    u       = sum_m f_mb * q_mbi,  f_mb = c_m * scale_mb
              (RDA: c_m = w_m / ||d_m||; weighted average: c_m = w_m)

so passes over the codes give the merged direction u (up to 8 deltas per XLA call; a round's size
is padded to 1, 2, 4 or 8 so that few shapes are ever compiled), and the radius/length rescaling
of RDA (merger/rda.py) is one multiply on the way into the outer step.  The
passes over codes run as XLA kernels; every reduction whose order could vary is either over exact
integers or a fixed halving tree, and the float64 sums over blocks are numpy pairwise sums over
fixed slices, so the same log gives the same bytes (replay feeds the same records to this code).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from protocol import CodedTensor


def _parts(codes: jax.Array, bits: int) -> list[jax.Array]:
    """uint8 (..., C) codes -> the int32 levels each byte holds, one array per position in the byte."""
    if bits == 8:
        return [jax.lax.bitcast_convert_type(codes, jnp.int8).astype(jnp.int32)]
    c = codes.astype(jnp.int32)
    if bits == 4:
        return [(c & 15) - 8, (c >> 4) - 8]
    return [((c >> (2 * k)) & 3) - 1 for k in range(4)]


def _levels(codes: jax.Array, bits: int) -> jax.Array:
    """uint8 (..., C) codes -> int32 (..., K) levels in value order (PROTOCOL.md §Codecs)."""
    parts = _parts(codes, bits)
    return parts[0] if len(parts) == 1 else jnp.stack(parts, axis=-1).reshape(*codes.shape[:-1], -1)


def _halving_sum(x: jax.Array) -> jax.Array:
    """Sum over the last axis (a power of two) in a fixed pairwise order."""
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x[..., 0]


@functools.partial(jax.jit, static_argnames=("bits",))
def block_square_sums(codes: jax.Array, bits: int) -> jax.Array:
    """(M, B, C) codes -> (M, B) int32: sum of squared levels per block (exact, so any order will do:
    bytes are not unpacked into value order)."""
    return _halving_sum(sum(q * q for q in _parts(codes, bits)))


@functools.partial(jax.jit, static_argnames=("bits",))
def accumulate(u: jax.Array, codes: jax.Array, factors: jax.Array, bits: int) -> jax.Array:
    """u (B, K) + sum_m factors_m * levels_m over (G, B, C) codes and (G, B) factors, m in order."""
    for m in range(codes.shape[0]):
        u = u + _levels(codes[m], bits).astype(jnp.float32) * factors[m][:, None]
    return u


@jax.jit
def square_sums(u: jax.Array) -> jax.Array:
    """Per-block sum of u^2 (float32, fixed order)."""
    return _halving_sum(u * u)


GROUPS = (1, 2, 4, 8)  # deltas per kernel call: a round of any size compiles at most these shapes


def groups(count: int) -> list[tuple[int, int, int]]:
    """(first, used, padded size) groups covering `count` deltas: 8 at a time, then the smallest that fits."""
    out, first = [], 0
    while first < count:
        left = count - first
        size = GROUPS[-1] if left >= GROUPS[-1] else next(g for g in GROUPS if g >= left)
        out.append((first, min(size, left), size))
        first += size
    return out


def _padded(arrays: list[np.ndarray], size: int) -> np.ndarray:
    """Stack, padding with zeros to `size` (a zero factor or a dropped row makes padding inert)."""
    return np.stack(arrays + [np.zeros_like(arrays[0])] * (size - len(arrays)))


@functools.partial(jax.jit, static_argnames=("layout",))
def split(tiles: list[jax.Array], block_scale: jax.Array, layout: tuple) -> list[jax.Array]:
    """The tiles of u, times block_scale, cut into the fragment's tensors: layout = ((first block, count, shape), ...)."""
    u = jnp.concatenate(tiles)
    flat = (u * block_scale[:, None]).reshape(-1)
    block = u.shape[1]
    return [flat[b0 * block : b0 * block + count].reshape(shape) for b0, count, shape in layout]


TILE_BLOCKS = 8192  # blocks per kernel call: fragments of any size run the same few compiled shapes


def tile_blocks(blocks: int) -> int:
    """Tile size for a fragment of `blocks` blocks: TILE_BLOCKS, or the power of two >= blocks (>= 16)."""
    return min(TILE_BLOCKS, max(16, 1 << (blocks - 1).bit_length()))


def warm_up(fragment_values: Sequence[int], block: int = 256, bits: int = 4) -> None:
    """Compile the kernels ahead of the first rounds, for fragments of these sizes (values) and one
    codec (int4, block 256 by default: the islands' default)."""
    for tile in sorted({tile_blocks(-(-values // block)) for values in fragment_values}):
        codes = np.zeros((tile, block * bits // 8), np.uint8)
        u = jnp.zeros((tile, block), jnp.float32)
        for size in GROUPS:
            block_square_sums(_padded([codes], size), bits).block_until_ready()
            accumulate(u, _padded([codes], size), np.zeros((size, tile), np.float32), bits).block_until_ready()
        square_sums(u).block_until_ready()


def _sum64(x: np.ndarray) -> float:
    return float(np.add.reduce(np.asarray(x, dtype=np.float64)))


def merge(tensors: Sequence[dict[str, CodedTensor]], weights: Sequence[float], plain: dict[str, bool]) -> tuple[dict, list[float], float]:
    """The merged pseudo-gradient of one round (canonical order, normalised weights), the fragment
    norm of every delta, and the merged norm.  `plain[path]`: weighted average instead of RDA."""
    paths = sorted(tensors[0])
    codec = tensors[0][paths[0]].codec
    spans, layout, start = {}, [], 0
    for path in paths:
        blocks = tensors[0][path].records.shape[0]
        spans[path] = (start, start + blocks)
        layout.append((start, tensors[0][path].count, tuple(tensors[0][path].shape)))
        start += blocks
    T = tile_blocks(start)
    n_tiles = -(-start // T)
    padding = np.zeros((n_tiles * T - start, codec.record_nbytes - 4), np.uint8)
    codes = [np.concatenate([t[p].codes for p in paths] + [padding]) for t in tensors]  # M x (tiles * T, C)
    scales = [np.concatenate([t[p].scales for p in paths]).astype(np.float64) for t in tensors]

    def tile(rows: list[np.ndarray], index: int, size: int) -> np.ndarray:
        return _padded([r[index * T : (index + 1) * T] for r in rows], size)

    plan = groups(len(codes))
    squares = np.concatenate(
        [np.concatenate([np.asarray(block_square_sums(tile(codes[a : a + n], i, g), codec.bits))[:n] for a, n, g in plan])
         for i in range(n_tiles)], axis=1)[:, :start].astype(np.float64)
    norms = [{p: float(np.sqrt(_sum64(scale[b0:b1] ** 2 * sq[b0:b1]))) for p, (b0, b1) in spans.items()} for scale, sq in zip(scales, squares)]
    factors = np.zeros((len(tensors), n_tiles * T), dtype=np.float64)  # padding blocks: factor 0, inert
    for m, (weight, scale) in enumerate(zip(weights, scales)):
        for path, (b0, b1) in spans.items():
            if plain[path]:
                factors[m, b0:b1] = weight * scale[b0:b1]
            elif norms[m][path] > 0:  # a zero delta contributes no direction
                factors[m, b0:b1] = weight / norms[m][path] * scale[b0:b1]
    factors = list(factors.astype(np.float32))
    tiles = []
    for i in range(n_tiles):
        u = jnp.zeros((T, codec.block), jnp.float32)
        for a, n, g in plan:
            u = accumulate(u, tile(codes[a : a + n], i, g), tile(factors[a : a + n], i, g), codec.bits)
        tiles.append(u)
    u_squares = np.concatenate([np.asarray(square_sums(u)) for u in tiles])
    block_scale = np.ones(n_tiles * T, dtype=np.float32)
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
    merged = dict(zip(paths, split(tiles, block_scale, tuple(layout))))
    delta_norms = [float(np.sqrt(sum(n[p] ** 2 for p in paths))) for n in norms]
    return merged, delta_norms, float(np.sqrt(merged_sq))


def mergeable(contributions_tensors: Sequence[dict]) -> bool:
    """Every tensor of every contribution is coded, with one codec and one block size."""
    codecs = {(t.codec.name, t.codec.block) if isinstance(t, CodedTensor) else None for tensors in contributions_tensors for t in tensors.values()}
    return len(codecs) == 1 and None not in codecs
