"""The replication stream: a primary merger ships its write-ahead log to a standby (PROTOCOL.md §12).

The primary binds a ROUTER (``--replication-endpoint``, CURVE domain ``replication``: mergers
only); a standby connects a DEALER and says where its own log ends (`follow`: its length, its
terms, its genesis).  The primary answers with where the copy starts (`start`: the logs' common
prefix, merger/logmatch.py; the standby sets the rest aside), then sends every record from there
on, in index order — older ones read back from its log on disk, recent ones from memory — and a
`lease` heartbeat every lease/6.  The standby appends each record to its own log, applies it to
its own state (the fold is deterministic given the log: the same bytes), and reports how much of
it is on its disk (`stored`).  After each fold the primary sends the fragment's digest; a standby
whose digest differs stops (an alarm, never a silent divergence).

Modes: ``sync`` — the primary publishes nothing (snapshot, ack, cursor) before the standby has
stored the records behind it (`ReplicationServer.barrier`); a standby silent for two leases is
dropped and the primary goes on alone, logging it, until the standby is back and caught up.
``async`` — records stream the same way, nothing waits.  ``off`` — no stream.

This module's `ReplicationServer` is the primary's side, on a thread of its own (it owns the
ROUTER); the merger's loop hands it records (`appended`) and finished folds (`folded`).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import zmq

from bus.security import Security
from bus.sockets import open_socket
from merger import records
from merger.logmatch import agreed_length
from merger.wal import read_records
from protocol.checksum import crc32
from protocol.errors import DlocoError

MODES = ("sync", "async", "off")
FOLLOW, START, RECORD, LEASE, STORED, DIGEST, FENCE, REFUSED = (b"follow", b"start", b"record", b"lease", b"stored", b"digest",
                                                                  b"fence", b"refused")
FIELDS = {FOLLOW: ("length", "terms", "genesis"), START: ("at",), RECORD: ("index", "crcs"), LEASE: ("epoch", "term", "length", "lease_s"),
          STORED: ("length",), DIGEST: ("index", "fragment", "sha256"), FENCE: ("epoch", "term"), REFUSED: ("why",)}
TAIL_BYTES = 256 << 20  # recent records kept in memory for the standby; older ones are read back from the log
SEND_BATCH = 256  # records sent per turn of the stream thread before it looks at its socket again
SEND_HWM = 4096
CAUGHT_UP_RECORDS = 64  # a standby within this many records of the primary's log counts as caught up (sync mode then waits for it)


class ReplicationError(DlocoError):
    """A replication message that cannot be read; `reason` is the counter key."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def encode(kind: bytes, body: dict, *extra) -> list:
    return [kind, msgpack.packb(body, use_bin_type=True), *extra]


def decode(frames: Sequence) -> tuple[bytes, dict, list]:
    """(kind, body, the frames after the body); ReplicationError for anything else."""
    if len(frames) < 2:
        raise ReplicationError("frames", f"{len(frames)} frame(s), at least 2 expected")
    kind = bytes(frames[0])
    if kind not in FIELDS:
        raise ReplicationError("kind", f"unknown message kind {kind[:16]!r}")
    try:
        body = msgpack.unpackb(frames[1], raw=False, strict_map_key=False)
    except (ValueError, TypeError, msgpack.UnpackException) as error:
        raise ReplicationError("body", f"{kind.decode()}: undecodable body: {error}") from None
    if not isinstance(body, dict) or any(field not in body for field in FIELDS[kind]):
        raise ReplicationError("body", f"{kind.decode()}: needs {', '.join(FIELDS[kind])}")
    return kind, body, list(frames[2:])


def record_frames(index: int, record: dict, blobs: Sequence[tuple[Any, int | None]]) -> list:
    """A log record as it travels: header (index, blob CRCs), the record's map, its blobs."""
    return encode(RECORD, {"index": index, "crcs": [crc for _, crc in blobs]}, msgpack.packb(record, use_bin_type=True),
                  *[memoryview(buffer).cast("B") for buffer, _ in blobs])


