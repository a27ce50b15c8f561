"""Reassemble chunked deltas and snapshots: any arrival order, duplicates harmless, exactly once.

A `Reassembler` holds partial messages keyed by sender, incarnation and message identity.  It has
no clock: callers pass ``now`` (seconds, any monotonic origin), so it is deterministic and
testable.  Memory is bounded: every chunk is charged its payload bytes plus a fixed overhead per
chunk and per slice (the Python objects that describe it), the total stays under ``max_bytes`` and
each sender's under ``max_sender_bytes`` (least recently extended partials are evicted first, the
sender's own first; a message that alone would exceed its sender's budget is refused), and a partial
that receives nothing for ``ttl_s`` is dropped.  The last ``remember`` completed keys are kept, so
late duplicates of a finished message are ignored rather than assembled again; older duplicates are
the sequencing layer's to filter (PROTOCOL.md §6).  A message whose slices do not tile its tensors
is dropped whole and not remembered, like an evicted one: its chunks, sent again, are reassembled
afresh.  PROTOCOL.md §7 gives the order of the checks; protocol/assembly.py holds the pure parts
(spans of values delivered, the tensors of a complete message).

``stream=True`` (islands' snapshots): each chunk is decoded on arrival into float32 arrays of its
message's tensors (the *staging* values, allocated as each tensor is first named) and its payloads
are let go, so a message is never held twice (encoded, then decoded) and a partial costs its chunk
overheads plus its staging values.  Those count against ``max_staged_bytes`` (by default
``max_bytes``), the chunks' overheads against ``max_bytes``: a fragment larger than the chunk
budget is reassembled within the model's size.  The values are handed over only when the message
is complete and its slices tile every tensor; a partial dropped for any reason takes them with it.
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np

from dloco.protocol.assembly import (
    Assembled,
    Chunk,
    add_spans,
    coded_tensors,
    decode_slices,
    message_fields,
    message_key,
)
from dloco.protocol.errors import EncodeError, ProtocolError

# Charged per chunk and per slice on top of payload bytes: measured Python object sizes, rounded up.
CHUNK_OVERHEAD_BYTES = 4096
SLICE_OVERHEAD_BYTES = 1024


@dataclasses.dataclass
class _Partial:
    first: Chunk
    # time of the latest chunk: the TTL runs from here
    touched: float
    chunks: dict[int, Chunk] = dataclasses.field(default_factory=dict)
    tensors: dict[str, tuple[str, tuple[int, ...]]] = dataclasses.field(default_factory=dict)
    # sorted, disjoint, coalesced
    spans: dict[str, list[tuple[int, int]]] = dataclasses.field(default_factory=dict)
    # payload bytes
    nbytes: int = 0
    # payload plus overhead, counted against max_bytes (stream: overhead only)
    charged: int = 0
    # stream: path -> flat float32 values so far
    staged: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    staged_bytes: int = 0


@dataclasses.dataclass
class ReassemblyStats:
    completed: int = 0
    duplicates: int = 0
    inconsistent: int = 0
    evicted_ttl: int = 0
    evicted_memory: int = 0
    over_budget: int = 0


class Reassembler:
    def __init__(
        self,
        ttl_s: float = 60.0,
        max_bytes: int = 256 << 20,
        max_partials: int = 1024,
        remember: int = 4096,
        decode: bool = True,
        max_sender_bytes: int | None = None,
        stream: bool = False,
        max_staged_bytes: int | None = None,
    ) -> None:
        """decode=False: tensors of a blockwise (int) codec come out as `CodedTensor` (their
        records), others decoded as usual.  `max_sender_bytes` (default: `max_bytes`) bounds what
        one sender's partials hold: past it, that sender's own least recently extended partials go
        first. `stream`, `max_staged_bytes`: see the module docstring."""
        self.decode, self.stream = decode, stream
        max_sender_bytes = max_bytes if max_sender_bytes is None else max_sender_bytes
        max_staged_bytes = max_bytes if max_staged_bytes is None else max_staged_bytes
        if not (
            ttl_s > 0
            and max_bytes > 0
            and max_partials > 0
            and remember > 0
            and max_sender_bytes > 0
            and max_staged_bytes > 0
        ):
            raise EncodeError(
                f"Reassembler bounds must be positive: ttl_s={ttl_s}, max_bytes={max_bytes},"
                f" max_partials={max_partials}, remember={remember},"
                f" max_sender_bytes={max_sender_bytes}, max_staged_bytes={max_staged_bytes}"
            )
        if stream and not decode:
            raise EncodeError("a streaming Reassembler decodes: stream=True needs decode=True")
        self.ttl_s, self.max_bytes, self.max_partials, self.remember = (
            ttl_s,
            max_bytes,
            max_partials,
            remember,
        )
        self.max_sender_bytes = min(max_sender_bytes, max_bytes)
        self.max_staged_bytes = max_staged_bytes
        # stream: float32 values held by partials
        self.staged_bytes = 0
        # oldest first
        self._partials: collections.OrderedDict[tuple, _Partial] = collections.OrderedDict()
        self._done: collections.OrderedDict[tuple, None] = collections.OrderedDict()
        self.held_bytes = 0
        self.sender_bytes: collections.Counter[str] = collections.Counter()
        self.stats = ReassemblyStats()

    def __len__(self) -> int:
        return len(self._partials)

    def add(self, chunk: Chunk, now: float) -> Assembled | None:
        """Take one decoded chunk; return the whole message when this chunk completes it.

        Raises ProtocolError("inconsistent", ...) when the chunk contradicts earlier chunks of its
        message: the chunk is dropped and the earlier ones kept; or, at completion, when the slices
        do not tile every tensor exactly: the whole message is dropped and forgotten.  Raises
        ProtocolError("reassembly_budget", ...) when the message alone needs more than `max_bytes`:
        it is dropped.  The state held for other messages is untouched.
        """
        self.evict(now)
        key = message_key(chunk)
        if key in self._done:
            self.stats.duplicates += 1
            return None
        size = sum(memoryview(p).nbytes for p in chunk.payloads)
        cost = (
            (0 if self.stream else size)
            + CHUNK_OVERHEAD_BYTES
            + SLICE_OVERHEAD_BYTES * len(chunk.slices)
        )
        partial = self._partials.get(key)
        if partial is None:
            partial = _Partial(first=chunk, touched=now)
        else:
            self._check_same_message(partial, chunk)
            if chunk.chunk_index in partial.chunks:
                self._check_duplicate(partial.chunks[chunk.chunk_index], chunk)
                self.stats.duplicates += 1
                return None
        if partial.charged + cost > self.max_sender_bytes:
            if key in self._partials:
                self._drop(key)
            self._reject(
                f"message {key} needs more than the reassembly budget of {self.max_sender_bytes}"
                " bytes",
                "reassembly_budget",
            )
        new_spans = self._check_slices(partial, chunk)
        staging = self._staging(partial, chunk) if self.stream else 0
        self._make_room(cost, keep=key, new=key not in self._partials, staging=staging)
        self._partials[key] = partial
        # most recently extended last: evicted last
        self._partials.move_to_end(key)
        partial.touched = now
        if self.stream:
            try:
                self._stage(partial, chunk, staging)
            # a payload its codec cannot decode: nothing of the message is kept
            except ValueError as error:
                self._drop(key)
                self._reject(f"chunk {chunk.chunk_index} of {key} does not decode: {error}")
            # decoded: the frames are let go
            chunk = dataclasses.replace(chunk, payloads=())
        self._hold(key, partial, chunk, new_spans, size, cost)
        if len(partial.chunks) < chunk.chunk_count:
            return None
        return self._complete(key, partial)

    def lowest_seq(self, sender: str, epoch: int) -> int | None:
        """Smallest stream seq among chunks held for incomplete messages of (sender, epoch)."""
        seqs = [
            chunk.seq
            for key, partial in self._partials.items()
            if key[:2] == (sender, epoch)
            for chunk in partial.chunks.values()
        ]
        return min(seqs) if seqs else None

    def delivered(self, key: tuple) -> bool:
        """Whether the message `key` was completed (within the last `remember` completions)."""
        return key in self._done

    def evict(self, now: float) -> list[tuple]:
        """Drop partial messages that received nothing for longer than the TTL; return their
        keys."""
        expired = [
            key for key, partial in self._partials.items() if now - partial.touched > self.ttl_s
        ]
        for key in expired:
            self._drop(key)
            self.stats.evicted_ttl += 1
        return expired

    # ---- internals ---------------------------------------------------------------------------
    def _reject(self, detail: str, reason: str = "inconsistent") -> None:
        if reason == "inconsistent":
            self.stats.inconsistent += 1
        else:
            self.stats.over_budget += 1
        raise ProtocolError(reason, detail)

    def _check_same_message(self, partial: _Partial, chunk: Chunk) -> None:
        if message_fields(chunk) != message_fields(partial.first):
            self._reject(
                f"chunk {chunk.chunk_index} of {message_key(chunk)} disagrees with earlier chunks"
                " on whole-message fields"
            )

    def _check_duplicate(self, earlier: Chunk, chunk: Chunk) -> None:
        """A repeat of a held index is ignored only if it is the same chunk: same slices, same
        payload checksums."""
        if earlier.slices != chunk.slices or [s.crc32 for s in earlier.slices] != [
            s.crc32 for s in chunk.slices
        ]:
            self._reject(
                f"two different chunks claim index {chunk.chunk_index} of {message_key(chunk)}"
            )

    def _check_slices(self, partial: _Partial, chunk: Chunk) -> dict[str, list[tuple[int, int]]]:
        """Spans per tensor after adding this chunk's slices (sorted), or reject an overlap."""
        try:
            return add_spans(partial.tensors, partial.spans, chunk.slices)
        except ProtocolError as error:
            self._reject(error.detail)

    def _staging(self, partial: _Partial, chunk: Chunk) -> int:
        """Bytes of the staging values this chunk's tensors add (refused if the message alone would
        need more than `max_staged_bytes`)."""
        fresh = {
            item.path: int(np.prod(item.shape, dtype=np.int64))
            for item in chunk.slices
            if item.path not in partial.staged
        }
        added = 4 * sum(fresh.values())
        if partial.staged_bytes + added > self.max_staged_bytes:
            if message_key(chunk) in self._partials:
                self._drop(message_key(chunk))
            self._reject(
                f"message {message_key(chunk)} needs more than the staging budget of"
                f" {self.max_staged_bytes} bytes",
                "reassembly_budget",
            )
        return added

    def _stage(self, partial: _Partial, chunk: Chunk, added: int) -> None:
        for item, payload in zip(chunk.slices, chunk.payloads):
            values = partial.staged.get(item.path)
            if values is None:
                values = partial.staged[item.path] = np.empty(
                    int(np.prod(item.shape, dtype=np.int64)), dtype=np.float32
                )
            chunk.codec.decode(
                payload, item.count, out=values[item.start : item.start + item.count]
            )
        partial.staged_bytes += added
        self.staged_bytes += added

    def _hold(
        self, key: tuple, partial: _Partial, chunk: Chunk, spans: dict, size: int, cost: int
    ) -> None:
        """Record an accepted chunk in its partial: its slices' spans and layouts, its bytes."""
        partial.chunks[chunk.chunk_index] = chunk
        partial.spans.update(spans)
        for item in chunk.slices:
            partial.tensors.setdefault(item.path, (item.dtype, item.shape))
        partial.nbytes += size
        partial.charged += cost
        self.held_bytes += cost
        self.sender_bytes[key[0]] += cost

    def _make_room(self, cost: int, keep: tuple, new: bool, staging: int = 0) -> None:
        sender = keep[0]
        # the sender's own partials first
        while self.sender_bytes[sender] + cost > self.max_sender_bytes:
            oldest = next((k for k in self._partials if k[0] == sender and k != keep), None)
            if oldest is None:
                break
            self._drop(oldest)
            self.stats.evicted_memory += 1
        while self._partials and (
            self.held_bytes + cost > self.max_bytes
            or (new and len(self._partials) >= self.max_partials)
            or self.staged_bytes + staging > self.max_staged_bytes
        ):
            oldest = next((k for k in self._partials if k != keep), None)
            if oldest is None:
                break
            self._drop(oldest)
            self.stats.evicted_memory += 1

    def _drop(self, key: tuple) -> None:
        partial = self._partials.pop(key)
        self.held_bytes -= partial.charged
        self.staged_bytes -= partial.staged_bytes
        self.sender_bytes[key[0]] -= partial.charged
        if not self.sender_bytes[key[0]]:
            del self.sender_bytes[key[0]]

    def _finish(self, key: tuple) -> None:
        self._drop(key)
        self._done[key] = None
        while len(self._done) > self.remember:
            self._done.popitem(last=False)

    def _complete(self, key: tuple, partial: _Partial) -> Assembled:
        for path, (_, shape) in partial.tensors.items():
            covered = sum(hi - lo for lo, hi in partial.spans[path])
            size = int(np.prod(shape, dtype=np.int64))
            if covered != size:
                # not remembered: the message was never delivered
                self._drop(key)
                self._reject(
                    f"tensor {path} of {key} has {covered} of {size} values after all chunks"
                    " arrived"
                )
        self._finish(key)
        ordered = [partial.chunks[i] for i in sorted(partial.chunks)]
        codec = partial.first.codec
        if self.stream:
            tensors = {
                path: partial.staged[path].reshape(shape)
                for path, (_, shape) in partial.tensors.items()
            }
        # keep the records; block-aligned slices concatenate
        elif not self.decode and codec.blockwise:
            tensors = coded_tensors(
                codec, {path: shape for path, (_, shape) in partial.tensors.items()}, ordered
            )
        else:
            tensors = decode_slices(
                codec,
                {path: shape for path, (_, shape) in partial.tensors.items()},
                (
                    (item, payload)
                    for chunk in ordered
                    for item, payload in zip(chunk.slices, chunk.payloads)
                ),
            )
        self.stats.completed += 1
        return Assembled(
            key=key,
            header=partial.first,
            tensors=tensors,
            seqs=tuple(chunk.seq for chunk in ordered),
            wire_bytes=partial.nbytes,
            chunks=tuple(ordered),
        )
