"""What arrives while the merger's loop waits: its sockets read into a bounded backlog, handled once
the loop goes on.

The loop waits in two places: acknowledgements held while the etcd lease is not valid, and sync
mode's barrier for the standby (merger/replication/primary.py).  A socket not read for that long
fills its receive pipe; ZeroMQ then stops reading the connection, misses the peer's heartbeats and
drops it after HEARTBEAT_TIMEOUT_MS, and the reconnection can abort the process
("Assertion failed: _input_stopped", libzmq issue 3937, open in libzmq 4.3.5).  So the wait reads
on: messages up to `limit_bytes` are kept in order, those past it are dropped and counted, as
ZeroMQ's high-water mark would have dropped them (islands ask again for what a gap lost, or resend
what was never acknowledged).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence

import zmq

from dloco.bus.security import peer_of

# a handler of one message: its frames and the CURVE peer that sent it (None where unknown)
Handler = Callable[[list, "str | None"], None]


class Backlog:
    """Messages read while the loop waited, in arrival order, at most `limit_bytes` of them."""

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self.bytes = 0
        self.dropped = 0
        self._items: collections.deque = collections.deque()

    def __len__(self) -> int:
        return len(self._items)

    def add(self, handle: Handler, frames: list, peer: str | None) -> bool:
        """Keep a message for `handle`; False (and counted in `dropped`) when it does not fit."""
        size = sum(memoryview(f).nbytes for f in frames)
        if self.bytes + size > self.limit_bytes:
            self.dropped += 1
            return False
        self._items.append((handle, frames, peer, size))
        self.bytes += size
        return True

    def handle_all(self) -> int:
        """Hand every kept message to its handler, oldest first; returns how many."""
        handled = 0
        while self._items:
            handle, frames, peer, size = self._items.popleft()
            self.bytes -= size
            handle(frames, peer)
            handled += 1
        return handled


def read_into(backlog: Backlog, sockets: Sequence[tuple[zmq.Socket, Handler]], limit: int) -> int:
    """Up to `limit` messages from each socket that has some, into `backlog` (never blocks);
    returns how many it dropped."""
    before = backlog.dropped
    for socket, handle in sockets:
        for _ in range(limit):
            try:
                frames = socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            backlog.add(handle, [frame.buffer for frame in frames], peer_of(frames[-1]))
    return backlog.dropped - before
