"""The compiled loops over int codes (merger/fold_loops.py) against hand-derived values and against
the codec's own decoding."""

from __future__ import annotations

import numpy as np
import pytest

from dloco.merger import fold_loops
from dloco.protocol import Codec, CodedTensor


def test_the_gram_of_hand_made_int4_blocks():
    # block 0: levels (+1, 0) and (+2, -3) in a, (+3, -1) and (0, +1) in b; block 1: a all -8
    a = np.array([[0x89, 0x5A], [0x00, 0x00]], np.uint8)
    b = np.array([[0x7B, 0x98], [0x88, 0x88]], np.uint8)
    gram = fold_loops.gram(np.stack([a, b]), 4)
    # a.a, a.b / -, b.b per block (below the diagonal: zero)
    assert gram[0].tolist() == [[1 + 4 + 9, 1 * 3 + 0 * -1 + 2 * 0 + -3 * 1], [0, 9 + 1 + 0 + 1]]
    assert gram[1].tolist() == [[4 * 64, 0], [0, 0]]
    assert fold_loops.gram(a[None], 4)[:, 0, 0].tolist() == [14, 256]


def test_levels_of_int8_and_int2_bytes():
    # int8: two's complement; int2: levels -1..2 from the low bits up
    pair = np.stack([np.array([[0xFF, 0x80]], np.uint8), np.array([[2, 1]], np.uint8)])
    assert fold_loops.gram(pair, 8)[0, 0, 1] == -1 * 2 + -128 * 1
    # 0b10_01_00_11: levels (3-1, 0-1, 1-1, 2-1) = (2, -1, 0, 1)
    byte = np.array([[[0b10010011]]], np.uint8)
    assert fold_loops.gram(byte, 2)[:, 0, 0].tolist() == [4 + 1 + 0 + 1]


def test_merge_into_writes_the_tensor_and_stops_at_its_last_value():
    # one int4 block of 8 holding 5 values: levels (+1, -2, +3, 0, +7 | padding -8 -8 -8), twice
    codes = np.array([[0x69, 0x8B, 0x0F, 0x00]], np.uint8)
    out = np.full(5, 99.0, np.float32)
    fold_loops.merge_into(
        out, np.stack([codes, codes]), np.float32([[0.5], [0.25]]), np.float32([2.0]), 4
    )
    # (0.5 q + 0.25 q) * 2
    assert out.tolist() == [1.5, -3.0, 4.5, 0.0, 10.5]
    with pytest.raises(ValueError, match="blocks of codes"):
        fold_loops.merge_into(
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
        fold_loops.merge_into(out, codes, tensor.scales[None], ones, codec.bits, threads)
        outs.append(out)
    assert outs[0].tobytes() == outs[1].tobytes() == tensor.decode().tobytes()
    squares = fold_loops.gram(tensor.codes[None], codec.bits, threads=3)[:, 0, 0]
    levels = np.round(tensor.decode() / np.repeat(tensor.scales, 64)[:count]).astype(np.int64)
    padded = np.concatenate([levels, np.zeros(64 * len(ones) - count, np.int64)])
    # the encoder pads the last block with zeros: level 0
    assert squares.tolist() == (padded.reshape(-1, 64) ** 2).sum(axis=1).tolist()


def test_the_norm_over_one_part_in_every_is_a_lower_bound_of_the_whole():
    """Parts of 65536 values: 1s, 2s, then 10 3s; a second tensor of one part."""
    part = fold_loops.NORM_PART
    x = np.concatenate([np.ones(part), np.full(part, 2.0), np.full(10, 3.0)]).astype(np.float32)
    y = np.array([12.0], np.float32)
    whole = part + 4 * part + 90 + 144
    assert fold_loops.norm([x, y]) == np.sqrt(whole)
    # parts 0 and 2 of x, part 0 of y
    assert fold_loops.norm([x, y], every=2) == np.sqrt(part + 90 + 144)
    assert fold_loops.norm([x, y], threads=1, every=3) == np.sqrt(part + 144)
    rng = np.random.default_rng(0)
    tensors = [rng.standard_normal(n).astype(np.float32) for n in (7, part + 1, 9 * part - 3)]
    for every in (2, 8, 64):
        assert fold_loops.norm(tensors, every=every) <= fold_loops.norm(tensors)
