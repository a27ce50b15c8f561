"""The standby merger: a bit-identical copy of the primary's state, kept from its log (primary.py).

It connects a DEALER to the primary's replication endpoint, says where its own log ends, sets
aside what the primary's log does not hold, then appends and applies every record the primary
sends, in order — the same records make the same folds, bit for bit — and reports what is on its
disk.  It checkpoints every `checkpoint_every` folds like the primary.  Each fold's digest is
compared with the primary's; a mismatch is an alarm and stops it (`Diverged`).

It takes over when the primary's lease lapses: no lease heartbeat for `lease_s`, counted only
once it has heard a primary (a standby never promotes itself without one, since it cannot know
whether its log is the newest).  Taking over writes a `term` record with the new epoch, above
every epoch the old primary used, and hands the state, log and lock to a `MergerService`.
`follow(probe=True)` is a merger's start with a peer: it becomes the standby if a primary answers
within two leases, else the primary.
"""

# Over 400 lines: one follower of one primary, its loop and its takeover over the same fields;
# the messages it reads are wire.py's, the state it keeps is MergerCore's.

from __future__ import annotations

import collections
import dataclasses
import threading
import time

import zmq

from dloco.bus.sockets import open_socket
from dloco.merger.log import logmatch, records
from dloco.merger.log.logmatch import genesis_id, genesis_of, newest_epoch, set_aside_from, terms_of
from dloco.merger.log.rundir import RunDirLock, check_shard
from dloco.merger.log.wal import WriteAheadLog
from dloco.merger.replication.consensus import Claim, Consensus, EtcdRefused, EtcdUnreachable
from dloco.merger.replication.wire import (
    DIGEST,
    FOLLOW,
    LEASE,
    RECORD,
    REFUSED,
    START,
    STORED,
    ReplicationError,
    decode,
    encode,
    fragment_digest,
    read_record,
)
from dloco.merger.settings import ReplicationConfig, ServiceConfig
from dloco.merger.state import checkpoint
from dloco.merger.state.core import MergerCore
from dloco.merger.state.recovery import checkpoint_dir, recover, wal_dir
from dloco.protocol.errors import DlocoError

POLL_MS = 50
DRAIN_LIMIT = 256
# records queued from the primary: no limit of ZeroMQ's, since the primary sends at most
# stream.WINDOW_BYTES beyond what we stored.  A limit stops the connection's input while we apply
# or recover; stopped past the heartbeat timeout, the connection is dropped and remade, and libzmq
# 4.3 then aborts restarting the input of the new one (stream_engine_base.cpp:396, "Assertion
# failed: _input_stopped"; zeromq/libzmq#3937), which a 30-minute soak hit once a takeover's old
# primary set its log aside and caught up
RECEIVE_HWM = 0
SEND_HWM = 16
# stored records' payloads waiting to be applied: beyond this the socket waits (a catch-up's memory)
UNAPPLIED_BYTES = 256 << 20
# fold digests awaiting their other half (a fold the primary made alone never gets one)
DIGESTS_KEPT = 4096


class Diverged(DlocoError):
    """The standby's state after a fold differs from the primary's."""


class Refused(DlocoError):
    """The primary will not be followed (another run's log)."""


@dataclasses.dataclass
class Takeover:
    """What a standby hands to the `MergerService` it becomes."""

    core: MergerCore
    wal: WriteAheadLog
    lock: RunDirLock
    epoch: int
    # (epoch, first index) of each term of its log
    terms: list[tuple[int, int]]
    # its term's number
    term: int
    # with etcd: the key it claimed, and its lease
    claim: Claim | None = None


