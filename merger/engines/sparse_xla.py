"""The XLA kernels of merging from sparse codes (merger/engines/coded.py): the scatter-adds of a
group of deltas' kept levels, and the outer step that takes the merged direction as tiles.  (The
dense int codecs fold by compiled loops: merger/engines/dense_loops.py.)

Every reduction whose order could vary is either over exact integers or a fixed halving tree, so
the same records give the same bytes (replay feeds the same records to this code).  The outer step
(`outer_step`) cuts u into the fragment's tensors in the same XLA computation, each tensor from
slices of just the tiles it spans (never a concatenation of the whole fragment).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax

# Bumped whenever a change to these kernels moves results by as much as a rounding unit (logged in
# the genesis record: `dloco replay` says when a log was written with other kernels or jax).
# CHANGELOG.md says what each version changed.
KERNELS_VERSION = 5


def _halving_sum(x: jax.Array) -> jax.Array:
    """Sum over the last axis (a power of two) in a fixed pairwise order."""
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x[..., 0]


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
    just the tiles it spans (concatenating every tile first made XLA copy the whole fragment
    twice).
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
