"""Free loopback ports for processes started on this machine."""

from __future__ import annotations

import socket


def free_ports(count: int) -> list[int]:
    """`count` distinct free loopback ports, held open together so the OS cannot hand one out
    twice."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()
