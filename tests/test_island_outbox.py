"""The outbox, pure: summing, order and bound, against hand-derived values."""

from __future__ import annotations

import numpy as np

from dloco.island.outbox import (
    BusState,
    Outbox,
    PendingDelta,
    held_scale,
    rebased,
    summed,
)

F32 = np.float32


def pending(fragment: int, base: int, values: list[float], steps: int, tokens: int) -> PendingDelta:
    return PendingDelta(fragment, base, {"w": np.array(values, F32)}, steps, tokens)


def test_a_newer_delta_is_summed_onto_the_unsent_one_keeping_the_newer_base():
    # older: base 3, [1, 2], 5 steps, 640 tokens; newer: base 4, [0.5, -2], 3 steps, 384 tokens
    total = summed(pending(0, 3, [1.0, 2.0], 5, 640), pending(0, 4, [0.5, -2.0], 3, 384))
    assert (
        total.fragment == 0
        and total.base_version == 4
        and total.steps == 8
        and total.tokens == 1024
    )
    assert total.delta["w"].tolist() == [1.5, 0.0] and total.delta["w"].dtype == F32


def test_the_outbox_holds_one_delta_per_fragment_in_the_order_they_became_pending():
    outbox = Outbox()
    assert outbox.take() is None and len(outbox) == 0
    assert outbox.put(pending(2, 0, [1.0], 1, 10)) is False
    assert outbox.put(pending(0, 0, [2.0], 1, 10)) is False
    # summed onto fragment 2's: no new entry, same place in line
    assert outbox.put(pending(2, 1, [4.0], 2, 20)) is True
    assert len(outbox) == 2
    first, second = outbox.take(), outbox.take()
    assert (
        first.fragment,
        first.base_version,
        first.delta["w"].tolist(),
        first.steps,
        first.tokens,
    ) == (2, 1, [5.0], 3, 30)
    assert (second.fragment, second.delta["w"].tolist()) == (0, [2.0])
    assert outbox.take() is None and len(outbox) == 0


def test_the_outbox_never_holds_more_than_one_delta_per_fragment():
    outbox, fragments = Outbox(), 4
    summed_count = sum(
        outbox.put(pending(step % fragments, step, [1.0], 1, 1)) for step in range(100)
    )
    assert len(outbox) == fragments and summed_count == 100 - fragments
    taken = [outbox.take() for _ in range(fragments)]
    assert [d.fragment for d in taken] == [0, 1, 2, 3] and all(
        d.steps == 25 and d.delta["w"].tolist() == [25.0] for d in taken
    )


def test_take_skips_the_deltas_that_are_not_ready_oldest_ready_first():
    box = Outbox()
    for fragment in (3, 1, 2):
        box.put(pending(fragment, 0, [1.0], 1, 10))
    # 3 is older but not ready
    assert box.take(lambda d: d.fragment != 3).fragment == 1
    assert box.take(lambda d: False) is None and len(box) == 2
    assert [box.take().fragment, box.take().fragment, box.take()] == [3, 2, None]


def test_a_full_stream_of_one_merger_shard_holds_back_only_its_own_fragments():
    """Two shards: shard 1's stream (fragments 1, 3) has a full retransmit buffer (its merger is
    down); a delta of fragment 0 (shard 0) is still taken, fragment 1's waits, and one merger
    keeps the old rule (any delta, then chunk by chunk)."""
    import threading

    from dloco.island.config import SyncConfig
    from dloco.island.shaper import LinkShaper
    from dloco.island.uplink import Uplink

    # each stream: 1 MiB
    sync = SyncConfig(fragments=4, interval=8, codec="int8", retransmit_bytes=1 << 20)
    uplink = Uplink("isl", "m", 1, sync, LinkShaper(None), threading.Event(), shards=2)
    # 600 kB at int8: a stream's budget holds one
    big = PendingDelta(1, 0, {"w": np.ones(600_000, np.float32)}, 1, 1)
    uplink.streams[1].kept.add(1, [b"x"], 600_000)
    uplink.outbox.put(big)
    uplink.outbox.put(PendingDelta(0, 0, {"v": np.ones(1000, np.float32)}, 1, 1))
    assert uplink.outbox.take(uplink._room_for).fragment == 0
    # fragment 1 waits for shard 1's cursor
    assert uplink.outbox.take(uplink._room_for) is None
    uplink.streams[1].kept.release(1)
    assert uplink.outbox.take(uplink._room_for).fragment == 1
    alone = Uplink("isl", "m", 1, sync, LinkShaper(None), threading.Event())
    alone.streams[0].kept.add(1, [b"x"], 1 << 20)
    alone.outbox.put(big)
    assert alone.outbox.take(alone._room_for).fragment == 1


