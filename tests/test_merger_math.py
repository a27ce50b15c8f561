"""The merger's pure core against hand-derived values: admission, weights, RDA, outer steps, fold,
and configuration errors (rounds: tests/test_merger_rounds.py; fold shares and weight caps:
tests/test_fold_shares.py)."""

from __future__ import annotations

import random

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dloco.merger.config import ConfigError, MergeConfig, OuterConfig, RoundConfig
from dloco.merger.fold import admission, outer, rda, weighting
from dloco.merger.fold.merge import Contribution, fold, init_state

LAYOUT = {"w": (2, 2), "b": (2,)}


def candidate(**overrides) -> admission.Candidate:
    fields = dict(
        island="a",
        epoch=1,
        delta_id=1,
        fragment=0,
        base_version=3,
        steps=10,
        tokens=1000,
        model="m",
        tensors={"w": np.ones((2, 2), np.float32), "b": np.zeros(2, np.float32)},
    )
    return admission.Candidate(**{**fields, **overrides})


@pytest.mark.parametrize(
    "overrides,reason,staleness",
    [
        ({}, "", 2),
        ({"base_version": 5}, "", 0),
        ({"base_version": 2}, "stale", 3),
        ({"base_version": 6}, "future_base", -1),
        ({"model": "other"}, "model_mismatch", 2),
        ({"tensors": {"w": np.ones((2, 2), np.float32)}}, "layout_mismatch", 2),
        (
            {"tensors": {"w": np.ones((4,), np.float32), "b": np.zeros(2, np.float32)}},
            "layout_mismatch",
            2,
        ),
        ({"steps": 0}, "empty", 2),
        (
            {"tensors": {"w": np.full((2, 2), np.nan, np.float32), "b": np.zeros(2, np.float32)}},
            "non_finite",
            2,
        ),
    ],
)
def test_admission(overrides, reason, staleness):
    verdict = admission.admit(
        candidate(**overrides), version=5, layout=LAYOUT, model="m", max_staleness=2
    )
    assert (verdict.admitted, verdict.reason, verdict.staleness) == (
        reason == "",
        reason,
        staleness,
    )


def test_token_weights_by_hand():
    assert weighting.token_weight(tokens=100, steps=10) == 1000.0
    assert weighting.weights([(100, 10, 0), (50, 10, 0)], power=0) == pytest.approx([0.8, 0.2])
    # staleness 1 with power 1 halves the raw weight: 1000 and 500 -> 2/3, 1/3
    assert weighting.weights([(100, 10, 0), (100, 10, 1)], power=1) == pytest.approx([2 / 3, 1 / 3])


def test_rda_by_hand():
    d1, d2 = np.array([3, 0], np.float32), np.array([0, 4], np.float32)
    # r = (3 + 4) / 2 = 3.5 ; u = ([1,0] + [0,1]) / 2 -> unit [1,1]/sqrt2 ; merged = 3.5/sqrt2 * [1,
    # 1]
    assert rda.radial_directional_average([d1, d2], [0.5, 0.5]) == pytest.approx(
        np.full(2, 3.5 / np.sqrt(2)), rel=1e-6
    )
    assert rda.weighted_average([d1, d2], [0.5, 0.5]) == pytest.approx([1.5, 2.0])


def test_rda_single_island_and_zero_deltas():
    d = np.array([[1, -2], [3, 0.5]], np.float32)
    assert np.allclose(rda.radial_directional_average([d], [1.0]), d, rtol=1e-6)
    zero, x = np.zeros(2, np.float32), np.array([2, 0], np.float32)
    # the zero delta halves the radius (r = 1) and adds no direction
    assert rda.radial_directional_average([zero, x], [0.5, 0.5]).tolist() == [1.0, 0.0]
    assert rda.radial_directional_average([zero, zero], [0.5, 0.5]).tolist() == [0.0, 0.0]


def test_rda_keeps_the_length_a_plain_mean_loses():
    rng = np.random.default_rng(0)
    deltas = [rng.standard_normal(10_000).astype(np.float32) for _ in range(16)]
    w = [1 / 16] * 16
    # near-orthogonal deltas: the mean shrinks ~1/sqrt(16) = 1/4, RDA keeps the mean norm
    assert rda.norm(rda.weighted_average(deltas, w)) == pytest.approx(100 / 4, rel=0.05)
    assert rda.norm(rda.radial_directional_average(deltas, w)) == pytest.approx(100, rel=0.02)


def run_outer(config: OuterConfig, grads: list[float]) -> list[float]:
    optimizer = outer.outer_optimizer(config)
    step = outer.make_step(optimizer)
    params = {"p": jnp.zeros(())}
    # make_step keeps optimizer state over the path-ordered list
    state = optimizer.init([params["p"]])
    trace = []
    for g in grads:
        params, state = step(params, state, {"p": jnp.asarray(g, jnp.float32)})
        trace.append(float(params["p"]))
    return trace


