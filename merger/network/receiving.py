"""What arrives from islands, on the delta bus and the control socket: decoded, its sender checked
against the key that sent it, put in order once per island (the stream keeper), reassembled,
submitted to the core and answered; catch-up requests passed to the publisher.  Bad input is
counted (`merger/rejected/<reason>`) and logged at most once a second per peer and reason."""

from __future__ import annotations

import time

from dloco import protocol
from dloco.bus.security import impostor

# an island's epoch (its start time, ns) may be this far ahead of our clock
EPOCH_AHEAD_NS = 24 * 3600 * 10**9


class Receiver:
    def __init__(
        self,
        *,
        config,
        core,
        pipeline,
        streams,
        reassembler,
        trained,
        publisher,
        announcer,
        owned,
        count,
        quiet,
        log,
    ) -> None:
        """The merger service's parts this drives: its settings (merger.settings.ServiceConfig),
        core, fold pipeline, stream keeper, reassembler, cluster tokens, publisher, announcer, owned
        fragments, counter (a function of the key), throttled log and log."""
        self.config, self.core, self.pipeline, self.streams = config, core, pipeline, streams
        self.reassembler, self.trained = reassembler, trained
        self.publisher, self.announcer, self.owned = publisher, announcer, owned
        self.count, self.quiet, self.log = count, quiet, log
        # bytes taken off the sockets, before decoding
        self.ingest_bytes = 0
        # CURVE peers that may ask for snapshots, never send deltas
        self.observers = config.security.names_with_role("observer")

    def on_delta_frames(self, frames: list, peer: str | None = None) -> None:
        """A message of the delta bus (or a resend); `peer`: who sent it, where CURVE told us (bound
        sockets)."""
        self.ingest_bytes += sum(f.nbytes for f in frames)
        try:
            message = protocol.decode(frames)
        except protocol.ProtocolError as error:
            self.count(f"merger/rejected/{error.reason}")
            self.quiet.warning("message_rejected", reason=error.reason, detail=error.detail[:200])
            return
        if not self.speaks_for_itself(message, peer):
            return
        # epochs are start times: one far ahead would outrank every later restart
        if message.epoch > time.time_ns() + EPOCH_AHEAD_NS:
            self.count("merger/rejected/epoch_ahead")
            self.quiet.warning(
                "message_rejected", reason="epoch_ahead", sender=message.sender, epoch=message.epoch
            )
            return
        self.streams.seen(message.sender)
        tracker = self.streams.tracker
        if isinstance(message, protocol.Heartbeat):
            tracker.heartbeat(message.sender, message.epoch, message.seq)
            self.trained.heartbeat(message.sender, message.epoch, message.tokens)
        elif isinstance(message, protocol.DeltaChunk):
            ready = tracker.receive(
                message.sender, message.epoch, message.seq, message, sum(f.nbytes for f in frames)
            )
            stream = tracker.streams.get(message.sender)
            if (
                not ready
                and stream is not None
                and stream.epoch == message.epoch
                and message.seq <= stream.delivered
            ):
                # a repeat of something settled: its sender may have missed our answer
                self.reack_resend(message)
            for chunk in ready:
                # exactly once, in order per island
                self.on_delta_chunk(chunk)

    def on_delta_chunk(self, message: protocol.DeltaChunk) -> None:
        now = time.monotonic()
        try:
            assembled = self.reassembler.add(message, now)
        except protocol.ProtocolError as error:
            self.count(f"merger/rejected/{error.reason}")
            self.quiet.warning("message_rejected", reason=error.reason, detail=error.detail[:200])
            return
        if assembled is None:
            return
        head = assembled.header
        self.trained.delta(head.sender, head.epoch, head.fragment, head.tokens)
        result = self.core.submit(assembled, now)
        if result is not None:
            self.count(f"merger/delta/{result.status}")
            if result.status == "rejected":
                self.quiet.warning(
                    "delta_rejected",
                    island=result.island,
                    delta_id=result.delta_id,
                    reason=result.reason,
                )
            self.announcer.publish_ack([result])
        for island, reason, seconds in self.core.quarantined:
            self.count("merger/quarantined")
            self.log.warning(
                "island_quarantined", island=island, last_reason=reason, seconds=seconds
            )
        self.core.quarantined.clear()

    def reack_resend(self, chunk: protocol.DeltaChunk) -> None:
        """A chunk of a delta settled before means its sender missed our ack: say it again (once
        per resent delta, on its first chunk)."""
        if chunk.chunk_index != 0:
            return
        result = self.core.settled.get((chunk.sender, chunk.epoch, chunk.delta_id))
        computing = (
            any(
                f.fragment == result.fragment and f.started.version == result.version
                for f in self.pipeline.in_flight
            )
            if result
            else False
        )
        # a fold still computing announces its acks itself
        if result is not None and not computing:
            self.count("merger/reacked")
            self.announcer.publish_ack([result])

    def on_control_frames(self, frames: list, peer: str | None = None) -> None:
        identity, body = bytes(frames[0]), frames[1:]
        try:
            message = protocol.decode(body)
        except protocol.ProtocolError as error:
            self.count(f"merger/rejected/{error.reason}")
            return
        if not self.speaks_for_itself(message, peer, identity):
            return
        # it may read, never train
        if isinstance(message, protocol.DeltaChunk) and peer in self.observers:
            self.count("merger/rejected/observer_delta")
            self.quiet.warning("message_rejected", reason="observer_delta", peer=peer)
        # a resend, point to point
        elif isinstance(message, protocol.DeltaChunk):
            self.count("merger/resent_chunks")
            self.on_delta_frames(body)
        elif isinstance(message, protocol.SnapshotRequest):
            self.publisher.answer_catch_up(
                identity,
                (
                    [f for f in message.fragments if self.config.owns(f)]
                    if message.fragments
                    else self.owned
                ),
            )
        elif isinstance(message, protocol.Hello):
            self.quiet.info(
                "hello",
                peer=message.sender,
                role=message.role,
                region=message.region,
                model_ok=message.model == self.core.model,
            )

    def speaks_for_itself(self, message, peer: str | None, routing_id: bytes | None = None) -> bool:
        """False (counted, logged) for a message whose sender is not the key that sent it
        (bus.security.impostor)."""
        if (claim := impostor(message.sender, peer, routing_id)) is None:
            return True
        self.count("merger/rejected/sender_mismatch")
        self.quiet.warning(
            "message_rejected",
            reason="sender_mismatch",
            peer=peer,
            socket="bus" if routing_id is None else "control",
            claimed=claim,
        )
        return False
