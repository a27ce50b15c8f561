"""The served value's digest (protocol/downlink.py `digest`, PROTOCOL.md §3.3): CRC-32 over each
tensor's path and its values as held, by hand."""

from __future__ import annotations

import zlib

import ml_dtypes
import numpy as np

from dloco.protocol import downlink

F32 = np.float32


def test_digest_by_hand():
    # 0x3f800000, little-endian
    one = np.array([1.0], F32)
    assert downlink.digest({"a": one}) == zlib.crc32(b"\x00\x00\x80\x3f", zlib.crc32(b"a"))
    # sorted by path, whatever the insertion order
    two = {"b": np.array([2.0], F32), "a": one}
    assert downlink.digest(two) == zlib.crc32(
        b"\x00\x00\x00\x40", zlib.crc32(b"b", zlib.crc32(b"\x00\x00\x80\x3f", zlib.crc32(b"a")))
    )
    # bytes, not values
    assert downlink.digest({"a": np.array([-0.0], F32)}) != downlink.digest(
        {"a": np.array([0.0], F32)}
    )


def test_the_digest_of_a_bfloat16_tensor_is_over_its_two_byte_values():
    # 1.0 is 0x3f80 in bfloat16, little-endian; -0.0 0x8000
    held = np.array([1.0, -0.0], ml_dtypes.bfloat16)
    assert downlink.digest({"a": held}) == zlib.crc32(b"\x80\x3f\x00\x80", zlib.crc32(b"a"))
    # not the float32 values' CRC (PROTOCOL.md v5's)
    assert downlink.digest({"a": held}) != downlink.digest({"a": held.astype(F32)})


def test_the_digest_of_a_tensor_held_in_another_dtype_is_that_of_its_float32_values():
    """float16 and big-endian float32, over more than one piece: the CRC of the float32
    little-endian copy; NaN payloads and -0.0 kept.  A bfloat16 one over several pieces and a
    strided one: its own bytes."""
    rng = np.random.default_rng(2)
    values = rng.standard_normal(downlink.DIGEST_PIECE + 1000).astype(F32)
    values[:3] = [np.nan, -0.0, np.inf]
    for held in (values.astype(np.float16), values.astype(">f4")):
        as_float32 = np.asarray(held, "<f4")
        expected = zlib.crc32(as_float32.tobytes(), zlib.crc32(b"w"))
        assert downlink.digest({"w": held}) == expected, held.dtype
    bf16 = values.astype(ml_dtypes.bfloat16)
    for held in (bf16, bf16[::2]):
        expected = zlib.crc32(np.ascontiguousarray(held).tobytes(), zlib.crc32(b"w"))
        assert downlink.digest({"w": held}) == expected