def test_an_unsent_delta_is_rebased_onto_a_newer_version_only():
    box = Outbox()
    box.put(pending(1, 3, [1.0], 2, 20))
    # older or equal: unchanged; no delta of fragment 0: nothing to do
    assert [box.rebase(1, 2), box.rebase(1, 3), box.rebase(0, 9)] == [False, False, False]
    assert box.rebase(1, 7) is True
    taken = box.take()
    # only the base moves: the work, its steps and tokens are the same
    assert (taken.base_version, taken.delta["w"].tolist(), taken.steps, taken.tokens) == (
        7,
        [1.0],
        2,
        20,
    )
    assert rebased(taken, 5) is taken and rebased(taken, 8).base_version == 8


def test_nothing_leaves_while_the_bus_is_down_and_after_it_returns_only_on_the_newest_base():
    """Times by hand: down at 10, back at 20 (wait 10 s); fragment 0's newest value, version 6,
    heard at 21; fragment 1's version 4 heard at 15 (during the cut) and not since."""
    bus = BusState()
    on_5, on_6, other_on_4 = (
        pending(0, 5, [1.0], 1, 1),
        pending(0, 6, [1.0], 1, 1),
        pending(1, 4, [1.0], 1, 1),
    )
    # the first connection is not a return: nothing waits at start
    bus.came_back(1.0)
    assert bus.back_at is None and bus.sendable(on_5, 2.0)
    bus.went_down()
    assert not bus.sendable(on_6, 11.0) and not bus.sendable(other_on_4, 11.0)
    bus.heard_of(1, 4, 15.0)
    bus.came_back(20.0)
    # back, nothing heard since: wait
    assert not bus.sendable(on_6, 20.5) and not bus.sendable(other_on_4, 20.5)
    bus.heard_of(0, 6, 21.0)
    # version 6 heard since: a delta on 5 waits to be rebased, one on 6 goes
    assert not bus.sendable(on_5, 21.5) and bus.sendable(on_6, 21.5)
    # fragment 1's version 4 was heard before the return; heard again, its delta goes
    assert not bus.sendable(other_on_4, 22.0)
    bus.heard_of(1, 4, 22.5)
    assert bus.sendable(other_on_4, 23.0)
    # an older version heard later changes nothing
    bus.heard_of(0, 2, 24.0)
    assert bus.heard[0] == (6, 21.0)
    # after the wait, anything goes (the staleness bound decides)
    assert bus.sendable(on_5, 30.0) and bus.sendable(pending(0, 0, [1.0], 1, 1), 30.0)


def test_a_summed_delta_is_scaled_to_at_most_four_times_the_median_of_recent_norms():
    three = summed(
        summed(pending(0, 0, [1.0], 1, 1), pending(0, 0, [1.0], 1, 1)), pending(0, 1, [1.0], 1, 1)
    )
    assert three.parts == 3 and pending(0, 0, [1.0], 1, 1).parts == 1
    # median 2, limit 8: a norm of 10 is scaled by 0.8; 8 and below are not; nothing to measure
    # against: not scaled
    assert held_scale(10.0, [1.0, 2.0, 3.0]) == 0.8
    assert held_scale(8.0, [3.0, 1.0, 2.0]) == 1.0 and held_scale(5.0, []) == 1.0
    assert held_scale(10.0, [2.0], factor=2.0) == 0.4
