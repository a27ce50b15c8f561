"""Write-ahead log: records survive reopen, torn tails are truncated, corruption is named."""

from __future__ import annotations

import pytest

from dloco.merger.log.segments import LogCorruption, read_records
from dloco.merger.log.wal import WriteAheadLog


def fill(directory, count, segment_bytes=1 << 20):
    log = WriteAheadLog(directory, segment_bytes=segment_bytes, fsync="never")
    for i in range(count):
        assert log.append({"i": i, "blob": bytes(100)}) == i
    log.close()


def test_records_round_trip_across_segments_and_reopen(tmp_path):
    fill(tmp_path, 50, segment_bytes=1000)
    assert len(list(tmp_path.glob("*.seg"))) > 5
    assert [r["i"] for _, r in read_records(tmp_path)] == list(range(50))
    assert [i for i, _ in read_records(tmp_path, start=37)] == list(range(37, 50))
    log = WriteAheadLog(tmp_path, segment_bytes=1000, fsync="always")
    assert log.next_index == 50 and log.append({"i": 50}) == 50
    log.close()
    assert [r["i"] for _, r in read_records(tmp_path)][-2:] == [49, 50]


@pytest.mark.parametrize("cut", [1, 5, 9, 60])
def test_a_torn_last_record_is_truncated_on_open(tmp_path, cut):
    fill(tmp_path, 3)
    (segment,) = tmp_path.glob("*.seg")
    size = segment.stat().st_size
    with open(segment, "r+b") as handle:
        # a crash in the middle of writing record 2
        handle.truncate(size - cut)
    assert [i for i, _ in read_records(tmp_path)] == [0, 1]
    with pytest.raises(LogCorruption, match="record 2"):
        list(read_records(tmp_path, allow_torn_tail=False))
    log = WriteAheadLog(tmp_path, fsync="never")
    assert log.next_index == 2 and log.truncated_bytes == size - cut - 2 * (size // 3)
    log.append({"i": "again"})
    log.close()
    assert [r["i"] for _, r in read_records(tmp_path)] == [0, 1, "again"]


def test_a_flipped_byte_in_the_middle_is_corruption_naming_the_record(tmp_path):
    fill(tmp_path, 5)
    (segment,) = tmp_path.glob("*.seg")
    data = bytearray(segment.read_bytes())
    record_size = len(data) // 5
    # inside record 2's payload
    data[2 * record_size + 20] ^= 0xFF
    segment.write_bytes(bytes(data))
    with pytest.raises(
        LogCorruption,
        match=r"log record 2 \(000000000000.seg at byte \d+\) is corrupt: checksum mismatch",
    ):
        list(read_records(tmp_path))
    with pytest.raises(LogCorruption):
        # never append after a hole
        WriteAheadLog(tmp_path)


def test_bad_fsync_policy_is_refused(tmp_path):
    with pytest.raises(Exception, match="fsync policy"):
        WriteAheadLog(tmp_path, fsync="sometimes")


def test_blobs_are_written_raw_and_checked_by_their_own_crc(tmp_path):
    import zlib

    log = WriteAheadLog(tmp_path, fsync="batch")
    blob = bytes(range(256)) * 40
    assert log.append({"i": 0}, [(blob, zlib.crc32(blob)), (b"tail", None)]) == 0
    assert log.append({"i": 1}) == 1
    # the fsync runs on the log's thread; wait_durable returns once it is done
    ticket = log.sync_async()
    log.wait_durable(ticket)
    log.close()
    (index, record), (_, plain) = list(read_records(tmp_path))
    assert (
        [bytes(b) for b in record["blobs"]] == [blob, b"tail"]
        and record["i"] == 0
        and "blobs" not in plain
    )
    segment = next(tmp_path.glob("*.seg"))
    data = bytearray(segment.read_bytes())
    # stored as is, not re-encoded
    assert data.count(blob) == 1
    data[data.index(blob) + 100] ^= 0xFF
    segment.write_bytes(bytes(data))
    with pytest.raises(LogCorruption, match=r"log record 0 .* checksum mismatch of blob 0"):
        list(read_records(tmp_path))


def test_a_torn_blob_at_the_end_is_truncated(tmp_path):
    log = WriteAheadLog(tmp_path, fsync="never")
    log.append({"i": 0})
    log.append({"i": 1}, [(bytes(5000), None)])
    log.close()
    segment = next(tmp_path.glob("*.seg"))
    with open(segment, "r+b") as handle:
        handle.truncate(segment.stat().st_size - 10)
    assert [i for i, _ in read_records(tmp_path)] == [0]
    assert WriteAheadLog(tmp_path, fsync="never").next_index == 1


def test_a_full_segment_is_fsynced_by_the_next_sync_not_by_the_append_that_fills_it(
    tmp_path, monkeypatch
):
    """Rotation does not wait for the disk on the appending thread; the next sync fsyncs the full
    segments oldest first, then the directory, then the current segment — only then is anything
    after them durable."""
    import os
    from pathlib import Path

    synced = []
    real_fsync = os.fsync

    def spy(fd):
        synced.append(Path(os.readlink(f"/proc/self/fd/{fd}")).name)
        real_fsync(fd)

    log = WriteAheadLog(tmp_path, segment_bytes=1000, fsync="batch")
    monkeypatch.setattr(os, "fsync", spy)
    for i in range(30):
        log.append({"i": i, "blob": bytes(100)})
    log.flush()
    segments = sorted(p.name for p in tmp_path.glob("*.seg"))
    # full segments closed, nothing waited for
    assert len(segments) >= 3 and synced == []
    log.sync()
    assert synced == [*segments[:-1], tmp_path.name, segments[-1]] and log.durable == 30
    synced.clear()
    ticket = log.sync_async()
    log.wait_durable(ticket)
    # nothing new: nothing to do
    assert synced == []
    log.append({"i": 30})
    log.wait_durable(log.sync_async())
    assert synced == [segments[-1]] and log.durable == 31
    log.close()
    assert [r["i"] for _, r in read_records(tmp_path)] == list(range(31))


def test_a_torn_record_in_an_earlier_segment_ends_the_log_and_later_segments_are_set_aside(
    tmp_path,
):
    """After a power failure, a full segment's tail may be missing while a later segment reached
    the disk: those later records were never durable (a sync fsyncs segments in order), so the log
    ends at the tear; the later segments are kept under discarded/, not deleted."""
    fill(tmp_path, 40, segment_bytes=1000)
    segments = sorted(tmp_path.glob("*.seg"))
    assert len(segments) >= 4
    torn = segments[1]
    first_after = int(segments[2].stem)
    with open(torn, "r+b") as handle:
        # the last record of segment 1 cut short
        handle.truncate(torn.stat().st_size - 7)
    # that record's index
    lost = first_after - 1
    # readers stop at the tear
    assert [i for i, _ in read_records(tmp_path)] == list(range(lost))
    with pytest.raises(LogCorruption, match=f"record {lost} "):
        list(read_records(tmp_path, allow_torn_tail=False))
    log = WriteAheadLog(tmp_path, segment_bytes=1000, fsync="never")
    assert log.next_index == lost and log.discarded == [p.name for p in segments[2:]]
    assert sorted(p.name for p in (tmp_path / "discarded" / f"{lost:012d}").iterdir()) == [
        p.name for p in segments[2:]
    ]
    assert log.append({"i": "after"}) == lost
    log.close()
    assert [r["i"] for _, r in read_records(tmp_path)] == [*range(lost), "after"]


def test_a_flipped_byte_in_an_earlier_segment_is_still_corruption(tmp_path):
    fill(tmp_path, 40, segment_bytes=1000)
    segment = sorted(tmp_path.glob("*.seg"))[1]
    data = bytearray(segment.read_bytes())
    # inside the first record's meta: not at the end of the segment
    data[20] ^= 0x01
    segment.write_bytes(bytes(data))
    with pytest.raises(LogCorruption, match="checksum mismatch"):
        WriteAheadLog(tmp_path, segment_bytes=1000, fsync="never")


@pytest.mark.timeout(120)
def test_segments_fill_while_the_syncer_fsyncs_and_every_ticket_comes_due(tmp_path, monkeypatch):
    """The merger asks for syncs in the background while it keeps appending; full segments are
    swapped under the syncer's lock, so a slow fsync never meets a closed file (were it to, the
    syncer would die and every later wait would hang)."""
    import os
    import time

    real_fsync = os.fsync

    def slow(fd):
        time.sleep(0.002)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", slow)
    log = WriteAheadLog(tmp_path, segment_bytes=600, fsync="batch")
    tickets = []
    for i in range(300):
        log.append({"i": i, "blob": bytes(100)})
        tickets.append(log.sync_async())
    for ticket in tickets:
        log.wait_durable(ticket)
    assert log.durable == 300 and len(list(tmp_path.glob("*.seg"))) > 50
    log.close()
    assert [r["i"] for _, r in read_records(tmp_path)] == list(range(300))


def test_fsync_always_makes_each_record_durable_before_append_returns(tmp_path):
    log = WriteAheadLog(tmp_path, fsync="always")
    for i in range(3):
        assert log.append({"i": i}) == i and log.durable == i + 1
    log.close()


def test_an_earlier_segment_that_lost_whole_records_ends_the_log_too(tmp_path):
    """A power failure can also cut a full segment exactly between records: no torn record, but the
    next segment starts later than this one ends.  The log ends at the gap; readers stop there (or
    name the missing records), and a log whose first segment is not record 0 is corruption."""
    import os

    from dloco.merger.log.segments import _scan

    fill(tmp_path, 40, segment_bytes=1000)
    segments = sorted(tmp_path.glob("*.seg"))
    ((last_index, last_offset, *_),) = [row for row in _scan(segments[1], int(segments[1].stem))][
        -1:
    ]
    with open(segments[1], "r+b") as handle:
        # segment 1 loses its last record, cleanly
        handle.truncate(last_offset)
    assert [i for i, _ in read_records(tmp_path)] == list(range(last_index))
    with pytest.raises(LogCorruption, match=f"records {last_index}..{last_index} are missing"):
        list(read_records(tmp_path, allow_torn_tail=False))
    log = WriteAheadLog(tmp_path, segment_bytes=1000, fsync="never")
    assert (
        log.next_index == last_index
        and log.truncated_bytes == 0
        and log.discarded == [p.name for p in segments[2:]]
    )
    log.close()
    first = sorted(tmp_path.glob("*.seg"))[0]
    os.rename(first, first.with_name("000000000001.seg"))
    with pytest.raises(LogCorruption, match="first segment starts at record 1"):
        WriteAheadLog(tmp_path, fsync="never")


def held_writer(monkeypatch):
    """Every record's write waits for the returned event (the writer thread is held)."""
    import threading

    release = threading.Event()
    real = WriteAheadLog._write

    def held(self, *args):
        assert release.wait(60)
        real(self, *args)

    monkeypatch.setattr(WriteAheadLog, "_write", held)
    return release


@pytest.mark.timeout(60)
def test_frozen_records_return_before_they_are_written_and_are_durable_only_once_written(
    tmp_path, monkeypatch
):
    """The receiving thread does not wait for the disk: a frozen record is queued; a ticket is
    durable only once the writer has written it, in order."""
    release = held_writer(monkeypatch)
    log = WriteAheadLog(tmp_path, fsync="never")
    assert [log.append({"i": i}, [(bytes(10), None)], frozen=True) for i in range(3)] == [0, 1, 2]
    ticket = log.sync_async()
    assert ticket == 3 and log.durable == 0 and list(read_records(tmp_path)) == []
    release.set()
    log.wait_durable(ticket)
    assert log.durable == 3 and [r["i"] for _, r in read_records(tmp_path)] == [0, 1, 2]
    # not frozen: written (and visible to a reader) when append returns, no sync asked
    log.append({"i": 3}, [(bytearray(10), None)])
    assert [r["i"] for _, r in read_records(tmp_path)] == [0, 1, 2, 3]
    # no blobs: queued, as a frozen record
    release.clear()
    log.append({"i": 4})
    assert log.next_index == 5 and len(list(read_records(tmp_path))) == 4
    release.set()
    log.flush()
    assert len(list(read_records(tmp_path))) == 5
    log.close()


@pytest.mark.timeout(60)
def test_the_write_queue_is_bounded_in_bytes(tmp_path, monkeypatch):
    import threading

    release = held_writer(monkeypatch)
    log = WriteAheadLog(tmp_path, fsync="batch", queue_bytes=1000)
    # one record over the bound is queued alone
    log.append({"i": 0}, [(bytes(2000), None)], frozen=True)
    second = threading.Thread(target=log.append, args=({"i": 1}, [(bytes(10), None)], True))
    second.start()
    second.join(0.2)
    assert second.is_alive() and log.next_index == 1
    release.set()
    second.join(30)
    log.sync()
    assert log.durable == 2
    log.close()
    assert [r["i"] for _, r in read_records(tmp_path)] == [0, 1]


def test_a_failed_write_stops_the_writer_and_every_later_append_and_sync_raises(tmp_path):
    """A write the disk refuses (here /dev/full: ENOSPC) ends the log where it was: nothing after
    it is written, the appender hears it at its next append or sync."""
    from dloco.merger.log.wal import StorageError

    log = WriteAheadLog(tmp_path, fsync="batch")
    log.append({"i": 0})
    log.sync()
    real_file, log._file = log._file, open("/dev/full", "ab")
    log.append({"i": 1}, [(bytes(100), None)], frozen=True)
    with pytest.raises(StorageError, match="No space left on device"):
        log.sync()
    with pytest.raises(StorageError, match="No space left on device"):
        log.append({"i": 2}, frozen=True)
    with pytest.raises(StorageError):
        log.wait_durable(2)
    with pytest.raises(StorageError):
        log.close()
    real_file.close()
    reopened = WriteAheadLog(tmp_path, fsync="never")
    assert reopened.next_index == 1
    reopened.close()
