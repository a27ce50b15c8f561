"""The sockets of the primary's replication stream (merger/replication/primary.py), each owned by
one thread.

`StandbyChannel` is the stream thread's: a ROUTER that standbys connect their DEALER to (CURVE
domain ``replication``: mergers only), messages decoded strictly (a bad one is counted, logged
and dropped) and sent without blocking (a full queue or a gone peer is counted: the stream
resumes from the same record next turn); and a DEALER to the configured peer, which tells an old
primary come back that it is fenced.  `Wakeup` is an inproc pair through which another thread
(the merger's loop, the digest hasher) wakes the stream thread from its poll.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator

import zmq

from dloco.bus.security import Security
from dloco.bus.sockets import open_socket
from dloco.merger.replication import wire
from dloco.merger.replication.wire import ReplicationError, decode, encode
from dloco.merger.settings import ReplicationConfig

# messages taken per turn of the stream thread before it goes on to its other work (as many as it
# sends: stream.SEND_BATCH)
RECEIVE_BATCH = 256


class StandbyChannel:
    """The ROUTER standbys follow through, and the DEALER that fences the peer."""

    def __init__(
        self,
        context: zmq.Context,
        config: ReplicationConfig,
        security: Security,
        sender: str,
        log,
        counters: collections.Counter[str],
    ) -> None:
        self.log, self.counters = log, counters
        self.socket = open_socket(
            context,
            zmq.ROUTER,
            config.endpoint,
            security,
            sender,
            domain="replication",
            send_hwm=0,
            # WINDOW_BYTES bounds it
            report=lambda message: log.warning("auth_refused", detail=message),
        )
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.fence = None
        # tell the peer, should it be an old primary come back, that it is fenced
        if config.peer:
            self.fence = open_socket(
                context, zmq.DEALER, config.peer, security, sender, immediate=True
            )

    def receive(self) -> Iterator[tuple[bytes, bytes, dict]]:
        """The messages waiting (RECEIVE_BATCH at most), one at a time: (identity, kind, body)."""
        for _ in range(RECEIVE_BATCH):
            try:
                identity, *frames = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                kind, body, _ = decode(frames)
            except ReplicationError as error:
                self.counters[f"rejected/{error.reason}"] += 1
                self.log.warning(
                    "replication_message_rejected", reason=error.reason, detail=str(error)[:200]
                )
                continue
            yield identity, kind, body

    def send(self, identity: bytes, frames: list) -> bool:
        try:
            self.socket.send_multipart([identity, *frames], zmq.NOBLOCK, copy=False)
            return True
        # its queue is full: the stream resumes from the same record next turn
        except zmq.Again:
            self.counters["send_full"] += 1
        # EHOSTUNREACH: it has gone; it says `follow` again when back
        except zmq.ZMQError:
            self.counters["send_unroutable"] += 1
        return False

    def fence_peer(self, epoch: int, term: int) -> None:
        """Tell the peer, if one is configured, that this primary's epoch holds."""
        if self.fence is None:
            return
        try:
            self.fence.send_multipart(
                encode(wire.FENCE, {"epoch": epoch, "term": term}), zmq.NOBLOCK
            )
        # nobody there: nothing to fence
        except zmq.ZMQError:
            pass

    def close(self) -> None:
        for socket in (self.socket, self.fence):
            if socket is not None:
                socket.close(linger=0)


class Wakeup:
    """An inproc PAIR pair: `signal()` on one thread wakes another that polls `socket`."""

    def __init__(self, context: zmq.Context, endpoint: str) -> None:
        self.socket = context.socket(zmq.PAIR)
        self.socket.bind(endpoint)
        # the signalling thread's own end (a socket per thread)
        self._sender = context.socket(zmq.PAIR)
        self._sender.connect(endpoint)

    def signal(self) -> None:
        try:
            self._sender.send(b"", zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    def close(self, polled_end: bool = True) -> None:
        """Close the signalling end, and the polled one unless its thread still runs."""
        self._sender.close(linger=0)
        if polled_end:
            self.socket.close(linger=0)