def read_record(body: dict, rest: list) -> tuple[int, dict, list[tuple[memoryview, int | None]]]:
    """(index, record, blobs with CRCs) of a `record` message; a blob whose CRC is given is checked."""
    try:
        record = msgpack.unpackb(rest[0], raw=False, strict_map_key=False)
    except (IndexError, ValueError, TypeError, msgpack.UnpackException) as error:
        raise ReplicationError("record", f"record {body['index']}: undecodable: {error}") from None
    crcs, blobs = body["crcs"], [memoryview(frame) for frame in rest[1:]]
    if not isinstance(record, dict) or "type" not in record or len(crcs) != len(blobs):
        raise ReplicationError("record", f"record {body['index']}: {len(blobs)} blobs for {len(crcs)} CRCs, or no type")
    for number, (blob, crc) in enumerate(zip(blobs, crcs)):
        if crc is not None and crc32(blob) != crc:
            raise ReplicationError("record", f"record {body['index']}: blob {number} fails its CRC")
    return int(body["index"]), record, list(zip(blobs, crcs))


def fragment_digest(params) -> str:
    """sha256 over one fragment's parameters (records.params_digest for one fragment)."""
    digest = hashlib.sha256()
    for path in sorted(params):
        digest.update(path.encode())
        digest.update(np.ascontiguousarray(params[path], dtype="<f4").tobytes())
    return digest.hexdigest()


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


@dataclasses.dataclass(frozen=True)
class ReplicationConfig:
    mode: str = "off"  # sync | async | off
    endpoint: str = ""  # ROUTER this merger binds while it is the primary ('@tcp://...')
    peer: str = ""  # the other merger's replication endpoint: followed as a standby, fenced after a takeover
    lease_s: float = 3.0  # a standby takes over after this long without the primary's lease; the primary drops it after twice this
    standby: bool = False  # start as the standby of `peer`

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise DlocoError(f"replication mode must be one of {MODES}, got {self.mode!r}")
        if self.lease_s <= 0:
            raise DlocoError(f"lease must be positive, got {self.lease_s}")
        if self.mode != "off" and not self.endpoint:
            raise DlocoError("replication needs --replication-endpoint (where this merger serves its log as the primary)")
        if self.standby and not self.peer:
            raise DlocoError("a standby needs the primary's replication endpoint (--standby-of)")
        if self.peer and self.mode == "off":
            raise DlocoError("a merger with a peer streams its log when it is the primary: give --replication-endpoint "
                             "(and --replication sync or async)")

    @property
    def on(self) -> bool:
        return self.mode != "off"


@dataclasses.dataclass
class Follower:
    identity: bytes
    next: int  # the next record to send
    stored: int  # records on its disk
    heard: float  # monotonic
    reported: bool = False  # has said what it stored since it joined
    caught_up: bool = False  # has stored all but the last CAUGHT_UP_RECORDS records at some point since it joined


