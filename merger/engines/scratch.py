"""Memory a merger's folds reuse (merger/engines/coded.py, merger/engines/fused.py): a fresh block
is faulted in a page at a time, many times slower than a copy into memory already mapped
(merger/memory.py), so a fold writes into memory an earlier one used.  Pure memory bookkeeping; no
I/O.
"""

from __future__ import annotations

import collections
import sys
import threading

import jax
import numpy as np

# free state buffers kept for the next folds (each a fragment's parameters or momentum)
SPARE_STATES = 2


def _aligned_empty(shape: tuple[int, ...], align: int = 64) -> np.ndarray:
    """An uninitialised uint8 array starting on an `align`-byte boundary, whose tiles (each a
    multiple of `align` bytes) jax.device_put hands to XLA without copying (it copies anything
    less aligned)."""
    nbytes = int(np.prod(shape))
    raw = np.empty(nbytes + align, np.uint8)
    start = -raw.ctypes.data % align
    return raw[start : start + nbytes].reshape(shape)


class Scratch:
    """Memory one merger's folds from dense codes reuse: a fresh block is faulted in a page at a
    time, many times slower than a copy into memory already mapped (merger/memory.py).
    The round's codes (`dense` alone uses them), and two buffers for the merged direction's
    float32 values, taken in turn: the fold's outer step reads a direction after `dense` returns
    (XLA takes it without a copy), so a fold's direction is written while the previous fold's step
    may still run, into the other buffer.  `read_by` names the arrays a step reading the last
    direction writes; `settle`, before the next step is taken (which may write over those
    arrays), waits until they are ready: a buffer is written again only after the step that read
    it is done.  Grown to the largest fragment; the codes shrink after a larger round than
    usual.  `states`: the buffers of fragments' states that folds taking their step in the
    merge's pass write (merger/engines/fused.py)."""

    def __init__(self) -> None:
        self._codes = np.empty(0, np.uint8)
        self._values = [np.empty(0, np.uint8), np.empty(0, np.uint8)]
        self._readers: list[object] = [None, None]
        self._last = 1
        self.states = StateBuffers()

    def codes(self, shape: tuple[int, ...]) -> np.ndarray:
        size = int(np.prod(shape))
        if not size <= self._codes.size <= 4 * size:
            self._codes = np.empty(size, np.uint8)
        return self._codes[:size].reshape(shape)

    def values(self, nbytes: int) -> np.ndarray:
        """`nbytes` of 64-byte aligned memory that no outer step reads any more."""
        i = self._last = 1 - self._last
        self._wait(i)
        if self._values[i].size < nbytes:
            self._values[i] = _aligned_empty((nbytes,))
        return self._values[i][:nbytes]

    def read_by(self, outputs: object) -> None:
        """The arrays (any pytree) an outer step reading the last values writes."""
        self._readers[self._last] = outputs

    def settle(self) -> None:
        """Wait for every step that reads a buffer (before a step that may donate their
        outputs)."""
        for i in (0, 1):
            self._wait(i)

    def _wait(self, i: int) -> None:
        if self._readers[i] is not None:
            jax.block_until_ready(self._readers[i])
            self._readers[i] = None


class StateBuffers:
    """Flat buffers that hold fragments' parameters and optimizer state (merger/engines/fused.py): a
    fold writes the fragment's new state into buffers taken here, and the buffers of the state it
    replaces are taken again by a later fold once nothing views them any more.  Whether anything
    does is the buffer's reference count: every numpy view of a buffer holds a reference to it
    (whoever still holds a state, a host view of it, or an array made from one keeps its buffer
    out of reuse).  At most `spare` free buffers of each size are kept."""

    def __init__(self, spare: int = SPARE_STATES) -> None:
        self.spare = spare
        self._buffers: list[np.ndarray] = []
        # every size asked for
        self._sizes: set[int] = set()
        # a buffer seen free is viewed before another thread looks
        self._lock = threading.Lock()
        # buffers allocated, not taken again (a merger's steady state allocates none)
        self.fresh = 0

    def take(self, nbytes: int, align: int = 64) -> np.ndarray:
        """`nbytes` of `align`-byte aligned uint8 memory that nothing else views: the smallest free
        buffer that holds them and is at most a quarter larger, else a new one, as large as the
        largest request so far that is at most a quarter larger (fragments of a model differ a
        little in size: each one's buffer then fits the next fold of any of them; a fragment much
        smaller does not take, and waste, a larger one's)."""
        with self._lock:
            return self._take(nbytes, align)

    def _take(self, nbytes: int, align: int) -> np.ndarray:
        self._sizes.add(nbytes)
        free = [i for i in range(len(self._buffers)) if not self._viewed(i)]
        fits = [i for i in free if 0 <= self._buffers[i].size - nbytes - align <= nbytes // 4]
        if fits:
            chosen = min(fits, key=lambda i: self._buffers[i].size)
        else:
            chosen = len(self._buffers)
            size = max(n for n in self._sizes if n <= nbytes + nbytes // 4)
            self._buffers.append(np.empty(size + align, np.uint8))
            self.fresh += 1
        # the viewed, the chosen, and of each size `spare` others free (a fold of a fragment of
        # another size cannot take them, the next of one of this size will)
        dropped, kept = set(), collections.Counter()
        for i in free:
            size = self._buffers[i].size
            if i != chosen and kept[size] >= self.spare:
                dropped.add(i)
            elif i != chosen:
                kept[size] += 1
        self._buffers = [b for i, b in enumerate(self._buffers) if i not in dropped]
        raw = self._buffers[chosen - sum(i < chosen for i in dropped)]
        start = -raw.ctypes.data % align
        return raw[start : start + nbytes]

    def _viewed(self, i: int) -> bool:
        # this list's reference and getrefcount's argument: nothing else
        return sys.getrefcount(self._buffers[i]) > 2
