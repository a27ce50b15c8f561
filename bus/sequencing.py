"""Lossless delivery over pub/sub, the pure parts: receiver-side gap tracking and in-order
delivery, sender-side bounded retransmit buffer.  No sockets, no clocks (PROTOCOL.md §6).

Receiver: per sender it knows the incarnation (epoch) and the highest seq delivered so far; a
message beyond it is held until the gap before it is filled, so delivery is exactly once and in
order per sender.  `missing` lists the gaps — including the tail, known from heartbeats carrying
the sender's last seq — as inclusive ranges to ask the sender for again.

Sender: keeps every stream message until a receiver's cursor covers it; refuses new ones when
full, which the caller turns into backpressure (it stops producing), never into a drop.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any


@dataclasses.dataclass
class _Stream:
    epoch: int
    # every seq <= delivered has been handed out
    delivered: int = 0
    # highest seq the sender says (or shows) it has sent
    known_last: int = 0
    # seq -> (message waiting for a gap, its bytes)
    held: dict[int, tuple[Any, int]] = dataclasses.field(default_factory=dict)
    held_bytes: int = 0


class GapTracker:
    """Out-of-order messages are held within bounds: `max_held` messages and `max_sender_bytes` per
    sender, `max_held_bytes` in all.  One beyond them is dropped (counted in `overflow`) and asked
    for again with its gap, so a sender that skips a seq cannot make the receiver hold more.  At
    most `max_senders` streams are tracked: a sender beyond them is refused (`refused_senders`)."""

    def __init__(
        self,
        max_held: int = 65_536,
        max_held_bytes: int = 256 << 20,
        max_sender_bytes: int | None = None,
        max_senders: int = 1024,
    ) -> None:
        self.max_held, self.max_held_bytes, self.max_senders = max_held, max_held_bytes, max_senders
        self.max_sender_bytes = (
            max_held_bytes // 2 if max_sender_bytes is None else max_sender_bytes
        )
        self.streams: dict[str, _Stream] = {}
        self.held_bytes = 0
        self.duplicates = self.stale = self.overflow = self.refused_senders = 0

    def _stream(self, sender: str, epoch: int) -> _Stream | None:
        stream = self.streams.get(sender)
        if stream is None and len(self.streams) >= self.max_senders:
            return None
        # first contact, or the sender restarted
        if stream is None or epoch > stream.epoch:
            if stream is not None:
                # the old incarnation's held messages go with it
                self.held_bytes -= stream.held_bytes
            stream = self.streams[sender] = _Stream(epoch)
        return stream if epoch == stream.epoch else None

    def receive(
        self, sender: str, epoch: int, seq: int, message: Any, nbytes: int = 0
    ) -> list[Any]:
        """Messages now deliverable in order (possibly none, possibly several); `nbytes`: the
        message's size, charged while it is held."""
        stream = self._stream(sender, epoch)
        if stream is None:
            if sender not in self.streams:
                self.refused_senders += 1
            else:
                self.stale += 1
            return []
        if seq <= stream.delivered or seq in stream.held:
            self.duplicates += 1
            return []
        stream.known_last = max(stream.known_last, seq)
        if seq != stream.delivered + 1:
            if (
                len(stream.held) >= self.max_held
                or stream.held_bytes + nbytes > self.max_sender_bytes
                or self.held_bytes + nbytes > self.max_held_bytes
            ):
                # dropped here; it will be asked for again as part of the gap
                self.overflow += 1
                return []
            stream.held[seq] = (message, nbytes)
            stream.held_bytes += nbytes
            self.held_bytes += nbytes
            return []
        stream.delivered = seq
        return [message, *self._release_held(stream)]

    def _release_held(self, stream: _Stream) -> list[Any]:
        """The held messages that follow what was delivered, now deliverable in order."""
        ready = []
        while stream.delivered + 1 in stream.held:
            stream.delivered += 1
            held, nbytes = stream.held.pop(stream.delivered)
            stream.held_bytes -= nbytes
            self.held_bytes -= nbytes
            ready.append(held)
        return ready

    def heartbeat(self, sender: str, epoch: int, last_seq: int) -> None:
        """A control message said the sender's stream reached `last_seq`: a tail beyond what we
        have is missing."""
        stream = self._stream(sender, epoch)
        if stream is not None:
            stream.known_last = max(stream.known_last, last_seq)

    def missing(self, sender: str, limit: int = 256) -> list[tuple[int, int]]:
        """Inclusive seq ranges known to exist but not received, oldest first, at most `limit`."""
        stream = self.streams.get(sender)
        if stream is None:
            return []
        ranges, start = [], stream.delivered + 1
        for seq in sorted(stream.held) + [stream.known_last + 1]:
            if seq > start:
                ranges.append((start, seq - 1))
                if len(ranges) == limit:
                    break
            start = seq + 1
        return ranges

    def skip_gap(self, sender: str) -> tuple[list[Any], tuple[int, int] | None]:
        """Give up the oldest gap of `sender`'s stream, for a sender that no longer holds it (a
        merger that lost records the sender was told were settled): the messages after it that were
        held become deliverable.  Returns them and the skipped range (None: no gap)."""
        stream = self.streams.get(sender)
        ranges = self.missing(sender, limit=1)
        if stream is None or not ranges:
            return [], None
        stream.delivered = ranges[0][1]
        return self._release_held(stream), ranges[0]

    def cursor(self, sender: str) -> tuple[int, int] | None:
        """(epoch, seq): everything up to seq of this incarnation was delivered."""
        stream = self.streams.get(sender)
        return None if stream is None else (stream.epoch, stream.delivered)


class RetransmitBuffer:
    """Stream messages kept until acknowledged; bounded in count and bytes."""

    def __init__(self, max_messages: int = 4096, max_bytes: int = 256 << 20) -> None:
        self.max_messages, self.max_bytes = max_messages, max_bytes
        self._kept: collections.OrderedDict[int, tuple[Any, int]] = collections.OrderedDict()
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._kept)

    def has_room(self, nbytes: int) -> bool:
        return not self._kept or (
            len(self._kept) < self.max_messages and self.nbytes + nbytes <= self.max_bytes
        )

    def add(self, seq: int, message: Any, nbytes: int) -> None:
        if not self.has_room(nbytes):
            raise OverflowError(
                f"retransmit buffer full ({len(self._kept)} messages, {self.nbytes} bytes): apply"
                " backpressure"
            )
        self._kept[seq] = (message, nbytes)
        self.nbytes += nbytes

    def release(self, upto: int) -> int:
        """Forget every message with seq <= upto (acknowledged); return how many."""
        released = 0
        while self._kept and next(iter(self._kept)) <= upto:
            _, (_, nbytes) = self._kept.popitem(last=False)
            self.nbytes -= nbytes
            released += 1
        return released

    def get(self, ranges: list[tuple[int, int]]) -> list[tuple[int, Any]]:
        """Kept messages in the inclusive ranges (released ones are acknowledged: nothing to
        resend)."""
        return [
            (seq, self._kept[seq][0])
            for first, last in ranges
            for seq in range(first, last + 1)
            if seq in self._kept
        ]
