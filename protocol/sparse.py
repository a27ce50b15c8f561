"""Sparse blockwise codecs ``topk2`` / ``topk4``: per block of ``block`` values, the ``block / 32``
values of largest magnitude, each as its index and a signed 2- or 4-bit nonzero level.

Pure numpy; no I/O.  `quantization.Codec` dispatches here; the layout is PROTOCOL.md §5.  A record:

    scale (float32) ‖ indices (keep × uint8, or × uint16 when block > 256) ‖ codes

(uint16 indices little-endian).

Indices are strictly increasing and below ``block``; of equal magnitudes the higher index is kept
(the tail block's padding before its values).  With ``M = 2**(bits - 1)`` magnitudes a code
holds ``m - 1`` (m in 1..M) in its low ``bits - 1`` bits and the sign in its top bit; the value is
``±m × scale`` with ``scale = absmax(kept) / M`` and
``m = clip(round_half_even(|x| / scale), 1, M)``. Codes are packed like int4/int2: code j of the
block in bits ``bits·(j mod per_byte)`` of byte ``j div per_byte``.  A block whose largest
magnitude is below 2**-120 is flushed: scale +0.0, indices 0..keep-1, codes 0 (it decodes to
zeros).  Values not kept decode to 0.

A kept value of 0 (a block with fewer than ``keep`` nonzero values) decodes to ``+scale``: use
these codecs with error feedback, which carries that error, and everything not kept, into the next
delta (`protocol.error_feedback`).  The merger folds the records directly (merger/engines/coded.py).
"""

from __future__ import annotations

import numpy as np

from dloco.protocol.errors import EncodeError, ProtocolError

SPARSE_BITS = {"topk2": 2, "topk4": 4}
# one value kept per this many: 3.125 %
KEEP_EVERY = 32
# keep >= 4, so that a block's codes fill whole bytes
MIN_SPARSE_BLOCK = 128
_SCALE_BYTES = 4
_FLUSH_BELOW = np.float32(2.0**-120)


def keep(block: int) -> int:
    return block // KEEP_EVERY


def index_bytes(block: int) -> int:
    return 1 if block <= 256 else 2


def record_nbytes(block: int, bits: int) -> int:
    k = keep(block)
    return _SCALE_BYTES + k * index_bytes(block) + k * bits // 8


def max_scale(bits: int) -> np.float32:
    """Largest valid scale: the largest magnitude (M) times it stays finite."""
    return np.float32(np.finfo(np.float32).max) / np.float32(1 << (bits - 1))


def check_block(name: str, block: int) -> None:
    if block < MIN_SPARSE_BLOCK:
        raise EncodeError(
            f"codec {name} needs a block of at least {MIN_SPARSE_BLOCK} values (keeps block /"
            f" {KEEP_EVERY}), got {block}"
        )


