"""The merger's side of the islands' streams: who is gone, what is missing, how far each is settled
(a mixin of `MergerService`, which owns the tracker, reassembler and control socket)."""

from __future__ import annotations

import time

import zmq

import protocol

RESEND_S = 0.2  # how often missing stream messages are asked for again
CURSOR_S = 1.0  # how often settled cursors are published even without a fold


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
            for island, stream in self.tracker.streams.items():
                ranges = self.tracker.missing(island)
                if not ranges:
                    continue
                request = protocol.ResendRequest(sender=self.config.sender, epoch=self.epoch, seq=self.seq, target=island,
                                                 target_epoch=stream.epoch, ranges=tuple(ranges))
                try:
                    self.control.send_multipart([island.encode(), *protocol.encode(request)], zmq.NOBLOCK)
                    self.count("merger/resend_requests")
                except zmq.ZMQError:  # not connected (yet): the next round asks again
                    self.count("merger/resend_unroutable")
        if now >= self.next_cursor:
            self.next_cursor = now + CURSOR_S
            self.publish_ack([])
        stats = self.reassembler.stats
        evictions = stats.evicted_memory + stats.evicted_ttl + self.tracker.overflow + self.tracker.refused_senders
        if evictions > self.evictions and now - self.evictions_logged_at >= 1.0:  # a flood does not flood the log
            self.evictions, self.evictions_logged_at = evictions, now
            self.log.warning("receive_evicted", partial_memory=stats.evicted_memory, partial_ttl=stats.evicted_ttl,
                             held_overflow=self.tracker.overflow, refused_senders=self.tracker.refused_senders,
                             partial_bytes=self.reassembler.held_bytes, held_bytes=self.tracker.held_bytes)

    def settled_cursors(self) -> dict[str, tuple[int, int]]:
        cursors = {}
        for island, stream in self.tracker.streams.items():
            assembling = self.reassembler.lowest_seq(island, stream.epoch)  # a delta still in reassembly is not settled
            cursors[island] = (stream.epoch, stream.delivered if assembling is None else min(stream.delivered, assembling - 1))
        return cursors
