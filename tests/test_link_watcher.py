"""The link watcher (bus/monitor.py) on real sockets over loopback: a connecting socket's link
comes up, goes down when the peer goes away, and comes back when it returns, each counted and
reported.  The half-open case (packets dropped, no reset) needs a partition:
tests/test_network_faults.py."""

from __future__ import annotations

import time

import zmq

from dloco.bus.monitor import LinkWatcher
from dloco.bus.security import Security
from dloco.bus.sockets import open_socket


def _until(condition, what: str, limit_s: float = 30.0) -> None:
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {limit_s} s: {what}"
        time.sleep(0.01)


def test_a_link_is_counted_up_down_and_up_again_with_its_endpoint():
    context, reports = zmq.Context(), []
    watcher = LinkWatcher(lambda event, label, endpoint: reports.append((event, label, endpoint)))
    try:
        server = context.socket(zmq.ROUTER)
        port = server.bind_to_random_port("tcp://127.0.0.1")
        client = open_socket(
            context,
            zmq.DEALER,
            f"tcp://127.0.0.1:{port}",
            Security(None, "island"),
            "merger",
            before_attach=lambda socket: watcher.watch(socket, "merger"),
        )
        _until(lambda: watcher.summary() == {"merger": {"up": 1, "down": 0}}, "the link up")
        server.close(linger=0)
        _until(
            lambda: watcher.summary()["merger"]["down"] == 1, "the link down once its peer has gone"
        )
        server = context.socket(zmq.ROUTER)
        server.bind(f"tcp://127.0.0.1:{port}")
        _until(
            lambda: watcher.summary()["merger"]["up"] == 2,
            "the link back once its peer is",
            # ZeroMQ reconnects by itself
        )
        assert [(event, label) for event, label, _ in reports][:3] == [
            ("link_up", "merger"),
            ("link_down", "merger"),
            ("link_up", "merger"),
        ]
        assert all(endpoint == f"tcp://127.0.0.1:{port}" for *_, endpoint in reports)
        server.close(linger=0)
        client.close(linger=0)
    finally:
        watcher.stop()
        context.destroy(linger=0)
