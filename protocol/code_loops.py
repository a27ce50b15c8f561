"""Compiled loops over the blockwise int codecs (int8, int4, int2; PROTOCOL.md §Codecs): the levels
of a code byte, and the two passes of a snapshot diff (protocol/downlink.py `diff`).

- `encode_change`: the records of ``theta - held``, encoded as `blockwise.encode` encodes it, bit
  for bit, without the change ever written out: each block's change is computed twice (its
  absmax, then its codes) from the two values, in cache.
- `add_decoded`: ``held += decode(records)`` in float32, as a receiver's decoding and addition
  make it (`Codec.decode`, then numpy's add).

Each codec's loops are compiled (numba, at their first call, about a second each) with its levels
per byte as constants, so that they vectorise; no fast-math, so every value is the same float32
roundings on any CPU.  They release the GIL: `pieces.run_split` runs them over a part of the blocks
per thread.  Pure functions of arrays; no I/O.
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
def level_int8(c, j):  # pragma: no cover - compiled
    return np.int32(np.int8(c))


@numba.njit(inline="always")
def level_int4(c, j):  # pragma: no cover - compiled
    return ((np.int32(c) >> (4 * j)) & 15) - 8


@numba.njit(inline="always")
def level_int2(c, j):  # pragma: no cover - compiled
    return ((np.int32(c) >> (2 * j)) & 3) - 1


# bits -> (the level at position j of a byte, levels per byte, the level added before packing)
LEVELS = {8: (level_int8, 1, 0), 4: (level_int4, 2, 8), 2: (level_int2, 4, 1)}

SERVED_BF16 = np.dtype(ml_dtypes.bfloat16)

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


@functools.cache
def _encode_loop(bits: int, wide: bool):
    """The encode loop of one codec, compiled at its first call; `wide`: the served value is
    bfloat16 (uint16 arrays)."""
    _, per, offset = LEVELS[bits]
    levels = np.float32(blockwise.LEVELS[{8: "int8", 4: "int4", 2: "int2"}[bits]])
    flush, max_scale, mask = blockwise.FLUSH_BELOW, blockwise.MAX_SCALE[bits], (1 << bits) - 1
    lanes = 8

    @numba.njit(nogil=True)
    def encode(theta, held, scales, codes, lo, hi):  # pragma: no cover - compiled
        status = OK
        width = theta.shape[1]
        most = np.zeros(lanes, np.float32)
        bits_w = np.empty(width, np.uint32)
        floats = bits_w.view(np.float32)
        for r in range(lo, hi):
            row = _row(held, r, wide, bits_w, floats)
            # the block's absmax (over independent lanes: a max is exact in any order) and
            # whether any change is NaN or infinite
            most[:] = 0
            wild = False
            for i in range(0, width, lanes):
                for lane in range(lanes):
                    a = abs(theta[r, i + lane] - row[i + lane])
                    wild |= not (a <= _FLOAT32_MAX)
                    most[lane] = max(most[lane], a)
            absmax = most.max()
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

    return encode


@functools.cache
def _add_loop(bits: int, wide: bool):
    """The add loop of one codec, compiled at its first call; `wide`: the served value is bfloat16
    (uint16 arrays), each sum rounded to it (nearest, ties to even, as ml_dtypes rounds a finite
    float32)."""
    level, per, _ = LEVELS[bits]

    @numba.njit(nogil=True)
    def add(held, scales, codes, lo, hi):  # pragma: no cover - compiled
        width = codes.shape[1] * per
        bits_w = np.empty(width, np.uint32)
        floats = bits_w.view(np.float32)
        for r in range(lo, hi):
            s = scales[r]
            row = _row(held, r, wide, bits_w, floats)
            for k in range(codes.shape[1]):
                for j in range(per):
                    row[k * per + j] = row[k * per + j] + np.float32(level(codes[r, k], j)) * s
            if wide:
                for i in range(width):
                    u = bits_w[i]
                    held[r, i] = np.uint16((u + np.uint32(0x7FFF) + ((u >> 16) & 1)) >> 16)

    return add


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


def warm_up(bits: int, block: int) -> None:
    """Compile one codec's loops ahead: a diff of a tensor of one block and a value (every argument
    layout `encode_change` and `add_decoded` pass), for either served dtype."""
    for dtype in (np.float32, SERVED_BF16):
        theta, held = np.ones(block + 1, np.float32), np.zeros(block + 1, dtype)
        add_decoded(held, encode_change(theta, held, bits, block), bits, block)
        # theta as the merger passes it: a host view of an XLA array, read-only
        theta.flags.writeable = False
        encode_change(theta, held, bits, block)
