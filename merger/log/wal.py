"""Segmented write-ahead log: the writer, appending records and making them durable.

The segment files and their records are merger/log/segments.py's.  Blobs are written as they are
(no copy into the msgpack) with a CRC the caller may already know: the merger logs delta payloads
with the CRC-32 their frame carried and decode verified, so a payload is checksummed once on its
way in, and still verified when the log is read.

Records are written on a thread of their own (``wal-write``), in order: `append` numbers a record,
queues it and returns; a record whose blobs the caller may change later (``frozen=False``, e.g.
the genesis record's parameters) is written before `append` returns.  So the merger's receiving
thread does not wait for the disk: writes to the page cache are throttled to the disk's pace once
dirty pages pile up, which made the log's `write` a large share of that thread's time at 1 B
parameters (BENCHMARKS.md).  At most `queue_bytes` wait to be written (then `append` waits).  A
write that fails is final: nothing after it is written, and every later append, sync or wait
raises the `StorageError`.

``sync()`` makes everything appended durable; ``sync_async()`` hands the fsync to a background
thread and returns a ticket for ``wait_durable`` — the merger starts the fsync when it dispatches
a fold and waits for it only when the fold is computed and about to be announced.  Both wait for
the writer first: a ticket is durable only once written and fsynced.

A full segment is closed and the next one opened without waiting for the disk: the fsync of the
old segment and of the directory happen with the next sync, in order — older segments, the
directory, then the current one — before anything after them is called durable.  (Waiting on
the writer would stall it on the disk at every segment, the receiving thread behind it.)

Opening a log for append scans every segment and truncates a torn tail away (what ends the log:
merger/log/segments.py).  Segments after that point were written after it, so never durable (only
a power failure leaves them behind): they are moved to ``DIR/discarded/<index where the log
ends>/``, not deleted.  Any other bad record raises `LogCorruption`.

``fsync``: "always" (every append is durable before `append` returns), "batch" (durable after
`sync()`, which the service calls before it acknowledges), "never" (tests, benchmarks: "durable"
once written).
"""

from __future__ import annotations

import collections
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import msgpack

from dloco.merger.log.segments import _HEADER, MAX_META_BYTES, _fsync_dir, _segments, open_log
from dloco.protocol.checksum import crc32
from dloco.protocol.errors import DlocoError

FSYNC_POLICIES = ("always", "batch", "never")
# records queued for the writer thread, at most (bytes); a record larger is queued alone
QUEUE_BYTES = 1 << 30


class Log(Protocol):
    """What the merger's core appends its records to (WriteAheadLog; tests give it others)."""

    next_index: int

    def append(
        self, record: dict, blobs: Sequence[tuple[Any, int | None]] = (), frozen: bool = False
    ) -> int: ...


class StorageError(DlocoError):
    """The run directory's disk refused a write or an fsync (full, read-only, failing).  What is on
    disk stays valid: a record cut short is a torn tail, which a restart truncates."""


