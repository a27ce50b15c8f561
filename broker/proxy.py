"""The broker process: two XSUB/XPUB proxies (delta bus, snapshot bus) in one poll loop.

Publishers connect to a bus's XSUB side, subscribers to its XPUB side; subscriptions flow back
from XPUB to XSUB.  With CURVE each side admits its roles only (bus.keys.SOCKET_ROLES: islands
publish deltas, the merger snapshots and acks), and every message's header must name the peer
that sent it (its key's name, ZAP's User-Id): one whose `sender` is another's is dropped, counted
as `sender_mismatch` and logged with both names (at most once a second per peer), so no peer can
speak for another.  On the snapshot bus, with or without CURVE, a message from an older epoch of
its sender than the newest seen is dropped and counted as `old_epoch`: a merger replaced by its
standby is fenced here (PROTOCOL.md §12).  Messages are otherwise forwarded frame for frame
without decoding (the topic frame is read for the per-topic counters, the header's sender and
epoch for the checks).
A (un)subscription reaches the publishers only if it is one the protocol's subscribers make
(protocol.subscribable); any other (a flood of distinct topics, a message that is no subscription)
is refused, counted as `subscription` and logged at most once a second per bus, so subscribers
cannot grow the publishers' (the merger's) memory.  The XPUB itself holds what a subscriber
subscribed to until it disconnects, with no per-peer limit; with CURVE the broker charges every
subscription to its peer (bus/subscriptions.py) and, past a budget, bans the peer and opens the
bus's XPUB afresh, which frees all it held (`reopened`).
High-water marks are sized in messages from a memory budget and the chunk size; XPUB_NODROP makes
a full subscriber visible (the send fails with EAGAIN, the message is counted as `dropped`, never
silently lost).  SIGTERM/SIGINT end the loop; sockets close with linger 0; exit 0.
"""

from __future__ import annotations

import collections
import dataclasses
import signal
import time

import zmq

from dloco.bus.security import Security
from dloco.bus.sockets import open_socket
from dloco.bus.subscriptions import BudgetedXPUB, give_back_freed
from dloco.protocol import DEFAULT_MAX_CHUNK_BYTES, ProtocolError, peek_sender, subscribable
from dloco.protocol.limits import MAX_SUBSCRIPTION_BYTES
from dloco.telemetry import prom

POLL_MS = 100
# larger TCP buffers: fewer wake-ups per MiB forwarded
KERNEL_BUFFER_BYTES = 4 << 20
# where a sender's older epochs are dropped
FENCED_BUS = "snapshot"
# one per direction of heavy traffic; faster than 1 with 1 MiB messages (dloco bench bus)
IO_THREADS = 2


@dataclasses.dataclass(frozen=True)
class BusEndpoints:
    # "delta" | "snapshot"
    name: str
    # XSUB bind address, publishers connect here
    inbound: str
    # XPUB bind address, subscribers connect here
    outbound: str


