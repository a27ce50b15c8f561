"""The replication stream, the primary's side: a merger ships its write-ahead log to a standby
(PROTOCOL.md §12; the messages are merger/replication_wire.py's).

The primary binds a ROUTER (``--replication-endpoint``, CURVE domain ``replication``: mergers
only); a standby connects a DEALER and says where its own log ends (`follow`).  The primary
answers with where the copy starts (`start`: the logs' common prefix, merger/logmatch.py), then
sends every record from there on, in index order — older ones read back from its log on disk,
recent ones from memory — no more than `WINDOW_BYTES` beyond what the standby has stored, a
`lease` heartbeat every lease/6, and each fold's digest.

Modes: ``sync`` — the primary publishes nothing (snapshot, ack, cursor) before the standby has
stored the records behind it (`ReplicationServer.barrier`); a standby silent for two leases, or
whose stored length has not moved for two leases while it is behind, is dropped and the primary
goes on alone, logging it, until the standby is back and caught up.  ``async`` — records stream
the same way, nothing waits.  ``off`` — no stream.

`ReplicationServer` runs on a thread of its own (it owns the sockets); the merger's loop hands it
records (`appended`) and finished folds (`folded`).  An error on that thread is logged and
counted, and drops the standby: a broken stream never holds the primary's acknowledgements.
"""

from __future__ import annotations

import collections
import dataclasses
import queue
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import zmq

from dloco.bus.security import Security
from dloco.bus.sockets import open_socket
from dloco.merger import records
from dloco.merger import replication_wire as wire
from dloco.merger.logmatch import agreed_length
from dloco.merger.replication_wire import (
    ReplicationConfig,
    ReplicationError,
    decode,
    encode,
    fragment_digest,
    record_frames,
)
from dloco.merger.wal import read_records
from dloco.protocol.errors import DlocoError

# recent records kept in memory for the standby; older ones are read back from the log
TAIL_BYTES = 256 << 20
# sent to the standby beyond what it has stored (its memory for records in flight)
WINDOW_BYTES = 256 << 20
# records sent per turn of the stream thread before it looks at its socket again
SEND_BATCH = 256
# a standby within this many records of the primary's log counts as caught up (sync mode then waits
# for it)
CAUGHT_UP_RECORDS = 64


class Fenced(DlocoError):
    """A merger with a newer epoch has taken over: this one must not publish again."""


class ReplicatedLog:
    """The write-ahead log, each appended record handed to the replication stream too."""

    def __init__(self, wal, server: ReplicationServer) -> None:
        self.wal, self.server = wal, server

    @property
    def next_index(self) -> int:
        return self.wal.next_index

    def append(self, record: dict, blobs: Sequence[tuple[Any, int | None]] = ()) -> int:
        index = self.wal.append(record, blobs)
        self.server.appended(index, record, blobs)
        return index


@dataclasses.dataclass
class Follower:
    identity: bytes
    # of the `follow` it answers: `stored` of an earlier one is ignored
    generation: int
    # the next record to send
    next: int
    # records on its disk
    stored: int
    # monotonic
    heard: float
    # when `stored` last moved (or it was level with the log)
    progressed: float
    # has said what it stored since it joined
    reported: bool = False
    # has stored all but the last CAUGHT_UP_RECORDS records at some point since it joined
    caught_up: bool = False
    # (index, bytes) sent, not yet stored
    in_flight: collections.deque = dataclasses.field(default_factory=collections.deque)
    in_flight_bytes: int = 0


