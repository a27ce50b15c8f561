"""The outbox, pure: summing, order and bound, against hand-derived values."""

from __future__ import annotations

import numpy as np

from dloco.island.outbox import Outbox, PendingDelta, summed

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
