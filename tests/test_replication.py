"""The hot standby's pure parts: where two logs agree, setting a log's tail aside, the replication
messages and their errors, the settings, and the epoch fences in the broker and the island."""

from __future__ import annotations

import threading
import time

import msgpack
import numpy as np
import pytest
import zmq

from dloco import protocol
from dloco.island.config import SyncConfig
from dloco.island.shaper import LinkShaper
from dloco.island.snapshots import Downlink
from dloco.island.uplink import Uplink
from dloco.merger.log import records
from dloco.merger.log.logmatch import agreed_length, set_aside_from, terms_of
from dloco.merger.log.segments import read_records
from dloco.merger.log.wal import WriteAheadLog
from dloco.merger.replication.wire import (
    FOLLOW,
    RECORD,
    ReplicationError,
    decode,
    encode,
    fragment_digest,
    read_record,
    record_frames,
)
from dloco.merger.settings import ReplicationConfig
from dloco.protocol.checksum import crc32
from dloco.protocol.errors import DlocoError
from tests.test_broker import BrokerProcess, heartbeat, pair


# terms: (epoch, first index)
@pytest.mark.parametrize(
    "mine, my_length, theirs, their_length, agreed",
    [
        # the same log
        ([(0, 0)], 10, [(0, 0)], 10, 10),
        # a standby behind
        ([(0, 0)], 10, [(0, 0)], 6, 6),
        # a standby ahead in the same term: the primary lost an unsynced tail
        ([(0, 0)], 10, [(0, 0)], 12, 10),
        # the standby took over at 8; the old primary wrote 8..10 meanwhile
        ([(0, 0), (1, 8)], 15, [(0, 0)], 11, 8),
        # a term the primary never saw: back to the last shared one
        ([(0, 0), (2, 9)], 20, [(0, 0), (1, 8)], 12, 8),
        # both in term 1
        ([(0, 0), (1, 8)], 15, [(0, 0), (1, 8)], 13, 13),
        # two primaries opened a term at 100: their epochs differ
        ([(0, 0), (500, 100)], 150, [(0, 0), (400, 100)], 201, 100),
        # an empty log
        ([(0, 0)], 10, [], 0, 0),
    ],
)
def test_the_logs_agree_up_to_where_their_newest_shared_term_ends_in_either(
    mine, my_length, theirs, their_length, agreed
):
    assert agreed_length(mine, my_length, theirs, their_length) == agreed


def _log(directory, count: int, term_at: int | None = None) -> WriteAheadLog:
    # a few records per segment
    wal = WriteAheadLog(directory, segment_bytes=300, fsync="never")
    for index in range(count):
        if index == term_at:
            wal.append(records.term_record(1, 99))
        else:
            wal.append(
                {"type": "cursors", "cursors": [["a", 1, index]]},
                [(np.full(40, index, np.uint8), None)],
            )
    return wal


def test_a_log_set_aside_from_a_record_keeps_everything_before_it_and_moves_the_rest(tmp_path):
    wal = _log(tmp_path / "wal", 12, term_at=9)
    wal.close()
    (tmp_path / "ckpt").mkdir()
    for n in (5, 7, 9):
        (tmp_path / "ckpt" / f"{n:012d}.ckpt").write_bytes(b"x")
    # terms by epoch; the newest term number
    assert terms_of(tmp_path / "wal") == ([(0, 0), (99, 9)], 12, 1)
    moved = set_aside_from(tmp_path / "wal", 7, tmp_path / "ckpt")
    assert [index for index, _ in read_records(tmp_path / "wal")] == list(range(7))
    # 9 covered records 7, 8
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        f"{5:012d}.ckpt",
        f"{7:012d}.ckpt",
    ]
    assert (
        f"{9:012d}.ckpt" in moved
        and len(list((tmp_path / "wal" / "discarded" / f"{7:012d}").iterdir())) >= 2
    )
    reopened = WriteAheadLog(tmp_path / "wal", segment_bytes=300, fsync="never")
    assert reopened.next_index == 7
    assert reopened.append({"type": "cursors", "cursors": []}) == 7
    reopened.close()
    assert terms_of(tmp_path / "wal") == ([(0, 0)], 8, 0)


