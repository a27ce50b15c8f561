"""The merger's snapshot socket queues every fragment's full fp32 snapshot at once
(merger/wiring.py `snapshot_send_hwm`): with ZeroMQ's default of 1000 messages, a burst of a
model's full snapshots above ~260 M parameters (1 MiB chunks) was partly dropped.  The figure by
hand, and on the sockets a merger opens; and a burst of 3,000 chunks through a PUB with that queue
reaches a subscriber whole."""

from __future__ import annotations

import structlog
import zmq

from dloco.cluster.ports import free_ports
from dloco.merger.settings import ServiceConfig
from dloco.merger.wiring import open_sockets, snapshot_send_hwm


def test_the_queue_holds_a_whole_model_of_full_snapshots_by_hand():
    # no model: ZeroMQ's default
    assert snapshot_send_hwm(0, 1 << 20) == 1000
    # 350 M float32 values in 1 MiB chunks: 1,335.1, so 1,336 messages
    assert snapshot_send_hwm(350_000_000, 1 << 20) == 1000 + 1336
    assert snapshot_send_hwm(256, 1024) == 1001


def test_a_merger_opens_its_snapshot_socket_with_that_queue(tmp_path):
    ports = free_ports(3)
    config = ServiceConfig(
        run_dir=tmp_path,
        delta_endpoint=f"tcp://127.0.0.1:{ports[0]}",
        snapshot_endpoint=f"@tcp://127.0.0.1:{ports[1]}",
        control_endpoint=f"@tcp://127.0.0.1:{ports[2]}",
        max_chunk_bytes=1 << 16,
    )
    sockets = open_sockets(config, 2, structlog.get_logger(), values=1 << 24)
    try:
        assert sockets.snapshot_pub.getsockopt(zmq.SNDHWM) == 1000 + 1024
    finally:
        sockets.context.destroy(linger=0)


def test_a_burst_beyond_zeromqs_default_reaches_a_subscriber_whole():
    """3,000 chunks of 64 KiB sent at once, as a fragment's full snapshot is: the subscriber (its
    own queue unbounded, as an island's) gets every one."""
    context = zmq.Context()
    port = free_ports(1)[0]
    count = 3000
    try:
        pub = context.socket(zmq.PUB)
        pub.setsockopt(zmq.SNDHWM, snapshot_send_hwm(count * (1 << 14), 1 << 16))
        pub.bind(f"tcp://127.0.0.1:{port}")
        sub = context.socket(zmq.SUB)
        sub.setsockopt(zmq.RCVHWM, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(f"tcp://127.0.0.1:{port}")
        # the subscription has arrived once a probe gets through
        while True:
            pub.send(b"probe")
            if sub.poll(100):
                while sub.poll(200):
                    sub.recv()
                break
        payload = bytes(1 << 16)
        for _ in range(count):
            pub.send(payload, copy=False)
        received = 0
        while received < count and sub.poll(30_000):
            sub.recv()
            received += 1
        assert received == count
    finally:
        context.destroy(linger=0)
