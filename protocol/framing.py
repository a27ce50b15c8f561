"""ZeroMQ frames to messages: ``[topic, header (msgpack map), *payload frames]`` (the other way
is protocol/encoding.py); each kind's header fields are read by protocol/headers.py.

`decode` is strict: any input that is not exactly a valid message raises
`ProtocolError` with a reason, and nothing else escapes it; no allocation is driven by a header
field (sizes are checked against `Limits` and against the frames actually received before use).
Payloads of a decoded message are zero-copy memoryviews of the received frames.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgpack

from dloco.protocol.checksum import crc32
from dloco.protocol.errors import ProtocolError
from dloco.protocol.headers import READERS, FieldReader
from dloco.protocol.limits import DEFAULT_LIMITS, MAX_TOPIC_BYTES, Limits
from dloco.protocol.messages import (
    PROTOCOL_VERSION,
    DeltaChunk,
    Kind,
    Message,
    SnapshotChunk,
    TensorSlice,
)
from dloco.protocol.quantization import Codec


# ---- decode --------------------------------------------------------------------------------------
def decode(frames: Sequence[Any], limits: Limits = DEFAULT_LIMITS) -> Message:
    """Parse and fully validate frames; raise ProtocolError (only) if they are not a valid message.

    Checks run in the order of PROTOCOL.md §4.1, and the first that fails names the reason: the
    frame list, the header's bytes, `v` and `kind`, the fields in the order of the kind's table
    (unknown fields after them), the topic, then the payload frames one by one.
    """
    try:
        return _decode(frames, limits)
    except ProtocolError:
        raise
    # pathological nesting that slipped past msgpack's own guard
    except RecursionError as error:
        raise ProtocolError("header_msgpack", f"header nesting too deep: {error}") from None


def _decode(frames: Sequence[Any], limits: Limits) -> Message:
    if not isinstance(frames, (list, tuple)) or len(frames) < 2:
        raise ProtocolError("frame_count", "a message has at least 2 frames (topic, header)")
    if len(frames) > 2 + limits.max_slices:
        raise ProtocolError(
            "frame_count", f"{len(frames)} frames exceed the limit of {2 + limits.max_slices}"
        )
    views = [_view(frame, index) for index, frame in enumerate(frames)]
    header = _unpack_header(views[1], limits)
    version = header.get("v")
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise ProtocolError(
            "version",
            f"protocol version {version!r} is not supported (this peer speaks {PROTOCOL_VERSION})",
        )
    kind_name = header.get("kind")
    try:
        kind = Kind(kind_name)
    except ValueError:
        raise ProtocolError("unknown_kind", f"unknown message kind {kind_name!r}") from None
    fields = FieldReader(header, f"{kind} header", limits)
    payloads = tuple(views[2:])
    message = READERS[kind](fields, payloads, limits)
    fields.finish(extra_allowed={"v", "kind"})
    topic = bytes(views[0][: MAX_TOPIC_BYTES + 1])
    if topic != message.topic.encode("ascii"):
        raise ProtocolError("topic", f"topic {topic[:80]!r} does not match {message.topic!r}")
    if isinstance(message, (DeltaChunk, SnapshotChunk)):
        _check_payloads(message.codec, message.slices, payloads, limits)
    elif payloads:
        raise ProtocolError("frame_count", f"{kind} has no payload frames, got {len(payloads)}")
    return message


def _view(frame: Any, index: int) -> memoryview:
    try:
        view = memoryview(frame)
        if not view.c_contiguous:
            raise ProtocolError("frame_type", f"frame {index} is not a contiguous buffer")
        return view if view.ndim == 1 and view.format == "B" else view.cast("B")
    # not a buffer, released, or of an uncastable format
    except (TypeError, ValueError, BufferError):
        raise ProtocolError(
            "frame_type", f"frame {index} ({type(frame).__name__}) is not a readable byte buffer"
        ) from None


def peek_sender(frames: Sequence[Any], limits: Limits = DEFAULT_LIMITS) -> tuple[str, int]:
    """(sender, epoch) from a message's header, without validating the rest (the broker checks who
    sent what it forwards; receivers decode it whole).  ProtocolError if they cannot be read."""
    if len(frames) < 2:
        raise ProtocolError(
            "frame_count", f"a message has at least 2 frames (topic, header), got {len(frames)}"
        )
    header = _unpack_header(_view(frames[1], 1), limits)
    sender, epoch = header.get("sender"), header.get("epoch")
    if type(sender) is not str or type(epoch) is not int:
        raise ProtocolError(
            "field_type", "the header's sender and epoch must be a string and an int"
        )
    return sender, epoch


def _unpack_header(view: memoryview, limits: Limits) -> dict:
    if view.nbytes > limits.max_header_bytes:
        raise ProtocolError(
            "header_too_large", f"header of {view.nbytes} bytes exceeds {limits.max_header_bytes}"
        )
    cap = limits.max_header_bytes
    try:
        header = msgpack.unpackb(
            view,
            raw=False,
            strict_map_key=True,
            use_list=True,
            object_pairs_hook=_unique_keys,
            max_str_len=cap,
            max_bin_len=cap,
            max_array_len=cap,
            max_map_len=cap,
            max_ext_len=cap,
        )
    except (ValueError, TypeError, OverflowError, msgpack.UnpackException) as error:
        raise ProtocolError(
            "header_msgpack", f"header is not valid msgpack: {type(error).__name__}: {error}"
        ) from None
    if not isinstance(header, dict):
        raise ProtocolError("header_type", f"header must be a map, got {type(header).__name__}")
    return header


def _unique_keys(pairs: list[tuple[Any, Any]]) -> dict:
    """Every map in a header has string keys, each once (with a repeated key, which value wins?)."""
    if not all(type(key) is str for key, _ in pairs):
        raise ProtocolError("header_msgpack", "a map in the header has a key that is not a string")
    result = dict(pairs)
    if len(result) != len(pairs):
        raise ProtocolError("header_msgpack", "a map in the header repeats a key")
    return result


def _check_payloads(
    codec: Codec, slices: tuple[TensorSlice, ...], payloads: tuple[memoryview, ...], limits: Limits
) -> None:
    """The payload frames of a chunk whose header was valid: count, total size, then frame by frame
    length, checksum and values."""
    if len(payloads) != len(slices):
        raise ProtocolError(
            "frame_count",
            f"{len(slices)} slices need {len(slices)} payload frames, got {len(payloads)}",
        )
    total = sum(p.nbytes for p in payloads)
    if total > limits.max_payload_bytes:
        raise ProtocolError(
            "payload_too_large", f"payload of {total} bytes exceeds {limits.max_payload_bytes}"
        )
    for index, (item, payload) in enumerate(zip(slices, payloads)):
        if payload.nbytes != codec.encoded_nbytes(item.count):
            raise ProtocolError(
                "length",
                f"payload frame {index} has {payload.nbytes} bytes, its slice says"
                f" {codec.encoded_nbytes(item.count)}",
            )
        if crc32(payload) != item.crc32:
            raise ProtocolError(
                "checksum", f"crc32 of payload frame {index} does not match its slice"
            )
        codec.validate(payload, item.count)
