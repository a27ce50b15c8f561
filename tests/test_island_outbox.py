"""The outbox, pure: summing, order and bound, against hand-derived values."""

from __future__ import annotations

import numpy as np

from island.outbox import Outbox, PendingDelta, summed

F32 = np.float32


def pending(fragment: int, base: int, values: list[float], steps: int, tokens: int) -> PendingDelta:
    return PendingDelta(fragment, base, {"w": np.array(values, F32)}, steps, tokens)


def test_a_newer_delta_is_summed_onto_the_unsent_one_keeping_the_newer_base():
    # older: base 3, [1, 2], 5 steps, 640 tokens; newer: base 4, [0.5, -2], 3 steps, 384 tokens
    total = summed(pending(0, 3, [1.0, 2.0], 5, 640), pending(0, 4, [0.5, -2.0], 3, 384))
    assert total.fragment == 0 and total.base_version == 4 and total.steps == 8 and total.tokens == 1024
    assert total.delta["w"].tolist() == [1.5, 0.0] and total.delta["w"].dtype == F32


def test_the_outbox_holds_one_delta_per_fragment_in_the_order_they_became_pending():
    outbox = Outbox()
    assert outbox.take() is None and len(outbox) == 0
    assert outbox.put(pending(2, 0, [1.0], 1, 10)) is False
    assert outbox.put(pending(0, 0, [2.0], 1, 10)) is False
    assert outbox.put(pending(2, 1, [4.0], 2, 20)) is True  # summed onto fragment 2's: no new entry, same place in line
    assert len(outbox) == 2
    first, second = outbox.take(), outbox.take()
    assert (first.fragment, first.base_version, first.delta["w"].tolist(), first.steps, first.tokens) == (2, 1, [5.0], 3, 30)
    assert (second.fragment, second.delta["w"].tolist()) == (0, [2.0])
    assert outbox.take() is None and len(outbox) == 0


def test_the_outbox_never_holds_more_than_one_delta_per_fragment():
    outbox, fragments = Outbox(), 4
    summed_count = sum(outbox.put(pending(step % fragments, step, [1.0], 1, 1)) for step in range(100))
    assert len(outbox) == fragments and summed_count == 100 - fragments
    taken = [outbox.take() for _ in range(fragments)]
    assert [d.fragment for d in taken] == [0, 1, 2, 3] and all(d.steps == 25 and d.delta["w"].tolist() == [25.0] for d in taken)