class ReplicationServer:
    """The primary's side.  `appended`, `folded` and `barrier` are called by the merger's loop; the
    stream thread owns the sockets.  `state`: "alone" (no standby, or one silent for two leases),
    "catching_up", "sync" (the standby has stored every record sent to it: sync mode waits for it)."""

    def __init__(self, context: zmq.Context, config: ReplicationConfig, security: Security, sender: str, wal, wal_directory: Path,
                 epoch: int, terms: list[tuple[int, int]], genesis: int, log) -> None:
        self.config, self.wal, self.directory, self.epoch = config, wal, Path(wal_directory), epoch
        self.log = log.bind(role="merger", sender=sender)  # the stream thread has none of the loop thread's context
        self.terms, self.genesis = list(terms), genesis
        self.cond = threading.Condition()
        self.tail: collections.deque[tuple[int, list, int]] = collections.deque()
        self.tail_bytes = 0
        self.length = wal.next_index  # records appended so far
        self.follower: Follower | None = None
        self.state, self.fenced_by = "alone", None
        self.digests: collections.deque = collections.deque()
        self.fold_index: dict[tuple[int, int], int] = {}
        self.counters: collections.Counter[str] = collections.Counter()
        self._stopping = False
        self._socket = open_socket(context, zmq.ROUTER, config.endpoint, security, sender, domain="replication", send_hwm=SEND_HWM,
                                   report=lambda message: log.warning("auth_refused", detail=message))
        self._socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._fence = None
        if config.peer:  # tell the peer, should it be an old primary come back, that it is fenced
            self._fence = open_socket(context, zmq.DEALER, config.peer, security, sender)
            self._fence.setsockopt(zmq.IMMEDIATE, 1)
        endpoint = f"inproc://replication-{id(self)}"
        self._wake_in = context.socket(zmq.PAIR)
        self._wake_in.bind(endpoint)
        self._wake = context.socket(zmq.PAIR)  # the loop's end
        self._wake.connect(endpoint)
        self._thread = threading.Thread(target=self._run, name="replication", daemon=True)
        self._thread.start()

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
                self.terms.append((record["term"], index))
        self._signal()

    def folded(self, fragment: int, version: int, state) -> None:
        """A fold is computed: its digest goes to the standby (hashed on the stream thread)."""
        with self.cond:
            index = self.fold_index.pop((fragment, version), None)
            if index is not None and self.follower is not None:
                self.digests.append((index, fragment, state.params))
        self._signal()

    def barrier(self, length: int) -> None:
        """In sync mode, return once the standby has stored the first `length` records, or has been
        dropped (silent for two leases); at once in async mode or with no standby in sync.  Raises
        Fenced once a newer primary said so: nothing may be published after that."""
        with self.cond:
            while (self.config.mode == "sync" and self.state == "sync" and self.follower is not None and self.follower.stored < length
                   and not self._stopping and self.fenced_by is None):
                self.cond.wait(timeout=self.config.lease_s / 6)
        self.check_fenced()

    def check_fenced(self) -> None:
        if self.fenced_by is not None:
            raise Fenced(f"a merger with epoch {self.fenced_by} has taken over (this one's is {self.epoch})")

    def close(self) -> None:
        with self.cond:
            self._stopping = True
            self.cond.notify_all()
        self._signal()
        self._thread.join(timeout=10)
        for socket in (self._wake, self._wake_in, self._socket, self._fence):
            if socket is not None:
                socket.close(linger=0)

    def _signal(self) -> None:
        try:
            self._wake.send(b"", zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    # ---- the stream thread -------------------------------------------------------------------
    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        poller.register(self._wake_in, zmq.POLLIN)
        next_lease = 0.0
        while not self._stopping:
            events = dict(poller.poll(int(self.config.lease_s / 6 * 1000)))
            if self._wake_in in events:
                while self._wake_in.poll(0):
                    self._wake_in.recv()
            if self._socket in events:
                self._receive()
            now = time.monotonic()
            if now >= next_lease:
                next_lease = now + self.config.lease_s / 6
                self._leases()
            self._stream()
            self._send_digests()
            self._judge(time.monotonic())

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
                self.log.warning("replication_message_rejected", reason=error.reason, detail=str(error)[:200])
                continue
            if kind == FOLLOW:
                self._on_follow(identity, body)
            elif kind == STORED:
                with self.cond:
                    if self.follower is not None and self.follower.identity == identity:
                        self.follower.stored = max(self.follower.stored, int(body["length"]))
                        self.follower.heard, self.follower.reported = time.monotonic(), True
                        self.cond.notify_all()
            elif kind == FENCE and int(body["epoch"]) > self.epoch:
                with self.cond:
                    if self.fenced_by is None:
                        self.log.warning("fenced", by_epoch=body["epoch"], by_term=body["term"], epoch=self.epoch)
                    self.fenced_by = int(body["epoch"])
                    self.cond.notify_all()
            else:
                self.counters[f"unexpected/{kind.decode()}"] += 1

    def _on_follow(self, identity: bytes, body: dict) -> None:
        length, theirs = int(body["length"]), [tuple(t) for t in body["terms"]]
        if length > 0 and int(body["genesis"]) != self.genesis:
            self._send(identity, encode(REFUSED, {"why": "its log is another run's (its genesis record differs from this primary's)"}))
            self.log.error("standby_refused", why="genesis differs")
            return
        with self.cond:
            at = agreed_length(self.terms, self.length, theirs, length) if length > 0 else 0
            self.follower = Follower(identity, at, at, time.monotonic())
            self.state = "catching_up"
            self.cond.notify_all()
        self.log.info("standby_following", its_length=length, common=at, length=self.length)
        self._send(identity, encode(START, {"at": at}))

    def _leases(self) -> None:
        lease = {"epoch": self.epoch, "term": self.terms[-1][0] if self.terms else 0, "length": self.length, "lease_s": self.config.lease_s}
        if self.follower is not None:
            self._send(self.follower.identity, encode(LEASE, lease))
        if self._fence is not None:
            try:
                self._fence.send_multipart(encode(FENCE, {"epoch": self.epoch, "term": lease["term"]}), zmq.NOBLOCK)
            except zmq.ZMQError:  # nobody there: nothing to fence
                pass

    def _send(self, identity: bytes, frames: list) -> bool:
        try:
            self._socket.send_multipart([identity, *frames], zmq.NOBLOCK, copy=False)
            return True
        except zmq.Again:  # its queue is full: the stream resumes from the same record next turn
            self.counters["send_full"] += 1
        except zmq.ZMQError:  # EHOSTUNREACH: it has gone; it says `follow` again when back
            self.counters["send_unroutable"] += 1
        return False

    def _frames_of(self, start: int, limit: int) -> list[tuple[int, list]]:
        """Records start.. (at most `limit`): from memory when still there, else from the log on
        disk (only what is durable there)."""
        with self.cond:
            first = self.tail[0][0] if self.tail else self.length
            if start >= first:
                return [self.tail[i][:2] for i in range(start - first, min(len(self.tail), start - first + limit))]
        out = []
        for index, record in read_records(self.directory, start):
            if index >= min(first, self.wal.durable) or len(out) >= limit:
                break
            blobs = record.pop("blobs", [])
            out.append((index, record_frames(index, record, [(b, None) for b in blobs])))
        return out

    def _stream(self) -> None:
        follower = self.follower
        if follower is None or follower.next >= self.length:
            return
        for index, frames in self._frames_of(follower.next, SEND_BATCH):
            if index != follower.next or not self._send(follower.identity, frames):
                return
            follower.next += 1
            self.counters["records_sent"] += 1

    def _send_digests(self) -> None:
        while self.digests and self.follower is not None:
            index, fragment, params = self.digests.popleft()
            self._send(self.follower.identity, encode(DIGEST, {"index": index, "fragment": fragment, "sha256": fragment_digest(params)}))

    def _judge(self, now: float) -> None:
        with self.cond:
            follower, before = self.follower, self.state
            if follower is not None and now - follower.heard > 2 * self.config.lease_s:
                self.follower, self.state = None, "alone"
            elif follower is not None and not follower.caught_up and follower.reported and follower.stored >= self.length - CAUGHT_UP_RECORDS:
                follower.caught_up, self.state = True, "sync"
            if self.state != before:
                self.cond.notify_all()
        if self.state != before:
            log = self.log.warning if self.state == "alone" else self.log.info
            log("replication", state=self.state, was=before, length=self.length,
                stored=follower.stored if follower is not None else None, mode=self.config.mode)

    def snapshot(self) -> dict:
        """For metrics and the status: state, records the standby lacks on disk."""
        with self.cond:
            follower = self.follower
            return {"state": self.state, "lag": self.length - follower.stored if follower is not None else None,
                    "fenced_by": self.fenced_by, **dict(self.counters)}