def _fields(data_U: np.ndarray, block: int, bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(scales (B,), indices (B, keep) as stored, packed codes (B, keep * bits / 8))."""
    k, width = keep(block), index_bytes(block)
    rec_BxR = data_U.reshape(-1, record_nbytes(block, bits))
    scale_B = np.ascontiguousarray(rec_BxR[:, :_SCALE_BYTES]).view("<f4").reshape(-1)
    raw = np.ascontiguousarray(rec_BxR[:, _SCALE_BYTES : _SCALE_BYTES + k * width])
    index_BxK = raw if width == 1 else raw.view("<u2")
    return scale_B, index_BxK, rec_BxR[:, _SCALE_BYTES + k * width :]


def unpack(data_U: np.ndarray, block: int, bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(scales float32 (B,), indices int32 (B, keep), signed levels int8 (B, keep)) of records."""
    scale_B, index_BxK, packed = _fields(np.asarray(data_U, np.uint8).reshape(-1), block, bits)
    per_byte, mask = 8 // bits, (1 << bits) - 1
    shifts = np.arange(per_byte, dtype=np.uint8) * bits
    codes = ((packed[:, :, None] >> shifts) & mask).reshape(len(scale_B), -1).astype(np.int8)
    top = 1 << (bits - 1)
    magnitude = (codes & (top - 1)) + 1
    levels = np.where(codes & top, -magnitude, magnitude).astype(np.int8)
    return scale_B, index_BxK.astype(np.int32), levels


def encode(x_N: np.ndarray, block: int, bits: int) -> np.ndarray:
    """Records (blocks, record_nbytes) of a flat finite float32 vector."""
    if not np.isfinite(x_N).all():
        raise EncodeError(
            f"cannot encode non-finite values ({np.count_nonzero(~np.isfinite(x_N))} NaN/Inf)"
        )
    k, n_blocks = keep(block), -(-x_N.size // block)
    x_BxK = np.zeros(n_blocks * block, np.float32)
    x_BxK[: x_N.size] = x_N
    x_BxK = x_BxK.reshape(n_blocks, block)
    # The k largest magnitudes, ties to the higher index (padding first): the float32 bits of |x|
    # order like the values, so (bits, index) is a unique key and the choice never depends on the
    # sort.  A decoded block then encodes to the same bytes, tail blocks included.
    key = (np.abs(x_BxK).view(np.uint32).astype(np.uint64) << np.uint64(32)) | np.arange(
        block, dtype=np.uint64
    )
    index_BxK = np.sort(np.argpartition(key, block - k, axis=1)[:, block - k :], axis=1)
    kept_BxK = np.take_along_axis(x_BxK, index_BxK, axis=1)
    absmax_B = np.abs(kept_BxK).max(axis=1)
    top = 1 << (bits - 1)
    normal_B = absmax_B >= _FLUSH_BELOW
    scale_B = np.where(normal_B, absmax_B / np.float32(top), np.float32(0)).astype(np.float32)
    if (scale_B > max_scale(bits)).any():
        raise EncodeError(f"values too large for {bits}-bit levels: |x| of {absmax_B.max():.4g}")
    inverse_B = np.divide(np.float32(top), absmax_B, out=np.zeros_like(absmax_B), where=normal_B)
    magnitude = np.clip(np.rint(np.abs(kept_BxK) * inverse_B[:, None]), 1, top).astype(np.uint8)
    codes = (magnitude - 1) | (np.signbit(kept_BxK).astype(np.uint8) << (bits - 1))
    codes[~normal_B] = 0
    index_BxK[~normal_B] = np.arange(k)
    per_byte = 8 // bits
    shifted = codes.reshape(n_blocks, -1, per_byte) << (np.arange(per_byte, dtype=np.uint8) * bits)
    packed = np.bitwise_or.reduce(shifted, axis=2).astype(np.uint8)
    index_dtype = np.uint8 if index_bytes(block) == 1 else np.dtype("<u2")
    indices = index_BxK.astype(index_dtype).view(np.uint8).reshape(n_blocks, -1)
    return np.concatenate(
        [scale_B.astype("<f4").view(np.uint8).reshape(n_blocks, _SCALE_BYTES), indices, packed],
        axis=1,
    )


def validate(data_U: np.ndarray, block: int, bits: int, name: str) -> None:
    """Raise ProtocolError unless every record has a valid scale and strictly increasing indices
    below `block`."""
    scale_B, index_BxK, _ = _fields(data_U, block, bits)
    if not (
        np.isfinite(scale_B).all()
        and (scale_B <= max_scale(bits)).all()
        and not np.signbit(scale_B).any()
    ):
        raise ProtocolError(
            "non_finite",
            f"{name} block scale is negative (or -0.0), NaN, Inf, or so large that decoded values"
            " overflow",
        )
    index = index_BxK.astype(np.int32)
    if (index[:, -1] >= block).any() or (np.diff(index, axis=1) <= 0).any():
        raise ProtocolError(
            "sparse_index",
            f"{name} indices must be strictly increasing and below the block of {block}",
        )


def decode(data_U: np.ndarray, block: int, bits: int, count: int, out_N: np.ndarray) -> None:
    scale_B, index_BxK, levels = unpack(data_U, block, bits)
    dense = np.zeros((len(scale_B), block), np.float32)
    np.put_along_axis(dense, index_BxK, levels.astype(np.float32) * scale_B[:, None], axis=1)
    out_N[:] = dense.reshape(-1)[:count]


def squared_norm(data_U: np.ndarray, block: int, bits: int, count: int) -> float:
    """The decoded values' sum of squares (exact levels, float64 scales), the tail block's padding
    left out."""
    scale_B, index_BxK, levels = unpack(data_U, block, bits)
    squares = levels.astype(np.int64) ** 2
    squares[-1][index_BxK[-1] >= count - block * (len(scale_B) - 1)] = 0
    # a pairwise sum, not BLAS's dot (CodedTensor.squared_norm_bound says why)
    return float(
        np.add.reduce(squares.sum(axis=1).astype(np.float64) * scale_B.astype(np.float64) ** 2)
    )
