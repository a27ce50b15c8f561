"""Reassemble chunked deltas and snapshots: any arrival order, duplicates harmless, exactly once.

A `Reassembler` holds partial messages keyed by sender, incarnation and message identity.  It has
no clock: callers pass ``now`` (seconds, any monotonic origin), so it is deterministic and
testable.  Memory is bounded twice: by the payload bytes held (oldest partials are evicted first
to make room) and by a time-to-live after which an incomplete message is dropped.  Completed keys
are remembered (a bounded LRU) so late duplicates of a finished message are ignored, not
assembled again.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
from typing import Union

import numpy as np

from protocol.errors import EncodeError, ProtocolError
from protocol.messages import DeltaChunk, SnapshotChunk

Chunk = Union[DeltaChunk, SnapshotChunk]
_PER_CHUNK_FIELDS = frozenset({"seq", "chunk_index", "slices", "payloads"})


@dataclasses.dataclass(frozen=True)
class Assembled:
    """A complete delta or snapshot: decoded float32 tensors plus the chunks' shared header."""

    key: tuple
    header: Chunk  # the first chunk received; its whole-message fields hold for all chunks
    tensors: dict[str, np.ndarray]  # path -> float32 array of the tensor's shape
    seqs: tuple[int, ...]  # stream seq of every chunk, in chunk order
    wire_bytes: int  # payload bytes received for it (duplicates excluded)
    chunks: tuple[Chunk, ...]  # the chunks in index order (their payloads: views of received frames)


def message_key(chunk: Chunk) -> tuple:
    if isinstance(chunk, DeltaChunk):
        return (chunk.sender, chunk.epoch, "delta", chunk.delta_id)
    return (chunk.sender, chunk.epoch, "snapshot", chunk.fragment, chunk.version)


def _identity(chunk: Chunk) -> tuple:
    return tuple(getattr(chunk, f.name) for f in dataclasses.fields(chunk) if f.name not in _PER_CHUNK_FIELDS)


@dataclasses.dataclass
class _Partial:
    first: Chunk
    started: float
    chunks: dict[int, Chunk] = dataclasses.field(default_factory=dict)
    tensors: dict[str, tuple[str, tuple[int, ...]]] = dataclasses.field(default_factory=dict)
    spans: dict[str, list[tuple[int, int]]] = dataclasses.field(default_factory=dict)  # sorted, disjoint
    nbytes: int = 0


@dataclasses.dataclass
class ReassemblyStats:
    completed: int = 0
    duplicates: int = 0
    inconsistent: int = 0
    evicted_ttl: int = 0
    evicted_memory: int = 0


