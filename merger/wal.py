"""Segmented write-ahead log: length-prefixed, checksummed msgpack records.

On disk, ``DIR/<first-index>.seg`` files (12-digit, zero-padded record index of their first
record), each a run of records::

    u32 little-endian  payload length
    u32 little-endian  CRC-32 (zlib) of the payload
    payload            one msgpack map

Opening a log for append scans the last segment.  A final record that is cut short, or whose
checksum fails with nothing after it, is a torn write from a crash: it is truncated away.  Any
other bad record is corruption and raises `LogCorruption` naming the segment, offset and record
index, so nothing written and acknowledged is ever silently dropped.

``fsync``: "always" (every append is durable before `append` returns), "batch" (durable after
`sync()`, which the service calls before it acknowledges), "never" (tests, benchmarks).
"""

from __future__ import annotations

import os
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack

from protocol.errors import DlocoError

_HEADER = struct.Struct("<II")
MAX_RECORD_BYTES = 1 << 31
FSYNC_POLICIES = ("always", "batch", "never")


class LogCorruption(DlocoError):
    """A record in the middle of the log is unreadable."""

    def __init__(self, segment: Path, offset: int, index: int, why: str) -> None:
        super().__init__(f"log record {index} ({segment.name} at byte {offset}) is corrupt: {why}")
        self.segment, self.offset, self.index = segment, offset, index


def _segments(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.seg"))


def _scan(segment: Path, first_index: int) -> Iterator[tuple[int, int, int, Any, str]]:
    """Yield (index, offset, end, record | None, problem) for each record of one segment file."""
    data = segment.read_bytes()
    offset, index = 0, first_index
    while offset < len(data):
        if len(data) - offset < _HEADER.size:
            yield index, offset, len(data), None, "torn: header cut short"
            return
        length, crc = _HEADER.unpack_from(data, offset)
        end = offset + _HEADER.size + length
        if end > len(data):
            yield index, offset, len(data), None, "torn: payload cut short"
            return
        payload = memoryview(data)[offset + _HEADER.size : end]
        if zlib.crc32(payload) != crc:
            yield index, offset, end, None, "torn: checksum mismatch at end of log" if end == len(data) else "checksum mismatch"
            return
        try:
            record = msgpack.unpackb(payload, raw=False, strict_map_key=False)
        except (ValueError, msgpack.UnpackException) as error:
            yield index, offset, end, None, f"undecodable payload: {error}"
            return
        yield index, offset, end, record, ""
        offset, index = end, index + 1


def read_records(directory: str | Path, start: int = 0, allow_torn_tail: bool = True) -> Iterator[tuple[int, dict]]:
    """Every valid record with index >= start, in order.  A torn tail ends the iteration quietly
    (or raises, with allow_torn_tail=False); corruption anywhere else raises LogCorruption."""
    segments = _segments(Path(directory))
    for position, segment in enumerate(segments):
        first = int(segment.stem)
        if position + 1 < len(segments) and int(segments[position + 1].stem) <= start:
            continue
        for index, offset, _, record, problem in _scan(segment, first):
            if problem:
                if allow_torn_tail and problem.startswith("torn") and position == len(segments) - 1:
                    return
                raise LogCorruption(segment, offset, index, problem)
            if index >= start:
                yield index, record


class WriteAheadLog:
    def __init__(self, directory: str | Path, segment_bytes: int = 64 << 20, fsync: str = "batch") -> None:
        if fsync not in FSYNC_POLICIES:
            raise DlocoError(f"wal fsync policy must be one of {FSYNC_POLICIES}, got {fsync!r}")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.segment_bytes, self.fsync = segment_bytes, fsync
        self.truncated_bytes = 0
        self.next_index = self._recover()
        self._file = None
        self._open_segment(self.next_index, reuse_last=True)

    def _recover(self) -> int:
        """Index after the last valid record; truncate a torn tail."""
        segments = _segments(self.directory)
        if not segments:
            return 0
        for segment in segments[:-1]:
            for index, offset, _, _, problem in _scan(segment, int(segment.stem)):
                if problem:
                    raise LogCorruption(segment, offset, index, problem)
        last = segments[-1]
        next_index, good_end = int(last.stem), 0
        for index, offset, end, _, problem in _scan(last, int(last.stem)):
            if problem:
                if not problem.startswith("torn"):
                    raise LogCorruption(last, offset, index, problem)
                break
            next_index, good_end = index + 1, end
        size = last.stat().st_size
        if size > good_end:
            self.truncated_bytes = size - good_end
            with open(last, "r+b") as handle:
                handle.truncate(good_end)
                os.fsync(handle.fileno())
        return next_index

    def _open_segment(self, first_index: int, reuse_last: bool = False) -> None:
        segments = _segments(self.directory)
        path = segments[-1] if reuse_last and segments else self.directory / f"{first_index:012d}.seg"
        if self._file is not None:
            self._file.close()
        self._file = open(path, "ab")
        self._segment_size = path.stat().st_size
        _fsync_dir(self.directory)

    def append(self, record: dict) -> int:
        """Write one record; return its index.  Durable on return when fsync == "always"."""
        payload = msgpack.packb(record, use_bin_type=True)
        if len(payload) >= MAX_RECORD_BYTES:
            raise DlocoError(f"log record of {len(payload)} bytes exceeds {MAX_RECORD_BYTES}")
        if self._segment_size > 0 and self._segment_size + len(payload) > self.segment_bytes:
            self.sync()
            self._open_segment(self.next_index)
        self._file.write(_HEADER.pack(len(payload), zlib.crc32(payload)))
        self._file.write(payload)
        self._segment_size += _HEADER.size + len(payload)
        if self.fsync == "always":
            self.sync()
        index, self.next_index = self.next_index, self.next_index + 1
        return index

    def sync(self) -> None:
        self._file.flush()
        if self.fsync != "never":
            os.fsync(self._file.fileno())

    def close(self) -> None:
        if self._file is not None:
            self.sync()
            self._file.close()
            self._file = None


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
