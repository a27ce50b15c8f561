"""The merger's backlog (merger/network/backlog.py): what its sockets deliver while its loop waits
for the etcd lease or the standby is read on, kept in order up to a byte bound, and handled after.
"""

from __future__ import annotations

import time

import zmq

from dloco.merger.network.backlog import Backlog, read_into


def test_the_backlog_keeps_messages_in_order_up_to_its_bound_and_counts_the_rest():
    handled = []

    def one(frames, peer):
        handled.append(("one", bytes(frames[0]), peer))

    def other(frames, peer):
        handled.append(("other", bytes(frames[0]), peer))

    backlog = Backlog(limit_bytes=10)
    # 4 + 4 bytes fit, 4 more would make 12 > 10, 2 more make exactly 10
    assert backlog.add(one, [b"aaaa"], "a") and backlog.add(other, [b"bb", b"bb"], None)
    assert not backlog.add(one, [b"cccc"], "c")
    assert backlog.add(one, [b"dd"], "d")
    assert (len(backlog), backlog.bytes, backlog.dropped) == (3, 10, 1)
    assert backlog.handle_all() == 3
    assert handled == [("one", b"aaaa", "a"), ("other", b"bb", None), ("one", b"dd", "d")]
    assert (len(backlog), backlog.bytes) == (0, 0)
    # room again once handled
    assert backlog.add(one, [b"eeeeeeeeee"], None) and backlog.handle_all() == 1


def test_read_into_takes_what_a_socket_holds_without_blocking():
    """A real PUB/SUB pair: 5 messages of 3 bytes sent; a bound of 12 keeps the first 4 in order
    and drops the fifth; an empty socket returns at once."""
    context = zmq.Context()
    try:
        sub = context.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        port = sub.bind_to_random_port("tcp://127.0.0.1")
        pub = context.socket(zmq.PUB)
        pub.connect(f"tcp://127.0.0.1:{port}")
        # a PUB drops what it sends before the subscription reached it: probe until one arrives
        deadline = time.monotonic() + 30
        while not sub.poll(50):
            assert time.monotonic() < deadline, "the subscription never reached the publisher"
            pub.send(b"probe")
        while sub.poll(50):
            sub.recv()
        for index in range(5):
            pub.send_multipart([b"m", str(index).encode(), b"x"])
        got = []
        backlog = Backlog(limit_bytes=12)
        dropped, deadline = 0, time.monotonic() + 30
        while len(backlog) + backlog.dropped < 5:
            assert time.monotonic() < deadline, (len(backlog), backlog.dropped)
            sub.poll(50)
            dropped += read_into(
                backlog, [(sub, lambda frames, peer: got.append(bytes(frames[1])))], limit=256
            )
        assert dropped == 1 and backlog.handle_all() == 4
        assert got == [b"0", b"1", b"2", b"3"]
        assert read_into(backlog, [(sub, None)], limit=256) == 0 and len(backlog) == 0
    finally:
        context.destroy(linger=0)
