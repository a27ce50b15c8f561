"""What the primary's replication stream keeps (merger/replication/primary.py): the standby it
streams to (`Follower`: where the stream is, what is in flight, what the standby has stored, whether
it is caught up or must be dropped), the records it streams from (`RecordTail`: the recent ones in
memory, older ones read back from the log on disk) and the fold digests it sends (`FoldDigests`,
hashed on a thread of their own).

None of them locks: the server calls them under its own lock (but `RecordTail.from_disk`, which
reads the disk only), and `FoldDigests` takes that lock to hand a digest over.
"""

from __future__ import annotations

import collections
import dataclasses
import queue
import threading
from pathlib import Path

import zmq

from dloco.merger.log.segments import read_records
from dloco.merger.replication.channel import Wakeup
from dloco.merger.replication.wire import fragment_digest, record_frames

# recent records kept in memory for the standby; older ones are read back from the log
TAIL_BYTES = 256 << 20
# sent to the standby beyond what it has stored (its memory for records in flight)
WINDOW_BYTES = 256 << 20
# records sent per turn of the stream thread before it looks at its socket again
SEND_BATCH = 256
# a standby within this many records of the primary's log counts as caught up (sync mode then waits
# for it)
CAUGHT_UP_RECORDS = 64


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

    def answers(self, identity: bytes, generation: int) -> bool:
        """Whether a `stored` from `identity` answering follow `generation` is this follower's."""
        return self.identity == identity and self.generation == generation

    def stored_to(self, length: int, now: float) -> None:
        """It says it has stored the first `length` records: those are no longer in flight."""
        if length > self.stored:
            self.stored, self.progressed = length, now
            while self.in_flight and self.in_flight[0][0] < self.stored:
                self.in_flight_bytes -= self.in_flight.popleft()[1]
        self.heard, self.reported = now, True

    def sent(self, index: int, nbytes: int) -> None:
        self.next += 1
        self.in_flight.append((index, nbytes))
        self.in_flight_bytes += nbytes

    def rewind(self, now: float) -> None:
        """Dropped: the stream resumes from what it has stored (a record lost on the way is sent
        again), and it is back in sync only after it says what it stored again."""
        self.caught_up = self.reported = False
        self.next, self.progressed = self.stored, now
        self.in_flight.clear()
        self.in_flight_bytes = 0

    def overdue(self, now: float, lease_s: float) -> str | None:
        """Why to stop waiting for it: silent, or its stored length stuck, for two leases."""
        if now - self.heard > 2 * lease_s:
            return "silent for two leases"
        if now - self.progressed > 2 * lease_s:
            return "its stored length has not moved for two leases"
        return None

    def catches_up(self, length: int, now: float, lease_s: float) -> bool:
        """Whether it has caught up just now: heard from lately, it has said it stored all but the
        last CAUGHT_UP_RECORDS of the log's `length` records."""
        return (
            not self.caught_up
            and self.reported
            and self.stored >= length - CAUGHT_UP_RECORDS
            and now - self.heard < lease_s
        )


class RecordTail:
    """The records the stream sends from: the latest ones as frames in memory (TAIL_BYTES of
    them), older ones read back from the log in `directory` (what `wal` holds durable)."""

    def __init__(self, wal, directory: str | Path) -> None:
        self.wal, self.directory = wal, Path(directory)
        # (index, frames, bytes), oldest first
        self.records: collections.deque[tuple[int, list, int]] = collections.deque()
        self.nbytes = 0

    def keep(self, index: int, frames: list, nbytes: int) -> None:
        self.records.append((index, frames, nbytes))
        self.nbytes += nbytes
        while self.nbytes > TAIL_BYTES and len(self.records) > 1:
            self.nbytes -= self.records.popleft()[2]

    def first(self, length: int) -> int:
        """The index of the oldest record in memory (`length`, the log's, when there is none)."""
        return self.records[0][0] if self.records else length

    def recent(self, start: int, first: int) -> list[tuple[int, list, int]]:
        """Records start.. from memory (SEND_BATCH of them); `first`: `self.first(...)`."""
        return [
            self.records[i]
            for i in range(start - first, min(len(self.records), start - first + SEND_BATCH))
        ]

    def from_disk(self, start: int, first: int, budget: int) -> list[tuple[int, list, int]]:
        """Records start.. (before `first`, the oldest in memory) read back from the log: what is
        durable there, up to `budget` bytes (a segment is read once per window, not once per
        record)."""
        out, total = [], 0
        for index, record in read_records(self.directory, start):
            if index >= min(first, self.wal.durable) or total >= budget:
                break
            blobs = record.pop("blobs", [])
            frames = record_frames(index, record, [(b, None) for b in blobs])
            out.append((index, frames, sum(memoryview(f).nbytes for f in frames)))
            total += out[-1][2]
        return out


class FoldDigests:
    """Fold digests for the standby, hashed on a thread of their own (a large fragment's hash must
    delay neither the merger's loop nor the leases).  `ready` holds (index, fragment, sha256) for
    the stream thread, guarded by `cond` (the server's lock); `wakeup` wakes that thread."""

    def __init__(self, context: zmq.Context, cond: threading.Condition, name: str) -> None:
        self.cond = cond
        self.ready: collections.deque[tuple[int, int, str]] = collections.deque()
        self.wakeup = Wakeup(context, f"inproc://replication-hashed-{name}")
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._hash, name="replication-digests", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def put(self, index: int, fragment: int, params) -> None:
        self._queue.put((index, fragment, params))

    def _hash(self) -> None:
        while (item := self._queue.get()) is not None:
            index, fragment, params = item
            digest = fragment_digest(params)
            with self.cond:
                self.ready.append((index, fragment, digest))
            self.wakeup.signal()

    def stop(self) -> None:
        """Let the hashing thread end once it has hashed what was put before."""
        self._queue.put(None)

    def join(self, timeout: float) -> None:
        self._thread.join(timeout=timeout)