def test_a_record_travels_with_its_blobs_and_their_crcs_and_a_damaged_blob_is_refused():
    payload = np.arange(100, dtype=np.uint8)
    record = {"type": "delta", "island": "a", "slices": [["w", [100], 0, 100]]}
    frames = record_frames(41, record, [(payload, crc32(payload))])
    kind, body, rest = decode(frames)
    index, back, blobs = read_record(body, rest)
    assert (kind, index, back) == (RECORD, 41, record)
    assert bytes(blobs[0][0]) == payload.tobytes() and blobs[0][1] == crc32(payload)
    damaged = [*frames[:3], b"\x01" + bytes(frames[3])[1:]]
    with pytest.raises(ReplicationError) as error:
        read_record(*decode(damaged)[1:])
    assert error.value.reason == "record"


@pytest.mark.parametrize(
    "frames, reason",
    [
        ([b"follow"], "frames"),
        ([b"hello", msgpack.packb({})], "kind"),
        # 0xc1 is never valid msgpack
        ([FOLLOW, b"\xc1"], "body"),
        # terms and genesis missing
        ([FOLLOW, msgpack.packb({"length": 3})], "body"),
        # a string for an int
        (
            [
                FOLLOW,
                msgpack.packb({"length": "3", "terms": [[0, 0]], "genesis": 1, "generation": 1}),
            ],
            "body",
        ),
        # a term without its index
        (
            [FOLLOW, msgpack.packb({"length": 3, "terms": [[0]], "genesis": 1, "generation": 1})],
            "body",
        ),
        ([FOLLOW, msgpack.packb([1, 2])], "body"),
    ],
)
def test_a_malformed_replication_message_is_a_typed_error(frames, reason):
    with pytest.raises(ReplicationError) as error:
        decode(frames)
    assert error.value.reason == reason


def test_follow_round_trips():
    body = {"length": 7, "terms": [[0, 0]], "genesis": 12345, "generation": 2}
    assert decode(encode(FOLLOW, body)) == (FOLLOW, body, [])


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"mode": "both"}, "replication mode"),
        ({"mode": "sync"}, "--replication-endpoint"),
        ({"mode": "off", "standby": True}, "--standby-of"),
        ({"mode": "off", "peer": "tcp://h:1"}, "--replication-endpoint"),
        ({"mode": "sync", "endpoint": "@tcp://*:1", "lease_s": 0}, "lease"),
    ],
)
def test_bad_replication_settings_are_refused_with_what_to_give(kwargs, words):
    with pytest.raises(DlocoError, match=words):
        ReplicationConfig(**kwargs)


def test_a_fragment_digest_depends_on_every_value_and_name():
    params = {"b": np.ones(3, np.float32), "a": np.zeros(2, np.float32)}
    base = fragment_digest(params)
    assert base == fragment_digest(dict(reversed(params.items())))
    assert base != fragment_digest({**params, "a": np.array([0, 1e-30], np.float32)})
    assert base != fragment_digest({"c": params["b"], "a": params["a"]})


def test_an_island_ignores_acks_from_an_older_epoch_of_their_sender():
    uplink = Uplink("a", "m", 5, SyncConfig(), LinkShaper(None), threading.Event())
    result = protocol.DeltaResult("a", 5, 1, 0, "folded", 3, "")
    uplink.on_ack(protocol.Ack(sender="merger", epoch=200, seq=1, cursors=(), results=()))
    uplink.on_ack(
        protocol.Ack(
            sender="merger",
            epoch=100,
            seq=9,
            cursors=(protocol.Cursor("a", 5, 4),),
            results=(result,),
        )
    )
    assert uplink.cursor == 0 and 1 not in uplink.settled
    assert uplink.results["dropped/old_epoch"] == 1
    uplink.on_ack(
        protocol.Ack(
            sender="merger",
            epoch=200,
            seq=2,
            cursors=(protocol.Cursor("a", 5, 4),),
            results=(result,),
        )
    )
    assert uplink.cursor == 4 and 1 in uplink.settled


