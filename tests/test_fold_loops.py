"""The compiled loops over int codes (merger/engines/dense_loops.py) against hand-derived values and
against the codec's own decoding."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from dloco.merger.engines import dense_loops
from dloco.protocol import Codec, CodedTensor


def test_the_gram_of_hand_made_int4_blocks():
    # block 0: levels (+1, 0) and (+2, -3) in a, (+3, -1) and (0, +1) in b; block 1: a all -8
    a = np.array([[0x89, 0x5A], [0x00, 0x00]], np.uint8)
    b = np.array([[0x7B, 0x98], [0x88, 0x88]], np.uint8)
    gram = dense_loops.gram(np.stack([a, b]), 4)
    # a.a, a.b / -, b.b per block (below the diagonal: zero)
    assert gram[0].tolist() == [[1 + 4 + 9, 1 * 3 + 0 * -1 + 2 * 0 + -3 * 1], [0, 9 + 1 + 0 + 1]]
    assert gram[1].tolist() == [[4 * 64, 0], [0, 0]]
    assert dense_loops.gram(a[None], 4)[:, 0, 0].tolist() == [14, 256]


def test_levels_of_int8_and_int2_bytes():
    # int8: two's complement; int2: levels -1..2 from the low bits up
    pair = np.stack([np.array([[0xFF, 0x80]], np.uint8), np.array([[2, 1]], np.uint8)])
    assert dense_loops.gram(pair, 8)[0, 0, 1] == -1 * 2 + -128 * 1
    # 0b10_01_00_11: levels (3-1, 0-1, 1-1, 2-1) = (2, -1, 0, 1)
    byte = np.array([[[0b10010011]]], np.uint8)
    assert dense_loops.gram(byte, 2)[:, 0, 0].tolist() == [4 + 1 + 0 + 1]


def test_merge_into_writes_the_tensor_and_stops_at_its_last_value():
    # one int4 block of 8 holding 5 values: levels (+1, -2, +3, 0, +7 | padding -8 -8 -8), twice
    codes = np.array([[0x69, 0x8B, 0x0F, 0x00]], np.uint8)
    out = np.full(5, 99.0, np.float32)
    dense_loops.merge_into(
        out, np.stack([codes, codes]), np.float32([[0.5], [0.25]]), np.float32([2.0]), 4
    )
    # (0.5 q + 0.25 q) * 2
    assert out.tolist() == [1.5, -3.0, 4.5, 0.0, 10.5]
    with pytest.raises(ValueError, match="blocks of codes"):
        dense_loops.merge_into(
            np.zeros(9, np.float32), codes[None], np.float32([[1]]), np.float32([1]), 4
        )


@pytest.mark.parametrize("name", ["int8", "int4", "int2"])
def test_one_pass_decodes_as_the_codec_does_on_any_number_of_threads(name):
    codec, rng = Codec(name, 64), np.random.default_rng(3)
    count = 64 * 1000 + 17
    tensor = CodedTensor(
        codec,
        (count,),
        codec.encode(rng.standard_normal(count).astype(np.float32)).reshape(
            -1, codec.record_nbytes
        ),
    )
    ones = np.ones(len(tensor.scales), np.float32)
    outs = []
    for threads in (1, 3):
        out = np.empty(count, np.float32)
        codes = np.ascontiguousarray(tensor.codes)[None]
        dense_loops.merge_into(out, codes, tensor.scales[None], ones, codec.bits, threads)
        outs.append(out)
    assert outs[0].tobytes() == outs[1].tobytes() == tensor.decode().tobytes()
    squares = dense_loops.gram(tensor.codes[None], codec.bits, threads=3)[:, 0, 0]
    levels = np.round(tensor.decode() / np.repeat(tensor.scales, 64)[:count]).astype(np.int64)
    padded = np.concatenate([levels, np.zeros(64 * len(ones) - count, np.int64)])
    # the encoder pads the last block with zeros: level 0
    assert squares.tolist() == (padded.reshape(-1, 64) ** 2).sum(axis=1).tolist()


def test_the_norm_over_one_part_in_every_is_a_lower_bound_of_the_whole():
    """Parts of 65536 values: 1s, 2s, then 10 3s; a second tensor of one part."""
    part = dense_loops.NORM_PART
    x = np.concatenate([np.ones(part), np.full(part, 2.0), np.full(10, 3.0)]).astype(np.float32)
    y = np.array([12.0], np.float32)
    whole = part + 4 * part + 90 + 144
    assert dense_loops.norm([x, y]) == np.sqrt(whole)
    # parts 0 and 2 of x, part 0 of y
    assert dense_loops.norm([x, y], every=2) == np.sqrt(part + 90 + 144)
    assert dense_loops.norm([x, y], threads=1, every=3) == np.sqrt(part + 144)
    rng = np.random.default_rng(0)
    tensors = [rng.standard_normal(n).astype(np.float32) for n in (7, part + 1, 9 * part - 3)]
    for every in (2, 8, 64):
        assert dense_loops.norm(tensors, every=every) <= dense_loops.norm(tensors)


def test_the_nesterov_step_of_a_hand_made_int8_block():
    # levels (+3, -2), factor 0.5, scale 2: g = (3, -2); p = (1, 1), m = (1, 0), lr 0.5, mu 0.5
    codes = np.array([[[0x03, 0xFE]]], np.uint8)
    factors, scale = np.float32([[0.5]]), np.float32([2.0])
    # t = g + mu m = (3.5, -2); p - lr (g + mu t) = (1 - 0.5 * 4.75, 1 - 0.5 * -3)
    params = np.float32([[1.0, 1.0]])
    for momentum, expected in (
        (np.float32([[1.0, 0.0]]), [3.5, -2.0]),
        # bfloat16's bits: 1.0 is 0x3F80; 3.5 is 0x4060, -2 is 0xC000
        (np.uint16([[0x3F80, 0x0000]]), [0x4060, 0xC000]),
    ):
        new = (np.zeros_like(params), np.zeros_like(momentum))
        dense_loops.nesterov_into(new, (params, momentum), codes, factors, scale, 8, (0.5, 0.5))
        assert new[0].tolist() == [[-1.375, 2.5]] and new[1].tolist() == [expected]


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_the_nesterov_step_is_numpys_float32_arithmetic_in_place_or_not(bits):
    rng, block, blocks = np.random.default_rng(bits), 64, 37
    codes = rng.integers(0, 256, (3, blocks, block * bits // 8), dtype=np.uint8)
    factors = rng.standard_normal((3, blocks)).astype(np.float32)
    scale = rng.random(blocks).astype(np.float32)
    g = np.empty(blocks * block, np.float32)
    dense_loops.merge_into(g, codes, factors, scale, bits)
    g = g.reshape(blocks, block)
    params = rng.standard_normal((blocks, block)).astype(np.float32)
    lr, mu = np.float32(0.7), np.float32(0.9)
    for dtype in (np.float32, ml_dtypes.bfloat16):
        momentum = rng.standard_normal((blocks, block)).astype(dtype)
        t = g + mu * momentum.astype(np.float32)
        expected = (params - lr * (g + mu * t), t.astype(dtype))
        held = momentum.view(np.uint16) if dtype != np.float32 else momentum
        new = (np.empty_like(params), np.empty_like(held))
        dense_loops.nesterov_into(new, (params, held), codes, factors, scale, bits, (0.7, 0.9))
        assert np.array_equal(new[0], expected[0])
        assert np.array_equal(new[1], expected[1].view(held.dtype))
        # over the old arrays themselves, on one thread: the same bytes
        same = (params.copy(), held.copy())
        dense_loops.nesterov_into(same, same, codes, factors, scale, bits, (0.7, 0.9), threads=1)
        assert np.array_equal(same[0], new[0]) and np.array_equal(same[1], new[1])


def test_the_nesterov_step_refuses_arrays_that_do_not_match():
    codes, ones = np.zeros((1, 2, 32), np.uint8), np.ones((1, 2), np.float32)
    pair = (np.zeros((2, 64), np.float32), np.zeros((2, 64), np.float32))
    with pytest.raises(ValueError, match="momentum of float32 into uint16"):
        wide = (pair[0], np.zeros((2, 64), np.uint16))
        dense_loops.nesterov_into(wide, pair, codes, ones, ones[0], 4, (0.1, 0.9))
    with pytest.raises(ValueError, match="for codes"):
        dense_loops.nesterov_into(pair, pair, codes[:, :1], ones, ones[0], 4, (0.1, 0.9))
