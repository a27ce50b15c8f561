"""Compiling ahead, so that the merger folds its first rounds without waiting for XLA.

Folds from int codes run a few compiled shapes (merger/coded.py: groups of 1, 2, 4 or 8 deltas over
tiles of a power of two blocks) and one outer step per fragment layout.  `warm_up_kernels`
compiles the former for fragments of given sizes and one codec; `warm_up_folds` both, for a
core's fragments: the kernels by merging a zero delta, the step from the fragments' shapes.  A
compilation cannot be cut short, and a process must not exit during one: once `stopping()` is
true, each returns before the next.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import numpy as np
import optax

from dloco.merger import coded
from dloco.merger.coded_kernels import (
    accumulate,
    accumulate_first,
    accumulate_last,
    block_square_sums,
    outer_step,
)
from dloco.merger.config import MergeConfig
from dloco.merger.fold import plain as fold_plain
from dloco.protocol import Codec, CodedTensor


def warm_up_kernels(
    fragment_values: Sequence[int], block: int = 256, bits: int = 4, stopping=lambda: False
) -> None:
    """Compile the kernels ahead of the first rounds, for fragments of these sizes (values) and one
    codec (int4, block 256 by default: the islands' default).  `stopping()` true: return before
    the next compilation (one cannot be cut short, and a process must not exit during one)."""
    for tile in sorted({coded.tile_blocks(-(-values // block)) for values in fragment_values}):
        codes = np.zeros((tile, block * bits // 8), np.uint8)
        # a round's first group, the groups after it; the last one of each
        for size in coded.GROUPS:
            if stopping():
                return
            group, factors = coded.padded([codes], size), np.zeros((size, tile), np.float32)
            block_square_sums(group, bits).block_until_ready()
            jax.block_until_ready(accumulate_first(np.float32(0), group, factors, bits, last=True))
            u = accumulate_first(np.float32(0), group, factors, bits)
            u = accumulate(u, group, factors, bits)
            jax.block_until_ready(accumulate_last(u, group, factors, bits))


def warm_up_folds(
    optimizer: optax.GradientTransformation,
    layouts: Sequence[dict[str, tuple[int, ...]]],
    merge: MergeConfig,
    codec: Codec,
    stopping: Callable[[], bool],
) -> None:
    """Compile the kernels of folds from int codes for every fragment's size (`layouts`), and the
    in-place outer step of every fragment, for deltas in `codec`.  The step is compiled from the
    shapes alone: the fragments' state is never read (a fold may take its step in place meanwhile)
    and no copy of it is made."""
    warm_up_kernels(
        [sum(int(np.prod(shape)) for shape in layout.values()) for layout in layouts],
        codec.block,
        codec.bits,
        stopping,
    )
    for layout in layouts:
        if stopping():
            return
        zero = {
            path: CodedTensor(
                codec,
                shape,
                np.zeros((-(-int(np.prod(shape)) // codec.block), codec.record_nbytes), np.uint8),
            )
            for path, shape in layout.items()
        }
        plain = {path: fold_plain(path, merge) for path in zero}
        paths, tiles, block_scale, kernel_layout, _, _ = coded.direction([zero], [0.0], plain)
        params = [jax.ShapeDtypeStruct(layout[p], np.float32) for p in paths]
        outer_step(optimizer, in_place=True).lower(
            params,
            jax.eval_shape(optimizer.init, params),
            tiles,
            block_scale,
            np.float32(1),
            kernel_layout,
        ).compile()
