"""Following the global model without training: the merger's snapshots as an island receives them
(the snapshot bus, diffs applied, catch-up requests point to point when one does not apply), for a
process that only reads the model, such as the evaluator (`dloco evaluator`).

It holds an `observer` key: the broker lets it read the snapshot bus, the merger answers its
catch-up requests and refuses any delta from it.  It never publishes on the delta bus, so the
merger does not count it among the islands.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import zmq

from dloco import protocol
from dloco.bus.security import Security
from dloco.bus.sockets import open_socket
from dloco.island.mergers import MergerLinks, split_endpoints
from dloco.island.snapshots import Downlink, snapshot_reassembler

POLL_MS = 100


class SnapshotFollower:
    def __init__(
        self,
        name: str,
        model: str,
        snapshot_endpoint: str,
        control_endpoint: str | list[str],
        security: Security | None = None,
        bus_server: str = "broker",
        control_server: str = "merger",
        model_bytes: int = 0,
    ) -> None:
        self.name, self.model, self.control_server = name, model, control_server
        self.security = security or Security(None, name)
        self.downlink = Downlink(name, time.time_ns())
        # fragment -> (version, tensors), as taken by `current`
        self.held: dict[int, tuple[int, dict[str, np.ndarray]]] = {}
        # messages not used, by reason
        self.dropped: dict[str, int] = {}
        self.bytes_received = 0
        self._model_bytes = model_bytes
        self._stop = threading.Event()
        # guards `held` between the receiver and `current`
        self._lock = threading.Lock()
        self._context = zmq.Context()
        # one per merger shard
        self._endpoints = (snapshot_endpoint, bus_server, split_endpoints(control_endpoint))
        self._thread = threading.Thread(target=self._receive, name=f"{name}-receiver", daemon=True)
        self._thread.start()
        self.receiver_id = self._thread.native_id

    def current(self) -> dict[int, tuple[int, dict[str, np.ndarray]]]:
        """The newest value of every fragment received so far: fragment -> (version, tensors)."""
        with self._lock:
            return dict(self.held)

    def _take(self) -> None:
        """Keep only the newest value of each fragment (the downlink queues every one)."""
        arrived = self.downlink.ready(time.monotonic())
        if arrived:
            with self._lock:
                for fragment, version, tensors in arrived:
                    if version >= self.held.get(fragment, (-1, None))[0]:
                        self.held[fragment] = (version, tensors)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._context.destroy(linger=0)

    def _receive(self) -> None:
        snapshot_endpoint, bus_server, control_endpoint = self._endpoints
        sub = open_socket(self._context, zmq.SUB, snapshot_endpoint, self.security, bus_server)
        sub.setsockopt(zmq.SUBSCRIBE, b"snapshot/")
        # as an island's: one per merger shard; with a standby ("A,B"), requests go only to the
        # merger that is up
        self._mergers = MergerLinks(
            self._context, control_endpoint, self.security, self.control_server, self.name
        )
        ask_all = {
            shard: protocol.encode(self.downlink.ask_for_all(time.monotonic()))
            for shard in range(self._mergers.count)
        }
        # as island/network.py
        reassemblers = {
            socket: snapshot_reassembler(self._model_bytes)
            for socket in (sub, *self._mergers.dealers)
        }
        poller = zmq.Poller()
        for socket in reassemblers:
            poller.register(socket, zmq.POLLIN)
        while not self._stop.is_set():
            for shard in [
                shard for shard, frames in ask_all.items() if self._mergers.send(frames, shard)
            ]:
                del ask_all[shard]
            for socket in dict(poller.poll(POLL_MS)):
                frames = socket.recv_multipart(copy=False)
                self._on_frames([f.buffer for f in frames], reassemblers[socket])
            self._mergers.refresh()
            self._take()
            self.downlink.ask_for_values(
                time.monotonic(), lambda fragment: 0, self._mergers.send_for
            )
        sub.close(linger=0)
        self._mergers.close()

    def _drop(self, reason: str) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1

    def _on_frames(self, frames: list, reassembler: protocol.Reassembler) -> None:
        self.bytes_received += sum(f.nbytes for f in frames)
        try:
            message = protocol.decode(frames)
            shard = self._mergers.shard_of_sender(message.sender)
            if shard is None:
                self._drop("foreign_sender")
                return
            if not isinstance(message, protocol.SnapshotChunk):
                return
            if not self._mergers.owns(shard, message.fragment):
                self._drop("other_shard")
                return
            assembled = reassembler.add(message, time.monotonic())
        except protocol.ProtocolError as error:
            self._drop(error.reason)
            return
        if assembled is None:
            return
        if assembled.header.model != self.model:
            self._drop("foreign_model")
            return
        self.downlink.on_snapshot(assembled.header, assembled.tensors, time.monotonic())
