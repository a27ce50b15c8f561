"""The uplink: deltas from the outbox onto the delta bus, kept until the merger has them.

Sending (`run`, the publisher thread): take the oldest pending delta, quantize it (with error
feedback if configured), chunk it, pace each chunk through the uplink shaper and send it on the
PUB under the next seq of its stream.  There is one stream per merger shard (protocol/shards.py:
a fragment's deltas go to shard fragment % shards), so each shard sees a whole stream of its own.
A heartbeat per stream every HEARTBEAT_S carries its last seq, so a lost tail shows up at the
shard.  Every chunk stays in a bounded `RetransmitBuffer` until the merger's
cursor covers it, and is resent point to point when the merger asks; a full buffer stops the
publisher (backpressure) while the outbox keeps summing.

Settling: a sent delta is settled by its result in an ack (folded or rejected).  Once the cursor
passes its last seq it is admitted (on the merger's disk); if its result has not come
PROBE_AFTER_S later (the ack went out while the bus was down), its first chunk is sent again
point to point, and the merger says the result again (a repeat of a settled delta is re-acked,
never refolded).  A delta still unsettled `settle_timeout_s` after admission counts as "unknown".

Across a partition: while the delta bus is down (`on_bus`) deltas stay in the outbox, where they
are summed and rebased onto what the island adopts (`rebase_unsent`); after it returns they wait
for the island to adopt the newest values heard of (`heard_of`): island/outbox.py's `BusState`.
"""

# Over 400 lines: one uplink's state shared by three threads (sending, settling, the bus's
# comings and goings) under one lock; split, each part would reach into the others' fields.

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Callable

import numpy as np
import zmq

from dloco import protocol
from dloco.bus.sequencing import RetransmitBuffer
from dloco.island import exchange
from dloco.island.config import SyncConfig
from dloco.island.outbox import BusState, Outbox, PendingDelta, held_scale
from dloco.island.shaper import LinkShaper
from dloco.protocol.shards import shard_of

POLL_MS = 50
# a heartbeat carries the last seq, so a lost tail is asked for within this
HEARTBEAT_S = 0.5
# a delta admitted this long ago and still unsettled: its result (an ack) was lost; ask again
PROBE_AFTER_S = 3.0
# the norms of a fragment's last deltas (as the loop made them) a summed one is measured against
NORMS_KEPT = 16


@dataclasses.dataclass
class Stream:
    """The deltas of one merger shard's fragments, numbered 1, 2, ... on their own."""

    # every chunk until the shard's cursor covers it
    kept: RetransmitBuffer
    # last seq sent
    seq: int = 0
    # highest seq the shard's cursor covered
    cursor: int = 0


@dataclasses.dataclass
class SentDelta:
    """A delta sent in full, not yet settled."""

    fragment: int
    # seq of its last chunk, in the stream of its fragment's shard
    last_seq: int
    # frames of its first chunk: sent again as a probe
    first_chunk: list
    # inner steps of work it carries
    steps: int
    # monotonic time the merger's cursor was seen past last_seq; None: not yet
    admitted_at: float | None = None
    # monotonic time of the last probe (or of admission)
    probed_at: float | None = None


