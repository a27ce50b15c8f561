"""Compiled loops over the blockwise int codecs (int8, int4, int2; PROTOCOL.md §Codecs): the levels
of a code byte, and the two passes of a snapshot diff (protocol/downlink.py `diff`).

- `encode_change`: the records of ``theta - held``, encoded as `blockwise.encode` encodes it, bit
  for bit, without the change ever written out: each block's change is computed twice (its
  absmax, then its codes) from the two values, in cache.
- `add_decoded`: ``held += decode(records)`` in float32, as a receiver's decoding and addition
  make it (`Codec.decode`, then numpy's add).

Each codec's loops are compiled (numba, at their first call, seconds each, then cached on disk:
`compiled`) with its levels per byte as constants, so that they vectorise; no fast-math, so every
value is the same float32 roundings on any CPU.  They release the GIL: `pieces.run_split` runs
them over a part of the blocks per thread.  Pure functions of arrays; no I/O.
"""

from __future__ import annotations

import functools

import ml_dtypes
import numba
import numpy as np

from dloco.protocol import blockwise
from dloco.protocol.errors import EncodeError
from dloco.protocol.pieces import DEFAULT_THREADS, run_split


@numba.njit(inline="always")
def level(c, j, bits):  # pragma: no cover - compiled
    """The level at position j of code byte c, for `bits` (a constant where the loops call it, so
    the compiler keeps one branch)."""
    if bits == 8:
        return np.int32(np.int8(c))
    if bits == 4:
        return ((np.int32(c) >> (4 * j)) & 15) - 8
    return ((np.int32(c) >> (2 * j)) & 3) - 1


# bits -> (levels per byte, the level added before packing)
LEVELS = {8: (1, 0), 4: (2, 8), 2: (4, 1)}

SERVED_BF16 = np.dtype(ml_dtypes.bfloat16)
# a served value's dtype by its config name (merger.served_dtype)
SERVED_DTYPES = {"fp32": np.dtype(np.float32), "bf16": SERVED_BF16}

# what `encode_change` returns: every block encodable, a non-finite value, a scale too large
OK, NOT_FINITE, TOO_LARGE = 0, 1, 2
_FLOAT32_MAX = np.float32(np.finfo(np.float32).max)


@numba.njit(inline="always")
def _row(held, r, wide, words, floats):  # pragma: no cover - compiled
    """Row r of the served value as float32: itself, or (bfloat16, held as uint16) each value's
    bits widened into `words` (uint32), which `floats` views as float32."""
    if not wide:
        return held[r]
    for i in range(held.shape[1]):
        words[i] = np.uint32(held[r, i]) << 16
    return floats


def compiled(loop, name: str):
    """`loop` compiled by numba at its first call, and cached on disk where numba finds a writable
    place (`__pycache__` beside the loop's file, else its user-wide cache): a cache's key includes
    the values the loop closes over (the codec's constants: numbers only, so that the key is the
    same in every process), and `name` keeps each variant's files apart.  Compiling one takes
    seconds; a process that finds it cached loads it in milliseconds.  (numba checks the loop's
    own file for changes, not this one's `level`: a change to `level` wants the caches cleared.)
    """
    loop.__name__ = loop.__qualname__ = name
    try:
        return numba.njit(nogil=True, cache=True)(loop)
    # no writable cache location: compiled in each process
    except RuntimeError:
        return numba.njit(nogil=True)(loop)


@functools.cache
def _encode_loop(bits: int, wide: bool):
    """The encode loop of one codec, compiled at its first call; `wide`: the served value is
    bfloat16 (uint16 arrays)."""
    per, offset = LEVELS[bits]
    levels = np.float32(blockwise.LEVELS[{8: "int8", 4: "int4", 2: "int2"}[bits]])
    flush, max_scale, mask = blockwise.FLUSH_BELOW, blockwise.MAX_SCALE[bits], (1 << bits) - 1

    def encode(theta, held, scales, codes, lo, hi):  # pragma: no cover - compiled
        status = OK
        width = theta.shape[1]
        bits_w = np.empty(width, np.uint32)
        floats = bits_w.view(np.float32)
        for r in range(lo, hi):
            row = _row(held, r, wide, bits_w, floats)
            # the block's absmax, and whether any change is NaN or infinite
            absmax = np.float32(0)
            wild = False
            for i in range(width):
                a = abs(theta[r, i] - row[i])
                wild |= not (a <= _FLOAT32_MAX)
                absmax = a if a > absmax else absmax
            if wild:
                status = max(status, NOT_FINITE)
                absmax = np.float32(0)
            normal = absmax >= flush
            scale = absmax / levels if normal else np.float32(0)
            if scale > max_scale:
                status = max(status, TOO_LARGE)
            inverse = levels / absmax if normal else np.float32(0)
            scales[r] = scale
            for k in range(codes.shape[1]):
                byte = 0
                for j in range(per):
                    x = theta[r, k * per + j] - row[k * per + j]
                    q = np.int32(np.rint(x * inverse)) + offset
                    byte |= (q & mask) << (bits * j)
                codes[r, k] = byte
        return status

    return compiled(encode, f"encode_int{bits}_{'bf16' if wide else 'fp32'}")