def test_once_a_newer_merger_epoch_came_on_a_snapshot_an_older_epochs_ack_settles_nothing():
    """After a split the old primary, alone, may answer a probe point to point (past the broker's
    fencing): the island's one record of epochs, shared by its snapshots and its acks, drops it."""
    epochs: dict[str, int] = {}
    uplink = Uplink(
        "a", "m", 5, SyncConfig(), LinkShaper(None), threading.Event(), merger_epochs=epochs
    )
    downlink = Downlink("a", 5, merger_epochs=epochs)
    old = protocol.Ack(
        sender="merger",
        epoch=100,
        seq=1,
        cursors=(),
        results=(protocol.DeltaResult("a", 5, 1, 0, "folded", 3, ""),),
    )
    downlink.on_snapshot(
        protocol.SnapshotChunk(
            sender="merger",
            epoch=200,
            seq=1,
            fragment=0,
            version=7,
            base_version=0,
            chunk_index=0,
            chunk_count=1,
            model="m",
            codec=protocol.Codec("fp32"),
            slices=(),
            payloads=(),
        ),
        {},
        0.0,
    )
    uplink.on_ack(old)
    assert (
        1 not in uplink.settled
        and uplink.results["dropped/old_epoch"] == 1
        and epochs == {"merger": 200}
    )


def test_an_island_adopts_snapshots_of_newer_merger_epochs_only_and_records_their_order():
    downlink = Downlink("a", 5)

    def full(epoch: int, version: int) -> None:
        downlink.on_snapshot(
            protocol.SnapshotChunk(
                sender="merger",
                epoch=epoch,
                seq=1,
                fragment=0,
                version=version,
                base_version=None,
                chunk_index=0,
                chunk_count=1,
                model="m",
                codec=protocol.Codec("fp32"),
                slices=(),
                payloads=(),
            ),
            {},
            0.0,
        )

    full(200, 7)
    full(200, 8)
    # a fenced primary's, late: refused
    full(100, 9)
    # the new primary's
    full(300, 9)
    # the old epoch again: refused, whatever its version
    full(200, 10)
    assert (
        downlink.adopted_epochs == {"merger": [200, 300]}
        and downlink.results["old_epoch"] == 2
        and downlink.results["full"] == 3
    )


@pytest.mark.timeout(120)
def test_the_broker_drops_snapshot_bus_messages_from_an_older_epoch_of_their_sender(tmp_path):
    broker = BrokerProcess(tmp_path, "--insecure")
    context = zmq.Context()
    try:
        pub, sub = pair(context, broker, 1)
        deadline = time.monotonic() + 30
        # until the subscription is through
        while not sub.poll(50):
            pub.send_multipart(heartbeat("merger", epoch=500))
            assert time.monotonic() < deadline
        for _ in range(10):
            # a replaced merger
            pub.send_multipart(heartbeat("merger", epoch=400))
        # another sender has its own epochs
        pub.send_multipart(heartbeat("other", epoch=1))
        pub.send_multipart(heartbeat("merger", epoch=600))
        seen = []
        while not seen or seen[-1] != ("merger", 600):
            assert sub.poll(10_000)
            message = protocol.decode(sub.recv_multipart())
            seen.append((message.sender, message.epoch))
        assert ("merger", 400) not in seen and ("other", 1) in seen
    finally:
        context.destroy(linger=0)
        assert broker.stop() == 0
    assert broker.events("broker_stopped")[-1]["refused"] == {"snapshot/old_epoch": 10}


def test_a_standby_whose_fold_differs_from_the_primarys_raises_whichever_digest_comes_second():
    from dloco.merger.replication.standby import Diverged, Standby

    # only its digest book-keeping: no sockets, no log
    standby = object.__new__(Standby)
    standby.digests, standby.theirs, standby.compared = {}, {}, 0
    # ours first
    standby._compare(7, None, (1, "aa"))
    standby._compare(7, "aa", None)
    # theirs first
    standby._compare(9, "bb", None)
    standby._compare(9, None, (0, "bb"))
    assert standby.compared == 2 and not standby.digests and not standby.theirs
    standby._compare(11, "cc", None)
    with pytest.raises(Diverged, match="fragment 1 after log record 11"):
        standby._compare(11, None, (1, "dd"))


def test_the_live_view_names_a_mergers_role_from_its_log_events_only():
    from dloco.cluster.liveview import role_line

    # a merger without a peer: no role line at all
    assert role_line({"event": "fold"}, None) is None
    assert role_line({"event": "following"}, None) == "standby"
    assert role_line({"event": "fold"}, "standby") == "standby"
    assert role_line({"event": "replication", "state": "alone"}, "primary").startswith(
        "primary, standby alone"
    )
    assert (
        role_line({"event": "taking_over", "epoch": 7}, "standby") == "primary (took over, epoch 7)"
    )
