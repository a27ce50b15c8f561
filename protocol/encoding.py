"""Messages to ZeroMQ frames: ``[topic, header (msgpack map), *payload frames]``.

`encode` never copies a payload: payload frames are the caller's buffers (send them with
``copy=False``).  Every header is read back by the decoder's own field rules before it leaves, so
the reference encoder never emits what a receiver must refuse (PROTOCOL.md §3-4).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack

from dloco.protocol.checksum import crc32
from dloco.protocol.errors import EncodeError, ProtocolError
from dloco.protocol.headers import READERS, FieldReader
from dloco.protocol.limits import DEFAULT_LIMITS
from dloco.protocol.messages import PROTOCOL_VERSION, DeltaChunk, Kind, Message, SnapshotChunk

# of a snapshot: left out of the header when None
OPTIONAL_FIELDS = frozenset({"base_version", "digest", "served"})


def encode(message: Message) -> list[bytes | memoryview]:
    """Frames of `message`: topic, msgpack header, then one raw payload frame per tensor slice.
    EncodeError for a message its receivers would refuse."""
    header, payloads = header_of(message)
    try:
        packed = msgpack.packb(header, use_bin_type=True)
    except (OverflowError, TypeError, ValueError) as error:
        raise EncodeError(f"cannot encode {message.kind} header: {error}") from None
    _check_header(message.kind, header, payloads)
    return [message.topic.encode("ascii"), packed, *payloads]


def header_of(message: Message) -> tuple[dict[str, Any], list[memoryview]]:
    """The header map of `message` (before msgpack) and its payload views."""
    header: dict[str, Any] = {"v": PROTOCOL_VERSION, "kind": str(message.kind)}
    payloads: list[memoryview] = []
    for field in dataclasses.fields(message):
        value = getattr(message, field.name)
        if field.name == "payloads" or (
            value is None and field.name in OPTIONAL_FIELDS and isinstance(message, SnapshotChunk)
        ):
            continue
        if field.name == "codec":
            header["codec"], header["block"] = value.name, value.block
        elif field.name == "slices":
            payloads = [_byte_view(p) for p in message.payloads]
            header["slices"] = _slice_headers(message, payloads)
        elif field.name in ("cursors", "results"):
            header[field.name] = [dataclasses.asdict(entry) for entry in value]
        elif isinstance(value, tuple):
            header[field.name] = [list(v) if isinstance(v, tuple) else v for v in value]
        else:
            header[field.name] = value
    return header, payloads


def _check_header(kind: Kind, header: dict[str, Any], payloads: list[memoryview]) -> None:
    """The header read back by the decoder's own field rules (PROTOCOL.md §3-4), so the encoder
    never emits what a receiver must refuse (a sender `a b`, a resend range [0, 1], a heartbeat
    stream of 1,024).  Payload bytes are the codecs' to get right and are not re-read here."""
    try:
        fields = FieldReader(header, f"{kind} header", DEFAULT_LIMITS)
        READERS[kind](fields, tuple(payloads), DEFAULT_LIMITS)
        fields.finish(extra_allowed={"v", "kind"})
    except ProtocolError as error:
        raise EncodeError(
            f"{kind} would be refused by its receivers ({error.reason}): {error.detail}"
        ) from None


def _byte_view(buffer: Any) -> memoryview:
    view = memoryview(buffer)
    if not view.c_contiguous:
        raise EncodeError("payload buffers must be C-contiguous")
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _slice_headers(
    message: DeltaChunk | SnapshotChunk, payloads: list[memoryview]
) -> list[dict[str, Any]]:
    if len(payloads) != len(message.slices):
        raise EncodeError(f"{len(message.slices)} slices but {len(payloads)} payloads")
    out = []
    for item, payload in zip(message.slices, payloads):
        expected = message.codec.encoded_nbytes(item.count)
        if payload.nbytes != expected:
            raise EncodeError(
                f"payload of {item.path} is {payload.nbytes} bytes, {message.codec.name} needs"
                f" {expected}"
            )
        out.append(
            {
                "path": item.path,
                "dtype": item.dtype,
                "shape": list(item.shape),
                "start": item.start,
                "count": item.count,
                "nbytes": payload.nbytes,
                "crc32": crc32(payload),
            }
        )
    return out