class WriteAheadLog:
    def __init__(
        self,
        directory: str | Path,
        segment_bytes: int = 64 << 20,
        fsync: str = "batch",
        queue_bytes: int = QUEUE_BYTES,
    ) -> None:
        if fsync not in FSYNC_POLICIES:
            raise DlocoError(f"wal fsync policy must be one of {FSYNC_POLICIES}, got {fsync!r}")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.segment_bytes, self.fsync, self.queue_bytes = segment_bytes, fsync, queue_bytes
        # by this process (metrics)
        self.bytes_appended = 0
        # called with each fsync's seconds (metrics)
        self.on_fsync = None
        # guards the fields below; fsync runs with it released
        self._cond = threading.Condition()
        # tickets: record indexes flushed / made durable
        self._wanted = self._durable = 0
        # descriptors of full segments not yet fsynced, oldest first
        self._rotated: list[int] = []
        # a segment was created since the directory's last fsync
        self._directory_dirty = False
        # a thread is fsyncing (the lock released): others wait their turn
        self._syncing = False
        self._syncer: threading.Thread | None = None
        self._closing, self._error = False, None
        # truncated_bytes: of a torn tail; discarded: segments set aside after it (module docstring)
        self.next_index, self.truncated_bytes, self.discarded = open_log(self.directory)
        # records for the writer thread: (index, header and map, blob views, bytes)
        self._queue: collections.deque[tuple[int, bytes, list, int]] = collections.deque()
        self._queued_bytes = 0
        # ticket: records before it are written (in the kernel's hands)
        self._written = self.next_index
        self._writer: threading.Thread | None = None
        self._file = None
        self._open_segment(self.next_index, reuse_last=True)

    def _open_segment(self, first_index: int, reuse_last: bool = False) -> None:
        segments = _segments(self.directory)
        path = (
            segments[-1] if reuse_last and segments else self.directory / f"{first_index:012d}.seg"
        )
        # a full segment: the next sync fsyncs it (a duplicate descriptor) first
        if self._file is not None:
            self._file.flush()
            new = open(path, "ab")
            # the syncer reads self._file under the lock: it never sees a closed one
            with self._cond:
                if self.fsync != "never":
                    self._rotated.append(os.dup(self._file.fileno()))
                    self._directory_dirty = True
                self._file.close()
                self._file = new
        else:
            self._file = open(path, "ab")
            _fsync_dir(self.directory)
        self._segment_size = path.stat().st_size

    def append(
        self, record: dict, blobs: Sequence[tuple[Any, int | None]] = (), frozen: bool = False
    ) -> int:
        """Queue one record, with raw blobs after it ((buffer, CRC-32 or None to compute it)), for
        the writer thread; return its index.  `frozen`: the blobs never change (received frames),
        so this returns at once, as for a record without blobs; otherwise once the record is
        written.  Durable on return when fsync == "always"."""
        views = [memoryview(buffer).cast("B") for buffer, _ in blobs]
        if blobs:
            record = {
                **record,
                "blobs": [
                    [v.nbytes, crc32(v) if crc is None else crc]
                    for v, (_, crc) in zip(views, blobs)
                ],
            }
        meta = msgpack.packb(record, use_bin_type=True)
        if len(meta) >= MAX_META_BYTES:
            raise DlocoError(f"log record's map of {len(meta)} bytes exceeds {MAX_META_BYTES}")
        head = _HEADER.pack(len(meta), crc32(meta)) + meta
        size = len(head) + sum(v.nbytes for v in views)
        with self._cond:
            while (
                self._error is None
                and self._queued_bytes
                and self._queued_bytes + size > self.queue_bytes
            ):
                self._cond.wait()
            if self._error is not None:
                raise self._error
            index, self.next_index = self.next_index, self.next_index + 1
            self._queue.append((index, head, views, size))
            self._queued_bytes += size
            if self._writer is None:
                self._writer = threading.Thread(
                    target=self._write_loop, name="wal-write", daemon=True
                )
                self._writer.start()
            self._cond.notify_all()
            if blobs and not frozen:
                self._wait_written(index + 1)
        self.bytes_appended += size
        if self.fsync == "always":
            # covers this record: the ticket is the index after it
            self.sync()
        return index

    def flush(self) -> None:
        """Wait until everything appended is written (the kernel's, not yet durable)."""
        with self._cond:
            self._wait_written(self.next_index)

    def _wait_written(self, ticket: int) -> None:
        """With the lock held: wait until the records before `ticket` are written."""
        while self._written < ticket and self._error is None:
            self._cond.wait()
        if self._error is not None:
            raise self._error

    def _write_loop(self) -> None:
        """The writer thread: each queued record written and flushed, in order; the first failure
        ends it (`_error`)."""
        with self._cond:
            while True:
                while not self._queue and not self._closing:
                    self._cond.wait()
                if not self._queue:
                    return
                index, head, views, size = self._queue[0]
                self._cond.release()
                failure = None
                try:
                    self._write(index, head, views, size)
                except StorageError as error:
                    failure = error
                # a bug, not the disk: every waiter must still hear of it
                except BaseException as error:
                    failure = DlocoError(f"the write-ahead log's writer failed: {error!r}")
                finally:
                    self._cond.acquire()
                self._queue.popleft()
                self._queued_bytes -= size
                if failure is not None:
                    self._error = failure
                    self._queue.clear()
                else:
                    self._written = index + 1
                    if self.fsync == "never":
                        self._durable = self._written
                self._cond.notify_all()

    def _write(self, index: int, head: bytes, views: list, size: int) -> None:
        try:
            if self._segment_size > 0 and self._segment_size + size > self.segment_bytes:
                self._open_segment(index)
            self._file.write(head)
            for view in views:
                # large writes go straight to the file, no copy
                self._file.write(view)
            self._file.flush()
        except OSError as error:
            raise StorageError(
                f"cannot append to the write-ahead log in {self.directory}:"
                f" {error.strerror or error}"
            ) from error
        self._segment_size += size

    @property
    def durable(self) -> int:
        """Ticket (record index) below which every record is known to be on disk."""
        return self._durable

    def sync_async(self) -> int:
        """Start making everything appended so far durable; returns the ticket for
        `wait_durable`."""
        ticket = self.next_index
        if self.fsync == "never":
            return ticket
        with self._cond:
            self._wanted = max(self._wanted, ticket)
            if self._syncer is None:
                self._syncer = threading.Thread(
                    target=self._sync_loop, name="wal-fsync", daemon=True
                )
                self._syncer.start()
            self._cond.notify_all()
        return ticket

    def wait_durable(self, ticket: int) -> None:
        """Block until the records before `ticket` are on disk (re-raising a write or fsync
        failure)."""
        with self._cond:
            while self._durable < ticket and self._error is None:
                self._cond.wait()
            if self._error is not None:
                raise self._error

    def sync(self) -> None:
        """Make everything appended durable now (on this thread: cheaper than a hand-off when the
        caller waits anyway)."""
        ticket = self.next_index
        with self._cond:
            if self.fsync == "never":
                self._wait_written(ticket)
                return
            self._make_durable(ticket)
            if self._error is not None:
                raise self._error

    def _sync_loop(self) -> None:
        with self._cond:
            while not self._closing and self._error is None:
                if self._wanted <= self._durable:
                    self._cond.wait()
                    continue
                self._make_durable(self._wanted)

    def _make_durable(self, target: int) -> None:
        """With the lock held: fsync full segments, the directory, then the current segment (the
        lock released meanwhile, one thread at a time), and call records before `target` durable.
        Any failure is final: `_error` is set and every later wait or sync raises it."""
        while (self._syncing or self._written < target) and self._error is None:
            self._cond.wait()
        if self._durable >= target or self._error is not None:
            return
        try:
            # a duplicate: rotation may close the file meanwhile
            current = os.dup(self._file.fileno())
        except (OSError, ValueError) as error:
            self._error = StorageError(f"fsync of the write-ahead log failed: {error}")
            self._cond.notify_all()
            return
        self._syncing = True
        rotated, self._rotated = self._rotated, []
        directory, self._directory_dirty = self._directory_dirty, False
        self._cond.release()
        failure, interrupted = None, None
        try:
            began = time.perf_counter()
            for fd in rotated:
                os.fsync(fd)
            if directory:
                _fsync_dir(self.directory)
            os.fsync(current)
            seconds = time.perf_counter() - began
        except OSError as error:
            failure = StorageError(f"fsync of the write-ahead log failed: {error}")
        # e.g. KeyboardInterrupt: the taken segments are not known to be on disk
        except BaseException as error:
            failure, interrupted = (
                DlocoError(f"fsync of the write-ahead log was interrupted: {error!r}"),
                error,
            )
        finally:
            for fd in (*rotated, current):
                try:
                    os.close(fd)
                except OSError:
                    pass
            self._cond.acquire()
            self._syncing = False
            self._cond.notify_all()
        if failure is not None:
            self._error = failure
        else:
            self._durable = max(self._durable, target)
            if self.on_fsync is not None:
                self.on_fsync(seconds)
        if interrupted is not None:
            raise interrupted

    def close(self) -> None:
        if self._file is None:
            return
        try:
            self.sync()
        finally:
            with self._cond:
                self._closing = True
                self._cond.notify_all()
            for thread in (self._writer, self._syncer):
                if thread is not None:
                    thread.join(timeout=60)
            with self._cond:
                # only after a failed sync
                for fd in self._rotated:
                    os.close(fd)
                self._rotated = []
                try:
                    self._file.close()
                # a full disk: the sync above raised already; what did not reach it is a torn tail
                except OSError:
                    pass
                self._file = None