def test_nesterov_by_hand():
    # m1 = 1, p1 = -0.7 (1 + 0.9*1) = -1.33 ; m2 = 1.9, p2 = p1 - 0.7 (1 + 0.9*1.9) = -3.227
    assert run_outer(OuterConfig("nesterov", lr=0.7, momentum=0.9), [1, 1]) == pytest.approx(
        [-1.33, -3.227], rel=1e-6
    )


def test_delayed_nesterov_by_hand():
    # N=2: plain 0.7*1/2 steps; every 2nd fold m <- 0.9 m + mean(g) and an extra 0.7*0.9*m step
    expected = [-0.35, -1.33, -1.68, -3.227]
    assert run_outer(
        OuterConfig("delayed_nesterov", lr=0.7, momentum=0.9, delay=2), [1, 1, 1, 1]
    ) == pytest.approx(expected, rel=1e-6)


def test_delayed_nesterov_with_delay_1_is_optax_nesterov():
    rng = np.random.default_rng(1)
    grads = [rng.standard_normal((3, 4)).astype(np.float32) for _ in range(6)]
    results = []
    for optimizer in (
        outer.delayed_nesterov(0.7, 0.9, 1),
        optax.sgd(0.7, momentum=0.9, nesterov=True),
    ):
        params, state = {"w": jnp.ones((3, 4))}, None
        state = optimizer.init(params)
        for g in grads:
            updates, state = optimizer.update({"w": jnp.asarray(g)}, state, params)
            params = optax.apply_updates(params, updates)
        results.append(np.asarray(params["w"]))
    assert np.allclose(results[0], results[1], rtol=1e-6, atol=1e-6)


def run_outer_shares(config: OuterConfig, grads: list[float], shares: list[float]) -> list[float]:
    step = outer.make_step(outer.outer_optimizer(config))
    params = {"p": jnp.zeros(())}
    state = outer.outer_optimizer(config).init([params["p"]])
    trace = []
    for g, share in zip(grads, shares):
        params, state = step(params, state, {"p": jnp.asarray(g, jnp.float32)}, share)
        trace.append(float(params["p"]))
    return trace


def test_round_nesterov_by_hand():
    # halves: fold 1 a plain step -0.7; fold 2 completes a round: m = 0.9*0 + (1 + 1) = 2, step -0.7
    # (1 + 0.9*2) -> -2.66; fold 3 -0.7 -> -3.36; fold 4: m = 0.9*2 + 2 = 3.8, step -0.7 (1 +
    # 0.9*3.8) -> -6.454
    config = OuterConfig("round_nesterov", lr=0.7, momentum=0.9)
    assert run_outer_shares(config, [1, 1, 1, 1], [0.5] * 4) == pytest.approx(
        [-0.7, -2.66, -3.36, -6.454], rel=1e-6
    )
    # at each round's end, where Nesterov takes one step on the round's sum (2): -2.66, -6.454
    assert run_outer(OuterConfig("nesterov", lr=0.7, momentum=0.9), [2, 2]) == pytest.approx(
        [-2.66, -6.454], rel=1e-6
    )
    # thirds add up to a round despite float rounding; a whole round (share 1) at once is Nesterov
    # itself
    assert run_outer_shares(config, [1, 1, 1], [1 / 3] * 3)[-1] == pytest.approx(
        -0.7 * 2 - 0.7 * (1 + 0.9 * 3), rel=1e-6
    )
    assert run_outer_shares(config, [1, 1], [1.0, 1.0]) == pytest.approx([-1.33, -3.227], rel=1e-6)
    # the other optimizers take the share and ignore it
    assert run_outer_shares(
        OuterConfig("nesterov", lr=0.7, momentum=0.9), [1, 1], [0.25, 0.25]
    ) == pytest.approx([-1.33, -3.227], rel=1e-6)


def test_outer_step_matches_a_direct_optax_reference():
    rng = np.random.default_rng(2)
    params = {"w": rng.standard_normal((5, 3)).astype(np.float32)}
    grads = [{"w": rng.standard_normal((5, 3)).astype(np.float32)} for _ in range(3)]
    reference = optax.sgd(0.7, momentum=0.9, nesterov=True)
    ref_params, ref_state = {"w": jnp.asarray(params["w"])}, reference.init(params)
    for g in grads:
        updates, ref_state = reference.update(g, ref_state, ref_params)
        ref_params = optax.apply_updates(ref_params, updates)
    state = init_state(params, outer.outer_optimizer(OuterConfig()))
    step = outer.make_step(outer.outer_optimizer(OuterConfig()))
    for g in grads:
        state, _ = fold(state, [Contribution("a", 1, 1, 0, 100, 10, g)], MergeConfig(), step)
    assert state.version == 3 and np.allclose(
        state.params["w"], np.asarray(ref_params["w"]), rtol=1e-6, atol=1e-6
    )


