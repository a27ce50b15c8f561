"""Segmented write-ahead log: the writer, appending records and making them durable.

The segment files and their records are merger/wal_segments.py's.  Blobs are written as they are
(no copy into the msgpack) with a CRC the caller may already know: the merger logs delta payloads
with the CRC-32 their frame carried and decode verified, so a payload is checksummed once on its
way in, and still verified when the log is read.

``sync()`` makes everything appended durable; ``sync_async()`` hands the fsync to a background
thread and returns a ticket for ``wait_durable`` — the merger starts the fsync when it dispatches
a fold and waits for it only when the fold is computed and about to be announced.

A full segment is closed and the next one opened without waiting for the disk: the fsync of the
old segment and of the directory happen with the next sync, in order — older segments, the
directory, then the current one — before anything after them is called durable.  (Waiting on
the merger's receiving thread would cost 30-50 ms per 64 MiB segment.)

Opening a log for append scans every segment and truncates a torn tail away (what ends the log:
merger/wal_segments.py).  Segments after that point were written after it, so never durable (only
a power failure leaves them behind): they are moved to ``DIR/discarded/<index where the log
ends>/``, not deleted.  Any other bad record raises `LogCorruption`.

``fsync``: "always" (every append is durable before `append` returns), "batch" (durable after
`sync()`, which the service calls before it acknowledges), "never" (tests, benchmarks).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import msgpack

from dloco.merger.wal_segments import (
    _HEADER,
    MAX_META_BYTES,
    LogCorruption,
    _fsync_dir,
    _scan,
    _segments,
)
from dloco.protocol.checksum import crc32
from dloco.protocol.errors import DlocoError

FSYNC_POLICIES = ("always", "batch", "never")


class Log(Protocol):
    """What the merger's core appends its records to (WriteAheadLog; tests give it others)."""

    next_index: int

    def append(self, record: dict, blobs: Sequence[tuple[Any, int | None]] = ()) -> int: ...


class StorageError(DlocoError):
    """The run directory's disk refused a write or an fsync (full, read-only, failing).  What is on
    disk stays valid: a record cut short is a torn tail, which a restart truncates."""


class WriteAheadLog:
    def __init__(
        self, directory: str | Path, segment_bytes: int = 64 << 20, fsync: str = "batch"
    ) -> None:
        if fsync not in FSYNC_POLICIES:
            raise DlocoError(f"wal fsync policy must be one of {FSYNC_POLICIES}, got {fsync!r}")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.segment_bytes, self.fsync = segment_bytes, fsync
        # by this process (metrics)
        self.bytes_appended = 0
        # called with each fsync's seconds (metrics)
        self.on_fsync = None
        self.truncated_bytes = 0
        # segments set aside after a torn record (see the module docstring)
        self.discarded: list[str] = []
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
        self.next_index = self._recover()
        self._file = None
        self._open_segment(self.next_index, reuse_last=True)

    def _recover(self) -> int:
        """Index after the last valid record; truncate a torn tail (and set aside any segments after
        it)."""
        segments = _segments(self.directory)
        if not segments:
            return 0
        if int(segments[0].stem) != 0:
            raise LogCorruption(
                segments[0],
                0,
                0,
                f"the log's first segment starts at record {int(segments[0].stem)}: records before"
                " it are missing",
            )
        next_index = 0
        for position, segment in enumerate(segments):
            # the previous segment lost its tail at a record boundary
            if int(segment.stem) != next_index:
                self._discard(segments[position:], next_index)
                return next_index
            good_end = 0
            for index, offset, end, _, problem in _scan(segment, int(segment.stem)):
                if problem:
                    if not problem.startswith("torn"):
                        raise LogCorruption(segment, offset, index, problem)
                    break
                next_index, good_end = index + 1, end
            else:
                continue
            self._discard(segments[position + 1 :], next_index)
            size = segment.stat().st_size
            self.truncated_bytes = size - good_end
            with open(segment, "r+b") as handle:
                handle.truncate(good_end)
                os.fsync(handle.fileno())
            return next_index
        return next_index

    def _discard(self, segments: list[Path], torn_index: int) -> None:
        """Move segments written after a torn record (never durable) to DIR/discarded/<its
        index>[-n]/."""
        if not segments:
            return
        aside, n = self.directory / "discarded" / f"{torn_index:012d}", 1
        # set aside at this index before: keep that too
        while aside.exists():
            n += 1
            aside = self.directory / "discarded" / f"{torn_index:012d}-{n}"
        aside.mkdir(parents=True)
        for segment in segments:
            segment.rename(aside / segment.name)
            self.discarded.append(segment.name)
        _fsync_dir(aside)
        _fsync_dir(self.directory)

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

    def append(self, record: dict, blobs: Sequence[tuple[Any, int | None]] = ()) -> int:
        """Write one record, with raw blobs after it ((buffer, CRC-32 or None to compute it));
        return its index.  Durable on return when fsync == "always"."""
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
        size = _HEADER.size + len(meta) + sum(v.nbytes for v in views)
        try:
            if self._segment_size > 0 and self._segment_size + size > self.segment_bytes:
                self._open_segment(self.next_index)
            self._file.write(_HEADER.pack(len(meta), crc32(meta)) + meta)
            for view in views:
                # large writes go straight to the file, no copy
                self._file.write(view)
        except OSError as error:
            raise StorageError(
                f"cannot append to the write-ahead log in {self.directory}:"
                f" {error.strerror or error}"
            ) from error
        self._segment_size += size
        self.bytes_appended += size
        index, self.next_index = self.next_index, self.next_index + 1
        if self.fsync == "always":
            # covers this record: the ticket is the index after it
            self.sync()
        return index

    @property
    def durable(self) -> int:
        """Ticket (record index) below which every record is known to be on disk."""
        return self._durable

    def _flush(self) -> None:
        try:
            self._file.flush()
        except OSError as error:
            raise StorageError(
                f"cannot write the write-ahead log in {self.directory}: {error.strerror or error}"
            ) from error

    def sync_async(self) -> int:
        """Start making everything appended so far durable; returns the ticket for
        `wait_durable`."""
        self._flush()
        ticket = self.next_index
        if self.fsync == "never":
            self._durable = ticket
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
        """Block until the records before `ticket` are on disk (re-raising an fsync failure)."""
        with self._cond:
            while self._durable < ticket and self._error is None:
                self._cond.wait()
            if self._error is not None:
                raise self._error

    def sync(self) -> None:
        """Make everything appended durable now (on this thread: cheaper than a hand-off when the
        caller waits anyway)."""
        self._flush()
        ticket = self.next_index
        with self._cond:
            if self.fsync == "never":
                self._durable = max(self._durable, ticket)
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
        while self._syncing:
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
            if self._syncer is not None:
                self._syncer.join(timeout=60)
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
