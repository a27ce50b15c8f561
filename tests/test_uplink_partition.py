"""Work held across a partition, on real ZeroMQ sockets: while the delta bus is down the uplink
sends heartbeats but no delta (what the island trains is summed in the outbox); once it is back a
delta waits until the island has adopted the newest value heard of since and rebased it onto it,
then goes out on that base, its steps whole.  Bounded by messages received, never by seconds."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import zmq

from dloco import protocol
from dloco.island.config import SyncConfig
from dloco.island.outbox import PendingDelta
from dloco.island.shaper import LinkShaper
from dloco.island.uplink import Uplink


def delta(fragment: int, base: int, value: float, steps: int) -> PendingDelta:
    return PendingDelta(fragment, base, {"w": np.full(8, value, np.float32)}, steps, steps * 10)


def received(sub: zmq.Socket, heartbeats: int) -> list:
    """Every message until `heartbeats` heartbeats have come (each uplink loop sends one per
    HEARTBEAT_S): whatever was due to be sent by then has been."""
    messages, beats = [], 0
    while beats < heartbeats:
        assert sub.poll(30_000), "nothing on the bus for 30 s"
        message = protocol.decode(sub.recv_multipart())
        beats += isinstance(message, protocol.Heartbeat)
        messages.append(message)
    return [m for m in messages if isinstance(m, protocol.DeltaChunk)]


# Over 60 lines: one partition walked through in order, on the same sockets.
@pytest.mark.timeout(120)
def test_deltas_wait_out_a_partition_summed_and_leave_rebased_on_the_newest_value():
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    pub = context.socket(zmq.PUB)
    pub.connect(f"tcp://127.0.0.1:{port}")
    stop = threading.Event()
    uplink = Uplink("isl", "m", 1, SyncConfig(fragments=2, interval=4), LinkShaper(None), stop)
    thread = threading.Thread(target=uplink.run, args=(pub,), daemon=True)
    thread.start()
    try:
        # the subscription has reached the PUB once a heartbeat arrives
        received(sub, 1)
        uplink.on_bus(True, time.monotonic())
        uplink.publish(delta(0, 3, 1.0, 4))
        (chunk,) = received(sub, 2)
        assert (chunk.fragment, chunk.base_version, chunk.steps) == (0, 3, 4)
        # the cut: two rounds of both fragments trained meanwhile, summed, nothing sent
        uplink.on_bus(False, time.monotonic())
        # fragment 0 five rounds (its sum, norm 5 x 2.83, is over 4x its last delta's: scaled down
        # to that), fragment 1 two (no delta of it sent yet: nothing to measure against)
        for _ in range(5):
            uplink.publish(delta(0, 3, 1.0, 4))
        for _ in range(2):
            uplink.publish(delta(1, 3, 2.0, 4))
        assert received(sub, 3) == [] and uplink.summed == 5 and len(uplink.outbox) == 2
        # healed: the merger has folded on meanwhile; nothing goes before the island has heard
        uplink.on_bus(True, time.monotonic())
        assert received(sub, 2) == []
        uplink.heard_of("merger", 1, 0, 9, time.monotonic())
        uplink.heard_of("merger", 1, 1, 8, time.monotonic())
        # heard of, not yet adopted: still held
        assert received(sub, 2) == []
        # the island adopts fragment 1's version 8: its delta goes, on that base, 8 steps
        uplink.rebase_unsent(1, 8)
        (chunk,) = received(sub, 2)
        assert (chunk.fragment, chunk.base_version, chunk.steps, chunk.tokens) == (1, 8, 8, 80)
        uplink.rebase_unsent(0, 9)
        (chunk,) = received(sub, 2)
        assert (chunk.fragment, chunk.base_version, chunk.steps) == (0, 9, 20)
        assert uplink.rebased == 2 and uplink.deltas_sent == 3 and uplink.scaled == 1
        # results count the steps their deltas carried: 4 folded, 8 rejected (1 and 2 are the last
        # two delta ids), and 8 whose result is yet to come
        ack = protocol.Ack(
            sender="merger",
            epoch=1,
            seq=1,
            cursors=(),
            results=(
                protocol.DeltaResult("isl", 1, 1, 0, "folded", 4, ""),
                protocol.DeltaResult("isl", 1, 2, 1, "rejected", 9, "stale"),
            ),
        )
        uplink.on_ack(ack)
        uplink.on_ack(ack)
        assert uplink.step_results == {"folded": 4, "rejected": 8}
    finally:
        stop.set()
        uplink.wake()
        thread.join(timeout=10)
        pub.close(linger=0)
        sub.close(linger=0)
        context.term()
