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

The int codecs' kernels are in protocol/blockwise.py.  Speed: they and bf16 work through the
input in cache-sized pieces, on a few threads (protocol/pieces.py), so that their numpy passes
touch L2, not DRAM (BENCHMARKS.md).
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from dloco.protocol import blockwise, sparse
from dloco.protocol.errors import EncodeError, ProtocolError
from dloco.protocol.pieces import DEFAULT_THREADS, PASS_BYTES, run_pieces

CODEC_NAMES = ("fp32", "bf16", "int8", "int4", "int2", *sparse.SPARSE_BITS)
DEFAULT_BLOCK = 256
MIN_BLOCK, MAX_BLOCK = 8, 1 << 16

_BITS = {"fp32": 32, "bf16": 16, **blockwise.BITS, **sparse.SPARSE_BITS}


@dataclasses.dataclass(frozen=True)
class Codec:
    """One wire encoding.  `block` matters only for the blockwise (int) codecs."""

    name: str
    # values per block; a power of two in [8, 65536]
    block: int = DEFAULT_BLOCK

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
        return self.name in blockwise.LEVELS or self.sparse

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
            return blockwise.record_nbytes(self.block, self.bits)
        return self.bits // 8

    @property
    def max_scale(self) -> float:
        """Largest valid block scale: every code times it is finite in float32."""
        return float(blockwise.MAX_SCALE[self.bits])

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
        return blockwise.encode(x_N, self.name, self.block, threads).reshape(-1)

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
            bits_B = data_U.reshape(-1, self.record_nbytes)[:, : blockwise.SCALE_BYTES].view("<u4")
            # The largest code magnitude (int8 -128, int4 -8, int2 +2) times the scale must stay
            # finite. The sign bit must be clear: -0.0 is refused too (encoders write +0.0 for a
            # flushed block).  As unsigned integers, the bits of positive floats (and +Inf, then
            # NaN) sort as the floats do, and every negative one's sort above them all: one
            # comparison with the largest valid scale's bits says all three.
            largest = np.float32(blockwise.MAX_SCALE[self.bits]).view("<u4")
            if bits_B.size and bits_B.max() > largest:
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
            blockwise.decode(data_U, self.block, self.bits, count, out, threads)
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


@dataclasses.dataclass(frozen=True, eq=False)
class CodedTensor:
    """A tensor kept in its blockwise wire form (records: scale ‖ codes per block), for consumers
    that work on codes directly (the merger folds int deltas without materialising float32).
    `decode()` gives the float32 values the codec defines.

    `parts`: the records as one uint8 (blocks, codec.record_nbytes) array, or as several whose
    blocks follow one another (a delta's chunks as they arrived: `records` joins them only when
    asked, `scales` and `codes_into` read them where they are)."""

    codec: Codec
    shape: tuple[int, ...]
    parts: np.ndarray | tuple[np.ndarray, ...]

    def __post_init__(self) -> None:
        if not self.codec.blockwise:
            raise EncodeError(f"CodedTensor needs a blockwise codec, got {self.codec.name}")
        parts = (self.parts,) if isinstance(self.parts, np.ndarray) else tuple(self.parts)
        object.__setattr__(self, "parts", parts)
        blocks = -(-self.count // self.codec.block)
        width = self.codec.record_nbytes
        if (
            not parts
            or any(p.dtype != np.uint8 or p.ndim != 2 or p.shape[1] != width for p in parts)
            or sum(p.shape[0] for p in parts) != blocks
        ):
            raise EncodeError(
                f"records of {self.shape} must be uint8 ({blocks}, {width}) in all, got"
                f" {[(p.dtype, p.shape) for p in parts]}"
            )

    @property
    def count(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def blocks(self) -> int:
        return sum(p.shape[0] for p in self.parts)

    @property
    def records(self) -> np.ndarray:
        """uint8 (blocks, codec.record_nbytes): the parts joined (a copy when there are several,
        not kept: the parts stay the tensor's only copy)."""
        return self.parts[0] if len(self.parts) == 1 else np.concatenate(self.parts)

    @functools.cached_property
    def scales(self) -> np.ndarray:
        """float32 scale of every block (gathered once: admission, the guard and the fold each
        read them)."""
        scales = (
            np.concatenate(
                [np.ascontiguousarray(p[:, : blockwise.SCALE_BYTES]) for p in self.parts]
            )
            .view("<f4")
            .reshape(-1)
        )
        scales.flags.writeable = False
        return scales

    @property
    def codes(self) -> np.ndarray:
        """uint8 (blocks, codes bytes per block), in the layout of the module docstring."""
        return self.records[:, blockwise.SCALE_BYTES :]

    def codes_into(self, out: np.ndarray) -> None:
        """Copy `codes` into `out` (blocks, codes bytes per block), part by part."""
        at = 0
        for part in self.parts:
            out[at : at + part.shape[0]] = part[:, blockwise.SCALE_BYTES :]
            at += part.shape[0]

    def decode(self) -> np.ndarray:
        return self.codec.decode(self.records.reshape(-1), self.count).reshape(self.shape)

    def scaled(self, factor: np.float32) -> CodedTensor:
        """This tensor times `factor` (0 <= factor <= 1), as records: every block's scale times it
        in float32, the codes as they are (dense codecs: each value is scale times level)."""
        if self.codec.sparse:
            raise EncodeError("a sparse tensor's records are not scaled in place; decode it")
        parts = tuple(part.copy() for part in self.parts)
        for part in parts:
            scales = part[:, : blockwise.SCALE_BYTES].view("<f4")
            scales *= np.float32(factor)
        return CodedTensor(self.codec, self.shape, parts)

    def squared_norm_bound(self) -> float:
        """An upper bound of the sum of the decoded values' squares, from the scales alone: every
        value of a block is at most its largest level (int8 128, int4 8, int2 2) times the block's
        scale.  One pass over the blocks, not the values (the merger judges every delta by it).
        Sparse codecs: the exact value (their levels are few)."""
        if self.codec.sparse:
            return sparse.squared_norm(self.records, self.codec.block, self.codec.bits, self.count)
        largest = float(1 << (self.codec.bits - 1))
        scales = self.scales.astype(np.float64) * largest
        if not len(scales):
            return 0.0
        squares = scales * scales
        # every block holds `block` values but the last, which holds the rest.  numpy's pairwise
        # sum, not BLAS's dot: on these short vectors BLAS's threads cost more than the sum (a
        # fifth of the merger's receive loop), and their split could change the summation order.
        last = self.count - self.codec.block * (len(scales) - 1)
        return float(self.codec.block * np.add.reduce(squares[:-1]) + last * squares[-1])
