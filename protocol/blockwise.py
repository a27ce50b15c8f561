"""Blockwise absmax codecs ``int8`` / ``int4`` / ``int2``: blocks of ``block`` values (the last
padded with 0), each one record, a float32 ``scale = absmax / L`` (L = 127, 7, 1) followed by the
block's codes ``q = round_half_even(x / scale)`` in ``[-L, L]``.

Pure numpy; no I/O.  `quantization.Codec` dispatches here; the layout is PROTOCOL.md §5 (and the
docstring of protocol/quantization.py).  Encoding and decoding work through the input in
cache-sized pieces, on a few threads (protocol/pieces.py), so that their numpy passes touch L2,
not DRAM (BENCHMARKS.md).
"""

from __future__ import annotations

import numpy as np

from dloco.protocol.errors import EncodeError
from dloco.protocol.pieces import PASS_BYTES, WorkBuffers, run_pieces, work_buffers

SCALE_BYTES = 4
# Blocks with a smaller absmax are flushed to zero: L / absmax must stay finite for L <= 127
# (127 * 2**120 < FLT_MAX), and such values are far below anything a delta carries.
FLUSH_BELOW = np.float32(2.0**-120)
LEVELS = {"int8": 127, "int4": 7, "int2": 1}
BITS = {"int8": 8, "int4": 4, "int2": 2}
# Largest code magnitude a decoder may meet: int8 -128, int4 nibble 0 = -8, int2 code 3 = +2.
_LARGEST_CODE = {"int8": 128, "int4": 8, "int2": 2}
# Largest valid scale, by bits: FLT_MAX / largest code (exact in float32: c is a power of two).
MAX_SCALE = {
    BITS[n]: np.float32(np.finfo(np.float32).max) / np.float32(_LARGEST_CODE[n]) for n in LEVELS
}


def _unpack_table(bits: int) -> np.ndarray:
    """Decoded level of every code in a byte: shape (256, 8 // bits), float32."""
    per_byte = 8 // bits
    offset = {4: 8, 2: 1}[bits]
    byte_B = np.arange(256, dtype=np.int32)[:, None]
    shifts_K = np.arange(per_byte, dtype=np.int32)[None, :] * bits
    return (((byte_B >> shifts_K) & ((1 << bits) - 1)) - offset).astype(np.float32)


# int4 decodes by arithmetic (_dequantize_rows)
_TABLES = {2: _unpack_table(2)}


def record_nbytes(block: int, bits: int) -> int:
    """Bytes of one record: the float32 scale and the block's codes."""
    return SCALE_BYTES + block * bits // 8