@dataclasses.dataclass(frozen=True)
class BrokerConfig:
    buses: tuple[BusEndpoints, ...]
    # per socket queue budget
    memory_bytes: int = 512 << 20
    # typical message size, to turn the budget into a high-water mark
    chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES
    # CURVE server with an allowlist, or plaintext (--insecure)
    security: Security = Security(None, "broker")
    stats_every_s: float = 10.0
    # Prometheus metrics served on this port (telemetry/prom.py); None: off
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"

    @property
    def hwm(self) -> int:
        return max(4, self.memory_bytes // self.chunk_bytes)


def topic_key(topic: bytes) -> str:
    """Counter key: the topic up to its first '/', e.g. 'delta', 'snapshot', 'ack'."""
    return topic.split(b"/", 1)[0][:32].decode("ascii", "replace")


# stats ticks after a bus's XPUB is reopened that hand its freed subscriptions back to the kernel
TRIMS_AFTER_REOPEN = 3


class Broker:
    def __init__(self, config: BrokerConfig, log) -> None:
        self.config, self.log = config, log
        self.context = zmq.Context(io_threads=IO_THREADS)
        self.pairs = []
        # with CURVE, per bus: its XPUB, charging subscriptions to their peers
        self.gates: dict[str, BudgetedXPUB] = {}
        self.poller, self.route = zmq.Poller(), {}
        try:
            for bus in config.buses:
                inbound = self._socket(zmq.XSUB, bus.inbound, f"{bus.name}-in")
                self.pairs.append((bus.name, inbound, self._outbound(bus)))
        # a missing key or allowlist, a busy port: nothing keeps running
        except BaseException:
            Security.stop(self.context)
            self.context.destroy(linger=0)
            raise
        self.messages = collections.Counter()
        self.bytes = collections.Counter()
        self.dropped = collections.Counter()
        # messages not forwarded: sender_mismatch, unreadable header, subscription
        self.refused = collections.Counter()
        # (un)subscriptions passed upstream
        self.subscriptions = collections.Counter()
        # per bus: the topics passed upstream since its XPUB was opened, and how many times it was
        # opened afresh
        self.upstream: dict[str, set[bytes]] = {bus.name: set() for bus in config.buses}
        self.reopened = collections.Counter()
        # stats ticks left that hand freed memory back after a reopening
        self._trims_due = 0
        self.last_warned: dict[str, float] = {}
        # snapshot bus: sender -> newest epoch (a lower one is a replaced merger)
        self.newest_epoch: dict[str, int] = {}
        self.stopping = False
        self.metrics_server = None
        if config.metrics_port is not None:
            try:
                self.metrics_server = prom.serve(
                    config.metrics_port,
                    config.metrics_host,
                    prom.registry_of(lambda: prom.broker_families(self.stats())),
                )
            except BaseException:
                Security.stop(self.context)
                self.context.destroy(linger=0)
                raise

    def _socket(self, kind: int, endpoint: str, domain: str) -> zmq.Socket:
        return open_socket(
            self.context,
            kind,
            f"@{endpoint}",
            self.config.security,
            send_hwm=self.config.hwm,
            receive_hwm=self.config.hwm,
            kernel_buffer_bytes=KERNEL_BUFFER_BYTES,
            report=lambda message: self.log.warning("auth_refused", detail=message),
            domain=domain,
        )

    def _outbound(self, bus: BusEndpoints) -> zmq.Socket:
        """A bus's XPUB; with CURVE, one whose subscriptions are charged to their peers."""
        if self.config.security.insecure:
            return self._xpub(bus)
        gate = BudgetedXPUB(lambda: self._xpub(bus), self.context, self.log, f"{bus.name}-out")
        gate.before_close = self._forget
        gate.after_open = lambda new: self._adopt(bus.name, new)
        self.gates[bus.name] = gate
        return gate.socket

    def _xpub(self, bus: BusEndpoints) -> zmq.Socket:
        """A full subscriber is seen (NODROP); with CURVE every subscription reaches the broker
        (VERBOSE)."""
        outbound = self._socket(zmq.XPUB, bus.outbound, f"{bus.name}-out")
        outbound.setsockopt(zmq.XPUB_NODROP, 1)
        if not self.config.security.insecure:
            outbound.setsockopt(zmq.XPUB_VERBOSE, 1)
        return outbound

    def _forget(self, old: zmq.Socket) -> None:
        self.poller.unregister(old)
        self.route.pop(old, None)

    def _adopt(self, name: str, new: zmq.Socket) -> None:
        """A bus's XPUB opened afresh: it holds no subscription, and is polled from now on."""
        index = next(i for i, pair in enumerate(self.pairs) if pair[0] == name)
        self.pairs[index] = (name, self.pairs[index][1], new)
        self.upstream[name].clear()
        self.reopened[name] += 1
        # the old socket's subscriptions, freed by ZeroMQ's reaper meanwhile, handed back
        self._trims_due = TRIMS_AFTER_REOPEN
        self._routes()

    def _routes(self) -> None:
        """Poll every socket; each forwards to its pair's other."""
        for name, inbound, outbound in self.pairs:
            self.poller.register(inbound, zmq.POLLIN)
            self.poller.register(outbound, zmq.POLLIN)
            self.route[inbound] = (name, outbound, True)
            self.route[outbound] = (name, inbound, False)

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: setattr(self, "stopping", True))
        self._routes()
        self.log.info(
            "broker_started",
            buses=[dataclasses.asdict(b) for b in self.config.buses],
            hwm=self.config.hwm,
            secure=not self.config.security.insecure,
        )
        next_stats = time.monotonic() + self.config.stats_every_s
        try:
            while not self.stopping:
                for socket in dict(self.poller.poll(POLL_MS)):
                    # not a socket reopened meanwhile
                    if socket in self.route:
                        name, target, is_data = self.route[socket]
                        self._forward(socket, target, name, is_data)
                if time.monotonic() >= next_stats:
                    if self._trims_due > 0:
                        give_back_freed()
                        self._trims_due -= 1
                    self.log.info("broker_stats", **self.stats())
                    next_stats = time.monotonic() + self.config.stats_every_s
        finally:
            self.log.info("broker_stopped", **self.stats())
            if self.metrics_server is not None:
                prom.stop(self.metrics_server)
            Security.stop(self.context)
            self.context.destroy(linger=0)
        return 0

    def _forward(self, source: zmq.Socket, target: zmq.Socket, bus: str, is_data: bool) -> None:
        # drain a burst, then let the other sockets have a turn
        for _ in range(256):
            try:
                frames = source.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            # a (un)subscription travelling upstream
            if not is_data:
                if self._subscription(target, frames, bus):
                    # the XPUB was opened afresh: `source` is closed
                    return
                continue
            key = f"{bus}/{topic_key(bytes(frames[0].buffer[:64]))}"
            if not self._admitted(frames, bus):
                continue
            try:
                target.send_multipart(frames, zmq.NOBLOCK, copy=False)
            # XPUB_NODROP: a subscriber is full; the sender's resend path recovers it
            except zmq.Again:
                self.dropped[key] += 1
                continue
            self.messages[key] += 1
            self.bytes[key] += sum(len(f) for f in frames)

    def _subscription(self, xsub: zmq.Socket, frames: list[zmq.Frame], bus: str) -> bool:
        """Charge a subscription to its peer (with CURVE) and pass it to the publishers if it is one
        the protocol's subscribers make, and the first of its topic (the last unsubscription: the
        XPUB passes only that).  True: it went past a budget and the bus's XPUB was opened afresh.
        """
        data = (
            bytes(frames[0].buffer)
            if len(frames) == 1 and len(frames[0]) <= 1 + MAX_SUBSCRIPTION_BYTES
            else b""
        )
        if (gate := self.gates.get(bus)) is not None:
            banned = gate.banned
            if gate.charge(frames):
                self.refused[f"{bus}/subscription_budget"] += gate.banned - banned
                return True
        if data[:1] in (b"\x00", b"\x01") and subscribable(data[1:]):
            topics, topic = self.upstream[bus], data[1:]
            if (topic not in topics) if data[0] else (topic in topics):
                (topics.add if data[0] else topics.discard)(topic)
                xsub.send_multipart(frames, copy=False)
                self.subscriptions[f"{bus}/{'subscribe' if data[0] else 'unsubscribe'}"] += 1
            return False
        self.refused[f"{bus}/subscription"] += 1
        now = time.monotonic()
        if now - self.last_warned.get(f"{bus}/subscription", -1.0) >= 1.0:
            self.last_warned[f"{bus}/subscription"] = now
            self.log.warning(
                "subscription_refused",
                bus=bus,
                topic=bytes(frames[0].buffer[1:41]).decode("ascii", "replace"),
                frames=len(frames),
                refused=self.refused[f"{bus}/subscription"],
            )
        return False

    def _admitted(self, frames: list[zmq.Frame], bus: str) -> bool:
        """Whether to forward: with CURVE, the header's sender must be the peer whose key sent it;
        on the snapshot bus, its epoch must not be older than the newest seen from that sender (a
        merger that a standby has replaced is fenced here: PROTOCOL.md §12).  Else counted, logged.
        """
        secure, fenced = not self.config.security.insecure, bus == FENCED_BUS
        if not secure and not fenced:
            return True
        peer = frames[0].get("User-Id") if secure else None
        try:
            sender, epoch = peek_sender([frame.buffer for frame in frames[:2]])
        except ProtocolError as error:
            # plaintext: the broker forwards what it cannot read, as it always has
            if not secure:
                return True
            sender, epoch, reason = None, None, f"header_{error.reason}"
        else:
            if secure and sender != peer:
                reason = "sender_mismatch"
            elif fenced and epoch < self.newest_epoch.get(sender, 0):
                reason = "old_epoch"
            else:
                if fenced:
                    self.newest_epoch[sender] = epoch
                return True
        self.refused[f"{bus}/{reason}"] += 1
        now = time.monotonic()
        # a flood does not flood the log
        if now - self.last_warned.get(peer, -1.0) >= 1.0:
            self.last_warned[peer] = now
            self.log.warning(
                "message_refused",
                reason=reason,
                bus=bus,
                peer=peer,
                claimed_sender=sender,
                claimed_epoch=epoch,
                refused=self.refused[f"{bus}/{reason}"],
            )
        return False

    def stats(self) -> dict:
        return {
            "messages": dict(self.messages),
            "bytes": dict(self.bytes),
            "dropped": dict(self.dropped),
            "refused": dict(self.refused),
            "subscriptions": dict(self.subscriptions),
            "reopened": dict(self.reopened),
            "auth_refused": Security.refused(self.context),
        }
