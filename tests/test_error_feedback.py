"""Error feedback: what is sent over T rounds equals what was meant, minus the last residual."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from dloco.island import exchange
from dloco.island.config import SyncConfig
from dloco.island.shaper import LinkShaper
from dloco.island.uplink import Uplink
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


@pytest.mark.parametrize("name", ["int4", "fp32", "topk2"])
def test_the_uplink_holds_residuals_and_adds_them_to_the_next_delta(name):
    """The uplink's error feedback (Uplink._compensated) sends what protocol.compensate sends, as
    encodings (protocol.Encoded, which split_fragment packs as they are); it holds each residual as
    exchange.held (int8 in the codec's blocks, bf16 for a sparse codec), to within half a step of
    that encoding, and adds it, so held, to the next delta.  fp32's encoding is a view of the
    values: what is sent must not become the residual."""
    sync = SyncConfig(fragments=1, codec=name, error_feedback=True)
    codec = Codec(sync.codec, sync.block)
    uplink = Uplink("island-0", "model", 1, sync, LinkShaper(None), threading.Event())
    rng = np.random.default_rng(3)
    first = {"a": rng.standard_normal((64, 16)).astype(np.float32)}
    expected, kept = compensate(first, {}, codec)
    sent = uplink._compensated({"a": first["a"].copy()})

    def decoded(encoded):
        return codec.decode(encoded.data, encoded.size).reshape(encoded.shape)

    assert sent["a"].shape == (64, 16) and np.array_equal(decoded(sent["a"]), expected["a"])
    encoded, shape = uplink.residuals["a"]
    held = exchange.unheld(encoded, shape, uplink.held_codec)
    if codec.sparse:
        assert uplink.held_codec.name == "bf16" and encoded.nbytes == 2 * 1024
        assert np.allclose(held, kept["a"], rtol=2**-8, atol=0)
    else:
        assert uplink.held_codec == Codec("int8", sync.block)
        assert encoded.nbytes == 4 * (4 + 256) and shape == (64, 16)
        steps = np.abs(kept["a"]).reshape(-1, 256).max(axis=1) / 127
        assert (np.abs(held - kept["a"]).reshape(-1, 256) <= steps[:, None] / 2 + 1e-9).all()
    # the next delta carries the residual as held
    second = {"a": rng.standard_normal((64, 16)).astype(np.float32)}
    expected, _ = compensate(second, {"a": held}, codec)
    again = uplink._compensated({"a": second["a"].copy()})["a"]
    assert np.array_equal(decoded(again), expected["a"])
    # a rebase takes them (IslandLoop._adopt): gone from the uplink
    assert set(uplink.take_residuals(["a", "b"])) == {"a"} and not uplink.residuals
