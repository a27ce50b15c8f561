"""Write-ahead log: records survive reopen, torn tails are truncated, corruption is named."""

from __future__ import annotations

import pytest

from merger.wal import LogCorruption, WriteAheadLog, read_records


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
        handle.truncate(size - cut)  # a crash in the middle of writing record 2
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
    data[2 * record_size + 20] ^= 0xFF  # inside record 2's payload
    segment.write_bytes(bytes(data))
    with pytest.raises(LogCorruption, match=r"log record 2 \(000000000000.seg at byte \d+\) is corrupt: checksum mismatch"):
        list(read_records(tmp_path))
    with pytest.raises(LogCorruption):
        WriteAheadLog(tmp_path)  # never append after a hole


def test_bad_fsync_policy_is_refused(tmp_path):
    with pytest.raises(Exception, match="fsync policy"):
        WriteAheadLog(tmp_path, fsync="sometimes")


def test_blobs_are_written_raw_and_checked_by_their_own_crc(tmp_path):
    import zlib

    log = WriteAheadLog(tmp_path, fsync="batch")
    blob = bytes(range(256)) * 40
    assert log.append({"i": 0}, [(blob, zlib.crc32(blob)), (b"tail", None)]) == 0
    assert log.append({"i": 1}) == 1
    ticket = log.sync_async()  # the fsync runs on the log's thread; wait_durable returns once it is done
    log.wait_durable(ticket)
    log.close()
    (index, record), (_, plain) = list(read_records(tmp_path))
    assert [bytes(b) for b in record["blobs"]] == [blob, b"tail"] and record["i"] == 0 and "blobs" not in plain
    segment = next(tmp_path.glob("*.seg"))
    data = bytearray(segment.read_bytes())
    assert data.count(blob) == 1  # stored as is, not re-encoded
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
