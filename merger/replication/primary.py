"""The replication stream, the primary's side: a merger ships its write-ahead log to a standby
(PROTOCOL.md §12; the messages are merger/replication/wire.py's).

The primary binds a ROUTER (``--replication-endpoint``, CURVE domain ``replication``: mergers
only); a standby connects a DEALER and says where its own log ends (`follow`).  The primary
answers with where the copy starts (`start`: the logs' common prefix, merger/log/logmatch.py), then
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

# Over 400 lines: one server of one standby, its stream thread and the loop's calls (records,
# folds, the barrier that holds acks for the standby's disk and the etcd lease) over the same
# fields and lock.

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import zmq

from dloco.bus.security import Security
from dloco.merger.log import records
from dloco.merger.log.logmatch import agreed_length
from dloco.merger.replication import wire
from dloco.merger.replication.channel import StandbyChannel, Wakeup
from dloco.merger.replication.consensus import PrimaryLease
from dloco.merger.replication.stream import (
    CAUGHT_UP_RECORDS,
    WINDOW_BYTES,
    FoldDigests,
    Follower,
    RecordTail,
)
from dloco.merger.replication.wire import encode, record_frames
from dloco.merger.settings import ReplicationConfig
from dloco.protocol.errors import DlocoError

OTHER_RUN = "its log is another run's (its genesis record differs from this primary's)"


class Fenced(DlocoError):
    """A merger with a newer epoch has taken over: this one must not publish again."""


class ReplicatedLog:
    """The write-ahead log, each appended record handed to the replication stream too."""

    def __init__(self, wal, server: ReplicationServer) -> None:
        self.wal, self.server = wal, server

    @property
    def next_index(self) -> int:
        return self.wal.next_index

    def append(
        self, record: dict, blobs: Sequence[tuple[Any, int | None]] = (), frozen: bool = False
    ) -> int:
        index = self.wal.append(record, blobs, frozen)
        self.server.appended(index, record, blobs)
        return index


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
        lease: PrimaryLease | None = None,
    ) -> None:
        self.config, self.epoch = config, epoch
        # with etcd: nothing is acknowledged while it is not valid (consensus.py)
        self.lease, self.lease_waits = lease, 0
        # the merger's loop says so: a barrier waiting for the lease gives up
        self.stopping = lambda: False
        # the merger's loop's sockets read while it waits here (merger/network/backlog.py)
        self.pump = lambda: None
        # the stream thread has none of the loop thread's context
        self.log = log.bind(role="merger", sender=sender)
        # terms: (epoch, first index); term: this one's number
        self.terms, self.term, self.genesis = list(terms), term, genesis
        self.cond = threading.Condition()
        self.tail = RecordTail(wal, wal_directory)
        # records appended so far
        self.length = wal.next_index
        self.follower: Follower | None = None
        self.state, self.fenced_by = "alone", None
        self.fold_index: dict[tuple[int, int], int] = {}
        self.counters: collections.Counter[str] = collections.Counter()
        self._stopping = False
        self.channel = StandbyChannel(context, config, security, sender, self.log, self.counters)
        # the loop wakes the stream thread with it
        self._wakeup = Wakeup(context, f"inproc://replication-{id(self)}")
        self.digests = FoldDigests(context, self.cond, str(id(self)))
        self._thread = threading.Thread(target=self._run, name="replication", daemon=True)
        self._thread.start()
        self.digests.start()

    # ---- called on the merger's loop ---------------------------------------------------------
    def appended(self, index: int, record: dict, blobs: Sequence[tuple[Any, int | None]]) -> None:
        frames = record_frames(index, record, blobs)
        nbytes = sum(memoryview(f).nbytes for f in frames)
        with self.cond:
            self.tail.keep(index, frames, nbytes)
            self.length = index + 1
            if record["type"] == records.FOLD:
                self.fold_index[(record["fragment"], record["version"])] = index
            elif record["type"] == records.TERM:
                self.terms.append((record["epoch"], index))
                self.term = record["term"]
        self._wakeup.signal()

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
            # host views, taken now: the next fold of this fragment takes its step over these
            # arrays (while the views are held, on copies of them)
            self.digests.put(index, fragment, {p: np.asarray(v) for p, v in state.params.items()})

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
                self.pump()
        self.check_fenced()
        self._hold_lease()

    def _hold_lease(self) -> None:
        """With etcd, return once the lease is valid; raises Fenced once it is lost, or when the
        merger stops without it (nothing more may be published)."""
        if self.lease is None or self.lease.valid():
            return
        self.lease_waits += 1
        self.log.warning("acks_held", why="the etcd lease is not valid: acknowledgements wait")
        began = time.monotonic()
        while not self.lease.valid():
            self.check_fenced()
            if self.stopping() or self._stopping:
                raise Fenced("stopped without a valid etcd lease: nothing more is published")
            self.lease.wait(self.config.lease_s / 6)
            self.pump()
        self.log.info("acks_resumed", held_s=round(time.monotonic() - began, 3))

    def check_fenced(self) -> None:
        if self.fenced_by is not None:
            raise Fenced(
                f"a merger with epoch {self.fenced_by} has taken over (this one's is {self.epoch})"
            )
        if self.lease is not None and self.lease.lost is not None:
            raise Fenced(self.lease.lost)

    def close(self) -> None:
        with self.cond:
            self._stopping = True
            self.cond.notify_all()
        self._wakeup.signal()
        self.digests.stop()
        if self.lease is not None:
            self.lease.close()
        self._thread.join(timeout=30)
        self.digests.join(timeout=30)
        # a thread still running keeps its own (the context's destruction ends them)
        ended = not self._thread.is_alive()
        self._wakeup.close(polled_end=ended)
        self.digests.wakeup.close(polled_end=ended)
        if ended:
            self.channel.close()

    # ---- the stream thread -------------------------------------------------------------------
    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.channel.socket, zmq.POLLIN)
        poller.register(self._wakeup.socket, zmq.POLLIN)
        poller.register(self.digests.wakeup.socket, zmq.POLLIN)
        next_lease = 0.0
        while not self._stopping:
            try:
                events = dict(poller.poll(int(self.config.lease_s / 6 * 1000)))
                for wake in (self._wakeup.socket, self.digests.wakeup.socket):
                    while wake in events and wake.poll(0):
                        wake.recv()
                if self.channel.socket in events:
                    self._receive()
                now = time.monotonic()
                if now >= next_lease:
                    next_lease = now + self.config.lease_s / 6
                    self._leases()
                self._stream()
                self._send_digests()
                self._judge(time.monotonic())
            # whatever breaks the stream must not hold the primary's acks
            except Exception as error:  # noqa: BLE001
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
        for identity, kind, body in self.channel.receive():
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
            self.channel.send(identity, encode(wire.REFUSED, {"why": OTHER_RUN}))
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
        self.channel.send(
            identity, encode(wire.START, {"at": at, "generation": body["generation"]})
        )

    def _on_stored(self, identity: bytes, body: dict) -> None:
        with self.cond:
            follower = self.follower
            # none, or an answer to an earlier follow
            if follower is None or not follower.answers(identity, body["generation"]):
                return
            follower.stored_to(body["length"], time.monotonic())
            self.cond.notify_all()

    def _leases(self) -> None:
        term = self.term
        if self.follower is not None:
            self.channel.send(
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
        self.channel.fence_peer(self.epoch, term)

    def _frames_of(self, start: int, budget: int) -> list[tuple[int, list, int]]:
        """Records start..: from memory when still there, else from the log on disk (up to
        `budget` bytes)."""
        with self.cond:
            first = self.tail.first(self.length)
            if start >= first:
                return self.tail.recent(start, first)
        return self.tail.from_disk(start, first, budget)

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
            not self.tail.records or follower.next < self.tail.records[0][0]
        ) and follower.in_flight_bytes > WINDOW_BYTES // 2:
            # from disk: refill in large steps, each a pass over the segments it reads
            return
        for index, frames, nbytes in self._frames_of(
            follower.next, WINDOW_BYTES - follower.in_flight_bytes
        ):
            if (
                index != follower.next
                or follower.in_flight_bytes >= WINDOW_BYTES
                or not self.channel.send(follower.identity, frames)
            ):
                return
            with self.cond:
                follower.sent(index, nbytes)
            self.counters["records_sent"] += 1

    def _send_digests(self) -> None:
        while self.digests.ready and self.follower is not None:
            with self.cond:
                index, fragment, digest = self.digests.ready.popleft()
            self.channel.send(
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
            why = follower.overdue(now, self.config.lease_s) if self.state != "alone" else None
            if why is None and follower.catches_up(self.length, now, self.config.lease_s):
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
            if follower is not None:
                follower.rewind(time.monotonic())
            # fragments' parameters: not kept for a standby that may not take them
            self.digests.ready.clear()
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
                **(
                    {"lease_valid": self.lease.valid(), "lease_waits": self.lease_waits}
                    if self.lease is not None
                    else {}
                ),
                **dict(self.counters),
            }
