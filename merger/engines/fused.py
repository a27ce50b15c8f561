"""Folds whose merge and outer step are one pass over the model: a round of dense int codes under
Nesterov momentum (`outer.kind = "nesterov"`, momentum float32 or bfloat16).

The merged pseudo-gradient is never written out.  `dense_loops.nesterov_into` reads each block's
codes, the fragment's parameters and momentum, and writes the new parameters and momentum: about
half the memory traffic of writing the direction and stepping over it in XLA (whose step with a
bfloat16 momentum is two programs, each reading the direction), and none of the merger's
receiving thread.  The fold writes the new state into buffers of its own (`StateBuffers`), never
over the state it was computed from: it runs on the fold worker while the fragment's state is
still what catch-up requests, checkpoints and the guard's norms read, and installing it is a
swap.  The state it replaces goes back to the buffers once nothing views it.

A fragment's state lives in two flat arrays over its blocks (parameters float32, momentum of its
dtype), each tensor a view from the first value of its first block, as the fold's codes lay them
out; a state that is not (a fragment's first, one from a checkpoint or from a fold in XLA) is
gathered into that layout by its first fold here.  Same records, same bytes: every value is the
same float32 roundings in a fixed order (dense_loops), on any CPU and any number of threads.
Pure functions of arrays; no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import ml_dtypes
import numpy as np

from dloco.merger.engines import dense_loops
from dloco.merger.engines.coded import Dense
from dloco.merger.engines.scratch import StateBuffers

BF16 = np.dtype(ml_dtypes.bfloat16)
MOMENTUM_DTYPES = (np.dtype(np.float32), BF16)


def fits(params: dict[str, Any], opt_state: Any) -> bool:
    """Whether a fragment's state is one this fold steps: float32 parameters, and an optimizer
    state of one momentum array per parameter, in path order, of one dtype it keeps."""
    leaves = jax.tree_util.tree_leaves(opt_state)
    paths = sorted(params)
    return (
        len(leaves) == len(paths)
        and all(np.dtype(params[p].dtype) == np.float32 for p in paths)
        and all(tuple(m.shape) == tuple(params[p].shape) for m, p in zip(leaves, paths))
        and len({np.dtype(m.dtype) for m in leaves}) == 1
        and np.dtype(leaves[0].dtype) in MOMENTUM_DTYPES
    )


def step(
    params: dict[str, Any],
    opt_state: Any,
    dense: Dense,
    terms: tuple[float, float],
    buffers: StateBuffers,
) -> tuple[dict[str, np.ndarray], Any]:
    """The fragment's new (parameters, optimizer state) after the Nesterov step of `terms` (lr,
    momentum) over the merged direction of `dense`, in buffers taken from `buffers`; `params` and
    `opt_state` (`fits`) are read, never written."""
    paths = sorted(params)
    leaves, treedef = jax.tree_util.tree_flatten(opt_state)
    dtype = np.dtype(leaves[0].dtype)
    values = dense.scale.size * dense.block
    offsets = [dense.spans[p][0] * dense.block for p in paths]
    new = (
        buffers.take(values * 4).view(np.float32),
        buffers.take(values * dtype.itemsize).view(dtype),
    )
    old = []
    for flat, arrays in zip(new, ([params[p] for p in paths], leaves)):
        held = _flat(arrays, offsets, values)
        if held is None:
            # into the new buffer, stepped in place
            _gather(flat, arrays, offsets)
            held = flat
        old.append(held)
    dense_loops.nesterov_into(
        tuple(_rows(a, dense.block) for a in new),
        tuple(_rows(a, dense.block) for a in old),
        dense.codes,
        dense.factors,
        dense.scale,
        dense.bits,
        terms,
    )
    shapes = [tuple(params[p].shape) for p in paths]
    new_params = dict(zip(paths, _views(new[0], offsets, shapes)))
    return new_params, jax.tree_util.tree_unflatten(treedef, _views(new[1], offsets, shapes))


def _rows(flat: np.ndarray, block: int) -> np.ndarray:
    """A flat array as the loops take it: (blocks, block), momentum of bfloat16 as its bits."""
    rows = flat.reshape(-1, block)
    return rows.view(np.uint16) if rows.dtype == BF16 else rows


def _views(flat: np.ndarray, offsets: list[int], shapes: list[tuple]) -> list[np.ndarray]:
    """Each tensor of a state, read-only (a state is replaced, never written: as XLA's arrays)."""
    views = []
    for at, shape in zip(offsets, shapes):
        view = flat[at : at + int(np.prod(shape))].reshape(shape)
        view.flags.writeable = False
        views.append(view)
    return views


def _flat(arrays: Sequence[Any], offsets: list[int], values: int) -> np.ndarray | None:
    """The flat array of `values` that `arrays` are views of, each at its offset, if they are
    (numpy views of one buffer that `StateBuffers` laid out; a host view of an XLA array is not)."""
    first = arrays[0]
    raw = first.base if isinstance(first, np.ndarray) else None
    if not isinstance(raw, np.ndarray) or raw.dtype != np.uint8 or raw.ndim != 1:
        return None
    dtype = first.dtype
    start = -raw.ctypes.data % 64
    if raw.size < start + values * dtype.itemsize:
        return None
    flat = raw[start : start + values * dtype.itemsize].view(dtype)
    for array, at in zip(arrays, offsets):
        if not (
            isinstance(array, np.ndarray)
            and array.base is raw
            and array.dtype == dtype
            and array.flags.c_contiguous
            and array.ctypes.data == flat.ctypes.data + at * dtype.itemsize
        ):
            return None
    return flat


def _gather(flat: np.ndarray, arrays: Sequence[Any], offsets: list[int]) -> None:
    """Each array's values into `flat` at its offset; the padding after each (the rest of its
    last block) zero."""
    ends = offsets[1:] + [flat.size]
    for array, at, end in zip(arrays, offsets, ends):
        values = np.asarray(array).reshape(-1)
        flat[at : at + values.size] = values
        flat[at + values.size : end] = 0
