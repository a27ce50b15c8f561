"""Merging straight from int codes (merger/engines/coded.py) against hand-derived values and against
the float32 path on the decoded deltas; live and replay take the same path
(tests/test_merger_log.py).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from dloco import protocol
from dloco.merger.config import MergeConfig, OuterConfig
from dloco.merger.engines import coded
from dloco.merger.fold import rda
from dloco.merger.fold.clipping import part_norm
from dloco.merger.fold.merge import Contribution, fold, init_state, merge
from dloco.merger.fold.outer import make_step, outer_optimizer
from dloco.protocol import Codec, CodedTensor

INT4_8 = Codec("int4", 8)


def record(scale: float, codes: list[int]) -> np.ndarray:
    return np.concatenate(
        [np.frombuffer(np.float32(scale).tobytes(), np.uint8), np.array(codes, np.uint8)]
    )


def test_two_hand_made_int4_deltas():
    # A: scale 0.5, level +1 at value 0 (low nibble 9); B: scale 1, level +2 at value 1 (high nibble
    # 10); the rest level 0 (nibble 8).
    a = CodedTensor(INT4_8, (8,), record(0.5, [0x89, 0x88, 0x88, 0x88])[None, :])
    b = CodedTensor(INT4_8, (8,), record(1.0, [0xA8, 0x88, 0x88, 0x88])[None, :])
    assert a.decode().tolist() == [0.5] + [0] * 7
    assert b.decode().tolist() == [0, 2] + [0] * 6
    merged, norms, merged_norm = coded.merge([{"w": a}, {"w": b}], [0.5, 0.5], {"w": False})
    # RDA: r = .5*.5 + .5*2 = 1.25; u = .5*e0 + .5*e1; merged = 1.25 * u / |u| = 1.25/sqrt(2) (e0 +
    # e1)
    assert norms == [0.5, 2.0] and merged_norm == pytest.approx(1.25)
    np.testing.assert_allclose(
        np.asarray(merged["w"]), [1.25 / np.sqrt(2)] * 2 + [0] * 6, rtol=1e-6
    )
    # weighted average: .25 e0 + e1
    merged, _, merged_norm = coded.merge([{"w": a}, {"w": b}], [0.5, 0.5], {"w": True})
    np.testing.assert_allclose(np.asarray(merged["w"]), [0.25, 1, 0, 0, 0, 0, 0, 0], rtol=1e-7)
    assert merged_norm == pytest.approx(np.sqrt(0.25**2 + 1))


def test_a_zero_delta_gives_no_direction_and_one_delta_comes_back_unchanged():
    zero = CodedTensor(INT4_8, (8,), record(0.0, [0x88] * 4)[None, :])
    # +2 at value 1, +7 at value 7
    b = CodedTensor(INT4_8, (8,), record(1.0, [0xA8, 0x88, 0x88, 0x8F])[None, :])
    alone, norms, _ = coded.merge([{"w": b}], [1.0], {"w": False})
    np.testing.assert_array_equal(np.asarray(alone["w"]), b.decode())
    with_zero, norms, _ = coded.merge([{"w": zero}, {"w": b}], [0.5, 0.5], {"w": False})
    # RDA: radius halves, direction is b's alone
    assert norms[0] == 0.0
    np.testing.assert_allclose(np.asarray(with_zero["w"]), 0.5 * b.decode(), rtol=1e-6)
    nothing, _, merged_norm = coded.merge([{"w": zero}], [1.0], {"w": False})
    assert merged_norm == 0.0 and not np.asarray(nothing["w"]).any()


def test_the_norm_bound_counts_each_block_at_its_largest_level():
    # int4 in blocks of 8: levels up to 8 times the scale; 12 values = a full block (scale 0.5)
    # and 4 values of a second (scale 2): 8 (8 x 0.5)^2 + 4 (8 x 2)^2 = 128 + 1024
    codes = [0x88] * 4
    tensor = CodedTensor(INT4_8, (12,), np.stack([record(0.5, codes), record(2.0, codes)]))
    assert tensor.squared_norm_bound() == 1152.0
    # one block, partly filled: 3 (8 x 0.25)^2
    assert CodedTensor(INT4_8, (3,), record(0.25, codes)[None, :]).squared_norm_bound() == 12.0


def test_two_hand_made_sparse_deltas():
    # topk2, block 128: keep 4 per block; code = (m - 1) | sign << 1, four codes per byte, first in
    # bits 0-1. A: scale 0.5, +2 at 3, -1 at 9, +1 at 20, -2 at 127 -> codes 1, 2, 0, 3 =
    # 0b11_00_10_01 B: scale 1.0, +1 at 3, +1 at 4, +1 at 5, +1 at 6 -> codes 0, 0, 0, 0
    topk2 = Codec("topk2", 128)
    a = CodedTensor(
        topk2,
        (128,),
        np.concatenate([record(0.5, []), np.array([3, 9, 20, 127, 0b11001001], np.uint8)])[None, :],
    )
    b = CodedTensor(
        topk2,
        (128,),
        np.concatenate([record(1.0, []), np.array([3, 4, 5, 6, 0], np.uint8)])[None, :],
    )
    da, db = a.decode(), b.decode()
    assert {i: da[i] for i in np.flatnonzero(da)} == {3: 1.0, 9: -0.5, 20: 0.5, 127: -1.0}
    assert {i: db[i] for i in np.flatnonzero(db)} == {3: 1.0, 4: 1.0, 5: 1.0, 6: 1.0}
    # weighted average
    merged, norms, merged_norm = coded.merge([{"w": a}, {"w": b}], [0.5, 0.5], {"w": True})
    expected = 0.5 * da + 0.5 * db
    np.testing.assert_array_equal(np.asarray(merged["w"]), expected)
    assert norms == [
        pytest.approx(np.sqrt(1 + 0.25 + 0.25 + 1)),
        2.0,
    ] and merged_norm == pytest.approx(np.linalg.norm(expected))
    # sparse: the exact value
    assert a.squared_norm_bound() == pytest.approx(2.5)


@pytest.mark.parametrize(
    "name,block", [("int8", 64), ("int4", 64), ("int2", 64), ("topk2", 128), ("topk4", 128)]
)
def test_codes_merge_like_the_decoded_floats(name, block):
    codec, rng = Codec(name, block), np.random.default_rng(3)
    # padded last blocks, a tensor smaller than a block
    shapes = {"a/kernel": (13, 17), "b/bias": (5,), "c/kernel": (64, 3)}
    deltas = [
        {
            p: CodedTensor(
                codec,
                s,
                codec.encode(
                    (rng.standard_normal(s) * 10.0**-m).astype(np.float32).reshape(-1)
                ).reshape(-1, codec.record_nbytes),
            )
            # sparse: groups of 8 and 2
            for p, s in shapes.items()
        }
        for m in range(10 if codec.sparse else 3)
    ]
    contributions = [
        Contribution(f"i{m}", 1, 1, 0, 100 * (m + 1), 10, d) for m, d in enumerate(deltas)
    ]
    for method in ("rda", "average"):
        config = MergeConfig(method=method, average_paths=("bias",))
        # the float path on decoded values
        expected, weights = merge(contributions, config)
        got, norms, merged_norm = coded.merge(
            deltas, weights, {p: method == "average" or "bias" in p for p in shapes}
        )
        for path in shapes:
            np.testing.assert_allclose(
                np.asarray(got[path]),
                expected[path],
                rtol=2e-5,
                atol=1e-7 * np.abs(expected[path]).max(),
            )
        floats = [{p: t.decode() for p, t in d.items()} for d in deltas]
        np.testing.assert_allclose(norms, [rda.fragment_norm(f) for f in floats], rtol=1e-6)
        assert merged_norm == pytest.approx(rda.fragment_norm(expected), rel=1e-5)


def test_fold_uses_the_codes_and_is_deterministic():
    codec, rng = Codec("int4"), np.random.default_rng(5)
    shapes = {"w": (300, 40), "v": (7,)}
    params = {p: rng.standard_normal(s).astype(np.float32) for p, s in shapes.items()}
    step = make_step(outer_optimizer(OuterConfig()))
    deltas = [
        {
            p: CodedTensor(
                codec,
                s,
                codec.encode(
                    (rng.standard_normal(s) * 1e-2).astype(np.float32).reshape(-1)
                ).reshape(-1, codec.record_nbytes),
            )
            for p, s in shapes.items()
        }
        for _ in range(2)
    ]
    members = [Contribution(f"i{m}", 1, m, 0, 50, 5, d) for m, d in enumerate(deltas)]
    results = []
    for _ in range(2):
        state = init_state(params, outer_optimizer(OuterConfig()))
        for _ in range(3):
            state, report = fold(state, members, MergeConfig(), step)
        results.append({p: np.asarray(v).tobytes() for p, v in state.params.items()})
    assert results[0] == results[1] and report.version == 3
    assert coded.mergeable([m.tensors for m in members])
    assert not coded.mergeable([members[0].tensors, {p: t.decode() for p, t in deltas[1].items()}])
    assert not coded.mergeable(
        [
            {
                p: CodedTensor(
                    Codec("int8"),
                    t.shape,
                    Codec("int8")
                    .encode(t.decode().reshape(-1))
                    .reshape(-1, Codec("int8").record_nbytes),
                )
                for p, t in deltas[0].items()
            },
            deltas[1],
        ]
    )
    with pytest.raises(protocol.EncodeError, match="records of"):
        CodedTensor(codec, (3, 3), np.zeros((2, codec.record_nbytes), np.uint8))


def _random_deltas(codec: Codec, count: int, deltas: int, rng) -> list[dict]:
    return [
        {
            "w": CodedTensor(
                codec,
                (count,),
                codec.encode(rng.standard_normal(count).astype(np.float32)).reshape(
                    -1, codec.record_nbytes
                ),
            )
        }
        for _ in range(deltas)
    ]


@pytest.mark.parametrize("name", ["int8", "int4", "int2"])
def test_a_dense_round_is_the_sequential_float32_sum_of_its_levels(name):
    """Eleven deltas of 40 values (blocks of 8, the last one partial), weighted average: each value
    is ((f_0 q_0 + f_1 q_1) + ...) in float32, f_m = w_m scale_m rounded to float32, bit for bit."""
    codec, rng = Codec(name, 8), np.random.default_rng(9)
    deltas = _random_deltas(codec, 40, 11, rng)
    weights = list(rng.random(11))
    merged, _, _ = coded.merge(deltas, weights, {"w": True})
    expected = np.zeros(40, np.float32)
    for weight, delta in zip(weights, deltas):
        scales = delta["w"].scales.astype(np.float64)
        levels = np.round(delta["w"].decode() / np.repeat(delta["w"].scales, 8)[:40])
        factor = np.repeat((weight * scales).astype(np.float32), 8)[:40]
        expected = expected + levels.astype(np.float32) * factor
    assert np.asarray(merged["w"]).tobytes() == expected.tobytes()


def test_sparse_rounds_of_any_size_use_few_kernel_shapes_and_the_same_order(monkeypatch):
    assert (
        coded.groups(1) == [(0, 1, 1)]
        and coded.groups(3) == [(0, 3, 4)]
        and coded.groups(11) == [(0, 8, 8), (8, 3, 4)]
    )
    codec, rng = Codec("topk4", 128), np.random.default_rng(9)
    deltas = _random_deltas(codec, 300, 11, rng)
    weights = list(rng.random(11))
    grouped, _, _ = coded.merge(deltas, weights, {"w": True})
    expected = sum(np.float32(w) * d["w"].decode() for w, d in zip(weights, deltas))
    np.testing.assert_allclose(np.asarray(grouped["w"]), expected, rtol=1e-5, atol=1e-6)
    # one delta per kernel call: the same sequential sum, bit for bit
    monkeypatch.setattr(coded, "GROUPS", (1,))
    single, _, _ = coded.merge(deltas, weights, {"w": True})
    assert np.asarray(single["w"]).tobytes() == np.asarray(grouped["w"]).tobytes()


def test_the_fold_share_reaches_the_outer_optimizer_on_both_paths():
    """round_nesterov folds from codes and from the decoded floats alike, the share passed on: with
    halves, the momentum moves every second fold only."""
    codec, rng = Codec("int4"), np.random.default_rng(6)
    shapes = {"w": (64, 8), "embed/v": (9,)}
    params = {p: rng.standard_normal(s).astype(np.float32) for p, s in shapes.items()}
    optimizer = outer_optimizer(OuterConfig("round_nesterov"))
    step = make_step(optimizer)
    coded_members = [
        [
            Contribution(
                "a",
                1,
                k,
                0,
                50,
                5,
                {
                    p: CodedTensor(
                        codec,
                        s,
                        codec.encode(
                            (rng.standard_normal(s) * 1e-2).astype(np.float32).reshape(-1)
                        ).reshape(-1, codec.record_nbytes),
                    )
                    for p, s in shapes.items()
                },
            )
        ]
        for k in range(4)
    ]
    float_members = [
        [
            dataclasses.replace(m, tensors={p: t.decode() for p, t in m.tensors.items()})
            for m in members
        ]
        for members in coded_members
    ]
    ends = []
    for rounds in (coded_members, float_members):
        state, momenta = init_state(params, optimizer), []
        for members in rounds:
            state, _ = fold(state, members, MergeConfig(), step, share=0.5)
            momenta.append(np.asarray(state.opt_state.momentum[0]).copy())
        ends.append(state)
        assert np.array_equal(momenta[0], np.zeros_like(momenta[0])) and not np.array_equal(
            momenta[1], momenta[0]
        )
        assert np.array_equal(momenta[2], momenta[1]) and not np.array_equal(momenta[3], momenta[2])
    for path in shapes:
        np.testing.assert_allclose(
            np.asarray(ends[0].params[path]), np.asarray(ends[1].params[path]), rtol=1e-5, atol=1e-6
        )


def test_a_coded_tensor_scaled_keeps_its_codes_and_scales_its_blocks():
    # scale 0.5, levels +1 and +2: times 0.25, 0.125 a level
    b = CodedTensor(INT4_8, (8,), record(0.5, [0xA9, 0x88, 0x88, 0x88])[None, :])
    half = b.scaled(np.float32(0.25))
    assert half.decode().tolist() == [0.125, 0.25, 0, 0, 0, 0, 0, 0]
    assert half.codes.tobytes() == b.codes.tobytes() and b.scales.tolist() == [0.5]
    sparse = Codec("topk2")
    values = np.arange(256, dtype=np.float32)
    with pytest.raises(protocol.EncodeError, match="sparse"):
        CodedTensor(sparse, (256,), sparse.encode(values).reshape(1, -1)).scaled(np.float32(0.5))


def test_a_fold_whose_delta_the_guard_clips_stays_on_the_codes(monkeypatch):
    """Island a's int4 delta is capped to a quarter of its movement: the fold still merges from the
    codes (a's block scales scaled), moves the model as the float32 path on the decoded, scaled
    deltas does, and reports a's norm as sent."""
    codec, rng = Codec("int4"), np.random.default_rng(7)
    shapes = {"w": (64, 32)}
    params = {"w": rng.standard_normal(shapes["w"]).astype(np.float32)}
    step = make_step(outer_optimizer(OuterConfig()))

    def coded_delta(size):
        values = (rng.standard_normal(shapes["w"]) * size).astype(np.float32).reshape(-1)
        return {"w": CodedTensor(codec, shapes["w"], codec.encode(values).reshape(-1, 128 + 4))}

    members = [
        Contribution("a", 1, 1, 0, 50, 5, coded_delta(1.0)),
        Contribution("b", 1, 2, 0, 50, 5, coded_delta(0.01)),
    ]
    norms = [float(np.linalg.norm(m.tensors["w"].decode())) for m in members]
    # weights 0.5 each; the guard measures a's part by admission's bound (`part_norm`)
    caps = {"a": 0.25 * 0.5 * part_norm(members[:1]), "b": 1e9}
    calls = []
    monkeypatch.setattr(coded, "dense_terms", _counting(coded.dense_terms, calls))
    fresh = init_state(params, outer_optimizer(OuterConfig()))
    state, report = fold(fresh, members, MergeConfig(), step, caps=caps)
    assert calls == [1] and report.clipped == ("a",)
    assert report.delta_norms == pytest.approx(norms, rel=1e-5)
    # the same bytes as folding a's delta scaled by a quarter beforehand
    quarter = dataclasses.replace(members[0], tensors={"w": members[0].tensors["w"].scaled(0.25)})
    same, _ = fold(fresh, [quarter, members[1]], MergeConfig(), step)
    assert np.asarray(same.params["w"]).tobytes() == np.asarray(state.params["w"]).tobytes()
    # and about what the float32 path makes of the decoded, scaled deltas
    floats = [
        dataclasses.replace(members[0], tensors={"w": members[0].tensors["w"].decode() * 0.25}),
        dataclasses.replace(members[1], tensors={"w": members[1].tensors["w"].decode()}),
    ]
    by_floats, _ = fold(fresh, floats, MergeConfig(), step)
    np.testing.assert_allclose(
        np.asarray(state.params["w"]), np.asarray(by_floats.params["w"]), rtol=0, atol=1e-5
    )


def _counting(function, calls):
    def counted(*args, **kwargs):
        calls.append(1)
        return function(*args, **kwargs)

    return counted


def test_folds_reuse_the_scratch_once_the_step_that_read_it_is_done():
    """A merger's folds write their direction into two buffers in turn (coded.Scratch): the third
    fold's values land where the first's were, after the step that read the first has written its
    output, and are the bytes a fold into fresh memory gives."""
    codec, rng = Codec("int4"), np.random.default_rng(11)

    def deltas(count):
        return [
            {
                p: CodedTensor(
                    codec,
                    (40, 16),
                    codec.encode(rng.standard_normal(640).astype(np.float32)).reshape(-1, 132),
                )
                for p in ("a", "b")
            }
            for _ in range(count)
        ]

    plains = {"a": False, "b": True}
    scratch = coded.Scratch()
    first, _, _ = coded.dense(deltas(2), [0.5, 0.5], plains, scratch)
    expected = np.asarray(first["a"]) * 2
    read = jax.jit(lambda x: x * 2)(jax.device_put(first["a"]))
    scratch.read_by(read)
    second, _, _ = coded.dense(deltas(1), [1.0], plains, scratch)
    scratch.read_by(jax.jit(lambda x: x + 1)(jax.device_put(second["a"])))
    assert not np.shares_memory(first["a"], second["a"])
    third_deltas = deltas(3)
    third, _, _ = coded.dense(third_deltas, [0.2, 0.3, 0.5], plains, scratch)
    fresh, _, _ = coded.dense(third_deltas, [0.2, 0.3, 0.5], plains)
    assert third["a"].ctypes.data == first["a"].ctypes.data
    assert np.array_equal(np.asarray(read), expected)
    assert all(third[p].tobytes() == fresh[p].tobytes() for p in plains)
