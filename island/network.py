"""The island's network side: a background publisher and a background snapshot receiver.

The training loop calls `publish` and `snapshots`; neither waits.  Threads own their sockets
(ZeroMQ sockets are not thread-safe):
- publisher: takes deltas from the outbox, quantizes and chunks them, paces them through the
  uplink shaper, sends them on a PUB (connects to the delta bus);
- receiver: a SUB on the snapshot bus and a DEALER to the merger's ROUTER (catch-up request on
  start); reassembles snapshots, applies diff snapshots to the value it holds (protocol/downlink.py;
  one that does not apply makes it ask for the fragment's value again), holds each until the
  downlink shaper says it has arrived, and queues it for the loop.

Outbox: at most one pending delta per fragment.  When the link is slower than deltas are made, a
newer delta of a fragment whose older one is still unsent is *rebased* onto it: the two are summed
(each is the change since the previous send or adoption, so the sum is the change since the older
one's anchor), their step and token counters are summed, and the newer base version is kept.
The outbox therefore never grows beyond P deltas and no trained work is silently dropped.
"""

from __future__ import annotations

import collections
import threading
import time

import numpy as np
import zmq

import protocol
from protocol import downlink
from island.config import SyncConfig
from bus.security import Security
from bus.sequencing import RetransmitBuffer
from bus.sockets import open_socket
from island.shaper import LinkShaper

POLL_MS = 50
HEARTBEAT_S = 0.5  # a heartbeat carries the last seq, so a lost tail is asked for within this
ASK_AGAIN_S = 1.0  # a fragment whose diff could not be applied is asked for at most this often
PROBE_AFTER_S = 3.0  # a delta admitted this long ago and still unsettled: its result (an ack) was lost; ask again