def test_one_island_with_plain_sgd_lr_1_lands_on_its_parameters():
    anchor = {"w": np.array([1.0, 2.0], np.float32)}
    theta = {"w": np.array([0.5, 2.5], np.float32)}
    delta = {"w": anchor["w"] - theta["w"]}
    config = OuterConfig("sgd", lr=1.0)
    state = init_state(anchor, outer.outer_optimizer(config))
    state, report = fold(
        state,
        [Contribution("a", 1, 1, 0, 64, 4, delta)],
        MergeConfig(),
        outer.make_step(outer.outer_optimizer(config)),
    )
    assert (
        np.array_equal(state.params["w"], theta["w"])
        and report.version == 1
        and report.weights == (1.0,)
    )


def test_fold_is_order_independent_and_deterministic():
    rng = np.random.default_rng(3)
    contributions = [
        Contribution(
            f"i{k}",
            1,
            k,
            k % 2,
            100 + k,
            10,
            {
                "w": rng.standard_normal(50).astype(np.float32),
                "embed/table": rng.standard_normal(7).astype(np.float32),
            },
        )
        for k in range(5)
    ]
    config = OuterConfig()
    step = outer.make_step(outer.outer_optimizer(config))
    start = init_state(
        {"w": np.zeros(50, np.float32), "embed/table": np.zeros(7, np.float32)},
        outer.outer_optimizer(config),
    )
    results = []
    for _ in range(3):
        shuffled = random.Random(len(results)).sample(contributions, len(contributions))
        state, report = fold(start, shuffled, MergeConfig(), step)
        results.append(
            (
                state.params["w"].tobytes(),
                state.params["embed/table"].tobytes(),
                report.contributors,
            )
        )
    assert results[0] == results[1] == results[2]
    assert report.contributors == ("i0", "i1", "i2", "i3", "i4") and sum(
        report.weights
    ) == pytest.approx(1.0)


def test_an_islands_deltas_in_one_fold_are_summed_before_weighting():
    """A merger folding a backlog: island a's two consecutive deltas (10 + 30 steps, 100 + 300
    tokens) count as one delta of their sum (400 tokens, 40 steps: weight 400**2/40 = 4000) beside
    b's (200 tokens, 20 steps: 2000).  Plain average, SGD lr 1: the parameters move by
    -(2/3 (a1 + a2) + 1/3 b); the report gives each delta its part of a's weight by tokens."""
    a1, a2, b = (
        np.array([3.0, 0.0], np.float32),
        np.array([0.0, 6.0], np.float32),
        np.array([-3.0, 3.0], np.float32),
    )
    config = OuterConfig("sgd", lr=1.0)
    step = outer.make_step(outer.outer_optimizer(config))
    state = init_state({"w": np.zeros(2, np.float32)}, outer.outer_optimizer(config))
    members = [
        Contribution("b", 1, 7, 0, 200, 20, {"w": b}),
        Contribution("a", 1, 2, 1, 300, 30, {"w": a2}),
        Contribution("a", 1, 1, 2, 100, 10, {"w": a1}),
    ]
    after, report = fold(state, members, MergeConfig(method="average"), step)
    np.testing.assert_allclose(
        after.params["w"],
        -np.array([2 / 3 * 3 + 1 / 3 * -3, 2 / 3 * 6 + 1 / 3 * 3], np.float32),
        rtol=1e-6,
    )
    assert (
        report.contributors == ("a", "a", "b")
        and report.delta_ids == (1, 2, 7)
        and report.steps == (10, 30, 20)
    )
    assert report.weights == pytest.approx((2 / 3 * 1 / 4, 2 / 3 * 3 / 4, 1 / 3))
    # the same fold with a's deltas sent as one (the staleness of its older piece) lands on the same
    # bytes
    one, _ = fold(
        state,
        [Contribution("a", 1, 1, 2, 400, 40, {"w": a1 + a2}), members[0]],
        MergeConfig(method="average"),
        step,
    )
    assert one.params["w"].tobytes() == after.params["w"].tobytes()
    # deltas of another epoch (a restarted island: another trajectory) are not summed with them
    # (weights 3000 : 1000 : 2000, a plain weighted mean: -(1/2 a2 + 1/6 a1 + 1/3 b))
    restarted = [members[0], members[1], Contribution("a", 2, 1, 0, 100, 10, {"w": a1})]
    apart, report = fold(state, restarted, MergeConfig(method="average"), step)
    np.testing.assert_allclose(apart.params["w"], np.array([0.5, -4.0], np.float32), rtol=1e-6)


@pytest.mark.parametrize(
    "make",
    [
        lambda: OuterConfig(kind="adam"),
        lambda: OuterConfig(lr=0),
        lambda: OuterConfig(delay=0),
        lambda: MergeConfig(method="median"),
        lambda: MergeConfig(max_staleness=-1),
        lambda: RoundConfig(quorum=0),
    ],
)
def test_bad_configuration_names_the_value(make):
    with pytest.raises(ConfigError):
        make()
