"""Per-message log lines once a second per key (telemetry/ratelimit.py), against hand-derived
clocks."""

from __future__ import annotations

import pytest

from dloco.telemetry.ratelimit import Throttle, ThrottledLog


def test_one_event_per_interval_per_key_with_the_count_left_out():
    throttle = Throttle(interval_s=1.0)
    assert throttle.admit("a", 0.0) == 0
    assert throttle.admit("a", 0.5) is None and throttle.admit("a", 0.9) is None
    # another key is not held back
    assert throttle.admit("b", 0.9) == 0
    # a second on: two were left out since
    assert throttle.admit("a", 1.0) == 2
    assert throttle.admit("a", 1.5) is None
    assert throttle.admit("a", 5.0) == 1


def test_the_keys_held_are_bounded():
    throttle = Throttle(interval_s=10.0, max_keys=2)
    assert [throttle.admit(key, 0.0) for key in ("a", "b", "c")] == [0, 0, 0]
    # a was dropped for c: admitted again, its count lost
    assert throttle.admit("a", 1.0) == 0
    assert throttle.admit("c", 1.0) is None
    with pytest.raises(ValueError):
        Throttle(interval_s=0)


class Recorder:
    def __init__(self):
        self.lines = []

    def warning(self, event, **fields):
        self.lines.append((event, fields))

    info = warning


def test_a_throttled_log_keys_by_event_peer_and_reason():
    now = [0.0]
    recorder = Recorder()
    log = ThrottledLog(recorder, clock=lambda: now[0])
    for _ in range(3):
        log.warning("message_rejected", peer="x", reason="epoch_ahead", epoch=1)
    log.warning("message_rejected", peer="x", reason="sender_mismatch")
    log.warning("message_rejected", peer="y", reason="epoch_ahead")
    log.info("hello", peer="x")
    now[0] = 2.0
    log.warning("message_rejected", peer="x", reason="epoch_ahead", epoch=2)
    assert recorder.lines == [
        ("message_rejected", {"peer": "x", "reason": "epoch_ahead", "epoch": 1}),
        ("message_rejected", {"peer": "x", "reason": "sender_mismatch"}),
        ("message_rejected", {"peer": "y", "reason": "epoch_ahead"}),
        ("hello", {"peer": "x"}),
        ("message_rejected", {"peer": "x", "reason": "epoch_ahead", "epoch": 2, "left_out": 2}),
    ]


def test_a_flush_says_what_was_left_out_since():
    now = [0.0]
    recorder = Recorder()
    log = ThrottledLog(recorder, clock=lambda: now[0])
    for _ in range(4):
        log.warning("message_rejected", peer="x", reason="epoch_ahead")
    log.info("hello", peer="y")
    log.flush()
    assert recorder.lines[-1] == (
        "message_rejected",
        {"peer": "x", "reason": "epoch_ahead", "left_out": 3, "flushed": True},
    )
    log.flush()
    # nothing more left out
    assert len(recorder.lines) == 3
