"""Island pure parts against hand-derived values: schedule, partition agreement, delta, adoption."""

from __future__ import annotations

import numpy as np
import pytest

from dloco import protocol
from dloco.island import exchange
from dloco.island.config import ConfigError, ModelConfig, SyncConfig, TrainConfig
from dloco.protocol import downlink


def test_schedule_staggers_fragments_by_hand():
    # P=4, H=50: offsets (p+1)*50//4 mod 50 = 12, 25, 37, 0
    due = {step: exchange.due_fragments(step, 4, 50) for step in range(1, 101)}
    assert {step: f for step, f in due.items() if f} == {
        12: [0],
        25: [1],
        37: [2],
        50: [3],
        62: [0],
        75: [1],
        87: [2],
        100: [3],
    }


def test_an_anchor_is_held_in_int8_and_what_that_rounds_off_goes_out_in_the_next_delta():
    base = {"w": np.array([1.0, 2.0, 3.0, 4.0], np.float32)}
    anchor = exchange.Anchor(base)
    # before a send the anchor is the global value itself: no copy
    assert anchor.value("w") is base["w"] and list(anchor) == ["w"]
    theta = {"w": base["w"] + np.array([0.5, 0.0, -0.2, 0.1], np.float32)}
    delta, anchor = exchange.advance(anchor, theta)
    # int8 absmax, one block: scale 0.5 / 127, codes 127, 0, rint(-50.8) = -51, rint(25.4) = 25
    first = np.array([0.5, 0.0, -51 / 254, 25 / 254])
    np.testing.assert_allclose(anchor.value("w") - base["w"], first, rtol=0, atol=1e-6)
    np.testing.assert_allclose(delta["w"], -first, rtol=0, atol=1e-6)
    assert anchor.base["w"] is base["w"] and anchor.offset["w"].dtype == np.uint8
    # 0.3 more on the second value: progress [0.5, 0.3, -0.2, 0.1] since the base, held as codes
    # 127, rint(76.2) = 76, -51, 25; the delta is the old anchor minus the new one
    theta = {"w": theta["w"] + np.array([0.0, 0.3, 0.0, 0.0], np.float32)}
    delta, anchor = exchange.advance(anchor, theta)
    np.testing.assert_allclose(delta["w"], [0.0, -76 / 254, 0.0, 0.0], rtol=0, atol=1e-6)
    # the deltas add up to base - anchor; what they left out, theta - anchor, is the held
    # progress's rounding (0.3 - 76/254 on the second value, the first send's on the last two): it
    # stays in theta against the anchor, so the next delta (or a rebase) carries it
    np.testing.assert_allclose(
        theta["w"] - anchor.value("w"),
        [0.0, 0.3 - 76 / 254, 51 / 254 - 0.2, 0.1 - 25 / 254],
        rtol=0,
        atol=1e-6,
    )


def test_an_anchor_on_a_bfloat16_value_keeps_it_and_takes_deltas_in_float32():
    """A merger serving bf16 (snapshot `served`): the anchor holds the downlink's 2-byte arrays
    themselves and reads them as float32 a tensor at a time."""
    bf16 = downlink.SERVED_DTYPES["bf16"]
    adopted = {"w": np.array([1.0, 2.0, 3.0, 4.0], np.float32).astype(bf16)}
    anchor = exchange.Anchor.adopted(adopted)
    assert anchor.base["w"] is adopted["w"] and anchor.value("w").dtype == np.float32
    theta = {"w": np.array([1.5, 2.0, 2.8, 4.1], np.float32)}
    delta, anchor = exchange.advance(anchor, theta)
    # as for a float32 base (above): int8 codes 127, 0, -51, 25 of scale 0.5 / 127
    np.testing.assert_allclose(delta["w"], [-0.5, 0.0, 51 / 254, -25 / 254], rtol=0, atol=1e-6)
    assert anchor.base["w"] is adopted["w"]


