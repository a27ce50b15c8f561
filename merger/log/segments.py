"""The write-ahead log's segment files: the record format, and reading records back checked.

On disk, ``DIR/<first-index>.seg`` files (12-digit, zero-padded record index of their first
record), each a run of records::

    u32 little-endian  meta length
    u32 little-endian  CRC-32 (zlib) of the meta
    meta               one msgpack map; a record with blobs lists them:
                       "blobs": [[nbytes, crc32], ...]
    blobs              raw bytes, back to back, each checked by its own CRC-32

A record without blobs is the format before blobs exactly, so older logs read unchanged.

The log ends at the first torn write: a record cut short, or whose checksum fails with nothing
after it in its segment; a segment that ends before the next one begins lost whole records.  Any
other bad record is corruption and raises `LogCorruption` naming the segment, offset and record
index, so nothing written and acknowledged is ever silently dropped.  (The writer,
merger/log/wal.py, truncates a torn tail when it opens the log.)
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack

from dloco.protocol.checksum import crc32
from dloco.protocol.errors import DlocoError

_HEADER = struct.Struct("<II")
# a record's map; its blobs may be any size (a genesis record's are the model)
MAX_META_BYTES = 1 << 31


class LogCorruption(DlocoError):
    """A record in the middle of the log is unreadable."""

    def __init__(self, segment: Path, offset: int, index: int, why: str) -> None:
        super().__init__(f"log record {index} ({segment.name} at byte {offset}) is corrupt: {why}")
        self.segment, self.offset, self.index = segment, offset, index


def _segments(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.seg"))


def _scan(segment: Path, first_index: int) -> Iterator[tuple[int, int, int, Any, str]]:
    """Yield (index, offset, end, record | None, problem) for each record of one segment file.
    A record's blobs come back as memoryviews under "blobs"."""
    data = segment.read_bytes()
    view = memoryview(data)
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
        if crc32(view[offset + _HEADER.size : end]) != crc:
            yield (
                index,
                offset,
                end,
                None,
                (
                    "torn: checksum mismatch at end of log"
                    if end == len(data)
                    else "checksum mismatch"
                ),
            )
            return
        try:
            record = msgpack.unpackb(
                view[offset + _HEADER.size : end], raw=False, strict_map_key=False
            )
            listed = record.get("blobs", ()) if isinstance(record, dict) else ()
            sizes = [(int(n), int(c)) for n, c in listed]
        except (ValueError, TypeError, msgpack.UnpackException) as error:
            yield index, offset, end, None, f"undecodable payload: {error}"
            return
        record_end = end + sum(nbytes for nbytes, _ in sizes)
        if record_end > len(data):
            yield index, offset, len(data), None, "torn: blob cut short"
            return
        blobs, problem = _blobs(view, end, sizes, at_end=record_end == len(data))
        if problem:
            yield index, offset, record_end, None, problem
            return
        end = record_end
        if sizes:
            record["blobs"] = blobs
        yield index, offset, end, record, ""
        offset, index = end, index + 1


def _blobs(
    view: memoryview, start: int, sizes: list[tuple[int, int]], at_end: bool
) -> tuple[list[memoryview], str]:
    """A record's blobs from `start` on, each checked against its (nbytes, CRC-32), and the problem
    with the first bad one ("" if none).  `at_end`: the record is the last of the log."""
    blobs = []
    for number, (nbytes, blob_crc) in enumerate(sizes):
        blob = view[start : start + nbytes]
        start += nbytes
        # in the last record of the log: a write the crash cut short
        if crc32(blob) != blob_crc:
            return blobs, (
                f"torn: checksum mismatch of blob {number} at end of log"
                if at_end
                else f"checksum mismatch of blob {number}"
            )
        blobs.append(blob)
    return blobs, ""


def read_records(
    directory: str | Path, start: int = 0, allow_torn_tail: bool = True
) -> Iterator[tuple[int, dict]]:
    """Every valid record with index >= start, in order.  A torn tail ends the iteration quietly
    (or raises, with allow_torn_tail=False); corruption anywhere else raises LogCorruption."""
    segments = _segments(Path(directory))
    # the index the next segment must start at (segments are named by their first record)
    expected = None
    for position, segment in enumerate(segments):
        first = int(segment.stem)
        if position + 1 < len(segments) and int(segments[position + 1].stem) <= start:
            continue
        # records expected..first-1 are missing
        if expected is not None and first != expected:
            # the earlier segment lost its tail: the log ends there, as after a torn record
            if allow_torn_tail:
                return
            raise LogCorruption(
                segment,
                0,
                expected,
                f"records {expected}..{first - 1} are missing (the segment starts at {first})",
            )
        expected = first
        for index, offset, _, record, problem in _scan(segment, first):
            if problem:
                # the log ends here (later segments: never durable)
                if allow_torn_tail and problem.startswith("torn"):
                    return
                raise LogCorruption(segment, offset, index, problem)
            expected = index + 1
            if index >= start:
                yield index, record


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def open_log(directory: Path) -> tuple[int, int, list[str]]:
    """Open a log for append: (the index after its last valid record, bytes of a torn tail
    truncated, segments set aside after it).  Segments after a torn record were never durable:
    they move to DIR/discarded/<its index>[-n]/.  Any other bad record raises LogCorruption."""
    segments = _segments(directory)
    if not segments:
        return 0, 0, []
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
            return next_index, 0, _discard(directory, segments[position:], next_index)
        good_end = 0
        for index, offset, end, _, problem in _scan(segment, int(segment.stem)):
            if problem:
                if not problem.startswith("torn"):
                    raise LogCorruption(segment, offset, index, problem)
                break
            next_index, good_end = index + 1, end
        else:
            continue
        discarded = _discard(directory, segments[position + 1 :], next_index)
        truncated = segment.stat().st_size - good_end
        with open(segment, "r+b") as handle:
            handle.truncate(good_end)
            os.fsync(handle.fileno())
        return next_index, truncated, discarded
    return next_index, 0, []


def _discard(directory: Path, segments: list[Path], torn_index: int) -> list[str]:
    """Move `segments` to DIR/discarded/<torn_index>[-n]/; their names."""
    if not segments:
        return []
    aside, n = directory / "discarded" / f"{torn_index:012d}", 1
    # set aside at this index before: keep that too
    while aside.exists():
        n += 1
        aside = directory / "discarded" / f"{torn_index:012d}-{n}"
    aside.mkdir(parents=True)
    for segment in segments:
        segment.rename(aside / segment.name)
    _fsync_dir(aside)
    _fsync_dir(directory)
    return [segment.name for segment in segments]
