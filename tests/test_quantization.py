"""Codecs against hand-derived bytes and bounds derived from the codec definition (PROTOCOL.md
§Codecs)."""

from __future__ import annotations

import itertools
import struct

import numpy as np
import pytest

from dloco.protocol import Codec, EncodeError, ProtocolError

LEVELS = {"int8": 127, "int4": 7, "int2": 1}
# blocks with a smaller absmax are flushed to zero
FLUSH = 2.0**-120
EPS = 2.0**-23


def blockwise_bound(x: np.ndarray, name: str, block: int) -> np.ndarray:
    """Per-value error bound: scale/2 for rounding, plus float32 rounding of x*inv and q*scale.

    scale = absmax/L; the products x*(L/absmax) and q*scale each carry ≤ 1 ulp relative error of
    values ≤ L and ≤ absmax, i.e. at most ≈ 2·L·scale·2**-23 in all; flushed blocks err
    ≤ 2**-120.
    """
    levels = LEVELS[name]
    padded = np.zeros(-(-x.size // block) * block, dtype=np.float32)
    padded[: x.size] = x
    absmax = np.abs(padded.reshape(-1, block)).max(axis=1).astype(np.float64)
    scale = absmax / levels
    bound = np.where(absmax >= FLUSH, scale / 2 + 4 * levels * scale * EPS, FLUSH)
    return np.repeat(bound, block)[: x.size]


GRID = list(
    itertools.product(
        ["int8", "int4", "int2"],
        [8, 64, 256, 1024],
        [1, 7, 255, 256, 257, 3 * 256 + 5, 10_000],
        [1e-20, 1e-4, 1.0, 1e20],
    )
)


@pytest.mark.parametrize("name,block,size,magnitude", GRID)
def test_blockwise_error_within_half_a_step(name, block, size, magnitude):
    rng = np.random.default_rng(size + block)
    x = (rng.standard_normal(size) * magnitude).astype(np.float32)
    codec = Codec(name, block)
    encoded = codec.encode(x)
    assert encoded.dtype == np.uint8 and encoded.size == codec.encoded_nbytes(size)
    codec.validate(encoded, size)
    y = codec.decode(encoded, size)
    assert y.dtype == np.float32 and y.shape == (size,)
    assert np.all(np.abs(y.astype(np.float64) - x) <= blockwise_bound(x, name, block))


@pytest.mark.parametrize("size", [1, 5, 1000, 70_001])
def test_fp32_is_lossless_and_bf16_within_2_pow_minus_8(size):
    x = (np.random.default_rng(size).standard_normal(size) * 3).astype(np.float32)
    assert np.array_equal(Codec("fp32").decode(Codec("fp32").encode(x), size), x)
    y = Codec("bf16").decode(Codec("bf16").encode(x), size)
    assert np.all(np.abs(y - x) <= np.abs(x) * 2.0**-8)


def test_int8_bytes_by_hand():
    x = np.array([1, -0.5, 0.25, 0, 0, 0, 0, 0], dtype=np.float32)
    # scale = 1/127; q = rint(127 x) = 127, rint(-63.5) = -64 (half to even), rint(31.75) = 32
    expected = struct.pack("<f", np.float32(1) / np.float32(127)) + bytes(
        [127, 256 - 64, 32, 0, 0, 0, 0, 0]
    )
    assert Codec("int8", 8).encode(x).tobytes() == expected


def test_int4_bytes_by_hand():
    x = np.array([7, -7, 3.5, 1, 0, -2, 6.5, 0.5], dtype=np.float32)
    # scale 1; q = 7 -7 4 1 0 -2 6 0 (3.5 -> 4, 6.5 -> 6, 0.5 -> 0: half to even); stored q+8, low
    # nibble first
    expected = struct.pack("<f", 1.0) + bytes([0x1F, 0x9C, 0x68, 0x8E])
    assert Codec("int4", 8).encode(x).tobytes() == expected


def test_int2_bytes_by_hand():
    x = np.array([1, -1, 0.4, -0.6, 0, 0.5, -0.5, 1], dtype=np.float32)
    # scale 1; q = 1 -1 0 -1 0 0 0 1; stored q+1 = 2 0 1 0 | 1 1 1 2, value 4j+k at bits 2k
    expected = struct.pack("<f", 1.0) + bytes([0b00010010, 0b10010101])
    assert Codec("int2", 8).encode(x).tobytes() == expected


def test_bf16_rounds_to_nearest_even_by_hand():
    x = np.array([1.0, 1 + 2**-8, 1 + 3 * 2**-8, -2.0], dtype=np.float32)
    # 1+2^-8 is halfway between 0x3F80 and 0x3F81 -> even 0x3F80; 1+3*2^-8 -> 0x3F82
    assert Codec("bf16").encode(x).view("<u2").tolist() == [0x3F80, 0x3F80, 0x3F82, 0xC000]


@pytest.mark.parametrize("tiny", [1e-40, 2e-38, 1e-37, 7e-37])
def test_zero_subnormal_and_tiny_blocks_flush_to_zero(tiny):
    x = np.zeros(20, dtype=np.float32)
    # L/absmax would overflow float32 for absmax < L/FLT_MAX (3.7e-37 at L=127)
    x[10:] = tiny
    for name in LEVELS:
        encoded = Codec(name, 8).encode(x)
        scales = encoded.reshape(-1, Codec(name, 8).record_nbytes)[:, :4].copy().view("<f4").ravel()
        assert np.all(scales == 0)
        assert np.all(Codec(name, 8).decode(encoded, 20) == 0)


@pytest.mark.parametrize("name", ["fp32", "bf16", "int8", "int4", "int2"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_input_refuses_to_encode(name, bad):
    x = np.ones(600, dtype=np.float32)
    x[517] = bad
    with pytest.raises(EncodeError):
        Codec(name).encode(x)


FLT_MAX = np.float32(np.finfo(np.float32).max)
LARGEST_CODE = {"int8": 128, "int4": 8, "int2": 2}


def scale_of(absmax: np.float32, name: str) -> np.float32:
    # float32 division, as PROTOCOL.md §5 says
    return np.float32(absmax) / np.float32(LEVELS[name])


@pytest.mark.parametrize("name", ["int8", "int4", "int2"])
def test_the_encoder_refuses_exactly_the_scales_the_decoder_refuses(name):
    """§5: a block is refused iff its float32 scale a / L is above FLT_MAX / c, the decoder's
    bound."""
    codec, bound = Codec(name, 8), FLT_MAX / np.float32(LARGEST_CODE[name])
    largest = np.float32(float(bound) * LEVELS[name])
    while scale_of(largest, name) > bound:
        largest = np.nextafter(largest, np.float32(0))
    while scale_of(np.nextafter(largest, FLT_MAX), name) <= bound:
        largest = np.nextafter(largest, FLT_MAX)
    below = largest
    # the 20 largest encodable absmax values all encode, and decode finite
    for _ in range(20):
        encoded = codec.encode(np.array([below, -below / 2, 0, 1, 2, 3, 4, 5], dtype=np.float32))
        codec.validate(encoded, 8)
        assert np.isfinite(codec.decode(encoded, 8)).all()
        below = np.nextafter(below, np.float32(0))
    above = np.nextafter(largest, np.float32(np.inf))
    # the next 20 are refused, and the scale they would need is one decoders refuse
    for _ in range(20):
        with pytest.raises(EncodeError, match="too large"):
            codec.encode(np.full(8, -above, dtype=np.float32))
        record = np.frombuffer(
            struct.pack("<f", scale_of(above, name)) + bytes(codec.record_nbytes - 4),
            dtype=np.uint8,
        )
        with pytest.raises(ProtocolError, match="non_finite"):
            codec.validate(record, 8)
        if above == FLT_MAX:
            break
        above = np.nextafter(above, np.float32(np.inf))
    assert (
        f"{float(largest):.3g}" == {"int8": "3.38e+38", "int4": "2.98e+38", "int2": "1.7e+38"}[name]
    )


@pytest.mark.parametrize(
    "name,padded_from,pad", [("int8", 3, 0x00), ("int4", 2, 0x88), ("int2", 1, 0x55)]
)
def test_the_last_block_is_padded_with_the_value_zero(name, padded_from, pad):
    """§5: padding is the value 0, so its codes are those of q = 0 (int8 0, int4 8, int2 1)."""
    codec = Codec(name, 16)
    # 3 of 16 values
    x = np.array([0.5, -1.0, 0.25], dtype=np.float32)
    record = codec.encode(x)
    codes = record[4:]
    assert record.size == codec.record_nbytes and np.all(codes[padded_from:] == pad)
    if name == "int4":
        # value 3, the first padding value, in the high nibble of byte 1
        assert codes[1] >> 4 == 8
    if name == "int2":
        # value 3 in bits 6..7 of byte 0
        assert codes[0] >> 6 == 1
    changed = record.copy()
    # decoders ignore the padding codes, whatever they are
    changed[4 + padded_from :] = 0xFF - pad
    assert np.array_equal(codec.decode(changed, 3), codec.decode(record, 3))


def test_bf16_overflow_refuses_to_encode():
    with pytest.raises(EncodeError, match="overflows"):
        Codec("bf16").encode(np.array([3.4e38], dtype=np.float32))


@pytest.mark.parametrize("name", ["bf16", "int8", "int4", "int2"])
def test_deterministic_and_thread_count_independent(name):
    x = (np.random.default_rng(1).standard_normal(3_000_000) * 1e-3).astype(np.float32)
    one = Codec(name).encode(x, threads=1)
    assert np.array_equal(one, Codec(name).encode(x, threads=1))
    assert np.array_equal(one, Codec(name).encode(x, threads=3))
    assert np.array_equal(
        Codec(name).decode(one, x.size, threads=1), Codec(name).decode(one, x.size, threads=3)
    )


def test_wire_bytes_per_value_at_block_256():
    assert (
        Codec("int4").wire_bytes_per_value() == pytest.approx(0.515625)
        and Codec("int4").wire_bytes_per_value() <= 0.53
    )
    assert (
        Codec("int8").wire_bytes_per_value() == pytest.approx(1.015625)
        and Codec("int8").wire_bytes_per_value() <= 1.02
    )
    assert Codec("int2").wire_bytes_per_value() == pytest.approx(0.265625)


def test_every_code_decodes_even_those_encoders_never_emit():
    # int4 nibble 0 means q = -8 and int2 code 3 means q = +2: defined, finite, never produced.
    record = np.frombuffer(struct.pack("<f", 0.5) + bytes([0x00, 0xFF, 0x00, 0x00]), dtype=np.uint8)
    assert Codec("int4", 8).decode(record, 8).tolist() == [-4, -4, 3.5, 3.5, -4, -4, -4, -4]
    record2 = np.frombuffer(struct.pack("<f", 0.5) + bytes([0xFF, 0x00]), dtype=np.uint8)
    assert Codec("int2", 8).decode(record2, 8).tolist() == [1, 1, 1, 1, -0.5, -0.5, -0.5, -0.5]


def test_int4_decodes_every_byte_by_hand_on_every_path():
    # Every byte value, as one block of 512 values with a scale that rounds (0.1 is not a float32
    # power of two): value 2i is byte i's low nibble - 8, value 2i+1 its high nibble - 8, each times
    # the scale in float32.  Two thousand blocks put the decoder on its threaded pieces too.
    scale = np.float32(0.1)
    record = struct.pack("<f", scale) + bytes(range(256))
    expected = (
        np.array([[(b & 15) - 8, (b >> 4) - 8] for b in range(256)], dtype=np.float32).reshape(-1)
        * scale
    )
    assert (
        Codec("int4", 512).decode(record, 512).view(np.uint32).tolist()
        == expected.view(np.uint32).tolist()
    )
    many = Codec("int4", 512).decode(record * 2000, 512 * 2000, threads=2)
    assert np.array_equal(many.view(np.uint32), np.tile(expected, 2000).view(np.uint32))
    # a last block cut short
    tail = Codec("int4", 512).decode(record, 300)
    assert np.array_equal(tail.view(np.uint32), expected[:300].view(np.uint32))


@pytest.mark.parametrize(
    "scale", [-1.0, -0.0, -1e-45, float("nan"), float("-nan"), float("inf"), 3e38]
)
def test_validate_rejects_bad_scales(scale):
    record = np.frombuffer(struct.pack("<f", scale) + bytes(4), dtype=np.uint8)
    with pytest.raises(ProtocolError) as info:
        Codec("int4", 8).validate(record, 8)
    assert info.value.reason == "non_finite"


def test_largest_valid_scale_decodes_finite():
    scale = Codec("int8", 8).max_scale
    # every code -128
    record = np.frombuffer(struct.pack("<f", scale) + bytes([0x80] * 8), dtype=np.uint8)
    Codec("int8", 8).validate(record, 8)
    assert np.isfinite(Codec("int8", 8).decode(record, 8)).all()


def test_validate_rejects_wrong_length_and_non_finite_floats():
    with pytest.raises(ProtocolError, match="length"):
        Codec("int8", 8).validate(bytes(11), 8)
    with pytest.raises(ProtocolError, match="non_finite"):
        Codec("fp32").validate(np.array([1, np.nan], dtype=np.float32).view(np.uint8), 2)
    with pytest.raises(ProtocolError, match="non_finite"):
        Codec("bf16").validate(np.array([0x3F80, 0x7F80], dtype="<u2").view(np.uint8), 2)


@pytest.mark.parametrize("block", [0, 3, 100, 1 << 17, True, 256.0])
def test_bad_codec_configuration_is_a_clear_error(block):
    with pytest.raises(EncodeError, match="block"):
        Codec("int8", block)
    with pytest.raises(EncodeError, match="unknown codec"):
        Codec("int3")
