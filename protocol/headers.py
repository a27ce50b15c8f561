"""Header maps to messages: each kind's fields read and checked in the order of its table in
PROTOCOL.md §3 (`READERS`), through `FieldReader`'s typed access.

The decoder (protocol/framing.py) runs them on every received header and the encoder
(protocol/encoding.py) on every header it builds, so the two share one set of field rules.  Every
failure is a `ProtocolError` whose reason names the first faulty field.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

from dloco.protocol.errors import EncodeError, ProtocolError
from dloco.protocol.limits import IDENT, PATH, REASON, Limits
from dloco.protocol.messages import (
    MESSAGE_TYPES,
    SERVED_DTYPES,
    TENSOR_DTYPES,
    Ack,
    Cursor,
    DeltaChunk,
    DeltaResult,
    Hello,
    Kind,
    Message,
    ResendRequest,
    SnapshotChunk,
    SnapshotRequest,
    TensorSlice,
)
from dloco.protocol.quantization import CODEC_NAMES, Codec
from dloco.protocol.shards import MAX_SHARDS

_U64 = 1 << 64


class FieldReader:
    """Typed access to one header map; remembers which keys were read to reject unknown ones."""

    def __init__(self, mapping: Any, where: str, limits: Limits) -> None:
        if not isinstance(mapping, dict):
            raise ProtocolError(
                "field_type", f"{where} must be a map, got {type(mapping).__name__}"
            )
        self.mapping, self.where, self.limits, self.seen = mapping, where, limits, set()

    def get(self, key: str) -> Any:
        if key not in self.mapping:
            raise ProtocolError("missing_field", f"{self.where} lacks {key!r}")
        self.seen.add(key)
        return self.mapping[key]

    def uint(self, key: str, below: int = _U64) -> int:
        value = self.get(key)
        if type(value) is not int or not 0 <= value < below:
            raise ProtocolError(
                "field_value",
                f"{self.where}.{key} must be an int in [0, {below}), got {_show(value)}",
            )
        return value

    def text(
        self,
        key: str,
        pattern: re.Pattern = IDENT,
        max_len: int | None = None,
        allow_empty: bool = False,
    ) -> str:
        value = self.get(key)
        max_len = max_len or self.limits.max_ident_len
        if not isinstance(value, str) or len(value) > max_len:
            raise ProtocolError(
                "field_value",
                f"{self.where}.{key} must be a string of at most {max_len} chars, got"
                f" {_show(value)}",
            )
        if not (allow_empty and value == "") and not pattern.fullmatch(value):
            raise ProtocolError(
                "field_value",
                f"{self.where}.{key} has characters outside {pattern.pattern}: {_show(value)}",
            )
        return value

    def items(self, key: str, min_len: int = 0, max_len: int | None = None) -> list:
        value = self.get(key)
        max_len = max_len or self.limits.max_list_len
        if not isinstance(value, list) or not min_len <= len(value) <= max_len:
            raise ProtocolError(
                "field_value",
                f"{self.where}.{key} must be a list of {min_len} to {max_len} entries, got"
                f" {_show(value)}",
            )
        return value

    def nested(self, key: str, index: int, item: Any) -> FieldReader:
        return FieldReader(item, f"{self.where}.{key}[{index}]", self.limits)

    def finish(self, extra_allowed: frozenset | set = frozenset()) -> None:
        unknown = set(self.mapping) - self.seen - set(extra_allowed)
        if unknown:
            raise ProtocolError(
                "unknown_field", f"{self.where} has unknown fields {sorted(map(str, unknown))[:5]}"
            )


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


# Each reader checks its fields in the order of the kind's table in PROTOCOL.md §3 (a call's
# arguments are evaluated left to right), so the first faulty field names the reason.
def _envelope(fields: FieldReader) -> dict[str, Any]:
    return {
        "sender": fields.text("sender"),
        "epoch": fields.uint("epoch"),
        "seq": fields.uint("seq"),
    }


def _read_position(fields: FieldReader, limits: Limits) -> dict[str, int]:
    chunk_index = fields.uint("chunk_index")
    chunk_count = fields.uint("chunk_count", below=limits.max_chunks + 1)
    if chunk_count < 1 or chunk_index >= chunk_count:
        raise ProtocolError("chunk_index", f"chunk {chunk_index} of {chunk_count} is out of range")
    return {"chunk_index": chunk_index, "chunk_count": chunk_count}


def _read_codec(fields: FieldReader) -> Codec:
    name = fields.text("codec")
    if name not in CODEC_NAMES:
        raise ProtocolError("codec", f"unknown codec {name!r}; expected one of {CODEC_NAMES}")
    block = fields.uint("block")
    try:
        return Codec(name, block)
    except EncodeError as error:
        raise ProtocolError("codec", str(error)) from None


def _read_content(fields: FieldReader, limits: Limits) -> dict[str, Any]:
    """`model`, `codec`, `block` and `slices` of a chunk (its payloads are checked after the
    topic)."""
    model = fields.text("model")
    codec = _read_codec(fields)
    entries = fields.items("slices", min_len=1, max_len=limits.max_slices)
    slices = tuple(
        _read_slice(fields.nested("slices", i, entry), codec, limits)
        for i, entry in enumerate(entries)
    )
    return {"model": model, "codec": codec, "slices": slices}


def _read_slice(fields: FieldReader, codec: Codec, limits: Limits) -> TensorSlice:
    path = fields.text("path", pattern=PATH, max_len=limits.max_path_len)
    dtype = fields.text("dtype")
    if dtype not in TENSOR_DTYPES:
        raise ProtocolError(
            "field_value", f"{fields.where}.dtype {dtype!r} is not one of {TENSOR_DTYPES}"
        )
    dims = fields.get("shape")
    if not isinstance(dims, list):
        raise ProtocolError(
            "field_value", f"{fields.where}.shape must be a list, got {_show(dims)}"
        )
    if len(dims) > limits.max_ndim or any(type(d) is not int or d < 1 for d in dims):
        raise ProtocolError(
            "shape",
            f"{fields.where}.shape must be at most {limits.max_ndim} positive ints, got"
            f" {_show(dims)}",
        )
    # exact (Python ints): no overflow, no allocation
    size = math.prod(dims)
    if size > limits.max_tensor_values:
        raise ProtocolError(
            "shape", f"{fields.where}: tensor of {size} values exceeds {limits.max_tensor_values}"
        )
    start, count = fields.uint("start"), fields.uint("count")
    if count < 1 or start + count > size or start % codec.granule:
        raise ProtocolError(
            "slice_bounds",
            f"{fields.where}: values [{start}, {start + count}) do not fit a tensor of {size}"
            f" aligned to {codec.granule}",
        )
    nbytes = fields.uint("nbytes")
    if nbytes != codec.encoded_nbytes(count):
        raise ProtocolError(
            "length",
            f"{fields.where}: {count} {codec.name} values take {codec.encoded_nbytes(count)} bytes,"
            f" header says {nbytes}",
        )
    crc = fields.uint("crc32", below=1 << 32)
    fields.finish()
    return TensorSlice(
        path=path, dtype=dtype, shape=tuple(dims), start=start, count=count, crc32=crc
    )


def _read_delta(
    fields: FieldReader, payloads: tuple[memoryview, ...], limits: Limits
) -> DeltaChunk:
    return DeltaChunk(
        **_envelope(fields),
        delta_id=fields.uint("delta_id"),
        fragment=fields.uint("fragment"),
        base_version=fields.uint("base_version"),
        **_read_position(fields, limits),
        steps=fields.uint("steps"),
        tokens=fields.uint("tokens"),
        **_read_content(fields, limits),
        payloads=payloads,
    )


def _read_snapshot(
    fields: FieldReader, payloads: tuple[memoryview, ...], limits: Limits
) -> SnapshotChunk:
    head = {**_envelope(fields), "fragment": fields.uint("fragment")}
    version = fields.uint("version")
    head.update(_read_position(fields, limits), **_read_content(fields, limits))
    base = fields.uint("base_version") if "base_version" in fields.mapping else None
    digest = fields.uint("digest", below=1 << 32) if "digest" in fields.mapping else None
    if base is not None and (base >= version or digest is None):
        raise ProtocolError(
            "field_value",
            f"snapshot.base_version must be below version ({version}) and come with a digest, got"
            f" {base}",
        )
    # present, `served` is a name of SERVED_DTYPES (nil is refused, as for every optional field)
    served = fields.get("served") if "served" in fields.mapping else None
    if "served" in fields.mapping and not (
        type(served) is str and served in SERVED_DTYPES and digest is not None
    ):
        raise ProtocolError(
            "field_value",
            f"snapshot.served must be one of {sorted(SERVED_DTYPES)} and come with a digest, got"
            f" {_show(served)}",
        )
    return SnapshotChunk(
        **head,
        version=version,
        payloads=payloads,
        base_version=base,
        digest=digest,
        served=served,
    )


def _read_hello(fields: FieldReader, payloads: tuple[memoryview, ...], limits: Limits) -> Hello:
    head = {
        **_envelope(fields),
        "role": fields.text("role"),
        "region": fields.text("region"),
        "model": fields.text("model"),
    }
    codecs = fields.items("codecs")
    if any(c not in CODEC_NAMES for c in codecs):
        raise ProtocolError("codec", f"hello lists unknown codecs {_show(codecs)}")
    return Hello(**head, codecs=tuple(codecs))


def _read_resend(
    fields: FieldReader, payloads: tuple[memoryview, ...], limits: Limits
) -> ResendRequest:
    head = {
        **_envelope(fields),
        "target": fields.text("target"),
        "target_epoch": fields.uint("target_epoch"),
    }
    ranges = fields.items("ranges")
    for pair in ranges:
        if not (
            isinstance(pair, list)
            and len(pair) == 2
            and all(type(s) is int and 0 < s < _U64 for s in pair)
            and pair[0] <= pair[1]
        ):
            raise ProtocolError(
                "field_value",
                f"resend range must be [first, last] with 0 < first <= last, got {_show(pair)}",
            )
    return ResendRequest(**head, ranges=tuple((a, b) for a, b in ranges))


def _read_ack(fields: FieldReader, payloads: tuple[memoryview, ...], limits: Limits) -> Ack:
    envelope, cursors, results = _envelope(fields), [], []
    for i, entry in enumerate(fields.items("cursors")):
        f = fields.nested("cursors", i, entry)
        cursors.append(Cursor(island=f.text("island"), epoch=f.uint("epoch"), seq=f.uint("seq")))
        f.finish()
    for i, entry in enumerate(fields.items("results")):
        f = fields.nested("results", i, entry)
        head = {
            "island": f.text("island"),
            "epoch": f.uint("epoch"),
            "delta_id": f.uint("delta_id"),
            "fragment": f.uint("fragment"),
        }
        status = f.text("status")
        if status not in DeltaResult.STATUSES:
            raise ProtocolError(
                "field_value",
                f"{f.where}.status must be one of {DeltaResult.STATUSES}, got {_show(status)}",
            )
        results.append(
            DeltaResult(
                **head,
                status=status,
                version=f.uint("version"),
                reason=f.text(
                    "reason", pattern=REASON, max_len=limits.max_reason_len, allow_empty=True
                ),
            )
        )
        f.finish()
    return Ack(
        **envelope, cursors=tuple(cursors), results=tuple(results), tokens=fields.uint("tokens")
    )


def _read_snapshot_request(
    fields: FieldReader, payloads: tuple[memoryview, ...], limits: Limits
) -> SnapshotRequest:
    envelope = _envelope(fields)
    fragments = fields.items("fragments")
    if any(type(f) is not int or not 0 <= f < _U64 for f in fragments):
        raise ProtocolError(
            "field_value", f"snapshot_request.fragments must be ints >= 0, got {_show(fragments)}"
        )
    return SnapshotRequest(**envelope, fragments=tuple(fragments))


READERS: dict[Kind, Callable[[FieldReader, tuple[memoryview, ...], Limits], Message]] = {
    Kind.DELTA: _read_delta,
    Kind.SNAPSHOT: _read_snapshot,
    Kind.HEARTBEAT: lambda fields, payloads, limits: MESSAGE_TYPES[Kind.HEARTBEAT](
        **_envelope(fields), stream=fields.uint("stream", MAX_SHARDS), tokens=fields.uint("tokens")
    ),
    Kind.HELLO: _read_hello,
    Kind.RESEND: _read_resend,
    Kind.ACK: _read_ack,
    Kind.SNAPSHOT_REQUEST: _read_snapshot_request,
}