class Reassembler:
    def __init__(self, ttl_s: float = 60.0, max_bytes: int = 256 << 20, max_partials: int = 1024, remember: int = 4096) -> None:
        if not (ttl_s > 0 and max_bytes > 0 and max_partials > 0 and remember > 0):
            raise EncodeError(f"Reassembler bounds must be positive: ttl_s={ttl_s}, max_bytes={max_bytes}, max_partials={max_partials}, remember={remember}")
        self.ttl_s, self.max_bytes, self.max_partials, self.remember = ttl_s, max_bytes, max_partials, remember
        self._partials: collections.OrderedDict[tuple, _Partial] = collections.OrderedDict()  # oldest first
        self._done: collections.OrderedDict[tuple, None] = collections.OrderedDict()
        self.held_bytes = 0
        self.stats = ReassemblyStats()

    def __len__(self) -> int:
        return len(self._partials)

    def add(self, chunk: Chunk, now: float) -> Assembled | None:
        """Take one decoded chunk; return the whole message when this chunk completes it.

        Raises ProtocolError("inconsistent", ...) when the chunk contradicts earlier chunks of its
        message (or, at completion, the slices do not tile every tensor exactly); the state held
        for other messages is untouched.
        """
        self.evict(now)
        key = message_key(chunk)
        if key in self._done:
            self.stats.duplicates += 1
            return None
        size = sum(memoryview(p).nbytes for p in chunk.payloads)
        partial = self._partials.get(key)
        if partial is None:
            if size > self.max_bytes:
                self._reject(f"chunk of {size} bytes exceeds the reassembly budget of {self.max_bytes}")
            partial = _Partial(first=chunk, started=now)
        else:
            self._check_same_message(partial, chunk)
            if chunk.chunk_index in partial.chunks:
                self._check_duplicate(partial.chunks[chunk.chunk_index], chunk)
                self.stats.duplicates += 1
                return None
        new_spans = self._check_slices(partial, chunk)
        self._make_room(size, keep=key)
        if key not in self._partials:
            self._partials[key] = partial
        partial.chunks[chunk.chunk_index] = chunk
        partial.spans.update(new_spans)
        for item in chunk.slices:
            partial.tensors.setdefault(item.path, (item.dtype, item.shape))
        partial.nbytes += size
        self.held_bytes += size
        if len(partial.chunks) < chunk.chunk_count:
            return None
        return self._complete(key, partial)

    def evict(self, now: float) -> list[tuple]:
        """Drop partial messages older than the TTL; return their keys."""
        expired = [key for key, partial in self._partials.items() if now - partial.started > self.ttl_s]
        for key in expired:
            self._drop(key)
            self.stats.evicted_ttl += 1
        return expired

    # ---- internals ---------------------------------------------------------------------------
    def _reject(self, detail: str) -> None:
        self.stats.inconsistent += 1
        raise ProtocolError("inconsistent", detail)

    def _check_same_message(self, partial: _Partial, chunk: Chunk) -> None:
        if _identity(chunk) != _identity(partial.first):
            self._reject(f"chunk {chunk.chunk_index} of {message_key(chunk)} disagrees with earlier chunks on whole-message fields")

    def _check_duplicate(self, earlier: Chunk, chunk: Chunk) -> None:
        if earlier.slices != chunk.slices:
            self._reject(f"two different chunks claim index {chunk.chunk_index} of {message_key(chunk)}")

    def _check_slices(self, partial: _Partial, chunk: Chunk) -> dict[str, list[tuple[int, int]]]:
        """Spans per tensor after adding this chunk's slices (sorted), or reject an overlap."""
        updated: dict[str, list[tuple[int, int]]] = {}
        layouts = dict(partial.tensors)
        for item in chunk.slices:
            known = layouts.setdefault(item.path, (item.dtype, item.shape))
            if known != (item.dtype, item.shape):
                self._reject(f"tensor {item.path} changes dtype/shape between chunks: {known} vs {(item.dtype, item.shape)}")
            spans = updated.setdefault(item.path, list(partial.spans.get(item.path, [])))
            span = (item.start, item.start + item.count)
            at = bisect.bisect_left(spans, span)
            for lo, hi in spans[max(0, at - 1) : at + 1]:
                if span[0] < hi and lo < span[1]:
                    self._reject(f"tensor {item.path} values {span} overlap values {(lo, hi)} of another chunk")
            spans.insert(at, span)
        return updated

    def _make_room(self, size: int, keep: tuple) -> None:
        while self._partials and (self.held_bytes + size > self.max_bytes or len(self._partials) >= self.max_partials):
            oldest = next((k for k in self._partials if k != keep), None)
            if oldest is None:
                break
            self._drop(oldest)
            self.stats.evicted_memory += 1

    def _drop(self, key: tuple) -> None:
        partial = self._partials.pop(key)
        self.held_bytes -= partial.nbytes

    def _finish(self, key: tuple) -> None:
        self._drop(key)
        self._done[key] = None
        while len(self._done) > self.remember:
            self._done.popitem(last=False)

    def _complete(self, key: tuple, partial: _Partial) -> Assembled:
        self._finish(key)
        for path, (dtype, shape) in partial.tensors.items():
            covered = sum(hi - lo for lo, hi in partial.spans[path])
            size = int(np.prod(shape, dtype=np.int64))
            if covered != size:
                self._reject(f"tensor {path} of {key} has {covered} of {size} values after all chunks arrived")
        tensors = {path: np.empty(int(np.prod(shape, dtype=np.int64)), dtype=np.float32) for path, (_, shape) in partial.tensors.items()}
        ordered = [partial.chunks[i] for i in sorted(partial.chunks)]
        for chunk in ordered:
            for item, payload in zip(chunk.slices, chunk.payloads):
                chunk.codec.decode(payload, item.count, out=tensors[item.path][item.start : item.start + item.count])
        self.stats.completed += 1
        return Assembled(
            key=key,
            header=partial.first,
            tensors={path: flat.reshape(partial.tensors[path][1]) for path, flat in tensors.items()},
            seqs=tuple(chunk.seq for chunk in ordered),
            wire_bytes=partial.nbytes,
            chunks=tuple(ordered),
        )
