"""How chunks make a message, with no state of their own: which message a chunk belongs to
(`message_key`), the spans of values delivered per tensor (overlaps refused), and what a complete
message becomes (`Assembled`: its tensors decoded, kept as coded records, or the values staged as
its chunks arrived).

Pure numpy; no I/O.  protocol/reassembly.py's `Reassembler` holds the partial messages and their
budgets and calls these; PROTOCOL.md §7 gives the order of its checks.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any, Union

import numpy as np

from dloco.protocol.errors import ProtocolError
from dloco.protocol.messages import DeltaChunk, SnapshotChunk, TensorSlice
from dloco.protocol.quantization import Codec, CodedTensor

Chunk = Union[DeltaChunk, SnapshotChunk]
# path -> (dtype, shape) of each tensor a message names
Layouts = Mapping[str, tuple[str, tuple[int, ...]]]
# path -> sorted, disjoint, coalesced [start, stop) ranges of values delivered
Spans = dict[str, list[tuple[int, int]]]
_PER_CHUNK_FIELDS = frozenset({"seq", "chunk_index", "slices", "payloads"})


@dataclasses.dataclass(frozen=True)
class Assembled:
    """A complete delta or snapshot: decoded float32 tensors plus the chunks' shared header."""

    key: tuple
    # the first chunk received; its whole-message fields hold for all chunks
    header: Chunk
    # path -> float32 array of the tensor's shape (CodedTensor: see Reassembler)
    tensors: dict[str, np.ndarray | CodedTensor]
    # stream seq of every chunk, in chunk order
    seqs: tuple[int, ...]
    # payload bytes received for it (duplicates excluded)
    wire_bytes: int
    # the chunks in index order (their payloads: views of received frames)
    chunks: tuple[Chunk, ...]


def message_key(chunk: Chunk) -> tuple:
    """Which message a chunk belongs to: sender, incarnation and the message's identity."""
    if isinstance(chunk, DeltaChunk):
        return (chunk.sender, chunk.epoch, "delta", chunk.delta_id)
    return (
        chunk.sender,
        chunk.epoch,
        "snapshot",
        chunk.fragment,
        chunk.version,
        chunk.base_version,
    )


def message_fields(chunk: Chunk) -> tuple:
    """The whole-message fields of a chunk, which every chunk of its message repeats."""
    return tuple(
        getattr(chunk, f.name) for f in dataclasses.fields(chunk) if f.name not in _PER_CHUNK_FIELDS
    )


def add_spans(layouts: Layouts, spans: Mapping, slices: Iterable[TensorSlice]) -> Spans:
    """Spans of the tensors `slices` name after adding them (sorted, touching ones coalesced).
    ProtocolError("inconsistent") when a slice changes its tensor's dtype or shape, or overlaps
    values already delivered."""
    updated: Spans = {}
    layouts = dict(layouts)
    for item in slices:
        known = layouts.setdefault(item.path, (item.dtype, item.shape))
        if known != (item.dtype, item.shape):
            raise ProtocolError(
                "inconsistent",
                f"tensor {item.path} changes dtype/shape between chunks: {known} vs"
                f" {(item.dtype, item.shape)}",
            )
        spans_of = updated.get(item.path)
        if spans_of is None:
            spans_of = updated[item.path] = list(spans.get(item.path, []))
        lo, hi = item.start, item.start + item.count
        at = bisect.bisect_left(spans_of, (lo, hi))
        for other_lo, other_hi in spans_of[max(0, at - 1) : at + 1]:
            if lo < other_hi and other_lo < hi:
                raise ProtocolError(
                    "inconsistent",
                    f"tensor {item.path} values {(lo, hi)} overlap values"
                    f" {(other_lo, other_hi)} of another chunk",
                )
        # Coalesce with touching neighbours: in-order chunking keeps one span per tensor.
        if at > 0 and spans_of[at - 1][1] == lo:
            at -= 1
            lo = spans_of.pop(at)[0]
        if at < len(spans_of) and spans_of[at][0] == hi:
            hi = spans_of.pop(at)[1]
        spans_of.insert(at, (lo, hi))
    return updated


def decode_slices(
    codec: Codec, shapes: Mapping[str, tuple[int, ...]], pieces: Iterable[tuple[TensorSlice, Any]]
) -> dict[str, np.ndarray]:
    """Float32 tensors of `shapes` from (slice, payload) pairs that together cover them: how every
    receiver decodes, so a sender that calls it knows bit for bit what its receivers hold."""
    flats = {
        path: np.empty(int(np.prod(shape, dtype=np.int64)), dtype=np.float32)
        for path, shape in shapes.items()
    }
    for item, payload in pieces:
        codec.decode(
            payload, item.count, out=flats[item.path][item.start : item.start + item.count]
        )
    return {path: flat.reshape(shapes[path]) for path, flat in flats.items()}


def coded_tensors(
    codec: Codec, shapes: Mapping[str, tuple[int, ...]], chunks: Iterable[Chunk]
) -> dict[str, CodedTensor]:
    """The records of a blockwise codec's tensors, not decoded: each tensor's block-aligned
    slices, in order, are its parts (views of the payloads, not copied)."""
    pieces: dict[str, list[tuple[int, memoryview]]] = {path: [] for path in shapes}
    for chunk in chunks:
        for item, payload in zip(chunk.slices, chunk.payloads):
            pieces[item.path].append((item.start, payload))
    return {
        path: CodedTensor(codec, tuple(shape), records_of(codec, pieces[path]))
        for path, shape in shapes.items()
    }


def records_of(codec: Codec, pieces: Iterable[tuple[int, Any]]) -> tuple[np.ndarray, ...]:
    """(start, payload) pairs of one tensor as its records' parts in value order: read-only views
    of the payloads (each a whole number of records: slices start on a block)."""
    return tuple(
        np.frombuffer(payload, np.uint8).reshape(-1, codec.record_nbytes)
        for _, payload in sorted(pieces, key=lambda piece: piece[0])
    )