class NetworkLink:
    def __init__(self, name: str, model: str, sync: SyncConfig, delta_endpoint: str, snapshot_endpoint: str, control_endpoint: str,
                 uplink: LinkShaper | None = None, downlink: LinkShaper | None = None, log=None,
                 security: Security | None = None, bus_server: str = "broker", control_server: str = "merger") -> None:
        self.name, self.model, self.sync, self.log = name, model, sync, log
        self.security = security or Security(None, name)
        self.servers = (bus_server, bus_server, control_server)
        self.epoch = time.time_ns()
        self.codec = protocol.Codec(sync.codec, sync.block)
        self.uplink, self.downlink = uplink or LinkShaper(None), downlink or LinkShaper(None)
        self.endpoints = (delta_endpoint, snapshot_endpoint, control_endpoint)
        self.bytes_sent = self.bytes_received = 0
        self.deltas_sent = self.rebased = 0
        self.results: collections.Counter[str] = collections.Counter()
        # fragment -> deltas of it settled without a fold (rejected, or given up on): a blocking
        # island waiting for such a delta's fold must stop waiting
        self.unfolded: collections.Counter[int] = collections.Counter()
        self._outbox: dict[int, tuple[int, dict[str, np.ndarray], int, int]] = {}
        self._order: collections.deque[int] = collections.deque()
        self._in_flight = False  # the publisher has taken a delta off the outbox and not finished sending it
        self._arrived: collections.deque = collections.deque()
        self._residuals: dict[str, np.ndarray] = {}
        # fragment -> the merger's value as received (protocol/downlink.py): diff snapshots apply to it
        self._served: dict[int, downlink.Served] = {}
        self._asked: dict[int, float] = {}  # fragment -> when its value was last asked for
        self._asked_all = -ASK_AGAIN_S  # when every fragment was (at start)
        self.ask_again_s = ASK_AGAIN_S
        self._wanted: dict[int, int] = {}  # fragment -> newest version seen in a diff that could not be applied
        self._early: dict[int, tuple] = {}  # fragment -> a diff whose base is newer than the value held
        self._merger_epoch: dict[str, int] = {}  # newest incarnation of each snapshot sender
        self.downlink_results: collections.Counter[str] = collections.Counter()  # full, diff, old, gap, mismatch, ...
        self._settled: set[int] = set()  # delta ids acknowledged (an ack can arrive twice)
        # Sent, not yet settled: delta id -> [last seq, first chunk's frames, when admitted (the cursor
        # passed it) or last probed, when admitted]; the times are None until the cursor passes.
        # Once the merger's cursor passes the last seq the delta is admitted; if no result follows (the
        # ack was published while the bus was down), re-sending the first chunk point to point makes
        # the merger acknowledge it again (a repeat of a settled delta is re-acked, never refolded).
        self._unsettled: dict[int, list] = {}
        self._cursor = 0  # highest seq the merger's cursor covered
        self.probes = 0
        self._kept = RetransmitBuffer(max_messages=sync.retransmit_messages, max_bytes=sync.retransmit_bytes)
        self.seq = 0  # last stream seq sent (delta chunks)
        self.resent = self.resend_deferred = self.backpressure_waits = 0
        self._lock = threading.Condition()
        self._stop = threading.Event()
        self._context = zmq.Context()
        self._threads = [threading.Thread(target=self._publisher, name=f"{name}-publisher", daemon=True),
                         threading.Thread(target=self._receiver, name=f"{name}-receiver", daemon=True)]
        for thread in self._threads:
            thread.start()

    # ---- called by the training loop (never blocks) -------------------------------------------
    def publish(self, fragment: int, base_version: int, delta: dict[str, np.ndarray], steps: int, tokens: int) -> None:
        with self._lock:
            older = self._outbox.get(fragment)
            if older is not None:
                _, old_delta, old_steps, old_tokens = older
                self.rebased += 1
                delta = {path: delta[path] + old_delta[path] for path in delta}
                steps, tokens = steps + old_steps, tokens + old_tokens
            else:
                self._order.append(fragment)
            self._outbox[fragment] = (base_version, delta, steps, tokens)
            self._lock.notify()

    def snapshots(self) -> list[tuple[int, int, dict[str, np.ndarray]]]:
        """Snapshots that have fully arrived (by the downlink's clock), oldest first."""
        ready, now = [], time.monotonic()
        with self._lock:
            while self._arrived and self._arrived[0][0] <= now:
                ready.append(self._arrived.popleft()[1])
        return ready

    def drain(self, timeout_s: float) -> bool:
        """At the end of a run: wait until every delta is sent and settled (folded or rejected),
        at most `timeout_s`.  Returns whether everything was."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while time.monotonic() < deadline:
                if not self._order and not self._in_flight and self.results["folded"] + self.results["rejected"] + self.results["unknown"] >= self.deltas_sent:
                    return True
                self._lock.wait(timeout=POLL_MS / 1000)
        return False

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            self._lock.notify_all()
        for thread in self._threads:
            thread.join(timeout=5)
        self._context.destroy(linger=0)

    # ---- publisher thread ----------------------------------------------------------------------
    def _publisher(self) -> None:
        pub = open_socket(self._context, zmq.PUB, self.endpoints[0], self.security, self.servers[0], send_hwm=self.sync.send_hwm)
        delta_id, next_heartbeat = 0, time.monotonic() + HEARTBEAT_S
        while not self._stop.is_set():
            with self._lock:
                while not self._order and not self._stop.is_set():
                    if time.monotonic() >= next_heartbeat:
                        break
                    self._lock.wait(timeout=POLL_MS / 1000)
                if self._stop.is_set():
                    break
                job = None
                if self._order:
                    fragment = self._order.popleft()
                    job = (fragment, *self._outbox.pop(fragment))
                    self._in_flight = True
            if time.monotonic() >= next_heartbeat:  # tells receivers our last seq: tail loss shows up
                pub.send_multipart(protocol.encode(protocol.Heartbeat(sender=self.name, epoch=self.epoch, seq=self.seq)))
                next_heartbeat = time.monotonic() + HEARTBEAT_S
            if job is None:
                continue
            fragment, base_version, delta, steps, tokens = job
            if self.sync.error_feedback:
                delta, kept = protocol.compensate(delta, self._residuals, self.codec)
                self._residuals.update(kept)
            plans = protocol.split_fragment(delta, self.codec, self.sync.chunk_bytes)
            delta_id += 1
            first = None
            for index, plan in enumerate(plans):
                frames = protocol.encode(protocol.DeltaChunk(
                    sender=self.name, epoch=self.epoch, seq=self.seq + 1, delta_id=delta_id, fragment=fragment,
                    base_version=base_version, chunk_index=index, chunk_count=len(plans), steps=steps, tokens=tokens,
                    model=self.model, codec=self.codec, slices=plan.slices, payloads=plan.payloads))
                nbytes = sum(memoryview(f).nbytes for f in frames)
                if not self._wait_for_room(nbytes):
                    break
                _, arrives = self.uplink.schedule(nbytes, time.monotonic())
                self._sleep_until(arrives)  # this thread waits for the emulated wire, never the loop
                if self._stop.is_set():
                    break
                with self._lock:
                    self.seq += 1
                    self._kept.add(self.seq, frames, nbytes)  # until the merger's cursor covers it
                pub.send_multipart(frames, copy=False)
                self.bytes_sent += nbytes
                first = first or frames
            else:
                self.deltas_sent += 1
                with self._lock:
                    if delta_id not in self._settled:
                        self._unsettled[delta_id] = [self.seq, first, None, None, fragment]
            with self._lock:
                self._in_flight = False
                self._lock.notify_all()
        pub.close(linger=0)

    def _wait_for_room(self, nbytes: int) -> bool:
        """Backpressure: a full retransmit buffer stops this thread (the loop's outbox keeps summing)."""
        with self._lock:
            while not self._kept.has_room(nbytes):
                if self._stop.is_set():
                    return False
                self.backpressure_waits += 1
                self._lock.wait(timeout=POLL_MS / 1000)
        return True

    def _sleep_until(self, when: float) -> None:
        while not self._stop.is_set() and (left := when - time.monotonic()) > 0:
            time.sleep(min(left, POLL_MS / 1000))

    # ---- receiver thread -----------------------------------------------------------------------
    def _receiver(self) -> None:
        sub = open_socket(self._context, zmq.SUB, self.endpoints[1], self.security, self.servers[1])
        sub.setsockopt(zmq.SUBSCRIBE, b"snapshot/")
        sub.setsockopt(zmq.SUBSCRIBE, b"ack")
        # the merger routes resend requests to us by name
        dealer = open_socket(self._context, zmq.DEALER, self.endpoints[2], self.security, self.servers[2], identity=self.name)
        self._dealer = dealer
        dealer.send_multipart(protocol.encode(protocol.SnapshotRequest(sender=self.name, epoch=self.epoch, seq=0, fragments=())))
        self._asked_all = time.monotonic()
        # Bus and point-to-point snapshots reassemble apart: a catch-up reply (exact: fp32 or the full
        # snapshots' codec) and a bus snapshot of one version share a key, and chunks of one must not
        # meet the other's.
        reassemblers = {sub: protocol.Reassembler(), dealer: protocol.Reassembler()}
        poller = zmq.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(dealer, zmq.POLLIN)
        while not self._stop.is_set():
            for socket in dict(poller.poll(POLL_MS)):
                frames = socket.recv_multipart(copy=False)
                self._on_frames([f.buffer for f in frames], reassemblers[socket])
            self._probe_unsettled()
            self._ask_for_values()
        sub.close(linger=0)
        dealer.close(linger=0)

    def _probe_unsettled(self) -> None:
        """Admitted deltas whose result never came: send their first chunk again, point to point."""
        now = time.monotonic()
        with self._lock:
            for entry in self._unsettled.values():
                if entry[2] is None and entry[0] <= self._cursor:  # admitted (logged) now: its result is due soon
                    entry[2] = entry[3] = now
            expired = [d for d, entry in self._unsettled.items() if entry[3] is not None and now - entry[3] > self.sync.settle_timeout_s]
            for delta_id in expired:  # the merger does not know it (e.g. rejected, then restarted): stop asking
                self.unfolded[self._unsettled.pop(delta_id)[4]] += 1
                self._settled.add(delta_id)  # a late answer is not counted twice
                self.results["unknown"] += 1
            if expired:
                self._lock.notify_all()
            due = [entry for entry in self._unsettled.values() if entry[2] is not None and now - entry[2] >= PROBE_AFTER_S]
            for entry in due:
                entry[2] = now
        for _, frames, *_ in due:
            try:
                self._dealer.send_multipart(frames, copy=False, flags=zmq.NOBLOCK)
                self.probes += 1
            except zmq.Again:
                self.resend_deferred += 1

    def _on_frames(self, frames: list, reassembler: protocol.Reassembler) -> None:
        nbytes = sum(f.nbytes for f in frames)
        self.bytes_received += nbytes
        _, arrives = self.downlink.schedule(nbytes, time.monotonic())
        try:
            message = protocol.decode(frames)
            if isinstance(message, protocol.Ack):
                with self._lock:
                    for result in message.results:
                        if result.island == self.name and result.epoch == self.epoch and result.delta_id not in self._settled:
                            self._settled.add(result.delta_id)
                            self._unsettled.pop(result.delta_id, None)
                            self.results[result.status] += 1
                            if result.status != "folded":
                                self.unfolded[result.fragment] += 1
                    for cursor in message.cursors:
                        if cursor.island == self.name and cursor.epoch == self.epoch:
                            self._kept.release(cursor.seq)
                            self._cursor = max(self._cursor, cursor.seq)
                    self._lock.notify_all()
                return
            if isinstance(message, protocol.ResendRequest):
                if message.target == self.name and message.target_epoch == self.epoch:
                    with self._lock:
                        again = self._kept.get(list(message.ranges))
                    for _, frames in again:  # point to point, not on the bus; never blocks (the merger asks again)
                        try:
                            self._dealer.send_multipart(frames, copy=False, flags=zmq.NOBLOCK)
                            self.resent += 1
                        except zmq.Again:
                            self.resend_deferred += 1
                return
            if not isinstance(message, protocol.SnapshotChunk) or message.model != self.model:
                return
            assembled = reassembler.add(message, time.monotonic())
        except protocol.ProtocolError as error:
            self.results[f"dropped/{error.reason}"] += 1
            return
        if assembled is not None:
            self._on_snapshot(assembled.header, assembled.tensors, arrives)

    def _on_snapshot(self, head: protocol.SnapshotChunk, tensors: dict[str, np.ndarray], arrives: float) -> None:
        """Hold and queue a newer value of the fragment; a diff that does not apply to the value held
        is kept (the next full value may be its base) and the fragment's value is asked for."""
        if head.epoch < self._merger_epoch.get(head.sender, 0):  # a restarted merger's predecessor, delayed
            self.downlink_results["old_epoch"] += 1
            return
        self._merger_epoch[head.sender] = head.epoch
        fragment = head.fragment
        held, outcome = downlink.receive(self._served.get(fragment), head.version, head.base_version, head.digest, tensors)
        self.downlink_results[outcome] += 1
        if outcome in downlink.ASK_AGAIN:
            self._wanted[fragment] = max(self._wanted.get(fragment, 0), head.version)
            if head.base_version is not None and (held is None or head.base_version > held.version):
                self._early[fragment] = (head, tensors, arrives)
        if outcome not in downlink.ADOPT:
            return
        self._served[fragment] = held
        with self._lock:
            self._arrived.append((arrives, (fragment, head.version, held.tensors)))
        early = self._early.get(fragment)
        if early is not None and early[0].base_version <= held.version:  # it can apply now, or never will
            del self._early[fragment]
            if early[0].base_version == held.version:  # the diff that came before its base
                self._on_snapshot(*early)

    def _ask_for_values(self) -> None:
        """Ask the merger for the value of every fragment a diff could not be applied to, until a
        value at least that new is held; at most once per ASK_AGAIN_S per fragment."""
        now = time.monotonic()
        for fragment, wanted in list(self._wanted.items()):
            held = self._served.get(fragment)
            if held is not None and held.version >= wanted:
                del self._wanted[fragment]
                continue
            if now - self._asked.get(fragment, self._asked_all) < self.ask_again_s:
                continue
            request = protocol.SnapshotRequest(sender=self.name, epoch=self.epoch, seq=self.seq, fragments=(fragment,))
            try:
                self._dealer.send_multipart(protocol.encode(request), flags=zmq.NOBLOCK)
                self._asked[fragment] = now
                self.downlink_results["asked"] += 1
            except zmq.Again:  # tried again on the next pass
                self.resend_deferred += 1
