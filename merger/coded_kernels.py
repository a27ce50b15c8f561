"""The XLA kernels of merging from codes (merger/coded.py): passes over a group of deltas' codes,
and the outer step that takes the merged direction as tiles.

Levels are unpacked per position in the byte (two arrays for int4) and u is accumulated that way;
the round's last kernel call interleaves u into value order and sums its squares per block.  Every
reduction whose order could vary is either over exact integers or a fixed halving tree, so the
same records give the same bytes (replay feeds the same records to this code).  The outer step
(`outer_step`) cuts u into the fragment's tensors in the same XLA computation, each tensor from
slices of just the tiles it spans (never a concatenation of the whole fragment).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import optax

# Bumped whenever a change to these kernels moves results by as much as a rounding unit (logged in
# the genesis record: `dloco replay` says when a log was written with other kernels or jax).
# 2: a fold whose delta the guard clipped stays on codes (its block scales scaled), where it was
# merged from float32
KERNELS_VERSION = 2


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


@functools.lru_cache(maxsize=64)
def outer_step(optimizer: optax.GradientTransformation, *, in_place: bool = False):
    """The outer step taking the pseudo-gradient as tiles: one XLA computation per fragment layout
    (as `outer.make_step`, whose optimizer-state layout — a path-ordered list — it shares).
    `in_place`: the parameters and optimizer state passed in are donated, the new ones written
    over them (a buffer a host view still holds is copied instead).  Keyword-only: the cache would
    hold a positional call apart, compiled again."""

    optimizer = optax.with_extra_args_support(optimizer)

    @functools.partial(
        jax.jit, static_argnames=("layout",), donate_argnums=(0, 1) if in_place else ()
    )
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
