"""Where two mergers' logs agree, and cutting a log back to that point.  Pure functions of the logs.

A log is a sequence of terms: one from the genesis record, and a new one at each `term` record a
merger wrote when it became the primary (merger/records.term_record).  A term is named by its
epoch, which no other primary shares (each is above every epoch its writer had seen, and a clock
reading; the term *number* is for people and may repeat when two mergers each believed the
other gone).  A term is written by one primary only, and a standby copies its primary's records
in order, so two logs that both hold the term of epoch e starting at the same index hold the same
records for as long as both stay in it.  Their common prefix therefore ends where the newest term
they share ends in either of them (`agreed_length`) — Raft's log-matching argument, with our
term records as its terms.

A merger that joins a primary as its standby keeps that prefix and sets the rest aside
(`set_aside_from`): records an old primary wrote after its standby took over, which no island was
told about (they were fenced: PROTOCOL.md §12).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import msgpack

from dloco.merger.log import records
from dloco.merger.log.segments import _fsync_dir, _scan, _segments, read_records
from dloco.protocol.checksum import crc32

# (the term's epoch, index of its first record), oldest first; the genesis's term has epoch 0
Terms = list[tuple[int, int]]


def terms_of(directory: str | Path) -> tuple[Terms, int, int]:
    """The terms of the log in `directory`, its length (the index after its last record) and its
    newest term number (0: none after the genesis)."""
    terms, length, number = [(0, 0)], 0, 0
    for index, record in read_records(directory):
        length = index + 1
        if record.get("type") == records.TERM:
            terms.append((int(record["epoch"]), index))
            number = max(number, int(record["term"]))
    return (terms if length else []), length, number


def newest_epoch(terms: Sequence[tuple[int, int]]) -> int:
    return max((epoch for epoch, _ in terms), default=0)


def genesis_id(record: dict) -> int:
    """What names a run: the CRC-32 of its genesis record packed as msgpack, each of its blobs
    (under "blobs", as the log reads them back) replaced by the blob's own CRC-32 (a standby never
    follows another run's log)."""
    if "blobs" in record:
        record = {**record, "blobs": [crc32(blob) for blob in record["blobs"]]}
    return crc32(msgpack.packb(record, use_bin_type=True))


def genesis_of(run_dir: str | Path) -> int:
    """The replication stream's name for a run (genesis_id of its first record; 0: no log)."""
    first = next(read_records(Path(run_dir) / "wal"), None)
    return genesis_id(first[1]) if first is not None else 0


def _ends(terms: Sequence[tuple[int, int]], length: int) -> dict[tuple[int, int], int]:
    """(epoch, start) -> index after the term's last record."""
    starts = [start for _, start in terms[1:]] + [length]
    return {(epoch, start): end for (epoch, start), end in zip(terms, starts)}


def agreed_length(
    mine: Sequence[tuple[int, int]],
    my_length: int,
    theirs: Sequence[tuple[int, int]],
    their_length: int,
) -> int:
    """How many records, from the start, two logs hold in common (0: not even the genesis)."""
    my_ends, their_ends = _ends(mine, my_length), _ends(theirs, their_length)
    shared = [key for key in their_ends if key in my_ends]
    if not shared:
        return 0
    newest = max(shared, key=lambda key: key[1])
    return min(my_ends[newest], their_ends[newest])


def set_aside_from(
    directory: str | Path, index: int, checkpoints: str | Path | None = None
) -> list[str]:
    """Move the log's records from `index` on (and checkpoints that cover any of them) to
    DIR/discarded/<index>/, never deleting them.  Returns the names of what was moved."""
    directory = Path(directory)
    aside, n = directory / "discarded" / f"{index:012d}", 1
    while aside.exists():
        n += 1
        aside = directory / "discarded" / f"{index:012d}-{n}"
    moved = []
    for segment in _segments(directory):
        first = int(segment.stem)
        if first >= index:
            aside.mkdir(parents=True, exist_ok=True)
            segment.rename(aside / segment.name)
            moved.append(segment.name)
            continue
        cut = next((offset for at, offset, _, _, _ in _scan(segment, first) if at == index), None)
        if cut is None:
            continue
        aside.mkdir(parents=True, exist_ok=True)
        with open(segment, "r+b") as handle:
            handle.seek(cut)
            # on disk before the original is cut
            with open(aside / segment.name, "wb") as copy:
                copy.write(handle.read())
                os.fsync(copy.fileno())
            _fsync_dir(aside)
            handle.truncate(cut)
            os.fsync(handle.fileno())
        moved.append(f"{segment.name}@{cut}")
    for path in sorted(Path(checkpoints).glob("*.ckpt")) if checkpoints is not None else ():
        if int(path.stem) > index:
            aside.mkdir(parents=True, exist_ok=True)
            path.rename(aside / path.name)
            moved.append(path.name)
    if moved:
        _fsync_dir(aside)
        _fsync_dir(directory)
    return moved


def other_shard(genesis: dict, shard: int, shards: int) -> str | None:
    """Why a merger started as shard `shard` of `shards` cannot keep the log that starts with
    `genesis` (the fragments it holds are another shard's, or the whole model's), or None."""
    fragments = genesis["fragments"]
    # a log written before the genesis record listed `tensors`: a `params` map instead
    if "tensors" in genesis:
        paths = dict.fromkeys(path for path, _ in genesis["tensors"])
    else:
        paths = dict.fromkeys(genesis.get("params", {}))
    held = [i for i, mine in enumerate(records.held_fragments(fragments, paths)) if mine]
    mine = [f for f in range(len(fragments)) if f % shards == shard]
    if held == mine:
        return None
    return (
        f"its log holds fragments {held} of {len(fragments)}; this merger, shard {shard}/{shards},"
        f" folds {mine}: give the standby the --shard of its primary"
    )
