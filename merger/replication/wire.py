"""The replication stream's messages and settings (PROTOCOL.md §12).  Pure: bytes in, values out.

Frame 0 is the kind, frame 1 a msgpack map whose fields are checked by name, type and range,
further frames as the kind says (a record's map and its blobs; none for the others).  Anything
else is a `ReplicationError` with a counter key.  A standby's `follow` carries a generation that
`start` and `stored` repeat, so an answer to an earlier `follow` is told apart from the current
stream's.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import msgpack
import numpy as np

from dloco.protocol.checksum import crc32
from dloco.protocol.errors import DlocoError

FOLLOW, START, RECORD, LEASE, STORED, DIGEST, FENCE, REFUSED = (
    b"follow",
    b"start",
    b"record",
    b"lease",
    b"stored",
    b"digest",
    b"fence",
    b"refused",
)


def _uint(value) -> bool:
    return type(value) is int and value >= 0


def _uint32(value) -> bool:
    return _uint(value) and value < 1 << 32


def _terms(value) -> bool:
    return isinstance(value, list) and all(
        isinstance(t, list) and len(t) == 2 and all(map(_uint, t)) for t in value
    )


def _crcs(value) -> bool:
    return isinstance(value, list) and all(c is None or _uint32(c) for c in value)


def _seconds(value) -> bool:
    return type(value) in (int, float) and 0 <= value < float("inf")


def _hex64(value) -> bool:
    return (
        isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)
    )


def _text(value) -> bool:
    return isinstance(value, str)


# kind -> {field: check}, in PROTOCOL.md §12's order
FIELDS = {
    FOLLOW: {"length": _uint, "terms": _terms, "genesis": _uint32, "generation": _uint},
    START: {"at": _uint, "generation": _uint},
    RECORD: {"index": _uint, "crcs": _crcs},
    LEASE: {"epoch": _uint, "term": _uint, "length": _uint, "lease_s": _seconds, "state": _text},
    STORED: {"length": _uint, "generation": _uint},
    DIGEST: {"index": _uint, "fragment": _uint, "sha256": _hex64},
    FENCE: {"epoch": _uint, "term": _uint},
    REFUSED: {"why": _text},
}
# the frames after the map: a record's map and blobs (at least the map); none for the others
MIN_EXTRA = {RECORD: 1}


class ReplicationError(DlocoError):
    """A replication message that cannot be read; `reason` is the counter key."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def encode(kind: bytes, body: dict, *extra) -> list:
    return [kind, msgpack.packb(body, use_bin_type=True), *extra]


def decode(frames: Sequence) -> tuple[bytes, dict, list]:
    """(kind, body, the frames after the body); ReplicationError for anything else."""
    if len(frames) < 2:
        raise ReplicationError("frames", f"{len(frames)} frame(s), at least 2 expected")
    kind = bytes(frames[0])
    if kind not in FIELDS:
        raise ReplicationError("kind", f"unknown message kind {kind[:16]!r}")
    try:
        body = msgpack.unpackb(frames[1], raw=False, strict_map_key=False)
    except (ValueError, TypeError, msgpack.UnpackException) as error:
        raise ReplicationError("body", f"{kind.decode()}: undecodable body: {error}") from None
    if not isinstance(body, dict):
        raise ReplicationError("body", f"{kind.decode()}: the body is not a map")
    wrong = [
        field
        for field, check in FIELDS[kind].items()
        if field not in body or not check(body[field])
    ]
    if wrong:
        raise ReplicationError("body", f"{kind.decode()}: missing or mistyped {', '.join(wrong)}")
    extra = len(frames) - 2
    if (kind in MIN_EXTRA and extra < MIN_EXTRA[kind]) or (kind not in MIN_EXTRA and extra):
        raise ReplicationError("frames", f"{kind.decode()}: {extra} frame(s) after the map")
    return kind, body, list(frames[2:])


def record_frames(index: int, record: dict, blobs: Sequence[tuple[Any, int | None]]) -> list:
    """A log record as it travels: header (index, blob CRCs), the record's map, its blobs."""
    return encode(
        RECORD,
        {"index": index, "crcs": [crc for _, crc in blobs]},
        msgpack.packb(record, use_bin_type=True),
        *[memoryview(buffer).cast("B") for buffer, _ in blobs],
    )


def read_record(body: dict, rest: list) -> tuple[int, dict, list[tuple[memoryview, int | None]]]:
    """(index, record, blobs with CRCs) of a `record` message; a blob whose CRC is given is
    checked."""
    try:
        record = msgpack.unpackb(rest[0], raw=False, strict_map_key=False)
    except (IndexError, ValueError, TypeError, msgpack.UnpackException) as error:
        raise ReplicationError("record", f"record {body['index']}: undecodable: {error}") from None
    crcs, blobs = body["crcs"], [memoryview(frame) for frame in rest[1:]]
    if (
        not isinstance(record, dict)
        or not isinstance(record.get("type"), str)
        or len(crcs) != len(blobs)
    ):
        raise ReplicationError(
            "record", f"record {body['index']}: {len(blobs)} blobs for {len(crcs)} CRCs, or no type"
        )
    for number, (blob, crc) in enumerate(zip(blobs, crcs)):
        if crc is not None and crc32(blob) != crc:
            raise ReplicationError("record", f"record {body['index']}: blob {number} fails its CRC")
    return body["index"], record, list(zip(blobs, crcs))


def fragment_digest(params) -> str:
    """sha256 over one fragment's parameters (records.params_digest for one fragment)."""
    digest = hashlib.sha256()
    for path in sorted(params):
        digest.update(path.encode())
        digest.update(np.ascontiguousarray(params[path], dtype="<f4").tobytes())
    return digest.hexdigest()
