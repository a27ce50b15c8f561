"""Message kinds of the wire protocol: frozen, typed values, one class per kind.

Every message carries the common envelope ``sender``, ``epoch`` (the sender's incarnation, new on
every process start, so a restarted sender's sequence numbers are never confused with its previous
life) and ``seq``.  For the *stream* kinds (delta, snapshot, ack) ``seq`` numbers the message in
its sender's stream, 1, 2, 3, ... without gaps; for the *control* kinds (heartbeat, hello, resend,
snapshot request) it is the sender's last stream ``seq`` so far (0 if none), which lets a receiver
notice tail loss from any message.  PROTOCOL.md defines every field.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import ClassVar, Union

from dloco.protocol.quantization import Codec

# 2: snapshots may be diffs (base_version, digest); 3: a stream per merger shard (heartbeat.stream,
# topics end in /); 4: trained tokens (heartbeat.tokens, ack.tokens) for the cluster's schedule;
# 5: a snapshot's served value may be held in bfloat16 (snapshot.served); 6: with served = bf16,
# the digest is over the bfloat16 bytes (PROTOCOL.md §9 lists every version)
PROTOCOL_VERSION = 6

# a snapshot's `served`: what else than float32 receivers may hold the served value in
SERVED_DTYPES = frozenset({"bf16"})

Buffer = Union[bytes, bytearray, memoryview]


class Kind(enum.StrEnum):
    DELTA = "delta"
    SNAPSHOT = "snapshot"
    HEARTBEAT = "heartbeat"
    HELLO = "hello"
    RESEND = "resend"
    ACK = "ack"
    SNAPSHOT_REQUEST = "snapshot_request"


STREAM_KINDS = frozenset({Kind.DELTA, Kind.SNAPSHOT, Kind.ACK})
TENSOR_DTYPES = ("float32", "bfloat16", "float16", "float64")


@dataclasses.dataclass(frozen=True)
class TensorSlice:
    """Values [start, start + count) of the flattened (C-order) tensor `path`."""

    # "/"-joined parameter path, e.g. "blocks/0/attn/qkv/kernel"
    path: str
    # the tensor's dtype in the model, one of TENSOR_DTYPES
    dtype: str
    # the whole tensor's shape
    shape: tuple[int, ...]
    # first value carried, a multiple of the codec's granule
    start: int
    # values carried, >= 1
    count: int
    # CRC-32 of the payload as the frame header carried it (decode checked it): the merger's log
    # stores it instead of computing a second one.  Not part of a slice's identity.
    crc32: int | None = dataclasses.field(default=None, compare=False)

    @property
    def size(self) -> int:
        return math.prod(self.shape)


@dataclasses.dataclass(frozen=True)
class DeltaChunk:
    """One chunk of an island's quantized pseudo-gradient for one fragment (island → merger)."""

    kind: ClassVar[Kind] = Kind.DELTA
    sender: str
    epoch: int
    seq: int
    # per-sender delta counter; all chunks of one delta share it
    delta_id: int
    fragment: int
    # version of the fragment snapshot this delta was computed against
    base_version: int
    chunk_index: int
    chunk_count: int
    # inner steps since the anchor was adopted
    steps: int
    # tokens trained on since the anchor was adopted
    tokens: int
    # model fingerprint (structure hash); must match the merger's
    model: str
    codec: Codec
    slices: tuple[TensorSlice, ...]
    # payloads[i] encodes slices[i] with `codec`
    payloads: tuple[Buffer, ...]

    @property
    # the closing "/": a shard subscribed to delta/1/ does not get delta/10/
    def topic(self) -> str:
        return f"delta/{self.fragment}/"