def encode(x_N: np.ndarray, name: str, block: int, threads: int) -> np.ndarray:
    """Quantize x into records of shape (blocks, record_nbytes)."""
    levels, bits = LEVELS[name], BITS[name]
    n_full, tail = divmod(x_N.size, block)
    n_blocks = n_full + (tail > 0)
    rec_BxR = np.empty((n_blocks, record_nbytes(block, bits)), dtype=np.uint8)
    scale_B = rec_BxR[:, :SCALE_BYTES].view("<f4")[:, 0]
    codes_BxC = rec_BxR[:, SCALE_BYTES:]
    rows = max(1, PASS_BYTES // (4 * block))
    full_BxK = x_N[: n_full * block].reshape(n_full, block)

    def quantize_piece(r0: int, r1: int) -> None:
        _quantize_rows(
            full_BxK[r0:r1],
            scale_B[r0:r1],
            codes_BxC[r0:r1],
            levels,
            bits,
            work_buffers(rows, block),
        )

    run_pieces(quantize_piece, n_full, rows, threads)
    if tail:
        padded_1xK = np.zeros((1, block), dtype=np.float32)
        padded_1xK[0, :tail] = x_N[n_full * block :]
        _quantize_rows(
            padded_1xK, scale_B[n_full:], codes_BxC[n_full:], levels, bits, work_buffers(1, block)
        )
    return rec_BxR


def _quantize_rows(x_RxK, scale_R, codes_RxC, levels: int, bits: int, work: WorkBuffers) -> None:
    n, block = x_RxK.shape
    t_RxK, absmax_R = work.f32_RxK[:n], work.absmax_R[:n]
    np.abs(x_RxK, out=t_RxK)
    np.max(t_RxK, axis=1, out=absmax_R)
    if not np.isfinite(absmax_R).all():
        raise EncodeError("cannot encode non-finite values (NaN/Inf in a block)")
    normal_R = absmax_R >= FLUSH_BELOW
    scale_R[:] = np.where(normal_R, absmax_R / np.float32(levels), np.float32(0))
    if (scale_R > MAX_SCALE[bits]).any():
        raise EncodeError(
            f"values too large for int{bits}: |x| of {absmax_R.max():.4g} needs a scale above"
            f" {MAX_SCALE[bits]:.4g}, which no decoder accepts"
        )
    inverse_R = np.divide(np.float32(levels), absmax_R, out=np.zeros_like(absmax_R), where=normal_R)
    np.multiply(x_RxK, inverse_R[:, None], out=t_RxK)
    # round half to even; |q| <= levels since |x| <= absmax
    np.rint(t_RxK, out=t_RxK)
    if bits == 8:
        np.copyto(codes_RxC.view(np.int8), t_RxK, casting="unsafe")
        return
    offset = {4: 8, 2: 1}[bits]
    t_RxK += np.float32(offset)
    u_RxK = work.u8_RxK[:n]
    np.copyto(u_RxK, t_RxK, casting="unsafe")
    if bits == 4:
        # Little-endian u16 of a pair is lo | hi << 8; OR-ing in itself >> 4 puts hi at bits 4..7.
        pair_RxH = u_RxK.view("<u2")
        np.copyto(codes_RxC, pair_RxH | (pair_RxH >> 4), casting="unsafe")
    else:
        quad_RxQ = u_RxK.view("<u4")
        packed_RxQ = quad_RxQ | (quad_RxQ >> 6)
        packed_RxQ |= packed_RxQ >> 12
        np.copyto(codes_RxC, packed_RxQ, casting="unsafe")


def decode(
    data_U: np.ndarray, block: int, bits: int, count: int, out_N: np.ndarray, threads: int
) -> None:
    """Dequantize `count` values from records (already validated) into float32 `out_N`."""
    rec_BxR = data_U.reshape(-1, record_nbytes(block, bits))
    n_blocks = rec_BxR.shape[0]
    scale_Bx1 = rec_BxR[:, :SCALE_BYTES].view("<f4")
    codes_BxC = rec_BxR[:, SCALE_BYTES:]
    n_full = count // block
    full_BxK = out_N[: n_full * block].reshape(n_full, block)

    def dequantize_piece(r0: int, r1: int) -> None:
        _dequantize_rows(codes_BxC[r0:r1], scale_Bx1[r0:r1], full_BxK[r0:r1], bits)

    run_pieces(dequantize_piece, n_full, max(1, PASS_BYTES // (4 * block)), threads)
    if n_blocks > n_full:
        padded_1xK = np.empty((1, block), dtype=np.float32)
        _dequantize_rows(codes_BxC[n_full:], scale_Bx1[n_full:], padded_1xK, bits)
        out_N[n_full * block :] = padded_1xK[0, : count - n_full * block]


def _dequantize_rows(codes_RxC, scale_Rx1, out_RxK, bits: int) -> None:
    if bits == 8:
        np.multiply(codes_RxC.view(np.int8), scale_Rx1, out=out_RxK)
        return
    if bits == 4:
        # Each code byte widened to a little-endian u16 of its low nibble then its high one: the
        # u16s' bytes are the codes + 8 in value order, so whole-array shifts, an int8 subtraction
        # and the scaling decode them: a few passes over contiguous arrays, faster than a table
        # lookup per byte (BENCHMARKS.md).
        n, half = codes_RxC.shape
        work = work_buffers(max(1, PASS_BYTES // (8 * half)), 2 * half)
        pair_RxH, low_RxH = work.u16_RxH[:n], work.u8_RxK[:n, :half]
        np.right_shift(codes_RxC, 4, out=pair_RxH, dtype=np.uint16)
        np.left_shift(pair_RxH, 8, out=pair_RxH)
        np.bitwise_and(codes_RxC, 15, out=low_RxH)
        np.bitwise_or(pair_RxH, low_RxH, out=pair_RxH)
        levels_RxK = pair_RxH.view(np.int8)
        np.subtract(levels_RxK, np.int8(8), out=levels_RxK)
        np.multiply(levels_RxK, scale_Rx1, out=out_RxK)
        return
    # One table lookup per byte yields all of its levels (2 for int4, 4 for int2), in order.
    table = _TABLES[bits]
    n, per_byte = out_RxK.shape[0], 8 // bits
    np.take(table, codes_RxC, axis=0, out=out_RxK.reshape(n, -1, per_byte))
    out_RxK *= scale_Rx1
