"""PROTOCOL.md §4.1: the order of the decoder's checks, so that a message with several faults is
refused for the first of them, and the bounds of §3 on every list and identifier."""

from __future__ import annotations

import dataclasses

import msgpack
import numpy as np
import pytest

from dloco import protocol
from dloco.protocol import Codec
from tests.conftest import (
    delta_messages,
    header_of,
    make_fragment,
    one_of_each_kind,
    reason_of,
    with_header,
)

BIG_HEADERS = protocol.Limits(max_header_bytes=1 << 20)


@pytest.fixture
def delta():
    message = delta_messages(make_fragment(), Codec("int8"), max_chunk_bytes=1 << 20)[0]
    assert len(message.slices) == 4
    return message


def kind(name: str):
    return next(m for m in one_of_each_kind() if m.kind == name)


def corrupt(frame: bytes) -> bytes:
    data = bytearray(frame)
    data[len(data) // 2] ^= 0x10
    return bytes(data)


def with_slice(header: dict, index: int, **changes) -> dict:
    slices = [dict(s) for s in header["slices"]]
    slices[index].update(changes)
    return {**header, "slices": slices}


# ---- one message, two faults: the reason is the earlier check's ---------------------------------
def test_frames_come_before_the_header(delta):
    frames, _ = header_of(delta)
    assert reason_of([frames[0], b"\xc1", object(), *frames[3:]]) == "frame_type"
    assert reason_of([frames[0], b"\xc1", *frames[2:], *[b""] * 1100]) == "frame_count"


def test_header_bytes_come_before_version(delta):
    frames, header = header_of(delta)
    too_large = msgpack.packb({**header, "v": 1, "pad": "x" * 70_000})
    assert reason_of([frames[0], too_large, *frames[2:]]) == "header_too_large"
    assert (
        reason_of([frames[0], msgpack.packb({**header, "v": 1})[:-1], *frames[2:]])
        == "header_msgpack"
    )


def test_version_comes_before_kind_and_fields(delta):
    frames, header = header_of(delta)
    assert (
        reason_of(with_header(frames, {**header, "v": 1, "kind": "gossip", "seq": -1})) == "version"
    )
    assert reason_of(with_header(frames, {**header, "kind": "gossip", "seq": -1})) == "unknown_kind"


def test_fields_are_checked_in_table_order(delta):
    frames, header = header_of(delta)
    no_sender = {k: v for k, v in header.items() if k != "sender"}
    # sender before seq
    assert reason_of(with_header(frames, {**no_sender, "seq": -1})) == "missing_field"
    no_delta_id = {k: v for k, v in header.items() if k != "delta_id"}
    # epoch before delta_id
    assert reason_of(with_header(frames, {**no_delta_id, "epoch": True})) == "field_value"
    # delta: ..., chunk_index, chunk_count, steps, tokens, model, codec, block, slices
    out_of_range = {**header, "chunk_index": header["chunk_count"]}
    assert (
        reason_of(with_header(frames, {**out_of_range, "steps": -1, "codec": "int3"}))
        == "chunk_index"
    )
    assert (
        reason_of(with_header(frames, {**header, "steps": -1, "chunk_index": 5})) == "chunk_index"
    )
    # codec before block
    assert reason_of(with_header(frames, {**header, "codec": "int3", "block": True})) == "codec"
    assert (
        reason_of(with_header(frames, with_slice({**header, "block": True}, 0, start=1)))
        == "field_value"
    )
    assert (
        reason_of(with_header(frames, with_slice({**header, "block": 100}, 0, start=1))) == "codec"
    )


def test_unknown_fields_come_after_every_defined_field(delta):
    frames, header = header_of(delta)
    assert (
        reason_of(with_header(frames, {**header, "colour": "blue", "tokens": -1})) == "field_value"
    )
    missing = {k: v for k, v in header.items() if k != "slices"}
    assert reason_of(with_header(frames, {**missing, "colour": "blue"})) == "missing_field"
    assert (
        reason_of(with_header(frames, with_slice(header, 0, colour="blue", crc32=-1)))
        == "field_value"
    )
    # A slice's unknown keys come right after its own fields, before the next slice's.
    assert (
        reason_of(with_header(frames, with_slice(with_slice(header, 0, colour="blue"), 1, start=1)))
        == "unknown_field"
    )


def test_slice_fields_in_table_order(delta):
    frames, header = header_of(delta)
    nine_dims = [1] * 9
    assert (
        reason_of(with_header(frames, with_slice(header, 0, shape=nine_dims, start=1, crc32=-1)))
        == "shape"
    )
    assert (
        reason_of(with_header(frames, with_slice(header, 0, start=1, nbytes=3))) == "slice_bounds"
    )
    assert reason_of(with_header(frames, with_slice(header, 0, nbytes=3, crc32=-1))) == "length"
    assert (
        reason_of(with_header(frames, with_slice(header, 1, path="a b", shape=nine_dims)))
        == "field_value"
    )


def test_the_header_comes_before_the_topic_and_the_topic_before_payloads(delta):
    frames, header = header_of(delta)
    wrong_topic = [b"delta/999", *frames[1:]]
    assert reason_of(with_header(wrong_topic, {**header, "colour": "blue"})) == "unknown_field"
    assert reason_of([*wrong_topic[:2], corrupt(frames[2]), *frames[3:]]) == "topic"
    # before the missing payload frames
    assert reason_of([*wrong_topic[:2], *frames[2:4]]) == "topic"
    # a faulty slice header (slice 1) is reported before a corrupted payload of slice 0
    assert (
        reason_of(
            with_header(
                [*frames[:2], corrupt(frames[2]), *frames[3:]], with_slice(header, 1, colour="blue")
            )
        )
        == "unknown_field"
    )
    heartbeat, _ = header_of(kind("heartbeat"))
    assert reason_of([b"hello", heartbeat[1], b"payload"]) == "topic"


def test_payload_frames_count_then_size_then_frame_by_frame(delta):
    frames, _ = header_of(delta)
    assert reason_of([*frames[:2], corrupt(frames[2]), *frames[3:5]]) == "frame_count"
    assert (
        reason_of(
            [*frames[:2], corrupt(frames[2]), *frames[3:]], protocol.Limits(max_payload_bytes=100)
        )
        == "payload_too_large"
    )
    assert reason_of([*frames[:2], frames[2][:-1], corrupt(frames[3]), *frames[4:]]) == "length"
    assert reason_of([*frames[:2], corrupt(frames[2]), frames[3][:-1], *frames[4:]]) == "checksum"


def test_checksum_comes_before_values():
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
    frames, _ = header_of(message)
    nan = np.frombuffer(frames[2], np.float32).copy()
    nan[3] = np.nan
    assert reason_of([*frames[:2], nan.tobytes()]) == "checksum"


def test_snapshot_base_is_checked_after_its_slices():
    snapshot = kind("snapshot")
    frames, header = header_of(snapshot)
    diff = {**header, "version": 4, "base_version": 4, "digest": 1}
    assert reason_of(with_header(frames, diff)) == "field_value"
    assert reason_of(with_header(frames, with_slice(diff, 0, start=1))) == "slice_bounds"
    # a base without a digest
    assert reason_of(with_header(frames, {**header, "base_version": 3})) == "field_value"


def test_result_fields_in_table_order():
    frames, header = header_of(kind("ack"))
    result = {**header["results"][1], "status": "lost"}
    del result["island"]
    # island comes first
    assert reason_of(with_header(frames, {**header, "results": [result]})) == "missing_field"
    cursor = {**header["cursors"][0], "seq": -1}
    assert (
        reason_of(with_header(frames, {**header, "cursors": [cursor], "results": [7]}))
        == "field_value"
    )
    assert (
        reason_of(with_header(frames, {**header, "cursors": [7], "results": [result]}))
        == "field_type"
    )


def test_every_map_key_is_a_string(delta):
    frames, header = header_of(delta)
    packed = msgpack.packb({**header, b"colour": 1}, use_bin_type=True)
    assert reason_of([frames[0], packed, *frames[2:]]) == "header_msgpack"
    packed = msgpack.packb(with_slice(header, 0, **{"extra": 1}), use_bin_type=True).replace(
        b"\xa5extra", b"\xc4\x05extra"
    )
    assert reason_of([frames[0], packed, *frames[2:]]) == "header_msgpack"


# ---- bounds on lists and identifiers (§3)
# ------------------------------------------------------------
@pytest.mark.parametrize(
    "name,field,entry",
    [
        ("resend", "ranges", [1, 1]),
        ("snapshot_request", "fragments", 0),
        ("hello", "codecs", "int4"),
        ("ack", "cursors", {"island": "island-a", "epoch": 7, "seq": 12}),
        (
            "ack",
            "results",
            {
                "island": "i",
                "epoch": 7,
                "delta_id": 1,
                "fragment": 2,
                "status": "folded",
                "version": 5,
                "reason": "",
            },
        ),
    ],
)
def test_every_list_holds_at_most_1024_entries(name, field, entry):
    frames, header = header_of(kind(name))
    assert protocol.decode(with_header(frames, {**header, field: [entry] * 1024}), BIG_HEADERS)
    assert (
        reason_of(with_header(frames, {**header, field: [entry] * 1025}), BIG_HEADERS)
        == "field_value"
    )


def test_slices_hold_1_to_1024_entries_and_shape_at_most_8(delta):
    frames, header = header_of(delta)
    assert reason_of(with_header(frames, {**header, "slices": []})) == "field_value"
    assert (
        reason_of(with_header(frames, {**header, "slices": header["slices"] * 257}), BIG_HEADERS)
        == "field_value"
    )
    assert (
        reason_of(with_header(frames, with_slice(header, 0, shape=[1] * 2000)), BIG_HEADERS)
        == "shape"
    )
    assert reason_of(with_header(frames, with_slice(header, 0, shape=7))) == "field_value"
    eight = with_slice(header, 0, shape=[*header["slices"][0]["shape"], 1, 1, 1, 1, 1, 1])
    assert protocol.decode(with_header(frames, eight)).slices[0].shape[-1] == 1


@pytest.mark.parametrize(
    "role", ["island", "merger", "broker", "observer", "tensorboard-relay", "x"]
)
def test_role_is_any_identifier(role):
    hello = dataclasses.replace(kind("hello"), role=role)
    assert protocol.decode(protocol.encode(hello)).role == role


@pytest.mark.parametrize("role", ["", "a b", "r" * 65, 3])
def test_role_must_be_an_identifier(role):
    frames, header = header_of(kind("hello"))
    assert reason_of(with_header(frames, {**header, "role": role})) == "field_value"