class Standby:
    def __init__(
        self,
        config: ServiceConfig,
        replication: ReplicationConfig,
        context: zmq.Context,
        log,
        consensus: Consensus | None = None,
    ) -> None:
        self.config, self.replication, self.context, self.log = config, replication, context, log
        # with etcd, a takeover is a claim of the primary's key (consensus.py)
        self.consensus, self.next_claim, self.refusal_logged = consensus, 0.0, None
        self.lock = RunDirLock(config.run_dir)
        self.stopping, self.warming = False, None
        try:
            check_shard(config.run_dir, config.shard, config.shards)
            self._open()
        except BaseException:
            self.lock.release()
            raise
        # what the primary last said of itself, and when we last heard it
        self.primary_epoch = 0
        self.primary_term = 0
        self.primary_length = 0
        self.primary_state = ""
        self.heard = None
        # our latest `follow`, and whether its `start` has come
        self.generation, self.started = 0, False
        # fold index -> (fragment, ours)
        self.digests: collections.OrderedDict[int, tuple[int, str]] = collections.OrderedDict()
        # fold index -> the primary's digest
        self.theirs: collections.OrderedDict[int, str] = collections.OrderedDict()
        self.folds = self.compared = 0

    def _open(self) -> None:
        """Open the log and rebuild the state from it (none while the log is empty)."""
        self.wal = WriteAheadLog(wal_dir(self.config.run_dir), fsync=self.config.fsync)
        # stored, not yet applied
        self.unapplied: collections.deque[tuple[int, dict]] = collections.deque()
        self.unapplied_bytes, self.refollow = 0, False
        self.terms, _, self.term = terms_of(wal_dir(self.config.run_dir))
        self.core = recover(self.config.run_dir) if self.wal.next_index > 0 else None
        if self.core is not None:
            self._warm_up()
        self.genesis = genesis_of(self.config.run_dir)

    def _warm_up(self) -> None:
        """Compile the fold kernels in the background (as the primary does), so the first folds
        applied here do not stall the stream for a compilation."""
        core = self.core
        self.warming = threading.Thread(
            target=lambda: core.warm_up(stopping=lambda: self.stopping), name="warm-up", daemon=True
        )
        self.warming.start()

    # Over 60 lines: one turn of the follower's loop in the order each turn needs (the socket,
    # the disk, the applier, the checkpoint, a follow again, the takeover rule), over shared fields.
    def follow(self, probe: bool = False) -> Takeover | None:
        """Follow the primary until its lease lapses (a Takeover), or, probing, until two leases
        passed without a primary (None).  Raises Diverged, Refused; returns None when stopped."""
        dealer = open_socket(
            self.context,
            zmq.DEALER,
            self.replication.peer,
            self.config.security,
            self.config.sender,
            receive_hwm=RECEIVE_HWM,
            # not ZMQ_IMMEDIATE: libzmq 4.3.5 aborts (fq.cpp, !_more) when such a DEALER's peer
            # goes while a multipart record is half read; what is sent while no primary is up
            # waits, SEND_HWM messages at most (a primary then hears few stale follows)
            send_hwm=SEND_HWM,
        )
        began, unsynced = time.monotonic(), False
        next_checkpoint = self.folds + self.config.checkpoint_every
        self.asked = -float("inf")
        self.log.info(
            "following", peer=self.replication.peer, length=self.wal.next_index, probe=probe
        )
        try:
            while not self.stopping:
                dealer.poll(POLL_MS)
                unsynced |= self._receive(dealer)
                # stored first, applied after: the primary waits for the disk, not for our folds
                if unsynced:
                    self.wal.sync()
                    unsynced = False
                    self._stored(dealer)
                # then back to the socket
                self._apply_stored(deadline=time.monotonic() + self.replication.lease_s / 6)
                if self.folds >= next_checkpoint and not self.unapplied:
                    checkpoint.save(
                        checkpoint_dir(self.config.run_dir), self.core, self.wal.next_index
                    )
                    next_checkpoint = self.folds + self.config.checkpoint_every
                if dealer.poll(0) or self.unapplied:
                    # more to do first: silence is judged on an empty queue
                    continue
                now = time.monotonic()
                if (
                    self.refollow
                    or now - max(self.asked, self.heard or -float("inf"))
                    > self.replication.lease_s / 3
                    # heard, but our latest follow not answered (lost with a dropped connection)
                    or (not self.started and now - self.asked > self.replication.lease_s)
                ):
                    # at start, after a lost record, and whenever the primary is silent: a restarted
                    # primary learns of us so
                    self._follow_again(dealer, now)
                if (
                    self.heard is not None
                    and now - self.heard > self.replication.lease_s
                    and self.core is not None
                ):
                    if self.consensus is None:
                        return self._take_over(now)
                    if (claim := self._claim(now)) is not None:
                        return self._take_over(now, claim)
                if probe and self.heard is None and now - began > 2 * self.replication.lease_s:
                    return None
            return None
        finally:
            dealer.close(linger=0)

    def _receive(self, dealer: zmq.Socket) -> bool:
        """Take the messages waiting (DRAIN_LIMIT at most; none while the stored records not yet
        applied are full: apply first); True when a record was appended."""
        unsynced = False
        for _ in range(DRAIN_LIMIT if self.unapplied_bytes < UNAPPLIED_BYTES else 0):
            try:
                frames = dealer.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            unsynced |= self._on_message([f.buffer for f in frames], dealer)
        return unsynced

    def _follow_again(self, dealer: zmq.Socket, now: float) -> None:
        """Say where our log ends, as a new `follow` generation (numbered only once queued: the
        primary answers the newest one we sent, however many waited out a cut)."""
        generation = self.generation + 1
        sent = _send(
            dealer,
            encode(
                FOLLOW,
                {
                    "length": self.wal.next_index,
                    "terms": self.terms,
                    "genesis": self.genesis,
                    "generation": generation,
                },
            ),
        )
        # unsent (the queue to an absent primary full): again next turn
        if sent:
            self.generation = generation
            self.asked = now
            self.started = False
            self.refollow = False

    def _on_message(self, frames: list, dealer: zmq.Socket) -> bool:
        """Handle one message from the primary; True when a record was appended."""
        try:
            kind, body, rest = decode(frames)
        except ReplicationError as error:
            self.log.warning(
                "replication_message_rejected", reason=error.reason, detail=str(error)[:200]
            )
            return False
        self.heard = time.monotonic()
        if kind == LEASE:
            self.primary_epoch, self.primary_term = (
                max(self.primary_epoch, body["epoch"]),
                body["term"],
            )
            self.primary_length, self.primary_state = body["length"], body["state"]
            self._stored(dealer)
        elif kind == START and body["generation"] == self.generation:
            self._start_at(body["at"])
            self.started = True
        # records before our latest follow's start belong to an earlier stream
        elif kind == RECORD and self.started:
            return self._on_record(body, rest)
        elif kind == DIGEST:
            self._compare(body["index"], body["sha256"], None)
        elif kind == REFUSED:
            raise Refused(
                f"the primary at {self.replication.peer} refuses this standby: {body['why']}"
            )
        return False

    def _stored(self, dealer: zmq.Socket) -> None:
        """Say how much of the log is on our disk, for the stream our latest follow started (before
        its `start`, records may still be set aside)."""
        if self.started:
            _send(
                dealer, encode(STORED, {"length": self.wal.durable, "generation": self.generation})
            )

    def _start_at(self, at: int) -> None:
        if at >= self.wal.next_index:
            return
        self.digests.clear()
        self.theirs.clear()
        self.wal.close()
        moved = set_aside_from(
            wal_dir(self.config.run_dir), at, checkpoint_dir(self.config.run_dir)
        )
        self.log.warning(
            "log_set_aside",
            from_index=at,
            moved=moved,
            why="the primary's log does not hold these records",
        )
        self._open()

    def _on_record(self, body: dict, rest: list) -> bool:
        try:
            index, record, blobs = read_record(body, rest)
        except ReplicationError as error:
            self.log.warning(
                "replication_message_rejected", reason=error.reason, detail=str(error)[:200]
            )
            # follow again from where our log ends: the primary resends from there
            self.refollow = True
            return False
        if index != self.wal.next_index:
            # beyond a gap: a record was lost on the way
            self.refollow |= index > self.wal.next_index
            return False
        if record["type"] != records.GENESIS and self.core is None:
            raise Diverged(f"record {index} arrived before any genesis record")
        if record["type"] == records.GENESIS and (
            why := logmatch.other_shard(record, self.config.shard, self.config.shards)
        ):
            raise Refused(f"the primary at {self.replication.peer}: {why}")
        self.wal.append(record, blobs)
        if record["type"] == records.GENESIS:
            # as the log reads it back
            record = {**record, "blobs": [blob for blob, _ in blobs]} if blobs else record
            self.core, self.terms, self.term, self.genesis = (
                MergerCore.from_genesis(record),
                [(0, 0)],
                0,
                genesis_id(record),
            )
            self._warm_up()
            return True
        if record["type"] == records.TERM:
            self.terms.append((record["epoch"], index))
            self.term = max(self.term, record["term"])
        self.unapplied.append(
            (index, {**record, "blobs": [blob for blob, _ in blobs]} if blobs else record)
        )
        self.unapplied_bytes += sum(blob.nbytes for blob, _ in blobs)
        return True

    def _apply_stored(self, deadline: float = float("inf")) -> None:
        """Apply stored records (the same folds as the primary's, bit for bit), until `deadline`
        (at least one).  A record this state cannot apply is a divergence."""
        while self.unapplied:
            index, record = self.unapplied.popleft()
            self.unapplied_bytes -= sum(blob.nbytes for blob in record.get("blobs", ()))
            try:
                report = self.core.apply_record(record, index)
            # whatever the reason, this state is not the primary's
            except Exception as error:  # noqa: BLE001
                raise Diverged(f"log record {index} does not apply here: {error!r}") from error
            if report is not None:
                self.folds += 1
                fragment = record["fragment"]
                self._compare(
                    index, None, (fragment, fragment_digest(self.core.states[fragment].params))
                )
            if time.monotonic() >= deadline:
                return

    def _compare(self, index: int, theirs: str | None, ours: tuple[int, str] | None) -> None:
        if ours is not None:
            if index not in self.theirs:
                # a fold the primary made while it had no standby never gets its digest
                _keep(self.digests, index, ours)
                return
            theirs = self.theirs.pop(index)
        else:
            if index not in self.digests:
                _keep(self.theirs, index, theirs)
                return
            ours = self.digests.pop(index)
        if ours[1] != theirs:
            raise Diverged(
                f"fragment {ours[0]} after log record {index}: digest {ours[1][:16]}… here,"
                f" {theirs[:16]}… at the primary"
            )
        self.compared += 1

    def _epoch_floor(self) -> int:
        """Above every epoch it has seen."""
        return max(time.time_ns(), self.primary_epoch + 1, newest_epoch(self.terms) + 1)

    def _claim(self, now: float) -> Claim | None:
        """With etcd, the primary silent: claim its key (every lease/6).  None while it is held (the
        primary renews it, so it lives: only this standby is cut off) or etcd is out of reach;
        each silence's first refusal is logged."""
        if now < self.next_claim:
            return None
        self.next_claim = now + self.replication.lease_s / 6
        try:
            claim = self.consensus.claim(self._epoch_floor())
            why = None if claim is not None else f"held by {self.consensus.holder_now()}"
        except (EtcdUnreachable, EtcdRefused) as error:
            claim, why = None, str(error)[:300]
        if why is not None and self.refusal_logged != self.heard:
            self.refusal_logged = self.heard
            self.log.warning("takeover_refused", silent_s=round(now - self.heard, 3), why=why)
        return claim

    def _take_over(self, now: float, claim: Claim | None = None) -> Takeover:
        self._apply_stored()
        epoch = claim.epoch if claim is not None else self._epoch_floor()
        term = max(self.term, self.primary_term) + 1
        self.terms.append((epoch, self.wal.append(records.term_record(term, epoch))))
        self.wal.sync()
        behind = self.primary_length - (self.wal.next_index - 1)
        (self.log.error if behind > 0 else self.log.warning)(
            "taking_over",
            silent_s=round(now - self.heard, 3),
            epoch=epoch,
            term=term,
            length=self.wal.next_index,
            versions=[state.version for state in self.core.states],
            folds_compared=self.compared,
            primary_said=self.primary_state,
            behind_records=max(0, behind),
            **({"etcd_revision": claim.revision} if claim is not None else {}),
        )
        return Takeover(self.core, self.wal, self.lock, epoch, self.terms, term, claim)

    def close(self) -> None:
        # a stopping standby's warm-up ends after the compilation under way
        if self.warming is not None:
            # exiting while XLA compiles on another thread aborts the process
            self.warming.join(timeout=120)
        self.wal.close()
        self.lock.release()


def _keep(book: collections.OrderedDict, index: int, value) -> None:
    book[index] = value
    while len(book) > DIGESTS_KEPT:
        book.popitem(last=False)


def _send(dealer: zmq.Socket, frames: list) -> bool:
    try:
        dealer.send_multipart(frames, zmq.NOBLOCK)
        return True
    # its queue is full (the primary long gone): asked again later
    except zmq.ZMQError:
        return False