class Uplink:
    """Shared by three threads: the loop (`publish`, `drain`), the publisher (`run`) and the
    receiver (`on_ack`, `resend`, `probe`).  `lock` guards everything they share."""

    # Over 60 lines: every field the three threads share, each with what it holds.
    def __init__(
        self,
        name: str,
        model: str,
        epoch: int,
        sync: SyncConfig,
        shaper: LinkShaper,
        stop: threading.Event,
        shards: int = 1,
        merger_epochs: dict[str, int] | None = None,
    ) -> None:
        self.name, self.model, self.epoch = name, model, epoch
        self.sync, self.shaper, self.stop = sync, shaper, stop
        self.codec = protocol.Codec(sync.codec, sync.block)
        self.lock = threading.Condition()
        self.outbox = Outbox()
        self.bus = BusState()
        # fragment -> NORMS_KEPT norms (the publisher's: `_scale_summed`)
        self.norms: dict[int, collections.deque[float]] = {}
        # the publisher has taken a delta off the outbox and not finished sending it
        self.in_flight = False
        # error feedback: what quantization left out, added to the next delta (path -> the
        # residual as held, exchange.held, and its shape)
        self.residuals: dict[str, tuple[np.ndarray, tuple[int, ...]]] = {}
        self.held_codec = exchange.residual_codec(self.codec)
        # each stream has the whole retransmit budget (a delta that fits one merger's fits each
        # shard's): the island holds at most `shards` times it
        self.streams = [
            Stream(
                RetransmitBuffer(
                    max_messages=sync.retransmit_messages, max_bytes=sync.retransmit_bytes
                )
            )
            for _ in range(shards)
        ]
        # by delta id
        self.unsettled: dict[int, SentDelta] = {}
        # delta ids with a result (an ack can arrive twice)
        self.settled: set[int] = set()
        # delta id -> its result, come before its sender had finished with it
        self.early_steps: dict[int, str] = {}
        # folded, rejected, unknown, dropped/<reason>
        self.results: collections.Counter[str] = collections.Counter()
        # the inner steps those deltas carried: folded, rejected, unknown
        self.step_results: collections.Counter[str] = collections.Counter()
        # newest epoch heard from each merger (by name), on acks and, when shared with the Downlink,
        # on snapshots: a replaced merger's acks are ignored once its successor has been heard at
        # all
        self.merger_epochs: dict[str, int] = {} if merger_epochs is None else merger_epochs
        # fragment -> deltas of it settled without a fold (rejected, or given up on): a blocking
        # island waiting for such a delta's fold must stop waiting
        self.unfolded: collections.Counter[int] = collections.Counter()
        self.bytes_sent = self.deltas_sent = self.summed = self.rebased = self.scaled = 0
        self.resent = self.probes = self.backpressure_waits = 0
        # tokens: this life's, set by the loop and told in heartbeats; the cluster's, the most any
        # ack has said (PROTOCOL.md §6.1)
        self.trained_tokens = self.heard_tokens = 0

    # ---- the loop's thread ----------------------------------------------------------------------
    def publish(self, delta: PendingDelta) -> None:
        with self.lock:
            self.summed += self.outbox.put(delta)
            self.lock.notify()

    def drain(self, timeout_s: float) -> bool:
        """Wait until every delta is sent and settled (folded, rejected or given up on), at most
        `timeout_s`.  Returns whether everything was."""
        deadline = time.monotonic() + timeout_s
        with self.lock:
            while time.monotonic() < deadline:
                settled = (
                    self.results["folded"] + self.results["rejected"] + self.results["unknown"]
                )
                if not self.outbox and not self.in_flight and settled >= self.deltas_sent:
                    return True
                self.lock.wait(timeout=POLL_MS / 1000)
        return False

    def wake(self) -> None:
        with self.lock:
            self.lock.notify_all()

    def rebase_unsent(self, fragment: int, version: int) -> None:
        """The island adopted `version` of `fragment` with its progress on top: an unsent delta of
        it is now a change of that version too."""
        with self.lock:
            self.rebased += self.outbox.rebase(fragment, version)
            self.lock.notify()

    def take_residuals(self, paths) -> dict[str, np.ndarray]:
        """The error-feedback residuals of `paths` (what quantization has not delivered yet),
        removed from here: the loop keeps them in the island's own parameters from now on (a
        rebase), and its next delta, taken against the new anchor, carries them."""
        with self.lock:
            taken = [(path, self.residuals.pop(path)) for path in paths if path in self.residuals]
        return {path: exchange.unheld(*residual, self.held_codec) for path, residual in taken}

    # ---- the link watcher's and the receiver's threads ----------------------------------------
    def on_bus(self, up: bool, now: float) -> None:
        """The delta bus's connection came up or went down."""
        with self.lock:
            if up:
                self.bus.came_back(now)
            else:
                self.bus.went_down()
            self.lock.notify_all()

    def heard_of(self, sender: str, epoch: int, fragment: int, version: int, now: float) -> None:
        """A value of `fragment` the merger served (not one of an older life of it)."""
        with self.lock:
            if epoch >= self.merger_epochs.get(sender, 0):
                self.bus.heard_of(fragment, version, now)
                self.lock.notify_all()

    # ---- the publisher thread --------------------------------------------------------------------
    def run(self, pub: zmq.Socket) -> None:
        """Send pending deltas and heartbeats on `pub` until `stop` is set."""
        delta_id, next_heartbeat = 0, time.monotonic() + HEARTBEAT_S
        while not self.stop.is_set():
            with self.lock:
                pending = None
                while (
                    not self.stop.is_set()
                    and time.monotonic() < next_heartbeat
                    and (pending := self.outbox.take(self._ready)) is None
                ):
                    self.lock.wait(timeout=POLL_MS / 1000)
                if self.stop.is_set():
                    # taken as the link closed: back where it was, unsent
                    if pending is not None:
                        self.outbox.put(pending)
                    break
                self.in_flight = pending is not None
            # tells each shard our last seq of its stream: tail loss shows up
            if time.monotonic() >= next_heartbeat:
                for index, stream in enumerate(self.streams):
                    beat = protocol.Heartbeat(
                        sender=self.name,
                        epoch=self.epoch,
                        seq=stream.seq,
                        stream=index,
                        tokens=self.trained_tokens,
                    )
                    pub.send_multipart(protocol.encode(beat))
                next_heartbeat = time.monotonic() + HEARTBEAT_S
            if pending is None:
                continue
            delta_id += 1
            self._send(pub, delta_id, pending)
            with self.lock:
                self.in_flight = False
                self.lock.notify_all()

    def _send(self, pub: zmq.Socket, delta_id: int, pending: PendingDelta) -> None:
        self._scale_summed(pending)
        delta = self._compensated(pending.delta) if self.sync.error_feedback else pending.delta
        plans = protocol.split_fragment(delta, self.codec, self.sync.chunk_bytes)
        stream, first = self.streams[shard_of(pending.fragment, len(self.streams))], None
        for index, plan in enumerate(plans):
            frames = protocol.encode(
                protocol.DeltaChunk(
                    sender=self.name,
                    epoch=self.epoch,
                    seq=stream.seq + 1,
                    delta_id=delta_id,
                    fragment=pending.fragment,
                    base_version=pending.base_version,
                    chunk_index=index,
                    chunk_count=len(plans),
                    steps=pending.steps,
                    tokens=pending.tokens,
                    model=self.model,
                    codec=self.codec,
                    slices=plan.slices,
                    payloads=plan.payloads,
                )
            )
            nbytes = sum(memoryview(f).nbytes for f in frames)
            if not self._wait_for_room(stream, nbytes):
                return
            _, arrives = self.shaper.schedule(nbytes, time.monotonic())
            # this thread waits for the emulated wire, never the loop
            self._sleep_until(arrives)
            if self.stop.is_set():
                return
            with self.lock:
                stream.seq += 1
                # until the shard's cursor covers it
                stream.kept.add(stream.seq, frames, nbytes)
            pub.send_multipart(frames, copy=False)
            self.bytes_sent += nbytes
            first = first or frames
        self.deltas_sent += 1
        with self.lock:
            if delta_id in self.early_steps:
                self.step_results[self.early_steps.pop(delta_id)] += pending.steps
            else:
                sent = SentDelta(pending.fragment, stream.seq, first, pending.steps)
                self.unsettled[delta_id] = sent

    def _scale_summed(self, pending: PendingDelta) -> None:
        """Keep the norm of a delta as the loop made it; scale a summed one down in place
        (island/outbox.py `held_scale`): the delta is this thread's alone now."""
        norm = float(np.sqrt(sum(float(np.vdot(v, v)) for v in pending.delta.values())))
        recent = self.norms.setdefault(pending.fragment, collections.deque(maxlen=NORMS_KEPT))
        if pending.parts == 1:
            recent.append(norm)
            return
        scale = held_scale(norm, recent)
        if scale < 1:
            for value in pending.delta.values():
                value *= np.float32(scale)
            self.scaled += 1

    def _compensated(self, delta: dict[str, np.ndarray]) -> dict[str, protocol.Encoded]:
        """Error feedback (protocol.error_feedback) a tensor at a time: returns the encodings the
        merger will decode.  The delta is this thread's alone now (the loop hands its arrays over):
        each is compensated in place and let go, so the fragment is not held twice in float32.  The
        loop may take residuals meanwhile (take_residuals): they are handed over whole."""
        with self.lock:
            residuals = {path: self.residuals.pop(path) for path in delta if path in self.residuals}
        sent = {}
        for path in list(delta):
            target = delta.pop(path)
            if path in residuals:
                target += exchange.unheld(*residuals[path], self.held_codec)
            encoded = self.codec.encode(target.reshape(-1))
            # fp32's encoding is a view of its input, which is about to become the residual
            encoded = encoded.copy() if np.shares_memory(encoded, target) else encoded
            sent[path] = protocol.Encoded(encoded, target.shape)
            target -= self.codec.decode(encoded, target.size).reshape(target.shape)
            residuals[path] = (exchange.held(target, self.held_codec), target.shape)
        with self.lock:
            self.residuals.update(residuals)
        return sent

    def _ready(self, pending: PendingDelta) -> bool:
        """May `pending` start now: the bus (`BusState.sendable`) and its stream's room."""
        return self.bus.sendable(pending, time.monotonic()) and self._room_for(pending)

    def _room_for(self, pending: PendingDelta) -> bool:
        """With merger shards, a delta starts only when its stream's retransmit buffer has room for
        all of it (or is empty): a shard that is down or slow fills its own stream and holds back
        its own fragments' deltas, never the other shards' (nor the heartbeats) -- unless one delta
        is larger than the whole budget, which then goes chunk by chunk as with one merger
        (`_wait_for_room`: any delta, then chunk by chunk)."""
        if len(self.streams) == 1:
            return True
        kept = self.streams[shard_of(pending.fragment, len(self.streams))].kept
        nbytes = sum(
            self.codec.encoded_nbytes(int(np.size(value))) for value in pending.delta.values()
        )
        # at most: a chunk boundary inside each tensor
        chunks = -(-nbytes // self.sync.chunk_bytes) + len(pending.delta)
        return not len(kept) or (
            len(kept) + chunks <= kept.max_messages
            and kept.nbytes + nbytes + chunks * 4096 <= kept.max_bytes
        )

    def _wait_for_room(self, stream: Stream, nbytes: int) -> bool:
        """Backpressure: a full retransmit buffer stops this thread (the loop's outbox keeps
        summing)."""
        with self.lock:
            while not stream.kept.has_room(nbytes):
                if self.stop.is_set():
                    return False
                self.backpressure_waits += 1
                self.lock.wait(timeout=POLL_MS / 1000)
        return True

    def _sleep_until(self, when: float) -> None:
        while not self.stop.is_set() and (left := when - time.monotonic()) > 0:
            time.sleep(min(left, POLL_MS / 1000))

    # ---- the receiver thread ---------------------------------------------------------------------
    def on_ack(self, ack: protocol.Ack, shard: int = 0) -> None:
        """Results settle deltas; cursors (of the stream of `shard`, who sent the ack) release the
        retransmit buffer and admit deltas.  An ack from an older epoch of its sender (a merger
        since restarted or replaced) is ignored."""
        with self.lock:
            if ack.epoch < self.merger_epochs.get(ack.sender, 0):
                self.results["dropped/old_epoch"] += 1
                return
            self.merger_epochs[ack.sender] = max(ack.epoch, self.merger_epochs.get(ack.sender, 0))
            self.heard_tokens = max(self.heard_tokens, ack.tokens)
            for result in ack.results:
                if (
                    result.island == self.name
                    and result.epoch == self.epoch
                    and result.delta_id not in self.settled
                ):
                    self.settled.add(result.delta_id)
                    sent = self.unsettled.pop(result.delta_id, None)
                    if sent is not None:
                        self.step_results[result.status] += sent.steps
                    # its sender has not finished with it yet (_send counts it)
                    else:
                        self.early_steps[result.delta_id] = result.status
                    self.results[result.status] += 1
                    if result.status != "folded":
                        self.unfolded[result.fragment] += 1
            stream = self.streams[shard]
            for cursor in ack.cursors:
                if cursor.island == self.name and cursor.epoch == self.epoch:
                    stream.kept.release(cursor.seq)
                    stream.cursor = max(stream.cursor, cursor.seq)
            self.lock.notify_all()

    def resend(
        self, request: protocol.ResendRequest, send: Callable[[list], bool], shard: int = 0
    ) -> None:
        """The kept chunks of `shard`'s stream that it asks for, point to point (not on the bus).
        `send` never blocks; what it cannot send now the receiver asks for again."""
        if request.target != self.name or request.target_epoch != self.epoch:
            return
        with self.lock:
            again = self.streams[shard].kept.get(list(request.ranges))
        for _, frames in again:
            if send(frames):
                self.resent += 1

    def probe(self, now: float, send: Callable[[list, int], bool]) -> None:
        """Admitted deltas whose result never came: send their first chunk again, point to point
        (`send(frames, shard)`)."""
        shards = len(self.streams)
        with self.lock:
            for sent in self.unsettled.values():
                # admitted (logged) now
                if (
                    sent.admitted_at is None
                    and sent.last_seq <= self.streams[shard_of(sent.fragment, shards)].cursor
                ):
                    sent.admitted_at = sent.probed_at = now
            timeout_s = self.sync.settle_timeout_s
            expired = [
                d
                for d, sent in self.unsettled.items()
                if sent.admitted_at is not None and now - sent.admitted_at > timeout_s
            ]
            # the merger does not know it (e.g. rejected, then restarted): stop asking
            for delta_id in expired:
                sent = self.unsettled.pop(delta_id)
                self.unfolded[sent.fragment] += 1
                self.step_results["unknown"] += sent.steps
                # a late answer is not counted twice
                self.settled.add(delta_id)
                self.results["unknown"] += 1
            if expired:
                self.lock.notify_all()
            due = [
                sent
                for sent in self.unsettled.values()
                if sent.probed_at is not None and now - sent.probed_at >= PROBE_AFTER_S
            ]
            for sent in due:
                sent.probed_at = now
        for sent in due:
            if send(sent.first_chunk, shard_of(sent.fragment, shards)):
                self.probes += 1

    # ---- one stream (no shards): what tests and benchmarks look at
    # ---------------------------------
    @property
    def seq(self) -> int:
        """The last seq sent on the first stream (the only one without merger shards)."""
        return self.streams[0].seq

    @property
    def cursor(self) -> int:
        return self.streams[0].cursor

    @property
    def kept(self) -> RetransmitBuffer:
        return self.streams[0].kept

    def count_dropped(self, reason: str) -> None:
        """A message from the merger that failed to decode."""
        with self.lock:
            self.results[f"dropped/{reason}"] += 1
