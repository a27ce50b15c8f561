"""An island's (or the evaluator's) point-to-point links to the merger, one per merger shard
(protocol/shards.py): shard I folds the fragments f with f % N == I and is named `merger` (I = 0)
or `merger.I`.  Each shard's endpoint may be "A,B" (the shard and its standby: requests queue
only to the one that is up).  Owned by the receiver thread, as its sockets are."""

from __future__ import annotations

import zmq

from dloco.bus.security import Security
from dloco.bus.sockets import open_socket
from dloco.protocol import shards


def split_endpoints(endpoints: str | list[str]) -> list[str]:
    """--control-endpoint, once per shard in shard order (a single string: one merger)."""
    return [endpoints] if isinstance(endpoints, str) else list(endpoints)


class MergerLinks:
    def __init__(
        self,
        context: zmq.Context,
        endpoints: list[str],
        security: Security,
        server: str,
        identity: str,
        watch=None,
    ) -> None:
        """`watch(socket, label)`: a link watcher's, called before each dealer connects."""
        self.names = shards.names(server, len(endpoints))
        self.dealers = [
            open_socket(
                context,
                zmq.DEALER,
                endpoint,
                security,
                name,
                identity=identity,
                immediate="," in endpoint,
                before_attach=None if watch is None else lambda socket, n=name: watch(socket, n),
            )
            for endpoint, name in zip(endpoints, self.names)
        ]
        # sends refused by a full queue (each is tried again later)
        self.deferred = 0

    @property
    def count(self) -> int:
        return len(self.dealers)

    def shard_of_sender(self, sender: str) -> int | None:
        """The shard a message's sender is (None: no merger of this run)."""
        return self.names.index(sender) if sender in self.names else None

    def owns(self, shard: int, fragment: int) -> bool:
        return shards.shard_of(fragment, self.count) == shard

    def send(self, frames: list, shard: int) -> bool:
        """Point to point to one shard, never blocking: False when its queue is full."""
        try:
            self.dealers[shard].send_multipart(frames, copy=False, flags=zmq.NOBLOCK)
            return True
        except zmq.Again:
            self.deferred += 1
            return False

    def send_for(self, frames: list, fragment: int) -> bool:
        """To the shard that folds `fragment`."""
        return self.send(frames, shards.shard_of(fragment, self.count))

    def close(self) -> None:
        for dealer in self.dealers:
            dealer.close(linger=0)
