"""Gap tracking and retransmit buffer, by hand."""

from __future__ import annotations

import pytest

from dloco.bus.sequencing import GapTracker, RetransmitBuffer


def test_in_order_exactly_once_with_gaps_and_duplicates():
    tracker = GapTracker()
    assert tracker.receive("a", 1, 1, "m1") == ["m1"]
    # 2 is missing: hold 3
    assert tracker.receive("a", 1, 3, "m3") == []
    assert tracker.receive("a", 1, 5, "m5") == []
    assert tracker.missing("a") == [(2, 2), (4, 4)]
    assert tracker.receive("a", 1, 2, "m2") == ["m2", "m3"]
    assert tracker.receive("a", 1, 3, "m3") == [] and tracker.duplicates == 1
    assert tracker.receive("a", 1, 4, "m4") == ["m4", "m5"]
    assert tracker.missing("a") == [] and tracker.cursor("a") == (1, 5)


def test_heartbeats_reveal_tail_loss():
    tracker = GapTracker()
    tracker.receive("a", 1, 1, "m1")
    # the sender sent up to 4; we have 1
    tracker.heartbeat("a", 1, 4)
    assert tracker.missing("a") == [(2, 4)]


def test_a_restarted_sender_starts_a_new_stream_and_old_epochs_are_ignored():
    tracker = GapTracker()
    tracker.receive("a", 1, 1, "old1")
    tracker.receive("a", 1, 2, "old2")
    assert tracker.receive("a", 2, 1, "new1") == ["new1"]
    assert tracker.receive("a", 1, 3, "old3") == [] and tracker.stale == 1
    assert tracker.cursor("a") == (2, 1)


def test_held_messages_are_bounded():
    tracker = GapTracker(max_held=2)
    for seq in (3, 4, 5):
        tracker.receive("a", 1, seq, seq)
    assert tracker.overflow == 1 and tracker.missing("a") == [(1, 2), (5, 5)]


def test_held_bytes_are_bounded_per_sender_and_in_all_and_senders_in_number():
    """A sender that skips seq 1 and streams on cannot make the receiver hold more than its share:
    500 bytes per sender, 800 in all; what is dropped is asked for again with its gap."""
    tracker = GapTracker(max_held_bytes=800, max_sender_bytes=500, max_senders=2)
    for seq in range(2, 10):
        tracker.receive("a", 1, seq, f"a{seq}", nbytes=200)
    assert (
        tracker.streams["a"].held_bytes == 400
        and tracker.overflow == 6
        and tracker.missing("a") == [(1, 1), (4, 9)]
    )
    for seq in range(2, 5):
        # b holds 2 (total 800), its third is past the total
        tracker.receive("b", 1, seq, f"b{seq}", nbytes=200)
    assert tracker.held_bytes == 800 and tracker.overflow == 7
    # a third sender name: refused
    assert tracker.receive("c", 1, 1, "c1") == [] and tracker.refused_senders == 1
    assert (
        tracker.receive("a", 1, 1, "a1", nbytes=200) == ["a1", "a2", "a3"]
        and tracker.held_bytes == 400
    )
    # b restarted: its old incarnation's held bytes are freed
    tracker.receive("b", 2, 1, "b-new")
    assert tracker.held_bytes == 0 and tracker.streams["b"].held_bytes == 0


def test_retransmit_buffer_keeps_until_released_and_pushes_back_when_full():
    buffer = RetransmitBuffer(max_messages=3, max_bytes=1000)
    for seq in (1, 2, 3):
        buffer.add(seq, f"m{seq}", 100)
    assert not buffer.has_room(100)
    with pytest.raises(OverflowError, match="backpressure"):
        buffer.add(4, "m4", 100)
    assert buffer.get([(2, 3), (7, 9)]) == [(2, "m2"), (3, "m3")]
    assert buffer.release(2) == 2 and len(buffer) == 1 and buffer.nbytes == 100
    # released means acknowledged: nothing to resend
    assert buffer.get([(1, 3)]) == [(3, "m3")]
    assert buffer.has_room(900) and not buffer.has_room(901)
    # an empty buffer always takes one message
    assert RetransmitBuffer(max_bytes=10).has_room(50)


def test_a_gap_given_up_delivers_what_was_held_after_it_and_the_next_gap_stays():
    tracker = GapTracker()
    tracker.receive("a", 1, 1, "m1")
    # 2-3 and 6-7 are missing
    for seq in (4, 5, 8):
        assert tracker.receive("a", 1, seq, f"m{seq}") == []
    assert tracker.skip_gap("a") == (["m4", "m5"], (2, 3))
    assert tracker.cursor("a") == (1, 5) and tracker.missing("a") == [(6, 7)]
    assert tracker.skip_gap("a") == (["m8"], (6, 7))
    # a lost tail: given up, nothing to deliver
    tracker.heartbeat("a", 1, 10)
    assert tracker.skip_gap("a") == ([], (9, 10)) and tracker.cursor("a") == (1, 10)
    assert tracker.skip_gap("a") == ([], None) and tracker.skip_gap("nobody") == ([], None)
    assert tracker.held_bytes == 0
