"""Merging blockwise-quantized deltas straight from their codes: no float32 copy of any delta.

A delta tensor arrives as records (scale_b, codes q_bi) with value d_bi = scale_b * q_bi.  Then

    ||d||^2 = sum_b scale_b^2 * sum_i q_bi^2          (the inner sums are exact integers)
    u       = sum_m f_mb * q_mbi,  f_mb = c_m * scale_mb
              (RDA: c_m = w_m / ||d_m||; weighted average: c_m = w_m)

(sparse codecs: d_bj = scale_b * level_bj at the block's kept indices only, so u is a scatter-add
of f_mb * level_mbj, one delta after another; each delta's indices are distinct, so the order of
the additions is fixed too), so passes over the codes give the merged direction u (up to 8
deltas per XLA call; a round's size is padded to 1, 2, 4 or 8 so that few shapes are ever
compiled), and the radius/length rescaling of RDA (merger/rda.py) is one multiply on the way into
the outer step.  u is accumulated per
position in the byte (two arrays for int4) and interleaved into value order once, by the round's
last kernel call, which also sums its squares per block; the outer step (`merge_and_step`) cuts
it into the fragment's tensors in the same XLA computation, each tensor from slices of just the
tiles it spans (never a concatenation of the whole fragment).  The fold waits on the host twice
(norms, then lengths), so the merger runs it on a worker thread (merger/pipeline.py).  The
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
import optax

from dloco.protocol import CodedTensor, sparse

# Bumped whenever a change to these kernels moves results by as much as a rounding unit (logged in
# the genesis record: `dloco replay` says when a log was written with other kernels or jax).
KERNELS_VERSION = 1


def _parts(codes: jax.Array, bits: int) -> list[jax.Array]:
    """uint8 (..., C) codes -> the int32 levels each byte holds, one array per position in the
    byte."""
    if bits == 8:
        return [jax.lax.bitcast_convert_type(codes, jnp.int8).astype(jnp.int32)]
    c = codes.astype(jnp.int32)
    if bits == 4:
        return [(c & 15) - 8, (c >> 4) - 8]
    return [((c >> (2 * k)) & 3) - 1 for k in range(4)]


def _interleave(parts: Sequence[jax.Array]) -> jax.Array:
    """Per-position arrays (..., C) -> (..., K) in value order (PROTOCOL.md §Codecs)."""
    return (
        parts[0] if len(parts) == 1 else jnp.stack(parts, axis=-1).reshape(*parts[0].shape[:-1], -1)
    )


def parts_per_byte(bits: int) -> int:
    return 1 if bits == 8 else 8 // bits


def _halving_sum(x: jax.Array) -> jax.Array:
    """Sum over the last axis (a power of two) in a fixed pairwise order."""
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x[..., 0]


@functools.partial(jax.jit, static_argnames=("bits",))
def block_square_sums(codes: jax.Array, bits: int) -> jax.Array:
    """(M, B, C) codes -> (M, B) int32: sum of squared levels per block (exact, so any order will
    do: bytes are not unpacked into value order)."""
    return _halving_sum(sum(q * q for q in _parts(codes, bits)))


def _accumulate(u: list[jax.Array], codes: jax.Array, factors: jax.Array, bits: int, last: bool):
    for m in range(codes.shape[0]):
        f = factors[m][:, None]
        u = [a + q.astype(jnp.float32) * f for a, q in zip(u, _parts(codes[m], bits))]
    if not last:
        return u
    # The round's last group: u in value order and its per-block sum of squares (float32, fixed
    # order: per position, then positions in order), from u still in registers — one pass over u
    # less, and the outer step reads u without interleaving it (2 ms of 17 a fold).
    total = _halving_sum(u[0] * u[0])
    for a in u[1:]:
        total = total + _halving_sum(a * a)
    return _interleave(u), total


@functools.partial(jax.jit, static_argnames=("bits",), donate_argnums=(0,))
def accumulate(
    u: list[jax.Array], codes: jax.Array, factors: jax.Array, bits: int
) -> list[jax.Array]:
    """u (per position in the byte, (B, C) each) + sum_m factors_m * levels_m over (G, B, C) codes
    and (G, B) factors, m in order.  Kept per position: interleaving once per fold, not once per
    delta, made this 2x faster."""
    return _accumulate(u, codes, factors, bits, last=False)


@functools.partial(jax.jit, static_argnames=("bits",))
def accumulate_last(
    u: list[jax.Array], codes: jax.Array, factors: jax.Array, bits: int
) -> tuple[jax.Array, jax.Array]:
    """`accumulate` for a round's last group: (u in value order (B, K), per-block sums of u^2)."""
    return _accumulate(u, codes, factors, bits, last=True)


