"""The merger's side of the islands' streams: in order and exactly once (its `GapTracker`), who is
gone, what is missing and asked for again, how far each stream is settled.  `StreamKeeper` owns that
state; the service hands it the reassembler (whose partial deltas are not settled yet) and the
control socket its resend requests go out on."""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import zmq

from dloco import protocol
from dloco.bus.sequencing import GapTracker
from dloco.merger.network.publishing import Stamp

# how often missing stream messages are asked for again
RESEND_S = 0.2
# how often settled cursors are published even without a fold
CURSOR_S = 1.0
# a gap an island, alive and asked all along, has not filled in this long is skipped
GAP_GIVE_UP_S = 60.0


class StreamKeeper:
    def __init__(
        self,
        cursors: dict[str, tuple[int, int]],
        config,
        reassembler: protocol.Reassembler,
        control,
        stamp: Stamp,
        log,
        count: Callable[[str], None],
    ) -> None:
        """`cursors`: island -> (epoch, seq) acknowledged as settled (the core's, from its log):
        each stream resumes there.  `config`: the service's (held_bytes, peer_timeout_s)."""
        self.config, self.reassembler, self.control = config, reassembler, control
        self.stamp, self.log, self.count = stamp, log, count
        self.tracker = GapTracker(max_held_bytes=config.held_bytes)
        for island, (epoch, seq) in cursors.items():
            self.tracker.receive(island, epoch, 0, None)
            self.tracker.streams[island].delivered = self.tracker.streams[island].known_last = seq
        self.next_resend = self.next_cursor = 0.0
        # island -> (its stream's delivered seq, since when) while it has a gap
        self.gap_since: dict[str, tuple[int, float]] = {}
        self.last_seen: dict[str, float] = {}
        self.gone: set[str] = set()
        # partials and held messages dropped for memory or age
        self.evictions, self.evictions_logged_at = 0, -math.inf

    def seen(self, island: str) -> None:
        self.last_seen[island] = time.monotonic()
        if island in self.gone:
            self.gone.discard(island)
            self.log.info("island_back", island=island)

    def live(self) -> int:
        """Islands heard from within peer_timeout_s (as of the last `maintain`)."""
        return len(self.last_seen) - len(self.gone)

    def maintain(self, now: float) -> tuple[list, bool]:
        """Ask islands for what is missing; mark islands that went silent.  Returns the chunks that
        skipping a gap released (for the caller to take in, in order) and whether the settled
        cursors are due to be published."""
        released = []
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
                if (ready := self._give_up(island, stream, now)) is not None:
                    released.extend(ready)
                    continue
                request = protocol.ResendRequest(
                    sender=self.stamp.sender,
                    epoch=self.stamp.epoch,
                    seq=self.stamp.seq,
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
        cursors_due = now >= self.next_cursor
        if cursors_due:
            self.next_cursor = now + CURSOR_S
        self._log_evictions(now)
        return released, cursors_due

    def _log_evictions(self, now: float) -> None:
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

    def _give_up(self, island: str, stream, now: float) -> list | None:
        """An island alive and asked for a gap for GAP_GIVE_UP_S without the stream moving no longer
        holds it: its sender released it on an acknowledgement this merger's log does not have (a
        standby that took over behind, or async replication).  Skip it (an error, counted) rather
        than hold everything after it and stall the island: the chunks after it, in order.  None
        while the gap is still waited for."""
        # not asked meanwhile: the wait starts when it is back
        if island in self.gone:
            self.gap_since.pop(island, None)
            return None
        since = self.gap_since.setdefault(island, (stream.delivered, now))
        if since[0] != stream.delivered:
            self.gap_since[island] = (stream.delivered, now)
            return None
        if now - since[1] < GAP_GIVE_UP_S:
            return None
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
        return ready

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
