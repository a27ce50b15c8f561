"""The merger's side of the islands' streams: who is gone, what is missing, how far each is settled
(a mixin of `MergerService`, which owns the tracker, reassembler and control socket)."""

from __future__ import annotations

import time

import zmq

from dloco import protocol

# how often missing stream messages are asked for again
RESEND_S = 0.2
# how often settled cursors are published even without a fold
CURSOR_S = 1.0
# a gap an island, alive and asked all along, has not filled in this long is skipped
GAP_GIVE_UP_S = 60.0


class StreamKeeping:
    def seen(self, island: str) -> None:
        self.last_seen[island] = time.monotonic()
        if island in self.gone:
            self.gone.discard(island)
            self.log.info("island_back", island=island)

    def maintain_streams(self) -> None:
        """Ask islands for what is missing; publish how far each island's stream is settled;
        mark islands that went silent."""
        now = time.monotonic()
        for island, last in self.last_seen.items():
            if island not in self.gone and now - last > self.config.peer_timeout_s:
                self.gone.add(island)
                self.log.warning("island_gone", island=island, silent_s=round(now - last, 1))
        if now >= self.next_resend:
            self.next_resend = now + RESEND_S
            for island, stream in list(self.tracker.streams.items()):
                ranges = self.tracker.missing(island)
                if not ranges:
                    self.gap_since.pop(island, None)
                    continue
                if self._give_up(island, stream, now):
                    continue
                request = protocol.ResendRequest(
                    sender=self.config.sender,
                    epoch=self.epoch,
                    seq=self.seq,
                    target=island,
                    target_epoch=stream.epoch,
                    ranges=tuple(ranges),
                )
                try:
                    self.control.send_multipart(
                        [island.encode(), *protocol.encode(request)], zmq.NOBLOCK
                    )
                    self.count("merger/resend_requests")
                # not connected (yet): the next round asks again
                except zmq.ZMQError:
                    self.count("merger/resend_unroutable")
                    # not asked: the wait starts again
                    self.gap_since.pop(island, None)
        if now >= self.next_cursor:
            self.next_cursor = now + CURSOR_S
            self.publish_ack([])
        stats = self.reassembler.stats
        evictions = (
            stats.evicted_memory
            + stats.evicted_ttl
            + self.tracker.overflow
            + self.tracker.refused_senders
        )
        # a flood does not flood the log
        if evictions > self.evictions and now - self.evictions_logged_at >= 1.0:
            self.evictions, self.evictions_logged_at = evictions, now
            self.log.warning(
                "receive_evicted",
                partial_memory=stats.evicted_memory,
                partial_ttl=stats.evicted_ttl,
                held_overflow=self.tracker.overflow,
                refused_senders=self.tracker.refused_senders,
                partial_bytes=self.reassembler.held_bytes,
                held_bytes=self.tracker.held_bytes,
            )

    def _give_up(self, island: str, stream, now: float) -> bool:
        """An island alive and asked for a gap for GAP_GIVE_UP_S without the stream moving no longer
        holds it: its sender released it on an acknowledgement this merger's log does not have (a
        standby that took over behind, or async replication).  Skip it (an error, counted) rather
        than hold everything after it and stall the island."""
        # not asked meanwhile: the wait starts when it is back
        if island in self.gone:
            self.gap_since.pop(island, None)
            return False
        since = self.gap_since.setdefault(island, (stream.delivered, now))
        if since[0] != stream.delivered:
            self.gap_since[island] = (stream.delivered, now)
            return False
        if now - since[1] < GAP_GIVE_UP_S:
            return False
        ready, skipped = self.tracker.skip_gap(island)
        self.gap_since.pop(island, None)
        self.count("merger/stream_gaps_skipped")
        self.log.error(
            "stream_gap_skipped",
            island=island,
            seqs=list(skipped),
            waited_s=round(now - since[1], 1),
            why=(
                "the island no longer holds them: they were acknowledged by a log this merger does"
                " not have"
            ),
        )
        for chunk in ready:
            self.on_delta_chunk(chunk)
        return True

    def settled_cursors(self) -> dict[str, tuple[int, int]]:
        cursors = {}
        for island, stream in self.tracker.streams.items():
            # a delta still in reassembly is not settled
            assembling = self.reassembler.lowest_seq(island, stream.epoch)
            cursors[island] = (
                stream.epoch,
                stream.delivered if assembling is None else min(stream.delivered, assembling - 1),
            )
        return cursors