@functools.partial(jax.jit, static_argnames=("bits", "last"))
def accumulate_first(
    zero: jax.Array, codes: jax.Array, factors: jax.Array, bits: int, last: bool = False
):
    """`accumulate` onto u = `zero` (a float32 scalar 0, passed in): a round's first group, without
    allocating and filling a zero u first.  A zero known at compile time would let XLA drop the
    additions and contract the first products differently (1 ulp off the sequential order)."""
    return _accumulate(
        [jnp.broadcast_to(zero, codes.shape[1:])] * parts_per_byte(bits), codes, factors, bits, last
    )


@functools.partial(jax.jit, donate_argnums=(0,))
def sparse_accumulate(
    u: jax.Array, index: jax.Array, levels: jax.Array, factors: jax.Array
) -> jax.Array:
    """u (T, K) plus, for each of G deltas in order, factors (G, T) times levels (G, T, k) at the
    kept positions index (G, T, k) of each block: distinct per delta and block, so each addition
    lands once per delta and the order of the sums is fixed."""
    rows = jnp.arange(u.shape[0])[:, None]
    for m in range(index.shape[0]):
        u = u.at[rows, index[m]].add(
            levels[m].astype(jnp.float32) * factors[m][:, None],
            indices_are_sorted=True,
            unique_indices=True,
        )
    return u


@jax.jit
def block_squares(u: jax.Array) -> jax.Array:
    """(T, K) -> (T,) sums of squares per block, in a fixed order."""
    return _halving_sum(u * u)


# deltas per kernel call: a round of any size compiles at most these shapes
GROUPS = (1, 2, 4, 8)


def groups(count: int) -> list[tuple[int, int, int]]:
    """(first, used, padded size) groups covering `count` deltas: 8 at a time, then the smallest
    that fits."""
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