@dataclasses.dataclass(frozen=True)
class SnapshotChunk:
    """One chunk of the merger's global value of one fragment at `version` (merger → islands)."""

    kind: ClassVar[Kind] = Kind.SNAPSHOT
    sender: str
    epoch: int
    seq: int
    fragment: int
    version: int
    chunk_index: int
    chunk_count: int
    model: str
    codec: Codec
    slices: tuple[TensorSlice, ...]
    payloads: tuple[Buffer, ...]
    # A *diff* snapshot (compressed downlink, protocol/downlink.py) carries the change of the served
    # value from version `base_version` to `version`; a full one carries the value and no base.
    base_version: int | None = None
    # CRC-32 of the served value after this snapshot; required with a base
    digest: int | None = None
    # "bf16": the served value is held in bfloat16, each value rounded after every snapshot
    # (protocol/downlink.py); None: in float32.  Only with a digest
    served: str | None = None

    @property
    def topic(self) -> str:
        return f"snapshot/{self.fragment}"


@dataclasses.dataclass(frozen=True)
class Heartbeat:
    """Liveness; `seq` is the sender's last seq of its stream `stream`, so tail loss shows up within
    one interval.  An island has one stream per merger shard (the shard's fragments' deltas).
    `tokens`: what the sender has trained in this epoch (the merger sums them for the cluster's
    schedule, PROTOCOL.md §6.1)."""

    kind: ClassVar[Kind] = Kind.HEARTBEAT
    sender: str
    epoch: int
    seq: int
    stream: int = 0
    tokens: int = 0

    @property
    def topic(self) -> str:
        return f"heartbeat/{self.stream}/"


@dataclasses.dataclass(frozen=True)
class Hello:
    """A process announces itself (join): who it is, where, and what it can speak."""

    kind: ClassVar[Kind] = Kind.HELLO
    sender: str
    epoch: int
    seq: int
    # what the process is, any identifier (e.g. "island", "merger", "observer"); informative only
    role: str
    region: str
    model: str
    codecs: tuple[str, ...]

    @property
    def topic(self) -> str:
        return "hello"


@dataclasses.dataclass(frozen=True)
class ResendRequest:
    """Ask `target` (incarnation `target_epoch`) to send its stream messages in `ranges` again."""

    kind: ClassVar[Kind] = Kind.RESEND
    sender: str
    epoch: int
    seq: int
    target: str
    target_epoch: int
    # inclusive [first, last] seq ranges, first <= last
    ranges: tuple[tuple[int, int], ...]

    @property
    def topic(self) -> str:
        return "resend"


@dataclasses.dataclass(frozen=True)
class Cursor:
    """All stream messages of `island` (incarnation `epoch`) with seq <= `seq` are settled."""

    island: str
    epoch: int
    seq: int


@dataclasses.dataclass(frozen=True)
class DeltaResult:
    """What became of one delta: folded into `version`, or rejected for `reason`."""

    island: str
    epoch: int
    delta_id: int
    fragment: int
    # "folded" | "rejected"
    status: str
    # the fragment version after the fold (folded) or at rejection (rejected)
    version: int
    # "" when folded
    reason: str

    STATUSES: ClassVar[tuple[str, ...]] = ("folded", "rejected")


@dataclasses.dataclass(frozen=True)
class Ack:
    """The merger's acknowledgements: senders may release settled messages from their buffers."""

    kind: ClassVar[Kind] = Kind.ACK
    sender: str
    epoch: int
    seq: int
    cursors: tuple[Cursor, ...]
    results: tuple[DeltaResult, ...]
    # the cluster's trained tokens as this merger knows them (PROTOCOL.md §6.1): islands decay
    # their schedule over a run's token budget by it
    tokens: int = 0

    @property
    def topic(self) -> str:
        return "ack"


@dataclasses.dataclass(frozen=True)
class SnapshotRequest:
    """Catch-up (Clone pattern): send the current snapshot of `fragments` (empty: all)."""

    kind: ClassVar[Kind] = Kind.SNAPSHOT_REQUEST
    sender: str
    epoch: int
    seq: int
    fragments: tuple[int, ...]

    @property
    def topic(self) -> str:
        return "snapshot_request"


Message = Union[DeltaChunk, SnapshotChunk, Heartbeat, Hello, ResendRequest, Ack, SnapshotRequest]
MESSAGE_TYPES: dict[Kind, type] = {
    cls.kind: cls
    for cls in (DeltaChunk, SnapshotChunk, Heartbeat, Hello, ResendRequest, Ack, SnapshotRequest)
}
