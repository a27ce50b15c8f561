"""The island's network side: what the training loop calls, and the two threads behind it.

The loop calls `publish` and `snapshots`; neither waits.  Each thread owns its sockets (ZeroMQ
sockets are not thread-safe):
- publisher: the uplink's loop (island/uplink.py) on a PUB to the delta bus;
- receiver: a SUB on the snapshot bus (snapshots, acks) and a DEALER to the merger's ROUTER, one
  per merger shard (island/mergers.py; requests for values, resends, probes).  It hands acks and
resend requests to the uplink and
  reassembled snapshots to the downlink (island/snapshots.py), and sends what they ask for.  A
  snapshot of another model than the island's is not adopted: its layout is kept (`foreign`), for
  the join to refuse that merger by name.
A LinkWatcher (bus/monitor.py) counts and logs each socket's connections going down (a reset, or a
half-open link the heartbeats gave up on) and coming back (`links` in the island's summary).
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time

import numpy as np
import zmq

from dloco import protocol
from dloco.bus.monitor import LinkWatcher
from dloco.bus.security import Security
from dloco.bus.sockets import open_socket
from dloco.island.config import SyncConfig
from dloco.island.mergers import MergerLinks, split_endpoints
from dloco.island.outbox import PendingDelta
from dloco.island.shaper import LinkShaper
from dloco.island.snapshots import Downlink, snapshot_reassembler
from dloco.island.uplink import Uplink
from dloco.protocol import shards
from dloco.telemetry.ratelimit import ThrottledLog

POLL_MS = 50


@dataclasses.dataclass(frozen=True)
class Route:
    """Where a socket connects, and the key name of the server it reaches there (CURVE)."""

    endpoint: str
    server: str


class NetworkLink:
    """`uplink` and `downlink` are the emulated links' shapers (None: unlimited)."""

    # Over 60 lines: the link's state, set up in one place before its two threads start (both read
    # all of it).
    def __init__(
        self,
        name: str,
        model: str,
        sync: SyncConfig,
        delta_endpoint: str,
        snapshot_endpoint: str,
        control_endpoint: str | list[str],
        uplink: LinkShaper | None = None,
        downlink: LinkShaper | None = None,
        log=None,
        security: Security | None = None,
        bus_server: str = "broker",
        control_server: str = "merger",
        model_bytes: int = 0,
    ) -> None:
        self.name, self.model, self.log = name, model, log
        self._model_bytes = model_bytes
        self.security = security or Security(None, name)
        self.delta_route, self.snapshot_route = (
            Route(delta_endpoint, bus_server),
            Route(snapshot_endpoint, bus_server),
        )
        # one per merger shard
        self.control_endpoints, self.control_server = (
            split_endpoints(control_endpoint),
            control_server,
        )
        self.epoch = time.time_ns()
        self._stop = threading.Event()
        # One record of each merger's newest epoch, whether heard on a snapshot or an ack: an old
        # primary that goes on alone after a split may still answer a probe point to point, past the
        # broker's fencing; its ack must not settle a delta once the new primary's snapshots have
        # come.
        epochs: dict[str, int] = {}
        self.uplink = Uplink(
            name,
            model,
            self.epoch,
            sync,
            uplink or LinkShaper(None),
            self._stop,
            shards=len(self.control_endpoints),
            merger_epochs=epochs,
        )
        self.downlink = Downlink(name, self.epoch, merger_epochs=epochs)
        self._downlink_shaper = downlink or LinkShaper(None)
        self.bytes_received = 0
        # of which full values (the model at the start, catch-ups): not a diff of one
        self.bytes_received_values = 0
        # Snapshots of another model than this island's (a merger started from another task): never
        # adopted; fragment -> {path: shape}, so that joining refuses it by name (IslandLoop.join).
        # Replaced whole by the receiver thread, never changed in place: the loop reads a consistent
        # value.
        self.foreign: dict[int, dict[str, tuple[int, ...]]] = {}
        self._link_log = ThrottledLog(log) if log is not None else None
        self.links = LinkWatcher(self._link_changed)
        self._context = zmq.Context()
        self._threads = [
            threading.Thread(target=self._publisher, name=f"{name}-publisher", daemon=True),
            threading.Thread(target=self._receiver, name=f"{name}-receiver", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    # ---- called by the training loop (never blocks) -------------------------------------------
    def publish(
        self,
        fragment: int,
        base_version: int,
        delta: dict[str, np.ndarray],
        steps: int,
        tokens: int,
    ) -> None:
        self.uplink.publish(PendingDelta(fragment, base_version, delta, steps, tokens))

    def take_residuals(self, paths) -> dict[str, np.ndarray]:
        return self.uplink.take_residuals(paths)

    def rebase_unsent(self, fragment: int, version: int) -> None:
        self.uplink.rebase_unsent(fragment, version)

    def report_trained(self, tokens: int) -> None:
        """This life's trained tokens, for the heartbeats (the merger sums them, PROTOCOL.md
        §6.1)."""
        self.uplink.trained_tokens = tokens

    @property
    def cluster_tokens(self) -> int:
        """The cluster's trained tokens, as the merger's acks last said (0 before any)."""
        return self.uplink.heard_tokens

    def snapshots(self) -> list[tuple[int, int, dict[str, np.ndarray]]]:
        """Snapshots that have fully arrived (by the downlink's clock), oldest first: (fragment,
        version, tensors)."""
        return self.downlink.ready(time.monotonic())

    def drain(self, timeout_s: float) -> bool:
        """At the end of a run: wait until every delta is sent and settled (folded or rejected),
        at most `timeout_s`.  Returns whether everything was."""
        return self.uplink.drain(timeout_s)

    def close(self) -> None:
        self._stop.set()
        self.uplink.wake()
        for thread in self._threads:
            thread.join(timeout=5)
        self.links.stop()
        self._context.destroy(linger=0)

    @property
    def bytes_sent(self) -> int:
        return self.uplink.bytes_sent

    @property
    def deltas_sent(self) -> int:
        return self.uplink.deltas_sent

    @property
    def summed(self) -> int:
        """Deltas summed onto an unsent one of their fragment in the outbox (island/outbox.py)."""
        return self.uplink.summed

    @property
    def results(self) -> collections.Counter[str]:
        return self.uplink.results

    def _sockets(self) -> list[tuple[str, str]]:
        names = shards.names(self.control_server, len(self.control_endpoints))
        return [
            ("delta-bus", self.delta_route.endpoint),
            ("snapshot-bus", self.snapshot_route.endpoint),
            *zip(names, self.control_endpoints),
        ]

    def unreached(self) -> list[str]:
        """The endpoints (and their sockets) that never answered a connection: what a host that
        cannot reach the hub names."""
        links = self.links
        with links.lock:
            return [
                f"{endpoint} ({label})"
                for label, endpoint in self._sockets()
                if not links.up[label] and not links.reached[label]
            ]

    def refused(self) -> list[str]:
        """The endpoints that answered but refused every handshake (a key the hub does not
        admit)."""
        links = self.links
        with links.lock:
            return [
                f"{endpoint} ({label})"
                for label, endpoint in self._sockets()
                if not links.up[label] and links.refused[label]
            ]

    @property
    def step_results(self) -> collections.Counter[str]:
        """The inner steps of settled deltas: folded, rejected, unknown."""
        return self.uplink.step_results

    @property
    def unfolded(self) -> collections.Counter[int]:
        return self.uplink.unfolded

    @property
    def downlink_results(self) -> collections.Counter[str]:
        return self.downlink.results

    @property
    def adopted_epochs(self) -> dict[str, list[int]]:
        """Per merger (shard), the epochs whose snapshots this island adopted, in order."""
        # copied whole first: the receiver adds
        return {
            sender: list(epochs) for sender, epochs in dict(self.downlink.adopted_epochs).items()
        }

    # ---- the threads ---------------------------------------------------------------------------
    def _link_changed(self, event: str, socket: str, endpoint: str) -> None:
        """`link_up` / `link_down` of one of the island's sockets (the link watcher's thread, or
        the receiver's for a merger and its standby), one at a time."""
        if socket == "delta-bus":
            self.uplink.on_bus(event == "link_up", time.monotonic())
        if self._link_log is not None:
            self._link_log.info(event, socket=socket, endpoint=endpoint)

    def _publisher(self) -> None:
        pub = open_socket(
            self._context,
            zmq.PUB,
            self.delta_route.endpoint,
            self.security,
            self.delta_route.server,
            send_hwm=self.uplink.sync.send_hwm,
            before_attach=lambda socket: self.links.watch(socket, "delta-bus"),
        )
        self.uplink.run(pub)
        pub.close(linger=0)

    def _receiver(self) -> None:
        sub = open_socket(
            self._context,
            zmq.SUB,
            self.snapshot_route.endpoint,
            self.security,
            self.snapshot_route.server,
            before_attach=lambda socket: self.links.watch(socket, "snapshot-bus"),
        )
        sub.setsockopt(zmq.SUBSCRIBE, b"snapshot/")
        sub.setsockopt(zmq.SUBSCRIBE, b"ack")
        # the merger (each shard) routes resend requests to us by name; with a standby, to both
        # mergers' control sockets ("A,B"), sending only to one that is up (the primary binds its
        # own)
        self._mergers = MergerLinks(
            self._context,
            self.control_endpoints,
            self.security,
            self.control_server,
            self.name,
            links=self.links,
        )
        ask_all = {
            shard: protocol.encode(self.downlink.ask_for_all(time.monotonic()))
            for shard in range(self._mergers.count)
        }
        # Bus and point-to-point snapshots reassemble apart: a catch-up reply (exact: fp32 or the
        # full snapshots' codec) and a bus snapshot of one version share a key, and chunks of one
        # must not meet the other's.
        reassemblers = {
            socket: snapshot_reassembler(self._model_bytes)
            for socket in (sub, *self._mergers.dealers)
        }
        poller = zmq.Poller()
        for socket in reassemblers:
            poller.register(socket, zmq.POLLIN)
        streams = self.uplink.streams
        while not self._stop.is_set():
            for shard in [
                shard for shard, frames in ask_all.items() if self._mergers.send(frames, shard)
            ]:
                del ask_all[shard]
            for socket in dict(poller.poll(POLL_MS)):
                frames = socket.recv_multipart(copy=False)
                self._on_frames([f.buffer for f in frames], reassemblers[socket])
            self._mergers.refresh()
            now = time.monotonic()
            self.uplink.probe(now, self._mergers.send)
            self.downlink.ask_for_values(
                now, lambda f: streams[shards.shard_of(f, len(streams))].seq, self._mergers.send_for
            )
        sub.close(linger=0)
        self._mergers.close()

    @property
    def sends_deferred(self) -> int:
        """Point-to-point sends refused by a full queue (each is tried again later)."""
        mergers = getattr(self, "_mergers", None)
        return mergers.deferred if mergers is not None else 0

    def _on_frames(self, frames: list, reassembler: protocol.Reassembler) -> None:
        nbytes = sum(f.nbytes for f in frames)
        self.bytes_received += nbytes
        _, arrives = self._downlink_shaper.schedule(nbytes, time.monotonic())
        try:
            message = protocol.decode(frames)
            shard = self._mergers.shard_of_sender(message.sender)
            # only the merger (its shards) speaks to islands (the broker admits no other publisher)
            if shard is None:
                self.uplink.count_dropped("foreign_sender")
                return
            if isinstance(message, protocol.Ack):
                self.uplink.on_ack(message, shard)
                return
            if isinstance(message, protocol.ResendRequest):
                self.uplink.resend(message, lambda again: self._mergers.send(again, shard), shard)
                return
            if not isinstance(message, protocol.SnapshotChunk):
                return
            # a shard speaks for its own fragments only
            if not self._mergers.owns(shard, message.fragment):
                self.uplink.count_dropped("other_shard")
                return
            if message.base_version is None:
                self.bytes_received_values += nbytes
            assembled = reassembler.add(message, time.monotonic())
        except protocol.ProtocolError as error:
            self.uplink.count_dropped(error.reason)
            return
        if assembled is not None and assembled.header.model != self.model:
            self.foreign = {
                **self.foreign,
                assembled.header.fragment: {
                    p: tuple(np.shape(v)) for p, v in assembled.tensors.items()
                },
            }
        elif assembled is not None:
            sender = assembled.header.sender
            before = len(self.downlink.adopted_epochs.get(sender, ()))
            head = assembled.header
            self.uplink.heard_of(head.sender, head.epoch, head.fragment, head.version, arrives)
            self.downlink.on_snapshot(assembled.header, assembled.tensors, arrives)
            # a new merger life's first value
            if self.log is not None and len(self.downlink.adopted_epochs.get(sender, ())) > before:
                self.log.info(
                    "merger_epoch",
                    merger=sender,
                    epoch=assembled.header.epoch,
                    fragment=assembled.header.fragment,
                    version=assembled.header.version,
                )