def _pseudo_gradient(
    tiles: list[jax.Array], block_scale: jax.Array, layout: tuple
) -> list[jax.Array]:
    """The tiles of u (value order, (T, K) each), times block_scale, cut into the fragment's
    tensors: layout = ((first block, count, shape), ...).  Each tensor is assembled from slices of
    just the tiles it spans (concatenating every tile first made XLA copy the whole fragment twice:
    2x slower).
    """
    size, K = tiles[0].shape
    out = []
    for b0, count, shape in layout:
        b1 = b0 + -(-count // K)
        pieces = []
        for t in range(b0 // size, (b1 - 1) // size + 1):
            r0, r1 = max(b0, t * size) - t * size, min(b1, (t + 1) * size) - t * size
            pieces.append(tiles[t][r0:r1] * block_scale[t * size + r0 : t * size + r1, None])
        flat = (pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces)).reshape(-1)
        out.append(flat[:count].reshape(shape))
    return out


split = jax.jit(_pseudo_gradient, static_argnames=("layout",))


@functools.lru_cache(maxsize=32)
def _outer_step(optimizer: optax.GradientTransformation):
    """The outer step taking the pseudo-gradient as tiles: one XLA computation per fragment layout
    (as `outer.make_step`, whose optimizer-state layout — a path-ordered list — it shares)."""

    optimizer = optax.with_extra_args_support(optimizer)

    @functools.partial(jax.jit, static_argnames=("layout",))
    def step(
        params: list,
        opt_state,
        tiles: list,
        block_scale: jax.Array,
        share: jax.Array,
        layout: tuple,
    ):
        # the barrier: computed once, not again inside each use the optimizer makes of it (slower)
        pseudo = jax.lax.optimization_barrier(_pseudo_gradient(tiles, block_scale, layout))
        updates, opt_state = optimizer.update(pseudo, opt_state, params, share=share)
        return optax.apply_updates(params, updates), opt_state

    return step


# blocks per kernel call: fragments of any size run the same few compiled shapes
TILE_BLOCKS = 8192


def tile_blocks(blocks: int) -> int:
    """Tile size for a fragment of `blocks` blocks: TILE_BLOCKS, or the power of two >= blocks (>=
    16)."""
    return min(TILE_BLOCKS, max(16, 1 << (blocks - 1).bit_length()))


def warm_up(
    fragment_values: Sequence[int], block: int = 256, bits: int = 4, stopping=lambda: False
) -> None:
    """Compile the kernels ahead of the first rounds, for fragments of these sizes (values) and one
    codec (int4, block 256 by default: the islands' default).  `stopping()` true: return before
    the next compilation (one cannot be cut short, and a process must not exit during one)."""
    for tile in sorted({tile_blocks(-(-values // block)) for values in fragment_values}):
        codes = np.zeros((tile, block * bits // 8), np.uint8)
        # a round's first group, the groups after it; the last one of each
        for size in GROUPS:
            if stopping():
                return
            group, factors = _padded([codes], size), np.zeros((size, tile), np.float32)
            block_square_sums(group, bits).block_until_ready()
            jax.block_until_ready(accumulate_first(np.float32(0), group, factors, bits, last=True))
            u = accumulate_first(np.float32(0), group, factors, bits)
            u = accumulate(u, group, factors, bits)
            jax.block_until_ready(accumulate_last(u, group, factors, bits))


def _code_tiles(deltas: list[list[np.ndarray]], size: int, T: int, n_tiles: int) -> list[jax.Array]:
    """The codes of a group of deltas (each a list of its tensors' (blocks, C) codes, in fragment
    order), padded with zero deltas to `size` and with zero blocks to n_tiles * T, as one device
    array (size, T, C) per tile: built once, with one copy out of the records, and read by both
    passes over the codes."""
    C = deltas[0][0].shape[1]
    buffer = _aligned_empty((n_tiles, size, T, C))
    buffer[:, len(deltas) :] = 0
    for m, tensors in enumerate(deltas):
        row = 0
        # rows [row, row + len(codes)) of this delta, cut at tile boundaries
        for codes in tensors:
            done = 0
            while done < len(codes):
                t, r = divmod(row + done, T)
                k = min(len(codes) - done, T - r)
                buffer[t, m, r : r + k] = codes[done : done + k]
                done += k
            row += len(codes)
        t, r = divmod(row, T)
        if t < n_tiles:
            # the last tile's padding blocks: zero codes (and factor 0)
            buffer[t, m, r:] = 0
    # aligned: XLA reads the buffer itself, no copy
    return [jax.device_put(buffer[i]) for i in range(n_tiles)]


def _aligned_empty(shape: tuple[int, ...], align: int = 64) -> np.ndarray:
    """An uninitialised uint8 array starting on an `align`-byte boundary, whose tiles (each a
    multiple of `align` bytes) jax.device_put hands to XLA without copying (it copies anything
    less aligned: 0.35 ms a tile)."""
    nbytes = int(np.prod(shape))
    raw = np.empty(nbytes + align, np.uint8)
    start = -raw.ctypes.data % align
    return raw[start : start + nbytes].reshape(shape)


def _sum64(x: np.ndarray) -> float:
    return float(np.add.reduce(np.asarray(x, dtype=np.float64)))


def merge(
    tensors: Sequence[dict[str, CodedTensor]], weights: Sequence[float], plain: dict[str, bool]
) -> tuple[dict, list[float], float]:
    """The merged pseudo-gradient of one round (canonical order, normalised weights), the fragment
    norm of every delta, and the merged norm.  `plain[path]`: weighted average instead of RDA."""
    paths, tiles, block_scale, layout, delta_norms, merged_norm = _direction(
        tensors, weights, plain
    )
    return dict(zip(paths, split(tiles, block_scale, layout))), delta_norms, merged_norm


def merge_and_step(
    optimizer: optax.GradientTransformation,
    params: dict,
    opt_state,
    tensors: Sequence[dict[str, CodedTensor]],
    weights: Sequence[float],
    plain: dict[str, bool],
    share: float = 1.0,
) -> tuple[dict, object, list[float], float]:
    """`merge` and the outer step (optimizer state over the path-ordered params, as
    `outer.make_step`; `share`: the fold's share of a round, for the optimizer), the pseudo-gradient
    built inside the step: (new params, new optimizer state, delta norms, merged norm)."""
    paths, tiles, block_scale, layout, delta_norms, merged_norm = _direction(
        tensors, weights, plain
    )
    new, opt_state = _outer_step(optimizer)(
        [params[p] for p in paths], opt_state, tiles, block_scale, np.float32(share), layout
    )
    return dict(zip(paths, new)), opt_state, delta_norms, merged_norm


def _direction(
    tensors: Sequence[dict[str, CodedTensor]], weights: Sequence[float], plain: dict[str, bool]
):
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
    plan = groups(len(tensors))

    def tile(rows: list[np.ndarray], index: int, size: int) -> np.ndarray:
        return _padded([r[index * T : (index + 1) * T] for r in rows], size)

    if codec.sparse:
        kept = [_sparse_levels([t[p] for p in paths], n_tiles * T) for t in tensors]
        scales = [s.astype(np.float64) for s, _, _ in kept]
        squares = np.stack(
            [(levels.astype(np.int64) ** 2).sum(axis=1)[:start] for _, _, levels in kept]
        ).astype(np.float64)
    else:
        codes = [
            _code_tiles([[t[p].codes for p in paths] for t in tensors[a : a + n]], g, T, n_tiles)
            for a, n, g in plan
        ]
        scales = [np.concatenate([t[p].scales for p in paths]).astype(np.float64) for t in tensors]
        squares = np.concatenate(
            [
                np.concatenate(
                    [
                        np.asarray(block_square_sums(group[i], codec.bits))[:n]
                        for group, (_, n, _) in zip(codes, plan)
                    ]
                )
                for i in range(n_tiles)
            ],
            axis=1,
        )[:, :start].astype(np.float64)
    norms = [
        {p: float(np.sqrt(_sum64(scale[b0:b1] ** 2 * sq[b0:b1]))) for p, (b0, b1) in spans.items()}
        for scale, sq in zip(scales, squares)
    ]
    # padding blocks: factor 0, inert
    factors = np.zeros((len(tensors), n_tiles * T), dtype=np.float64)
    for m, (weight, scale) in enumerate(zip(weights, scales)):
        for path, (b0, b1) in spans.items():
            if plain[path]:
                factors[m, b0:b1] = weight * scale[b0:b1]
            # a zero delta contributes no direction
            elif norms[m][path] > 0:
                factors[m, b0:b1] = weight / norms[m][path] * scale[b0:b1]
    factors = list(factors.astype(np.float32))
    tiles, sums = [], []
    for i in range(n_tiles):
        if codec.sparse:
            u = jnp.zeros((T, codec.block), jnp.float32)
            for a, n, g in plan:
                index = tile([k[1] for k in kept[a : a + n]], i, g)
                # padding deltas: distinct positions, level 0
                index[n:] = np.arange(index.shape[-1], dtype=np.int32)
                u = sparse_accumulate(
                    u,
                    index,
                    tile([k[2] for k in kept[a : a + n]], i, g),
                    tile(factors[a : a + n], i, g),
                )
            tiles.append(u)
            sums.append(block_squares(u))
            continue
        (_, n, g), single = plan[0], len(plan) == 1
        u = accumulate_first(
            np.float32(0), codes[0][i], tile(factors[:n], i, g), codec.bits, last=single
        )
        for k, (group, (a, n, g)) in enumerate(zip(codes[1:], plan[1:]), start=2):
            u = (accumulate_last if k == len(plan) else accumulate)(
                u, group[i], tile(factors[a : a + n], i, g), codec.bits
            )
        tiles.append(u[0])
        sums.append(u[1])
    u_squares = np.concatenate([np.asarray(s) for s in sums])
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
    delta_norms = [float(np.sqrt(sum(n[p] ** 2 for p in paths))) for n in norms]
    return paths, tiles, block_scale, tuple(layout), delta_norms, float(np.sqrt(merged_sq))


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