@functools.cache
def _add_loop(bits: int, wide: bool):
    """The add loop of one codec, compiled at its first call; `wide`: the served value is bfloat16
    (uint16 arrays), each sum rounded to it (nearest, ties to even, as ml_dtypes rounds a finite
    float32)."""
    per = LEVELS[bits][0]

    def add(held, scales, codes, lo, hi):  # pragma: no cover - compiled
        width = codes.shape[1] * per
        bits_w = np.empty(width, np.uint32)
        floats = bits_w.view(np.float32)
        for r in range(lo, hi):
            s = scales[r]
            row = _row(held, r, wide, bits_w, floats)
            for k in range(codes.shape[1]):
                for j in range(per):
                    row[k * per + j] = (
                        row[k * per + j] + np.float32(level(codes[r, k], j, bits)) * s
                    )
            if wide:
                for i in range(width):
                    u = bits_w[i]
                    held[r, i] = np.uint16((u + np.uint32(0x7FFF) + ((u >> 16) & 1)) >> 16)

    return compiled(add, f"add_int{bits}_{'bf16' if wide else 'fp32'}")


def _blocks(values: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray | None]:
    """A flat tensor as its full blocks (rows, width) and its last, partial block padded with
    zeros to a row of its own (None when every block is full)."""
    full = values.size // width
    rows = values[: full * width].reshape(full, width)
    if values.size == full * width:
        return rows, None
    tail = np.zeros((1, width), values.dtype)
    tail[0, : values.size - full * width] = values[full * width :]
    return rows, tail


def _read_only(values: np.ndarray) -> np.ndarray:
    view = values.view()
    view.flags.writeable = False
    return view


def _held(held: np.ndarray) -> tuple[np.ndarray, bool]:
    """The served value as the loops take it: float32, or bfloat16 as its uint16 bits."""
    wide = held.dtype == SERVED_BF16
    return (held.view(np.uint16) if wide else held), wide


def encode_change(
    theta: np.ndarray, held: np.ndarray, bits: int, block: int, threads: int = DEFAULT_THREADS
) -> np.ndarray:
    """Records (blocks, 4 + block * bits / 8) of ``theta - held`` (float32 theta; held float32 or
    bfloat16, the same shape) in the int codec of `bits`, the bytes `blockwise.encode` gives for
    that change (computed in float32).  EncodeError as it raises: a non-finite change, or one too
    large for the codec."""
    held, wide = _held(held)
    encode = _encode_loop(bits, wide)
    records = np.empty((-(-theta.size // block), blockwise.record_nbytes(block, bits)), np.uint8)
    scales = records[:, : blockwise.SCALE_BYTES].view("<f4")[:, 0]
    codes = records[:, blockwise.SCALE_BYTES :]
    statuses = []
    parts = zip(_blocks(theta.reshape(-1), block), _blocks(held.reshape(-1), block))
    row = 0
    for theta_rows, held_rows in parts:
        if theta_rows is None:
            continue
        # read-only views: one compiled variant, whether the caller's arrays (or the padded last
        # block) are writable or not
        theta_rows, held_rows = _read_only(theta_rows), _read_only(held_rows)
        n, at = len(theta_rows), row

        def part(lo: int, hi: int) -> None:
            statuses.append(encode(theta_rows, held_rows, scales[at:], codes[at:], lo, hi))

        run_split(part, n, threads)
        row += n
    if NOT_FINITE in statuses:
        raise EncodeError("cannot encode non-finite values (NaN/Inf in a block)")
    if TOO_LARGE in statuses:
        raise EncodeError(
            f"values too large for int{bits}: a change needs a scale above"
            f" {blockwise.MAX_SCALE[bits]:.4g}, which no decoder accepts"
        )
    return records


def add_decoded(
    held: np.ndarray, records: np.ndarray, bits: int, block: int, threads: int = DEFAULT_THREADS
) -> None:
    """held (float32 or bfloat16, any shape, contiguous) += the values `records` decode to, in
    float32 (bfloat16: the sum rounded to it)."""
    held, wide = _held(held)
    add = _add_loop(bits, wide)
    flat = held.reshape(-1)
    scales = records[:, : blockwise.SCALE_BYTES].view("<f4")[:, 0]
    codes = records[:, blockwise.SCALE_BYTES :]
    full = flat.size // block
    rows = flat[: full * block].reshape(full, block)
    run_split(lambda lo, hi: add(rows, scales, codes, lo, hi), full, threads)
    if full < records.shape[0]:
        tail = np.zeros((1, block), flat.dtype)
        tail[0, : flat.size - full * block] = flat[full * block :]
        add(tail, scales[full:], codes[full:], 0, 1)
        flat[full * block :] = tail[0, : flat.size - full * block]


def warm_up(bits: int, block: int, served: str | None = None) -> None:
    """Compile (or load from numba's cache) one codec's loops ahead: a diff of a tensor of one
    block and a value (every argument layout `encode_change` and `add_decoded` pass), for the
    served dtype `served` ("fp32" or "bf16"; None: both)."""
    for dtype in (np.float32, SERVED_BF16) if served is None else (SERVED_DTYPES[served],):
        theta, held = np.ones(block + 1, np.float32), np.zeros(block + 1, dtype)
        add_decoded(held, encode_change(theta, held, bits, block), bits, block)
