"""The spec's last edges, found by a second implementation written from PROTOCOL.md alone: every
field of every message, given every msgpack type, is either taken or refused with the decoder's
one error (ProtocolError on the bus, ReplicationError on the §12 stream), never anything else;
nil is refused for every optional field; §12's ranges and frame counts are enforced."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest

from dloco import protocol
from dloco.merger.replication import wire
from dloco.merger.replication.wire import ReplicationError
from dloco.protocol import ProtocolError, decode, encode
from tests.conftest import one_of_each_kind

# one value of each msgpack type, and the edges of the integer ranges
VALUES = [None, True, -1, 1 << 32, (1 << 64) - 1, 1.5, "x", b"x", [1], {"a": 1}, [], {}]


def messages() -> list:
    """One message of each kind, and a snapshot with every optional field (a bf16 served value)."""
    kinds = one_of_each_kind()
    snapshot = next(m for m in kinds if isinstance(m, protocol.SnapshotChunk))
    served = dataclasses.replace(snapshot, version=5, base_version=4, digest=7, served="bf16")
    return [*kinds, served]


def _with(frames: list[bytes], key: str, value) -> list[bytes]:
    header = msgpack.unpackb(frames[1], raw=False)
    return [frames[0], msgpack.packb({**header, key: value}, use_bin_type=True), *frames[2:]]


@pytest.mark.parametrize("message", messages(), ids=lambda m: type(m).__name__)
def test_every_header_field_given_every_type_is_taken_or_refused_with_one_error(message):
    frames = [bytes(f) for f in encode(message)]
    for key in msgpack.unpackb(frames[1], raw=False):
        for value in VALUES:
            try:
                decode(_with(frames, key, value))
            except ProtocolError as error:
                assert error.reason
            except Exception as error:  # noqa: BLE001 - the point: nothing else escapes
                pytest.fail(f"{key} = {value!r}: {type(error).__name__}: {error}")


def test_served_is_a_name_with_a_digest_and_nil_is_refused_as_for_every_optional_field():
    served = messages()[-1]
    frames = [bytes(f) for f in encode(served)]
    assert decode(frames).served == "bf16"
    for value in (None, ["bf16"], {"bf16": 1}, "fp16", 1):
        with pytest.raises(ProtocolError, match="served"):
            decode(_with(frames, "served", value))


def frames_of(kind: bytes, body: dict, *extra) -> list:
    return wire.encode(kind, body, *extra)


# a valid body of each §12 kind
BODIES = {
    wire.FOLLOW: {"length": 3, "terms": [[0, 0], [2, 1]], "genesis": 7, "generation": 1},
    wire.START: {"at": 1, "generation": 1},
    wire.LEASE: {"epoch": 2, "term": 1, "length": 3, "lease_s": 3.0, "state": "sync"},
    wire.STORED: {"length": 3, "generation": 1},
    wire.DIGEST: {"index": 2, "fragment": 0, "sha256": "ab" * 32},
    wire.FENCE: {"epoch": 3, "term": 2},
    wire.REFUSED: {"why": "another run"},
}


@pytest.mark.parametrize("kind", list(BODIES), ids=lambda k: k.decode())
def test_every_replication_field_given_every_type_is_taken_or_refused(kind):
    assert wire.decode(frames_of(kind, BODIES[kind]))[1] == BODIES[kind]
    for key in BODIES[kind]:
        for value in VALUES:
            try:
                wire.decode(frames_of(kind, {**BODIES[kind], key: value}))
            except ReplicationError as error:
                assert error.reason
            except Exception as error:  # noqa: BLE001 - the point: nothing else escapes
                pytest.fail(f"{kind!r}.{key} = {value!r}: {type(error).__name__}: {error}")


@pytest.mark.parametrize(
    ("kind", "key", "value"),
    [
        (wire.START, "at", -1),
        (wire.FOLLOW, "genesis", 1 << 32),
        (wire.FOLLOW, "genesis", -1),
        (wire.FOLLOW, "terms", [[0, -1]]),
        (wire.FOLLOW, "length", -5),
        (wire.LEASE, "lease_s", -1.0),
        (wire.LEASE, "lease_s", float("inf")),
        (wire.DIGEST, "sha256", "AB" * 32),
        (wire.DIGEST, "sha256", "ab" * 31),
    ],
)
def test_the_ranges_of_section_12_are_enforced(kind, key, value):
    with pytest.raises(ReplicationError, match=key):
        wire.decode(frames_of(kind, {**BODIES[kind], key: value}))


def test_frames_after_the_map_are_those_the_kind_lists():
    for kind in (wire.LEASE, wire.STORED, wire.START, wire.FENCE):
        with pytest.raises(ReplicationError) as refused:
            wire.decode(frames_of(kind, BODIES[kind], b"extra"))
        assert refused.value.reason == "frames"
    # a record carries its map, then its blobs: at least the map
    with pytest.raises(ReplicationError, match="frame"):
        wire.decode(frames_of(wire.RECORD, {"index": 0, "crcs": []}))
    record = wire.record_frames(0, {"type": "x"}, [(b"blob", None)])
    assert wire.decode(record)[0] == wire.RECORD
    # a record's CRC entry is a uint32 or nil
    with pytest.raises(ReplicationError, match="crcs"):
        wire.decode(frames_of(wire.RECORD, {"index": 0, "crcs": [1 << 32]}, b"m"))
