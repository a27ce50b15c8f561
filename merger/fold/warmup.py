"""Compiling ahead, so that the merger folds its first rounds without waiting for a compiler.

Folds from dense int codes run compiled loops, a few per codec (merger/engines/dense_loops.py; under
Nesterov momentum the outer step is one of them: merger/engines/fused.py), other folds one outer
step per fragment layout; folds from sparse codes run XLA kernels of a few shapes
(merger/engines/coded.py) and compile them at their first round.  `warm_up_kernels` compiles one
codec's loops; `warm_up_folds` those and every fragment's outer step.  A compilation cannot be cut
short, and a process must not exit during one: once `stopping()` is true, each returns before the
next.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import numpy as np
import optax

from dloco.merger.engines import coded, dense_loops
from dloco.merger.fold.outer import compile_step, make_step
from dloco.protocol import Codec, CodedTensor


def warm_up_kernels(codec: Codec) -> None:
    """Compile the loops of folds: the guard's norm, and those of `codec`'s codes (dense int
    codecs) by merging two small deltas (the loops take the same arrays for any number)."""
    # of numpy arrays (a fragment's first state) and of host views of XLA arrays (read-only, a
    # compilation of their own)
    held = np.zeros(3, np.float32)
    dense_loops.norm([held])
    held.flags.writeable = False
    dense_loops.norm([held])
    if not codec.blockwise or codec.sparse:
        return
    count = codec.block + 1
    zero = {"w": CodedTensor(codec, (count,), _zero_records(codec, count))}
    coded.dense([zero, zero], [0.5, 0.5], {"w": False})
    # the Nesterov step in the merge's pass (merger/engines/fused.py), momentum float32 or
    # bfloat16's bits
    codes = np.zeros((1, 1, codec.block * codec.bits // 8), np.uint8)
    factors = np.zeros((1, 1), np.float32)
    for dtype in (np.float32, np.uint16):
        pair = (np.zeros((1, codec.block), np.float32), np.zeros((1, codec.block), dtype))
        dense_loops.nesterov_into(pair, pair, codes, factors, factors[0], codec.bits, (0.0, 0.0))


def _zero_records(codec: Codec, count: int) -> np.ndarray:
    return np.zeros((-(-count // codec.block), codec.record_nbytes), np.uint8)


def warm_up_folds(
    optimizer: optax.GradientTransformation,
    layouts: Sequence[dict[str, tuple[int, ...]]],
    codec: Codec,
    stopping: Callable[[], bool],
) -> None:
    """Compile the loops of folds from `codec`'s codes, and the in-place outer step of every
    fragment (`layouts`: each one's shapes).  The step is compiled from the
    shapes alone: the fragments' state is never read (a fold may take its step in place meanwhile)
    and no copy of it is made."""
    warm_up_kernels(codec)
    for layout in layouts:
        if stopping():
            return
        paths = sorted(layout)
        params = [jax.ShapeDtypeStruct(layout[p], np.float32) for p in paths]
        compile_step(
            make_step(optimizer, in_place=True), params, jax.eval_shape(optimizer.init, params)
        )
