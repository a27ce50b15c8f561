"""Wire codecs for parameter deltas and snapshots: fp32, bf16, blockwise absmax int8/int4/int2, and
the sparse blockwise topk2/topk4 (protocol/sparse.py: top 1/32 of each block, 2- or 4-bit levels).

Pure numpy; no I/O.  Every codec turns a flat float32 vector into a flat uint8 buffer and back.
The byte layouts are specified in PROTOCOL.md §Codecs; in short:

- ``fp32``: IEEE-754 binary32, little-endian.  Lossless.
- ``bf16``: the upper 16 bits of the binary32 value after round-to-nearest-even, little-endian.
  Relative error ≤ 2**-8 for normal values (8 significant bits, round to nearest even).
- ``int8`` / ``int4`` / ``int2``: blocks of ``block`` values (the last padded with 0), each one
  *record*: a float32 ``scale = absmax / L`` (L = 127, 7, 1) followed by the block's codes
  ``q = round_half_even(x / scale)`` in ``[-L, L]``, so every value is off by at most ``scale / 2``
  (plus float32 rounding).  Blocks with absmax below 2**-120 are flushed to zero (scale 0).
  Encoders refuse exactly the scales decoders refuse (above FLT_MAX / largest code), so whatever
  encodes, decodes.  Code packing: int8 one byte; int4 ``q + 8`` in nibbles, low first; int2
  ``q + 1`` in two bits, value 4j+k in bits 2k..2k+1 of byte j.  PROTOCOL.md §5 has the details.

Records make any block-aligned slice of an encoded tensor a contiguous byte range, so a tensor is
quantized once and its chunks are zero-copy views (see `chunking.py`).

Speed: the int codecs work through the input in cache-sized pieces, on a few threads
(protocol/pieces.py), so that their numpy passes touch L2, not DRAM (BENCHMARKS.md).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import numpy as np

from dloco.protocol import sparse
from dloco.protocol.errors import EncodeError, ProtocolError
from dloco.protocol.pieces import DEFAULT_THREADS, PASS_BYTES, WorkBuffers, run_pieces, work_buffers

CODEC_NAMES = ("fp32", "bf16", "int8", "int4", "int2", *sparse.SPARSE_BITS)
DEFAULT_BLOCK = 256
MIN_BLOCK, MAX_BLOCK = 8, 1 << 16

_SCALE_BYTES = 4
# Blocks with a smaller absmax are flushed to zero: L / absmax must stay finite for L <= 127
# (127 * 2**120 < FLT_MAX), and such values are far below anything a delta carries.
_FLUSH_BELOW = np.float32(2.0**-120)
_LEVELS = {"int8": 127, "int4": 7, "int2": 1}
_BITS = {"fp32": 32, "bf16": 16, "int8": 8, "int4": 4, "int2": 2, **sparse.SPARSE_BITS}
# Largest code magnitude a decoder may meet: int8 -128, int4 nibble 0 = -8, int2 code 3 = +2.
_LARGEST_CODE = {"int8": 128, "int4": 8, "int2": 2}
# Largest valid scale, by bits: FLT_MAX / largest code (exact in float32: c is a power of two).
_MAX_SCALE = {
    _BITS[n]: np.float32(np.finfo(np.float32).max) / np.float32(_LARGEST_CODE[n]) for n in _LEVELS
}


def _unpack_table(bits: int) -> np.ndarray:
    """Decoded level of every code in a byte: shape (256, 8 // bits), float32."""
    per_byte = 8 // bits
    offset = {4: 8, 2: 1}[bits]
    byte_B = np.arange(256, dtype=np.int32)[:, None]
    shifts_K = np.arange(per_byte, dtype=np.int32)[None, :] * bits
    return (((byte_B >> shifts_K) & ((1 << bits) - 1)) - offset).astype(np.float32)


@dataclasses.dataclass(frozen=True)
class Codec:
    """One wire encoding.  `block` matters only for the blockwise (int) codecs."""

    name: str
    # values per block; a power of two in [8, 65536]
    block: int = DEFAULT_BLOCK

    # int4 decodes by arithmetic (_dequantize_rows)
    _tables: ClassVar[dict[int, np.ndarray]] = {2: _unpack_table(2)}

    def __post_init__(self) -> None:
        if self.name not in CODEC_NAMES:
            raise EncodeError(f"unknown codec {self.name!r}; expected one of {CODEC_NAMES}")
        block = self.block
        if not isinstance(block, int) or isinstance(block, bool):
            raise EncodeError(f"codec block must be an int, got {block!r}")
        if not MIN_BLOCK <= block <= MAX_BLOCK or block & (block - 1):
            raise EncodeError(
                f"codec block must be a power of two in [{MIN_BLOCK}, {MAX_BLOCK}], got {block}"
            )
        if self.sparse:
            sparse.check_block(self.name, block)

    # ---- sizes -------------------------------------------------------------------------------
    @property
    def bits(self) -> int:
        return _BITS[self.name]

    @property
    def blockwise(self) -> bool:
        """Records of scale and codes per block (the int codecs and the sparse ones)."""
        return self.name in _LEVELS or self.sparse

    @property
    def sparse(self) -> bool:
        return self.name in sparse.SPARSE_BITS

    @property
    def granule(self) -> int:
        """Slices of a tensor must start at a multiple of this many values."""
        return self.block if self.blockwise else 1

    @property
    def record_nbytes(self) -> int:
        """Bytes per block record (blockwise) or per value (fp32, bf16)."""
        if self.sparse:
            return sparse.record_nbytes(self.block, self.bits)
        if self.blockwise:
            return _SCALE_BYTES + self.block * self.bits // 8
        return self.bits // 8

    @property
    def max_scale(self) -> float:
        """Largest valid block scale: every code times it is finite in float32."""
        return float(_MAX_SCALE[self.bits])

    def encoded_nbytes(self, count: int) -> int:
        """Exact payload length of `count` values."""
        if self.blockwise:
            return -(-count // self.block) * self.record_nbytes
        return count * self.record_nbytes

    def wire_bytes_per_value(self) -> float:
        return self.record_nbytes / self.block if self.blockwise else float(self.record_nbytes)

    # ---- encode ------------------------------------------------------------------------------
    def encode(self, x_N: np.ndarray, threads: int = DEFAULT_THREADS) -> np.ndarray:
        """Encode a flat finite float32 vector into a flat uint8 buffer (a view of x for fp32).

        Raises EncodeError on NaN/Inf (and on bf16 overflow): a delta that cannot be represented
        is a bug upstream, never something to put on the wire.
        """
        x_N = np.ascontiguousarray(x_N, dtype=np.float32).reshape(-1)
        if self.name == "fp32":
            _require_finite(x_N)
            return x_N.astype("<f4", copy=False).view(np.uint8)
        if self.name == "bf16":
            return _encode_bf16(x_N, threads).view(np.uint8)
        if self.sparse:
            return sparse.encode(x_N, self.block, self.bits).reshape(-1)
        return _encode_blocks(x_N, self.name, self.block, threads).reshape(-1)

    # ---- decode ------------------------------------------------------------------------------
    def validate(self, buf: memoryview | bytes | np.ndarray, count: int) -> None:
        """Raise ProtocolError unless `buf` is a well-formed, finite encoding of `count` values."""
        data_U = np.frombuffer(buf, dtype=np.uint8)
        expected = self.encoded_nbytes(count)
        if data_U.size != expected:
            raise ProtocolError(
                "length",
                f"{self.name} payload of {count} values must be {expected} bytes, got"
                f" {data_U.size}",
            )
        if self.sparse:
            sparse.validate(data_U, self.block, self.bits, self.name)
        elif self.blockwise:
            scale_B = data_U.reshape(-1, self.record_nbytes)[:, :_SCALE_BYTES].view("<f4")
            # The largest code magnitude (int8 -128, int4 -8, int2 +2) times the scale must stay
            # finite. The sign bit must be clear: -0.0 is refused too (encoders write +0.0 for a
            # flushed block).
            if not (
                np.isfinite(scale_B).all()
                and (scale_B <= _MAX_SCALE[self.bits]).all()
                and not np.signbit(scale_B).any()
            ):
                raise ProtocolError(
                    "non_finite",
                    f"{self.name} block scale is negative (or -0.0), NaN, Inf, or so large that"
                    " decoded values overflow",
                )
        elif self.name == "fp32":
            if not np.isfinite(data_U.view("<f4")).all():
                raise ProtocolError("non_finite", "fp32 payload holds NaN or Inf")
        # bf16: exponent all ones means Inf or NaN
        else:
            if ((data_U.view("<u2") & 0x7F80) == 0x7F80).any():
                raise ProtocolError("non_finite", "bf16 payload holds NaN or Inf")

    def decode(
        self,
        buf: memoryview | bytes | np.ndarray,
        count: int,
        out: np.ndarray | None = None,
        threads: int = DEFAULT_THREADS,
    ) -> np.ndarray:
        """Decode `count` values from `buf` (already `validate`d) into float32 `out` (allocated if
        None)."""
        data_U = np.frombuffer(buf, dtype=np.uint8)
        if data_U.size != self.encoded_nbytes(count):
            raise ProtocolError(
                "length",
                f"{self.name} payload of {count} values must be {self.encoded_nbytes(count)} bytes,"
                f" got {data_U.size}",
            )
        if out is None:
            out = np.empty(count, dtype=np.float32)
        if out.shape != (count,) or out.dtype != np.float32:
            raise EncodeError(
                f"out must be float32 of shape ({count},), got {out.dtype} {out.shape}"
            )
        if self.name == "fp32":
            np.copyto(out, data_U.view("<f4"))
        elif self.name == "bf16":
            half_N, out_bits_N = data_U.view("<u2"), out.view(np.uint32)

            def widen(lo: int, hi: int) -> None:
                np.left_shift(half_N[lo:hi], 16, out=out_bits_N[lo:hi], dtype=np.uint32)

            run_pieces(widen, count, PASS_BYTES // 4, threads)
        elif self.sparse:
            sparse.decode(data_U, self.block, self.bits, count, out)
        else:
            _decode_blocks(data_U, self, count, out, threads)
        return out


def _require_finite(x_N: np.ndarray) -> None:
    if not np.isfinite(x_N).all():
        raise EncodeError(
            f"cannot encode non-finite values ({np.count_nonzero(~np.isfinite(x_N))} NaN/Inf)"
        )


def _encode_bf16(x_N: np.ndarray, threads: int) -> np.ndarray:
    bits_N = x_N.view(np.uint32)
    rounded_N = np.empty(x_N.size, dtype="<u2")
    overflow = []

    def round_piece(lo: int, hi: int) -> None:
        _require_finite(x_N[lo:hi])
        bits = bits_N[lo:hi]
        # Round to nearest even on the 16 dropped bits: add 0x7FFF plus the lowest kept bit.
        wide = (bits >> 16) & 1
        wide += 0x7FFF
        wide += bits
        wide >>= 16
        np.copyto(rounded_N[lo:hi], wide, casting="unsafe")
        if ((rounded_N[lo:hi] & 0x7F80) == 0x7F80).any():
            overflow.append(lo)

    run_pieces(round_piece, x_N.size, PASS_BYTES // 4, threads)
    if overflow:
        raise EncodeError("value overflows bfloat16 (|x| > 3.39e38)")
    return rounded_N


def _encode_blocks(x_N: np.ndarray, name: str, block: int, threads: int) -> np.ndarray:
    """Quantize x into records of shape (blocks, record_nbytes)."""
    levels, bits = _LEVELS[name], _BITS[name]
    n_full, tail = divmod(x_N.size, block)
    n_blocks = n_full + (tail > 0)
    rec_BxR = np.empty((n_blocks, _SCALE_BYTES + block * bits // 8), dtype=np.uint8)
    scale_B = rec_BxR[:, :_SCALE_BYTES].view("<f4")[:, 0]
    codes_BxC = rec_BxR[:, _SCALE_BYTES:]
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
    normal_R = absmax_R >= _FLUSH_BELOW
    scale_R[:] = np.where(normal_R, absmax_R / np.float32(levels), np.float32(0))
    if (scale_R > _MAX_SCALE[bits]).any():
        raise EncodeError(
            f"values too large for int{bits}: |x| of {absmax_R.max():.4g} needs a scale above"
            f" {_MAX_SCALE[bits]:.4g}, which no decoder accepts"
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


def _decode_blocks(
    data_U: np.ndarray, codec: Codec, count: int, out_N: np.ndarray, threads: int
) -> None:
    block, bits = codec.block, codec.bits
    rec_BxR = data_U.reshape(-1, codec.record_nbytes)
    n_blocks = rec_BxR.shape[0]
    scale_Bx1 = rec_BxR[:, :_SCALE_BYTES].view("<f4")
    codes_BxC = rec_BxR[:, _SCALE_BYTES:]
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
        # and the scaling decode them (about 3x a table lookup per byte on this machine).
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
    table = Codec._tables[bits]
    n, per_byte = out_RxK.shape[0], 8 // bits
    np.take(table, codes_RxC, axis=0, out=out_RxK.reshape(n, -1, per_byte))
    out_RxK *= scale_Rx1


@dataclasses.dataclass(frozen=True, eq=False)
class CodedTensor:
    """A tensor kept in its blockwise wire form (records: scale ‖ codes per block), for consumers
    that work on codes directly (the merger folds int deltas without materialising float32).
    `decode()` gives the float32 values the codec defines."""

    codec: Codec
    shape: tuple[int, ...]
    # uint8, (blocks, codec.record_nbytes)
    records: np.ndarray

    def __post_init__(self) -> None:
        if not self.codec.blockwise:
            raise EncodeError(f"CodedTensor needs a blockwise codec, got {self.codec.name}")
        blocks = -(-self.count // self.codec.block)
        if self.records.dtype != np.uint8 or self.records.shape != (
            blocks,
            self.codec.record_nbytes,
        ):
            raise EncodeError(
                f"records of {self.shape} must be uint8 ({blocks}, {self.codec.record_nbytes}), got"
                f" {self.records.dtype} {self.records.shape}"
            )

    @property
    def count(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def scales(self) -> np.ndarray:
        """float32 scale of every block."""
        return np.ascontiguousarray(self.records[:, :_SCALE_BYTES]).view("<f4").reshape(-1)

    @property
    def codes(self) -> np.ndarray:
        """uint8 (blocks, codes bytes per block), in the layout of the module docstring."""
        return self.records[:, _SCALE_BYTES:]

    def decode(self) -> np.ndarray:
        return self.codec.decode(self.records.reshape(-1), self.count).reshape(self.shape)

    def squared_norm_bound(self) -> float:
        """An upper bound of the sum of the decoded values' squares, from the scales alone: every
        value of a block is at most its largest level (int8 128, int4 8, int2 2) times the block's
        scale.  One pass over the blocks, not the values (the merger judges every delta by it).
        Sparse codecs: the exact value (their levels are few)."""
        if self.codec.sparse:
            return sparse.squared_norm(self.records, self.codec.block, self.codec.bits, self.count)
        largest = float(1 << (self.codec.bits - 1))
        scales = self.scales.astype(np.float64) * largest
        counts = np.full(len(scales), float(self.codec.block))
        counts[-1] = self.count - self.codec.block * (len(scales) - 1)
        return float(np.dot(counts, scales * scales))
