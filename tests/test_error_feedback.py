"""Error feedback: what is sent over T rounds equals what was meant, minus the last residual."""

from __future__ import annotations

import numpy as np
import pytest

from dloco.protocol import Codec, compensate, quantize_with_feedback


@pytest.mark.parametrize("name", ["int8", "int4", "int2"])
def test_sum_of_sent_equals_sum_of_deltas_minus_residual(name):
    codec, rng = Codec(name, 64), np.random.default_rng(0)
    residual, sent_total, meant_total = None, np.zeros(1000), np.zeros(1000)
    for _ in range(20):
        delta = (rng.standard_normal(1000) * 1e-3).astype(np.float32)
        encoded, residual = quantize_with_feedback(delta, residual, codec)
        sent_total += codec.decode(encoded, 1000)
        meant_total += delta
    # telescoping sum: exact up to float32 rounding of each round's (delta + residual) - decoded
    assert np.allclose(sent_total + residual, meant_total, rtol=0, atol=20 * 1e-3 * 2**-20)


def test_feedback_beats_plain_int2_on_the_running_sum():
    codec, rng = Codec("int2", 64), np.random.default_rng(1)
    residual, with_ef, without_ef, meant = None, 0.0, 0.0, 0.0
    for _ in range(50):
        delta = (rng.standard_normal(4096) * 1e-3).astype(np.float32)
        encoded, residual = quantize_with_feedback(delta, residual, codec)
        with_ef = with_ef + codec.decode(encoded, delta.size)
        without_ef = without_ef + codec.decode(codec.encode(delta), delta.size)
        meant = meant + delta
    assert np.linalg.norm(with_ef - meant) < 0.2 * np.linalg.norm(without_ef - meant)


def test_residual_is_bounded_by_half_a_step():
    codec = Codec("int4", 8)
    delta = np.array([7, -7, 3.5, 1, 0, -2, 6.5, 0.5], dtype=np.float32)
    _, residual = quantize_with_feedback(delta, None, codec)
    # hand-derived: scale 1, codes 7 -7 4 1 0 -2 6 0, so residual = [0, 0, -0.5, 0, 0, 0, 0.5, 0.5]
    assert residual.tolist() == [0, 0, -0.5, 0, 0, 0, 0.5, 0.5]


def test_compensate_over_a_fragment_matches_the_per_tensor_helper():
    rng = np.random.default_rng(2)
    fragment = {
        "a": rng.standard_normal((30, 7)).astype(np.float32),
        "b": rng.standard_normal(5).astype(np.float32),
    }
    residuals = {"a": rng.standard_normal((30, 7)).astype(np.float32) * 0.1}
    sent, kept = compensate(fragment, residuals, Codec("int4"))
    encoded, expected_residual = quantize_with_feedback(
        fragment["a"], residuals["a"], Codec("int4")
    )
    assert np.array_equal(kept["a"], expected_residual) and kept["a"].shape == (30, 7)
    assert np.array_equal(sent["a"].reshape(-1), Codec("int4").decode(encoded, 210))
    assert np.array_equal(sent["b"] + kept["b"], fragment["b"])
    # re-encoding what is sent reproduces it to within a float32 ulp
    again = Codec("int4").decode(Codec("int4").encode(sent["a"]), 210).reshape(30, 7)
    assert np.allclose(again, sent["a"], rtol=2**-22, atol=0)