@pytest.mark.parametrize("fragments_,interval", [(1, 1), (3, 10), (4, 50), (24, 24), (5, 7)])
def test_each_fragment_is_due_every_h_steps_and_never_two_at_once(fragments_, interval):
    steps = range(1, 3 * interval + 1)
    for p in range(fragments_):
        times = [t for t in steps if p in exchange.due_fragments(t, fragments_, interval)]
        assert len(times) == 3 and all(b - a == interval for a, b in zip(times, times[1:]))
    assert all(len(exchange.due_fragments(t, fragments_, interval)) <= 1 for t in steps)


def test_partition_is_the_one_the_merger_computes():
    shapes = {"a": (128, 64), "b": (64,), "c": (64, 256), "d": (3,)}
    # c (16384 values) -> 0; a (8192) -> 1; b (64) and d (3) -> 1, still the lighter one
    assert (
        exchange.partition(shapes, 2) == protocol.partition(shapes, 2) == [["c"], ["a", "b", "d"]]
    )


def test_pseudo_gradient_and_adoption_by_hand():
    anchor = {"w": np.array([1.0, 2.0], np.float32)}
    theta = {"w": np.array([0.5, 3.0], np.float32)}
    assert exchange.pseudo_gradient(anchor, theta)["w"].tolist() == [0.5, -1.0]
    snapshot = {"w": np.array([2.0, 2.0], np.float32)}
    assert exchange.adopt(theta, snapshot, 0.0)["w"].tolist() == [2.0, 2.0]
    # 0.5*theta + 0.5*Theta
    assert exchange.adopt(theta, snapshot, 0.5)["w"].tolist() == [1.25, 2.5]
    # rebase: Theta + (theta - anchor) = [2 + (0.5 - 1), 2 + (3 - 2)]; the next delta against Theta
    # is the island's whole progress since its anchor, -(theta - anchor)
    rebased = exchange.rebase(theta, anchor, snapshot)
    assert rebased["w"].tolist() == [1.5, 3.0] and rebased["w"].dtype == np.float32
    assert (
        exchange.pseudo_gradient(snapshot, rebased)["w"].tolist()
        == exchange.pseudo_gradient(anchor, theta)["w"].tolist()
    )
    # with error feedback's residual r (delta units, not delivered yet): Theta + (theta - anchor) -
    # r, and the next delta is the progress plus r: [0.5 + 0.25, -1.0 - 0.5]
    residual = {"w": np.array([0.25, -0.5], np.float32)}
    carried = exchange.rebase(theta, anchor, snapshot, residual)
    assert carried["w"].tolist() == [1.25, 3.5] and exchange.pseudo_gradient(snapshot, carried)[
        "w"
    ].tolist() == [0.75, -1.5]


@pytest.mark.parametrize(
    "make",
    [
        lambda: ModelConfig(width=130, heads=4),
        lambda: ModelConfig(depth=0),
        lambda: TrainConfig(lr=0),
        lambda: TrainConfig(schedule="linear"),
        lambda: SyncConfig(fragments=4, interval=3),
        lambda: SyncConfig(codec="int3"),
        lambda: SyncConfig(alpha=1.0, adoption="replace"),
        lambda: SyncConfig(adoption="merge"),
        lambda: SyncConfig(alpha=0.5),
    ],
)
def test_bad_configuration_names_the_value(make):
    with pytest.raises(ConfigError):
        make()


def test_a_blocking_wait_ends_on_a_newer_version_or_a_delta_settled_without_a_fold():
    # both fragments sent, based on version 4
    sent = {0: 4, 1: 4}
    # fragment 1 not back yet
    assert not exchange.fold_wait_over(sent, {0: 5, 1: 4}, {}, {})
    assert exchange.fold_wait_over(sent, {0: 5, 1: 5}, {}, {})
    # fragment 1's delta was rejected since
    assert exchange.fold_wait_over(sent, {0: 5, 1: 4}, {1: 2}, {1: 3})
    # an older rejection does not count
    assert not exchange.fold_wait_over(sent, {0: 5, 1: 4}, {1: 3}, {1: 3, 0: 9})