class ReplicationServer:
    """The primary's side.  `appended`, `folded` and `barrier` are called by the merger's loop; the
    stream thread owns the sockets.  `state`: "alone" (no standby, or one dropped), "catching_up",
    "sync" (the standby is within CAUGHT_UP_RECORDS of the log: sync mode waits for it)."""

    def __init__(
        self,
        context: zmq.Context,
        config: ReplicationConfig,
        security: Security,
        sender: str,
        wal,
        wal_directory: Path,
        epoch: int,
        terms: list[tuple[int, int]],
        term: int,
        genesis: int,
        log,
    ) -> None:
        self.config, self.wal, self.directory, self.epoch = config, wal, Path(wal_directory), epoch
        # the stream thread has none of the loop thread's context
        self.log = log.bind(role="merger", sender=sender)
        # terms: (epoch, first index); term: this one's number
        self.terms, self.term, self.genesis = list(terms), term, genesis
        self.cond = threading.Condition()
        self.tail: collections.deque[tuple[int, list, int]] = collections.deque()
        self.tail_bytes = 0
        # records appended so far
        self.length = wal.next_index
        self.follower: Follower | None = None
        self.state, self.fenced_by = "alone", None
        self.digests: collections.deque = collections.deque()
        self.fold_index: dict[tuple[int, int], int] = {}
        self.counters: collections.Counter[str] = collections.Counter()
        self._stopping = False
        self._socket = open_socket(
            context,
            zmq.ROUTER,
            config.endpoint,
            security,
            sender,
            domain="replication",
            send_hwm=0,
            # WINDOW_BYTES bounds it
            report=lambda message: self.log.warning("auth_refused", detail=message),
        )
        self._socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._fence = None
        # tell the peer, should it be an old primary come back, that it is fenced
        if config.peer:
            self._fence = open_socket(
                context, zmq.DEALER, config.peer, security, sender, immediate=True
            )
        endpoint = f"inproc://replication-{id(self)}"
        self._wake_in = context.socket(zmq.PAIR)
        self._wake_in.bind(endpoint)
        self._hashed_in = context.socket(zmq.PAIR)
        self._hashed_in.bind(f"inproc://replication-hashed-{id(self)}")
        # the loop's end
        self._wake = context.socket(zmq.PAIR)
        self._wake.connect(endpoint)
        # the hashing thread's own end (a socket per thread)
        self._hasher_wake = context.socket(zmq.PAIR)
        self._hasher_wake.connect(f"inproc://replication-hashed-{id(self)}")
        self._to_hash: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="replication", daemon=True)
        self._hasher = threading.Thread(target=self._hash, name="replication-digests", daemon=True)
        self._thread.start()
        self._hasher.start()

    # ---- called on the merger's loop ---------------------------------------------------------
    def appended(self, index: int, record: dict, blobs: Sequence[tuple[Any, int | None]]) -> None:
        frames = record_frames(index, record, blobs)
        nbytes = sum(memoryview(f).nbytes for f in frames)
        with self.cond:
            self.tail.append((index, frames, nbytes))
            self.tail_bytes += nbytes
            while self.tail_bytes > TAIL_BYTES and len(self.tail) > 1:
                self.tail_bytes -= self.tail.popleft()[2]
            self.length = index + 1
            if record["type"] == records.FOLD:
                self.fold_index[(record["fragment"], record["version"])] = index
            elif record["type"] == records.TERM:
                self.terms.append((record["epoch"], index))
                self.term = record["term"]
        self._signal()

    def folded(self, fragment: int, version: int, state) -> None:
        """A fold is computed: its digest goes to the standby (hashed on a thread of its own: a
        large fragment's hash must delay neither the loop nor the leases)."""
        with self.cond:
            index = self.fold_index.pop((fragment, version), None)
            listening = (
                self.follower is not None
                and time.monotonic() - self.follower.heard <= self.config.lease_s
            )
        if index is not None and listening:
            self._to_hash.put((index, fragment, state.params))

    def _hash(self) -> None:
        while (item := self._to_hash.get()) is not None:
            index, fragment, params = item
            digest = fragment_digest(params)
            with self.cond:
                self.digests.append((index, fragment, digest))
            self._signal_from_hasher()

    def barrier(self, length: int) -> None:
        """In sync mode, return once the standby has stored the first `length` records, or has been
        dropped; at once in async mode or with no standby in sync.  Raises Fenced once a newer
        primary said so: nothing may be published after that."""
        with self.cond:
            while (
                self.config.mode == "sync"
                and self.state == "sync"
                and self.follower is not None
                and self.follower.stored < length
                and not self._stopping
                and self.fenced_by is None
            ):
                self.cond.wait(timeout=self.config.lease_s / 6)
        self.check_fenced()

    def check_fenced(self) -> None:
        if self.fenced_by is not None:
            raise Fenced(
                f"a merger with epoch {self.fenced_by} has taken over (this one's is {self.epoch})"
            )

    def close(self) -> None:
        with self.cond:
            self._stopping = True
            self.cond.notify_all()
        self._signal()
        self._to_hash.put(None)
        self._thread.join(timeout=30)
        self._hasher.join(timeout=30)
        sockets = (
            [self._wake, self._hasher_wake]
            if self._thread.is_alive()
            else [
                self._wake,
                self._hasher_wake,
                self._wake_in,
                self._hashed_in,
                self._socket,
                self._fence,
            ]
        )
        # a thread still running keeps its own (the context's destruction ends them)
        for socket in sockets:
            if socket is not None:
                socket.close(linger=0)

    def _signal(self) -> None:
        try:
            self._wake.send(b"", zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    def _signal_from_hasher(self) -> None:
        try:
            self._hasher_wake.send(b"", zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    # ---- the stream thread -------------------------------------------------------------------
    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        poller.register(self._wake_in, zmq.POLLIN)
        poller.register(self._hashed_in, zmq.POLLIN)
        next_lease = 0.0
        while not self._stopping:
            try:
                events = dict(poller.poll(int(self.config.lease_s / 6 * 1000)))
                for wake in (self._wake_in, self._hashed_in):
                    while wake in events and wake.poll(0):
                        wake.recv()
                if self._socket in events:
                    self._receive()
                now = time.monotonic()
                if now >= next_lease:
                    next_lease = now + self.config.lease_s / 6
                    self._leases()
                self._stream()
                self._send_digests()
                self._judge(time.monotonic())
            except Exception as error:  # noqa: BLE001 — whatever breaks the stream must not hold the primary's acks
                self.counters["errors"] += 1
                # the 1st, 2nd, 4th, 8th, ...
                if self.counters["errors"] & (self.counters["errors"] - 1) == 0:
                    self.log.error(
                        "replication_error", error=repr(error)[:500], errors=self.counters["errors"]
                    )
                self._drop("stream error")
                # a lasting fault (a corrupt segment) is not retried in a tight loop
                time.sleep(self.config.lease_s / 6)

    def _receive(self) -> None:
        for _ in range(SEND_BATCH):
            try:
                identity, *frames = self._socket.recv_multipart(zmq.NOBLOCK)
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
            if kind == wire.FOLLOW:
                self._on_follow(identity, body)
            elif kind == wire.STORED:
                self._on_stored(identity, body)
            elif kind == wire.FENCE and body["epoch"] > self.epoch:
                with self.cond:
                    if self.fenced_by is None:
                        self.log.warning(
                            "fenced", by_epoch=body["epoch"], by_term=body["term"], epoch=self.epoch
                        )
                    self.fenced_by = body["epoch"]
                    self.cond.notify_all()
            elif kind != wire.FENCE:
                self.counters[f"unexpected/{kind.decode()}"] += 1

    def _on_follow(self, identity: bytes, body: dict) -> None:
        length, theirs = body["length"], [tuple(t) for t in body["terms"]]
        if length > 0 and body["genesis"] != self.genesis:
            self._send(
                identity,
                encode(
                    wire.REFUSED,
                    {
                        "why": (
                            "its log is another run's (its genesis record differs from this"
                            " primary's)"
                        )
                    },
                ),
            )
            self.log.error("standby_refused", why="genesis differs")
            return
        now = time.monotonic()
        with self.cond:
            at = agreed_length(self.terms, self.length, theirs, length) if length > 0 else 0
            # a standby in sync that follows again (a reconnect, a lost record) with its log whole
            # stays in sync
            caught_up = self.state == "sync" and at >= self.length - CAUGHT_UP_RECORDS
            self.follower = Follower(
                identity,
                body["generation"],
                at,
                at,
                now,
                now,
                reported=caught_up,
                caught_up=caught_up,
            )
            self._set_state("sync" if caught_up else "catching_up")
        self.log.info("standby_following", its_length=length, common=at, length=self.length)
        self._send(identity, encode(wire.START, {"at": at, "generation": body["generation"]}))

    def _on_stored(self, identity: bytes, body: dict) -> None:
        with self.cond:
            follower = self.follower
            if (
                follower is None
                or follower.identity != identity
                or follower.generation != body["generation"]
            ):
                # an answer to an earlier follow
                return
            now = time.monotonic()
            if body["length"] > follower.stored:
                follower.stored, follower.progressed = body["length"], now
                while follower.in_flight and follower.in_flight[0][0] < follower.stored:
                    follower.in_flight_bytes -= follower.in_flight.popleft()[1]
            follower.heard, follower.reported = now, True
            self.cond.notify_all()

    def _leases(self) -> None:
        term = self.term
        if self.follower is not None:
            self._send(
                self.follower.identity,
                encode(
                    wire.LEASE,
                    {
                        "epoch": self.epoch,
                        "term": term,
                        "length": self.length,
                        "lease_s": self.config.lease_s,
                        "state": self.state,
                    },
                ),
            )
        if self._fence is not None:
            try:
                self._fence.send_multipart(
                    encode(wire.FENCE, {"epoch": self.epoch, "term": term}), zmq.NOBLOCK
                )
            # nobody there: nothing to fence
            except zmq.ZMQError:
                pass

    def _send(self, identity: bytes, frames: list) -> bool:
        try:
            self._socket.send_multipart([identity, *frames], zmq.NOBLOCK, copy=False)
            return True
        # its queue is full: the stream resumes from the same record next turn
        except zmq.Again:
            self.counters["send_full"] += 1
        # EHOSTUNREACH: it has gone; it says `follow` again when back
        except zmq.ZMQError:
            self.counters["send_unroutable"] += 1
        return False

    def _frames_of(self, start: int, budget: int) -> list[tuple[int, list, int]]:
        """Records start..: from memory when still there (SEND_BATCH of them), else from the log on
        disk (what is durable there, up to `budget` bytes: a segment is read once per window, not
        once per record)."""
        with self.cond:
            first = self.tail[0][0] if self.tail else self.length
            if start >= first:
                return [
                    self.tail[i]
                    for i in range(start - first, min(len(self.tail), start - first + SEND_BATCH))
                ]
        out, total = [], 0
        for index, record in read_records(self.directory, start):
            if index >= min(first, self.wal.durable) or total >= budget:
                break
            blobs = record.pop("blobs", [])
            frames = record_frames(index, record, [(b, None) for b in blobs])
            out.append((index, frames, sum(memoryview(f).nbytes for f in frames)))
            total += out[-1][2]
        return out

    def _stream(self) -> None:
        follower = self.follower
        if (
            follower is None
            or follower.next >= self.length
            or follower.in_flight_bytes >= WINDOW_BYTES
        ):
            return
        if time.monotonic() - follower.heard > self.config.lease_s:
            # not heard from lately: nothing is read or sent for it until it answers a lease
            return
        if (
            not self.tail or follower.next < self.tail[0][0]
        ) and follower.in_flight_bytes > WINDOW_BYTES // 2:
            # from disk: refill in large steps, each a pass over the segments it reads
            return
        for index, frames, nbytes in self._frames_of(
            follower.next, WINDOW_BYTES - follower.in_flight_bytes
        ):
            if (
                index != follower.next
                or follower.in_flight_bytes >= WINDOW_BYTES
                or not self._send(follower.identity, frames)
            ):
                return
            with self.cond:
                follower.next += 1
                follower.in_flight.append((index, nbytes))
                follower.in_flight_bytes += nbytes
            self.counters["records_sent"] += 1

    def _send_digests(self) -> None:
        while self.digests and self.follower is not None:
            with self.cond:
                index, fragment, digest = self.digests.popleft()
            self._send(
                self.follower.identity,
                encode(wire.DIGEST, {"index": index, "fragment": fragment, "sha256": digest}),
            )

    def _judge(self, now: float) -> None:
        with self.cond:
            follower = self.follower
            if follower is None:
                return
            if follower.stored >= self.length:
                follower.progressed = now
            why = None
            if self.state != "alone" and now - follower.heard > 2 * self.config.lease_s:
                why = "silent for two leases"
            elif self.state != "alone" and now - follower.progressed > 2 * self.config.lease_s:
                why = "its stored length has not moved for two leases"
            elif (
                not follower.caught_up
                and follower.reported
                and follower.stored >= self.length - CAUGHT_UP_RECORDS
                and now - follower.heard < self.config.lease_s
            ):
                follower.caught_up = True
                self._set_state("sync")
        if why is not None:
            self._drop(why)

    def _drop(self, why: str) -> None:
        """Acknowledgements stop waiting for the standby.  It still gets leases (state "alone"), so
        a live standby does not take over, and the stream resumes from what it has stored (a record
        lost on the way is sent again); it is in sync again once caught up."""
        with self.cond:
            follower = self.follower
            # back in sync only after it says what it stored again
            if follower is not None:
                follower.caught_up = follower.reported = False
                follower.next, follower.progressed = follower.stored, time.monotonic()
                follower.in_flight.clear()
                follower.in_flight_bytes = 0
            # fragments' parameters: not kept for a standby that may not take them
            self.digests.clear()
            self._set_state(
                "alone", why=why, stored=follower.stored if follower is not None else None
            )

    def _set_state(self, state: str, **detail) -> None:
        """With the lock held."""
        if state == self.state:
            return
        before, self.state = self.state, state
        self.cond.notify_all()
        (self.log.warning if state == "alone" else self.log.info)(
            "replication",
            state=state,
            was=before,
            length=self.length,
            mode=self.config.mode,
            **detail,
        )

    def snapshot(self) -> dict:
        """For metrics and the status: state, records the standby lacks on disk."""
        with self.cond:
            follower = self.follower
            return {
                "state": self.state,
                "lag": self.length - follower.stored if follower is not None else None,
                "fenced_by": self.fenced_by,
                **dict(self.counters),
            }
