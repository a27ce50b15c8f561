"""An island's (or the evaluator's) point-to-point links to the merger, one per merger shard
(protocol/shards.py): shard I folds the fragments f with f % N == I and is named `merger` (I = 0)
or `merger.I`.  Each shard's endpoint may be "A,B" (the shard and its standby): one DEALER per
endpoint, and requests go only to one whose link is up (the primary binds its control socket, the
standby does not until it takes over).  Owned by the receiver thread, as its sockets are.

Not ZMQ_IMMEDIATE, which would do that choosing inside one DEALER: libzmq 4.3.5 drops such a
socket's pipe the moment its peer goes, and aborts the process ('Assertion failed: !_more',
src/fq.cpp) when a multipart message (a catch-up reply's chunk) was half read from it.  The links'
state comes from each DEALER's socket monitor instead (the ZMTP handshake done, or the link
down), read here and passed on to the island's link watcher."""

from __future__ import annotations

import zmq
from zmq.utils.monitor import recv_monitor_message

from dloco.bus.monitor import LinkWatcher
from dloco.bus.security import Security
from dloco.bus.sockets import open_socket
from dloco.protocol import shards

_UP, _DOWN = zmq.EVENT_HANDSHAKE_SUCCEEDED, zmq.EVENT_DISCONNECTED


def split_endpoints(endpoints: str | list[str]) -> list[str]:
    """--control-endpoint, once per shard in shard order (a single string: one merger)."""
    return [endpoints] if isinstance(endpoints, str) else list(endpoints)


class _Pair:
    """One shard's DEALERs to "A,B": each with its monitor, and when its link last came up."""

    def __init__(self) -> None:
        self.dealers: list[zmq.Socket] = []
        self.monitors: list[zmq.Socket] = []
        # per dealer: the count of link changes seen when it last came up (None: down)
        self.up: list[int | None] = []
        self.changes = 0

    def watch(self, dealer: zmq.Socket) -> None:
        """Before `dealer` connects (its first handshake must not be missed)."""
        self.dealers.append(dealer)
        self.monitors.append(dealer.get_monitor_socket(_UP | _DOWN))
        self.up.append(None)

    def refresh(self, label: str, links: LinkWatcher | None) -> None:
        """Take the links' changes so far (each passed on to `links`, labelled `label`)."""
        for index, monitor in enumerate(self.monitors):
            while True:
                try:
                    event = recv_monitor_message(monitor, zmq.NOBLOCK)
                except zmq.Again:
                    break
                # a monitor message this pyzmq cannot parse
                except ValueError:
                    continue
                if event.get("event") not in (_UP, _DOWN):
                    continue
                self.changes += 1
                self.up[index] = self.changes if event["event"] == _UP else None
                if links is not None:
                    links.on_event(label, event)

    def current(self) -> zmq.Socket | None:
        """The DEALER whose link came up last of those up (a new primary binds anew)."""
        up = [(at, index) for index, at in enumerate(self.up) if at is not None]
        return self.dealers[max(up)[1]] if up else None

    def close(self) -> None:
        for monitor in self.monitors:
            monitor.close(linger=0)


class MergerLinks:
    def __init__(
        self,
        context: zmq.Context,
        endpoints: list[str],
        security: Security,
        server: str,
        identity: str,
        links: LinkWatcher | None = None,
    ) -> None:
        """`links`: the island's link watcher, told of each DEALER's link coming up and going
        down (labelled with its shard's name)."""
        self.names = shards.names(server, len(endpoints))
        self.links = links
        self.shards: list[zmq.Socket | _Pair] = []
        for endpoint, name in zip(endpoints, self.names):
            parts = endpoint.split(",")
            pair = _Pair() if len(parts) > 1 else None
            dealers = [
                open_socket(
                    context,
                    zmq.DEALER,
                    part,
                    security,
                    name,
                    identity=identity,
                    before_attach=self._watcher(pair, name),
                )
                for part in parts
            ]
            self.shards.append(dealers[0] if pair is None else pair)
        # every DEALER, for the receiver's poller
        self.dealers = [
            dealer
            for shard in self.shards
            for dealer in (shard.dealers if isinstance(shard, _Pair) else [shard])
        ]
        # sends refused by a full queue, or with no merger of a pair up (each is tried again later)
        self.deferred = 0

    def _watcher(self, pair: _Pair | None, name: str):
        """What sees a DEALER before it connects: its pair (which reads its monitor and passes the
        link's changes on), else the island's link watcher, if any."""
        if pair is not None:
            return pair.watch
        if self.links is not None:
            return lambda socket: self.links.watch(socket, name)
        return None

    @property
    def count(self) -> int:
        return len(self.shards)

    def shard_of_sender(self, sender: str) -> int | None:
        """The shard a message's sender is (None: no merger of this run)."""
        return self.names.index(sender) if sender in self.names else None

    def owns(self, shard: int, fragment: int) -> bool:
        return shards.shard_of(fragment, self.count) == shard

    def refresh(self) -> None:
        """Read the pairs' link changes (they reach the link watcher from here)."""
        for name, shard in zip(self.names, self.shards):
            if isinstance(shard, _Pair):
                shard.refresh(name, self.links)

    def send(self, frames: list, shard: int) -> bool:
        """Point to point to one shard, never blocking: False when its queue is full (or, with a
        standby, when neither merger is up)."""
        link = self.shards[shard]
        if isinstance(link, _Pair):
            link.refresh(self.names[shard], self.links)
            link = link.current()
        try:
            if link is None:
                raise zmq.Again()
            link.send_multipart(frames, copy=False, flags=zmq.NOBLOCK)
            return True
        except zmq.Again:
            self.deferred += 1
            return False

    def send_for(self, frames: list, fragment: int) -> bool:
        """To the shard that folds `fragment`."""
        return self.send(frames, shards.shard_of(fragment, self.count))

    def close(self) -> None:
        for shard in self.shards:
            if isinstance(shard, _Pair):
                shard.close()
        for dealer in self.dealers:
            dealer.close(linger=0)
