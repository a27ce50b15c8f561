"""Round trips of every message kind, zero-copy payloads, and one test per decode rejection
reason."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import msgpack
import numpy as np
import pytest

from dloco import protocol
from dloco.protocol import Codec, decode, encode
from tests.conftest import (
    delta_messages,
    header_of,
    make_fragment,
    one_of_each_kind,
    reason_of,
    with_header,
)


def same(a, b) -> bool:
    """Messages equal field by field, payloads compared by content."""
    if type(a) is not type(b):
        return False
    for field in dataclasses.fields(a):
        x, y = getattr(a, field.name), getattr(b, field.name)
        if field.name == "payloads":
            if [bytes(p) for p in x] != [bytes(p) for p in y]:
                return False
        elif x != y:
            return False
    return True


@pytest.mark.parametrize("message", one_of_each_kind(), ids=lambda m: str(m.kind))
def test_every_kind_round_trips(message):
    frames = encode(message)
    assert frames[0] == message.topic.encode()
    header = msgpack.unpackb(frames[1])
    assert header["v"] == protocol.PROTOCOL_VERSION and header["kind"] == message.kind
    assert {"sender", "epoch", "seq"} <= set(header)
    assert same(decode([bytes(f) for f in frames]), message)


@pytest.mark.parametrize("name", protocol.CODEC_NAMES)
def test_delta_round_trips_with_every_codec(fragment, name):
    for message in delta_messages(fragment, Codec(name)):
        assert same(decode(encode(message)), message)


def test_chunk_headers_are_self_describing(fragment):
    message = delta_messages(fragment, Codec("int4"), max_chunk_bytes=1 << 20)[0]
    header = msgpack.unpackb(encode(message)[1])
    for key in (
        "fragment",
        "base_version",
        "chunk_index",
        "chunk_count",
        "delta_id",
        "steps",
        "tokens",
        "model",
        "codec",
        "block",
    ):
        assert key in header
    assert set(header["slices"][0]) == {
        "path",
        "dtype",
        "shape",
        "start",
        "count",
        "nbytes",
        "crc32",
    }


def test_payloads_are_zero_copy_both_ways(fragment):
    x = np.arange(1000, dtype=np.float32)
    plan = protocol.split_fragment({"w": x}, Codec("fp32"))[0]
    message = protocol.SnapshotChunk(
        sender="m",
        epoch=1,
        seq=1,
        fragment=0,
        version=1,
        chunk_index=0,
        chunk_count=1,
        model="abc",
        codec=Codec("fp32"),
        slices=plan.slices,
        payloads=plan.payloads,
    )
    frames = encode(message)
    # fp32 snapshot: the parameter buffer itself
    assert np.shares_memory(np.frombuffer(frames[2], dtype=np.float32), x)
    received = [bytes(frames[0]), bytes(frames[1]), bytearray(frames[2])]
    decoded = decode(received)
    # a view of the received frame, not a copy
    assert decoded.payloads[0].obj is received[2]


def test_protocol_imports_neither_zmq_nor_jax():
    code = (
        "import sys, dloco.protocol; bad = {'zmq', 'jax', 'flax'} & set(sys.modules); assert not"
        " bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# ---- one rejection per reason ----------------------------------------------------------------
@pytest.fixture
def delta():
    return delta_messages(make_fragment(), Codec("int8"), max_chunk_bytes=1 << 20)[0]


def test_rejects_wrong_version(delta):
    frames, header = header_of(delta)
    assert (
        reason_of(with_header(frames, {**header, "v": protocol.PROTOCOL_VERSION + 1})) == "version"
    )


def test_rejects_unknown_kind(delta):
    frames, header = header_of(delta)
    assert reason_of(with_header(frames, {**header, "kind": "gossip"})) == "unknown_kind"


def test_rejects_missing_and_unknown_fields(delta):
    frames, header = header_of(delta)
    assert (
        reason_of(with_header(frames, {k: v for k, v in header.items() if k != "base_version"}))
        == "missing_field"
    )
    assert reason_of(with_header(frames, {**header, "colour": "blue"})) == "unknown_field"
    slices = [{**header["slices"][0], "extra": 1}, *header["slices"][1:]]
    assert reason_of(with_header(frames, {**header, "slices": slices})) == "unknown_field"


def test_rejects_missing_and_extra_frames(delta):
    frames, _ = header_of(delta)
    assert reason_of(frames[:-1]) == "frame_count"
    assert reason_of(frames + [b"x"]) == "frame_count"
    assert reason_of(frames[:1]) == "frame_count"
    heartbeat = [bytes(f) for f in encode(protocol.Heartbeat(sender="a", epoch=1, seq=1))]
    assert reason_of(heartbeat + [b""]) == "frame_count"


def test_rejects_large_or_broken_headers(delta):
    frames, header = header_of(delta)
    assert reason_of(frames, protocol.Limits(max_header_bytes=100)) == "header_too_large"
    assert reason_of([frames[0], b"\xc1", *frames[2:]]) == "header_msgpack"
    assert reason_of([frames[0], frames[1][:-3], *frames[2:]]) == "header_msgpack"
    assert reason_of([frames[0], msgpack.packb([1, 2]), *frames[2:]]) == "header_type"
    assert reason_of([frames[0], object(), *frames[2:]]) == "frame_type"


def test_rejects_unreadable_frames(delta):
    frames, header = header_of(delta)
    released = memoryview(bytearray(frames[0]))
    released.release()
    assert reason_of([released, *frames[1:]]) == "frame_type"
    strided = np.zeros(2 * len(frames[2]), np.uint8)
    strided[::2] = np.frombuffer(frames[2], np.uint8)
    assert reason_of([*frames[:2], strided[::2], *frames[3:]]) == "frame_type"
    assert reason_of([b"x" * 1_000_000, *frames[1:]]) == "topic"


def test_rejects_booleans_floats_and_repeated_keys(delta):
    frames, header = header_of(delta)
    assert reason_of(with_header(frames, {**header, "v": True})) == "version"
    # version 1 had no diff snapshots
    assert reason_of(with_header(frames, {**header, "v": 1})) == "version"
    assert (
        reason_of(with_header(frames, {**header, "v": float(protocol.PROTOCOL_VERSION)}))
        == "version"
    )
    packed = msgpack.packb(header)
    # append a second "seq" entry by hand: bump the map16 length and add the pair
    assert packed[0] == 0xDE
    count = int.from_bytes(packed[1:3], "big")
    repeated = (
        b"\xde"
        + (count + 1).to_bytes(2, "big")
        + packed[3:]
        + msgpack.packb("seq")
        + msgpack.packb(999)
    )
    assert reason_of([frames[0], repeated, *frames[2:]]) == "header_msgpack"


def test_rejects_length_mismatch(delta):
    frames, header = header_of(delta)
    assert reason_of([*frames[:2], frames[2][:-1], *frames[3:]]) == "length"
    slices = [
        {**header["slices"][0], "count": header["slices"][0]["count"] - 256},
        *header["slices"][1:],
    ]
    assert reason_of(with_header(frames, {**header, "slices": slices})) == "length"


def test_rejects_chunk_index_out_of_range(delta):
    frames, header = header_of(delta)
    assert (
        reason_of(with_header(frames, {**header, "chunk_index": header["chunk_count"]}))
        == "chunk_index"
    )
    assert (
        reason_of(with_header(frames, {**header, "chunk_count": 0, "chunk_index": 0}))
        == "chunk_index"
    )


def test_rejects_checksum_mismatch(delta):
    frames, _ = header_of(delta)
    corrupted = bytearray(frames[2])
    corrupted[len(corrupted) // 2] ^= 0x10
    assert reason_of([*frames[:2], bytes(corrupted), *frames[3:]]) == "checksum"


def test_rejects_nan_in_payload():
    x = np.ones(64, dtype=np.float32)
    plan = protocol.split_fragment({"w": x}, Codec("fp32"))[0]
    message = protocol.SnapshotChunk(
        sender="m",
        epoch=1,
        seq=1,
        fragment=0,
        version=1,
        chunk_index=0,
        chunk_count=1,
        model="abc",
        codec=Codec("fp32"),
        slices=plan.slices,
        payloads=plan.payloads,
    )
    frames = [bytes(f) for f in encode(message)]
    # the sender's buffer changed after the checksum: still refused, as non-finite
    x[5] = np.nan
    poisoned = encode(message)
    assert reason_of([bytes(f) for f in poisoned]) == "non_finite"
    assert decode(frames).slices == plan.slices


def test_rejects_absurd_sizes_without_allocating(delta):
    frames, header = header_of(delta)
    huge = [{**header["slices"][0], "shape": [1 << 40, 1 << 40]}, *header["slices"][1:]]
    assert reason_of(with_header(frames, {**header, "slices": huge})) == "shape"
    assert reason_of(with_header(frames, {**header, "chunk_count": 1 << 40})) == "field_value"
    assert reason_of(frames, protocol.Limits(max_payload_bytes=10)) == "payload_too_large"


@pytest.mark.parametrize(
    "key,value",
    [
        ("seq", -1),
        ("epoch", True),
        ("fragment", 1.5),
        ("sender", ""),
        ("sender", "a b"),
        ("model", 7),
        ("codec", "int3"),
        ("block", 100),
    ],
)
def test_rejects_mistyped_fields(delta, key, value):
    frames, header = header_of(delta)
    assert reason_of(with_header(frames, {**header, key: value})) in {"field_value", "codec"}


def test_rejects_topic_mismatch(delta):
    frames, _ = header_of(delta)
    assert reason_of([b"delta/999", *frames[1:]]) == "topic"


def test_rejects_misaligned_or_out_of_bounds_slices(delta):
    frames, header = header_of(delta)
    first = header["slices"][0]
    assert (
        reason_of(
            with_header(
                frames, {**header, "slices": [{**first, "start": 1}, *header["slices"][1:]]}
            )
        )
        == "slice_bounds"
    )
    assert (
        reason_of(
            with_header(
                frames, {**header, "slices": [{**first, "shape": [1]}, *header["slices"][1:]]}
            )
        )
        == "slice_bounds"
    )


def test_encode_refuses_inconsistent_messages(delta):
    with pytest.raises(protocol.EncodeError):
        encode(dataclasses.replace(delta, payloads=delta.payloads[:-1]))
    with pytest.raises(protocol.EncodeError):
        encode(dataclasses.replace(delta, payloads=(b"x", *delta.payloads[1:])))
    with pytest.raises(protocol.EncodeError):
        encode(dataclasses.replace(delta, seq=1 << 70))


def test_the_checksum_is_zlibs_crc32_by_isal():
    """protocol.checksum.crc32: the same values and chaining as zlib's, from ISA-L (a
    dependency)."""
    import zlib

    from dloco.protocol import checksum

    data = np.random.default_rng(0).integers(0, 256, 1 << 20, dtype=np.uint8).tobytes()
    # the check value PROTOCOL.md §3.4 names
    assert checksum.crc32(b"123456789") == 0xCBF43926
    assert checksum.crc32(data) == zlib.crc32(data) and checksum.crc32(
        data[7:], 12345
    ) == zlib.crc32(data[7:], 12345)
    assert checksum.crc32(memoryview(data)[3:1000]) == zlib.crc32(data[3:1000])
    assert "isal" in checksum.crc32.__module__
