"""An island's several deltas of one fold (a merger that fell behind) are merged as their sum, and
with a dense int codec straight from their codes (merger/engines/coded.py `dense`, `sizes`): the
fold stays on the codes instead of decoding every delta for the float32 path."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from dloco.merger.config import MergeConfig, OuterConfig
from dloco.merger.engines import coded
from dloco.merger.fold.clipping import part_norm
from dloco.merger.fold.merge import Contribution, fold, init_state
from dloco.merger.fold.outer import make_step, outer_optimizer
from dloco.protocol import Codec, CodedTensor

INT4_8 = Codec("int4", 8)
SHAPES = {"w": (64, 32), "v": (7,)}


def record(scale: float, codes: list[int]) -> np.ndarray:
    return np.concatenate(
        [np.frombuffer(np.float32(scale).tobytes(), np.uint8), np.array(codes, np.uint8)]
    )


def hand_made(scale: float, codes: list[int]) -> dict:
    return {"w": CodedTensor(INT4_8, (8,), record(scale, codes)[None, :])}


def test_a_member_of_two_hand_made_deltas_merges_as_their_sum():
    # a: +1 at value 0 (scale 0.5); b: +2 at value 1 (scale 1); c: +1 at value 2 (scale 1)
    a, b = hand_made(0.5, [0x89, 0x88, 0x88, 0x88]), hand_made(1.0, [0xA8, 0x88, 0x88, 0x88])
    c = hand_made(1.0, [0x88, 0x89, 0x88, 0x88])
    # one member, a + b, alone: RDA gives it back, (0.5, 2, 0, ...)
    merged, norms, merged_norm = coded.dense([a, b], [1.0], {"w": False}, sizes=[2])
    np.testing.assert_allclose(merged["w"], [0.5, 2, 0, 0, 0, 0, 0, 0], rtol=1e-6)
    assert norms == [0.5, 2.0] and merged_norm == pytest.approx(np.sqrt(4.25))
    # with c, half each: radius .5 |a+b| + .5 |c|, along .5 (a+b)/|a+b| + .5 c/|c|
    merged, norms, merged_norm = coded.dense([a, b, c], [0.5, 0.5], {"w": False}, sizes=[2, 1])
    u = 0.5 * np.array([0.5, 2, 0]) / np.sqrt(4.25) + 0.5 * np.array([0, 0, 1.0])
    radius = 0.5 * np.sqrt(4.25) + 0.5
    np.testing.assert_allclose(merged["w"][:3], radius * u / np.linalg.norm(u), rtol=1e-6)
    assert not merged["w"][3:].any()
    assert norms == [0.5, 2.0, 1.0] and merged_norm == pytest.approx(radius)
    # weighted average: .5 (a + b) + .5 c
    merged, _, _ = coded.dense([a, b, c], [0.5, 0.5], {"w": True}, sizes=[2, 1])
    np.testing.assert_allclose(merged["w"][:3], [0.25, 1, 0.5], rtol=1e-7)
    with pytest.raises(ValueError, match="sizes"):
        coded.dense([a, b, c], [0.5, 0.5], {"w": False}, sizes=[1, 1])


def _coded(rng, size: float, codec: Codec = Codec("int4")) -> dict:
    return {
        p: CodedTensor(
            codec,
            s,
            codec.encode((rng.standard_normal(s) * size).astype(np.float32).reshape(-1)).reshape(
                -1, codec.record_nbytes
            ),
        )
        for p, s in SHAPES.items()
    }


def _decoded(c: Contribution, factor: float = 1.0) -> Contribution:
    return dataclasses.replace(c, tensors={p: t.decode() * factor for p, t in c.tensors.items()})


def _counting(function, calls: list):
    def counted(*args, **kwargs):
        calls.append(1)
        return function(*args, **kwargs)

    return counted


@pytest.fixture
def backlog():
    """Island a's two deltas and island b's one, in one fold; the model and the step."""
    rng = np.random.default_rng(11)
    params = {p: rng.standard_normal(s).astype(np.float32) for p, s in SHAPES.items()}
    members = [
        Contribution("a", 1, 1, 1, 50, 5, _coded(rng, 0.01)),
        Contribution("a", 1, 2, 0, 50, 5, _coded(rng, 0.01)),
        Contribution("b", 1, 3, 0, 100, 10, _coded(rng, 0.02)),
    ]
    return params, members, make_step(outer_optimizer(OuterConfig()))


def test_a_fold_of_an_islands_backlog_stays_on_the_codes(backlog, monkeypatch):
    params, members, step = backlog
    fresh = init_state(params, outer_optimizer(OuterConfig()))
    by_floats, float_report = fold(fresh, [_decoded(c) for c in members], MergeConfig(), step)
    calls, decodes = [], []
    monkeypatch.setattr(coded, "dense_terms", _counting(coded.dense_terms, calls))
    monkeypatch.setattr(CodedTensor, "decode", _counting(CodedTensor.decode, decodes))
    results = []
    for _ in range(2):
        state, report = fold(fresh, members, MergeConfig(), step)
        results.append({p: np.asarray(v).tobytes() for p, v in state.params.items()})
    # one merge from the codes per fold, nothing decoded, the same bytes every time
    assert calls == [1, 1] and decodes == [] and results[0] == results[1]
    # about what the float32 path makes of the decoded deltas (a's summed first)
    for p in SHAPES:
        np.testing.assert_allclose(
            np.asarray(state.params[p]), np.asarray(by_floats.params[p]), rtol=0, atol=1e-6
        )
    # one weight per delta, a's two sharing a's by tokens; each delta's own norm
    assert report.weights == pytest.approx(float_report.weights)
    assert report.delta_norms == pytest.approx(float_report.delta_norms, rel=1e-5)
    assert report.merged_norm == pytest.approx(float_report.merged_norm, rel=1e-5)


def test_a_clipped_backlog_stays_on_the_codes(backlog, monkeypatch):
    """Island a's part (two deltas) capped to a quarter of its movement: each of its deltas is
    scaled by its block scales, and the fold is the one of a's deltas scaled beforehand."""
    params, members, step = backlog
    fresh = init_state(params, outer_optimizer(OuterConfig()))
    w_a = 0.5
    caps = {"a": 0.25 * w_a * part_norm(members[:2]), "b": 1e9}
    calls = []
    monkeypatch.setattr(coded, "dense_terms", _counting(coded.dense_terms, calls))
    state, report = fold(fresh, members, MergeConfig(), step, caps=caps)
    assert calls == [1] and report.clipped == ("a",)
    quarter = [
        dataclasses.replace(
            c, tensors={p: t.scaled(np.float32(0.25)) for p, t in c.tensors.items()}
        )
        for c in members[:2]
    ]
    same, _ = fold(fresh, [*quarter, members[2]], MergeConfig(), step)
    for p in SHAPES:
        assert np.asarray(same.params[p]).tobytes() == np.asarray(state.params[p]).tobytes()
    # each delta's norm as sent
    sent = [
        float(np.sqrt(sum((t.decode() ** 2).sum() for t in c.tensors.values()))) for c in members
    ]
    assert report.delta_norms == pytest.approx(sent, rel=1e-5)


def test_a_backlog_of_sparse_deltas_is_summed_in_float32(backlog):
    params, _, step = backlog
    rng = np.random.default_rng(12)
    topk = Codec("topk2", 128)
    members = [
        Contribution("a", 1, 1, 1, 50, 5, _coded(rng, 0.01, topk)),
        Contribution("a", 1, 2, 0, 50, 5, _coded(rng, 0.01, topk)),
    ]
    fresh = init_state(params, outer_optimizer(OuterConfig()))
    state, report = fold(fresh, members, MergeConfig(), step)
    by_floats, _ = fold(fresh, [_decoded(c) for c in members], MergeConfig(), step)
    for p in SHAPES:
        assert np.asarray(state.params[p]).tobytes() == np.asarray(by_floats.params[p]).tobytes()
    assert report.contributors == ("a", "a")
