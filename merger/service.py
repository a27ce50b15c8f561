"""The merger process: sockets, clock and disk around `MergerCore`.

Sockets (endpoint strings: ``@tcp://...`` binds, ``tcp://...`` or ``>tcp://...`` connects):
- ``delta_sub``  SUB on the delta bus (topics ``delta/``, ``heartbeat/0/``; a shard only its
  fragments' ``delta/F/`` and its stream's ``heartbeat/I/``, protocol/shards.py): chunks from
islands;
- ``snapshot_pub`` PUB on the snapshot bus: fragment snapshots after every fold (or at most once
  per mean round of the islands: ``snapshot_every_round``), and acks with results and
  per-island cursors;
- ``control`` ROUTER (binds): catch-up snapshot requests (Clone pattern), resend requests to
  islands (routed by island name) and the chunks they resend, hellos.

Chunks pass a `GapTracker` first (in order, exactly once per island); gaps and heartbeat-revealed
tails are asked for again every RESEND_S.  Per admitted delta: write-ahead log first, fold when the
round policy says so (the fold computes while the loop goes on: merger/pipeline.py), and once it is
computed sync the log, then publish the snapshot and the acks — an acknowledged delta is always on
disk, and cursors are logged before islands see them.  Every receive is behind a poll
with a timeout; SIGTERM/SIGINT stop the loop, write a final checkpoint, close the sockets with
linger 0 and exit 0.
"""

from __future__ import annotations

import collections
import math
import signal
import threading
import time

import zmq

from dloco import protocol
from dloco.bus.security import Security, impostor, peer_of
from dloco.bus.sequencing import GapTracker
from dloco.bus.sockets import open_socket
from dloco.merger import checkpoint, records
from dloco.merger.logmatch import genesis_of, newest_epoch, terms_of
from dloco.merger.pipeline import FoldPipeline
from dloco.merger.publishing import SnapshotPublishing
from dloco.merger.recovery import checkpoint_dir, recover, wal_dir
from dloco.merger.replication import Fenced, ReplicatedLog, ReplicationServer
from dloco.merger.round_policy import CatchUpBudget
from dloco.merger.rundir import RunDirLock, check_shard

# re-exported: the service's settings
from dloco.merger.settings import ServiceConfig as ServiceConfig
from dloco.merger.standby import Takeover
from dloco.merger.streams import StreamKeeping
from dloco.merger.trained_tokens import TrainedTokens
from dloco.merger.wal import StorageError, WriteAheadLog
from dloco.protocol import downlink, shards
from dloco.protocol.errors import ConfigError
from dloco.telemetry import prom
from dloco.telemetry.logs import configure_logging
from dloco.telemetry.ratelimit import ThrottledLog

# longest sleep between checks of the clock-driven round policy
POLL_MS = 50
# messages taken from one socket before the loop looks at the others
DRAIN_LIMIT = 256
# an island's epoch (its start time, ns) may be this far ahead of our clock
EPOCH_AHEAD_NS = 24 * 3600 * 10**9
# the exit code of a merger stopped by its disk (full, read-only, failing)
EXIT_STORAGE = 3


class MergerService(SnapshotPublishing, StreamKeeping):
    def __init__(
        self, config: ServiceConfig, core_factory=None, takeover: Takeover | None = None
    ) -> None:
        """`takeover`: a standby's state, log and lock (merger/standby.py), instead of recovering
        them."""
        self.config = config
        self.log = configure_logging("merger", sender=config.sender)
        # lines a peer's messages cause: once a second per peer and reason
        self.quiet = ThrottledLog(self.log)
        # first: a busy port fails here, before any thread or file is opened
        self.metrics_server, self.histograms = (
            self._serve_metrics() if config.metrics_port is not None else (None, None)
        )
        if takeover is not None:
            self.lock, self.wal, self.core, self.epoch = (
                takeover.lock,
                takeover.wal,
                takeover.core,
                takeover.epoch,
            )
            self.core.log = self.wal
        else:
            # before the log opens: RunDirInUse if another merger runs here
            self.lock = RunDirLock(config.run_dir)
            check_shard(config.run_dir, config.shard, config.shards)
            self.wal = WriteAheadLog(wal_dir(config.run_dir), fsync=config.fsync)
            if self.wal.truncated_bytes or self.wal.discarded:
                self.log.warning(
                    "wal_torn_tail_truncated",
                    bytes=self.wal.truncated_bytes,
                    segments_set_aside=self.wal.discarded,
                )
            if self.wal.next_index > 0:
                self.core = recover(config.run_dir, log=self.wal)
                self.log.info(
                    "recovered",
                    next_index=self.wal.next_index,
                    versions=[s.version for s in self.core.states],
                    digest=self.core.digest(),
                )
            else:
                self.core = core_factory(self.wal)
                self.log.info(
                    "genesis", fragments=len(self.core.fragments), digest=self.core.digest()
                )
            self.epoch = time.time_ns()
        # (dloco merger checks this before a new log is written)
        if config.shard >= len(self.core.fragments):
            raise ConfigError(
                f"shard {config.shard}/{config.shards} owns no fragment of"
                f" {len(self.core.fragments)}: give fewer shards than fragments"
            )
        if self.histograms is not None:
            self.wal.on_fsync = self.histograms[2].observe
        self.seq, self.folds = 0, 0
        # int deltas stay in their records: the fold works on codes (merger/coded.py), whose kernels
        # compile in the background now rather than in the first rounds
        self.stopping, self.storage_failed = False, None
        self.warming = threading.Thread(
            target=lambda: self.core.warm_up(stopping=lambda: self.stopping),
            name="warm-up",
            daemon=True,
        )
        self.warming.start()
        # what islands' messages may hold here, per sender (half) and in all: partial deltas, and
        # stream messages beyond a gap
        self.reassembler = protocol.Reassembler(
            ttl_s=config.reassembly_ttl_s,
            max_bytes=config.reassembly_bytes,
            decode=False,
            max_sender_bytes=config.reassembly_bytes // 2,
        )
        self.counters: dict[str, int] = {}
        # with diff snapshots: what islands hold of each fragment
        self.served: dict[int, downlink.Served] = {}
        # fragment -> monotonic time of its last snapshot on the bus
        self.published_at: dict[int, float] = {}
        # fragments with folds not yet on the bus (config.snapshot_every_round)
        self.unpublished: set[int] = set()
        self.context = zmq.Context()
        # ZeroMQ's queue of arrived deltas is part of the receive budget: beyond it they are dropped
        # and asked for again domain: bound without a broker
        self.delta_sub = self._socket(
            zmq.SUB,
            config.delta_endpoint,
            server="broker",
            domain="delta-in",
            receive_hwm=max(16, config.held_bytes // config.max_chunk_bytes),
        )
        # ZeroMQ filters at the publishers
        for topic in shards.subscriptions(config.shard, config.shards, len(self.core.fragments)):
            self.delta_sub.setsockopt(zmq.SUBSCRIBE, topic)
        self.owned = shards.owned(config.shard, config.shards, len(self.core.fragments))
        self.core.owned = frozenset(self.owned) if config.shards > 1 else None
        self.snapshot_pub = self._socket(
            zmq.PUB, config.snapshot_endpoint, server="broker", domain="snapshot-out"
        )
        self.control = self._socket(
            zmq.ROUTER, config.control_endpoint, server=config.sender, domain="control"
        )
        # an unknown island is an error we count, not a silent drop
        self.control.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.pipeline = FoldPipeline(self.core, self.wal, self.context)
        self.replication, self.fenced = None, None
        # the log goes to a standby too; in sync mode nothing is published before it has it
        if config.replication.on:
            self.replication = self._replicate(takeover)
        self.tracker = GapTracker(max_held_bytes=config.held_bytes)
        # the cluster's tokens, for islands' schedules (every ack carries them)
        self.trained = TrainedTokens()
        # partials and held messages dropped for memory or age
        self.evictions, self.evictions_logged_at = 0, -math.inf
        # resume each stream where it was acknowledged
        for island, (epoch, seq) in self.core.cursors.items():
            self.tracker.receive(island, epoch, 0, None)
            self.tracker.streams[island].delivered = self.tracker.streams[island].known_last = seq
        self.next_resend = self.next_cursor = 0.0
        # island -> (its stream's delivered seq, since when) while it has a gap
        self.gap_since: dict[str, tuple[int, float]] = {}
        self.last_seen: dict[str, float] = {}
        self.gone: set[str] = set()
        self.ingest_bytes, self.folds_by_fragment = 0, collections.Counter()
        # CURVE peers that may ask for snapshots, never send deltas
        self.observers = config.security.names_with_role("observer")
        # per peer
        self.catch_up_budgets: dict[bytes, CatchUpBudget] = {}
        # (metrics: the counters above exist)
        self.started = True

    def _replicate(self, takeover: Takeover | None) -> ReplicationServer:
        """The log's stream to a standby.  A primary that did not take over starts a term of its own
        (records it lost since it last streamed must not match its standby's copies of them) with an
        epoch above every epoch its log names."""
        if takeover is not None:
            terms, term = takeover.terms, takeover.term
        else:
            # the genesis record a new run just wrote, on disk where terms_of and genesis_of read
            self.wal.sync()
            terms, _, term = terms_of(wal_dir(self.config.run_dir))
            self.epoch, term = max(self.epoch, newest_epoch(terms) + 1), term + 1
            terms.append((self.epoch, self.wal.append(records.term_record(term, self.epoch))))
            self.wal.sync()
        server = ReplicationServer(
            self.context,
            self.config.replication,
            self.config.security,
            self.config.sender,
            self.wal,
            wal_dir(self.config.run_dir),
            self.epoch,
            terms,
            term,
            genesis_of(self.config.run_dir),
            self.log,
        )
        self.core.log, self.pipeline.barrier = ReplicatedLog(self.wal, server), server.barrier
        return server

    def _serve_metrics(self):
        def read():
            # still starting (recovering the log, opening sockets)
            if not getattr(self, "started", False):
                return []
            replication = self.replication.snapshot() if self.replication is not None else None
            return [
                *prom.merger_families(
                    dict(self.counters),
                    dict(self.core.rejected),
                    dict(self.folds_by_fragment),
                    [s.version for s in self.core.states],
                    self.ingest_bytes,
                    self.wal.bytes_appended,
                ),
                *prom.replication_families("primary", self.epoch, replication, self.wal.next_index),
            ]

        registry = prom.registry_of(read)
        histograms = prom.merger_histograms(registry)
        return prom.serve(self.config.metrics_port, self.config.metrics_host, registry), histograms

    def _socket(
        self, kind: int, endpoint: str, server: str, domain: str, receive_hwm: int | None = None
    ) -> zmq.Socket:
        return open_socket(
            self.context,
            kind,
            endpoint,
            self.config.security,
            server,
            domain=domain,
            receive_hwm=receive_hwm,
            report=lambda message: self.log.warning("auth_refused", detail=message),
        )

    # ---- loop ------------------------------------------------------------------------------------
    def run(self, signals: bool = True) -> int:
        """Until SIGTERM/SIGINT (`signals`: install the handlers; else the caller's set
        `stopping`)."""
        if signals:
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, lambda *_: setattr(self, "stopping", True))
        poller = zmq.Poller()
        poller.register(self.delta_sub, zmq.POLLIN)
        poller.register(self.control, zmq.POLLIN)
        poller.register(self.pipeline.signal, zmq.POLLIN)
        for fragment in self.owned:
            self.publish_snapshot(fragment)
        wake = None
        try:
            while not self.stopping:
                # wake may be far off
                timeout = (
                    POLL_MS
                    if wake is None
                    else int(max(0.0, min(POLL_MS, (wake - time.monotonic()) * 1000)))
                )
                events = dict(poller.poll(timeout))
                if self.delta_sub in events:
                    self._drain(self.delta_sub, self.on_delta_frames)
                if self.control in events:
                    self._drain(self.control, self.on_control_frames)
                # first: a fragment whose fold finished may fold again now
                self.announce(self.pipeline.finished())
                wake = self.pipeline.dispatch(time.monotonic())
                next_snapshot = self.publish_due(time.monotonic())
                wake = (
                    next_snapshot
                    if wake is None
                    else wake
                    if next_snapshot is None
                    else min(wake, next_snapshot)
                )
                self.maintain_streams()
                if self.replication is not None:
                    self.replication.check_fenced()
        # a full disk: stop; the log on disk is valid up to its last whole record
        except StorageError as error:
            self.storage_failed = error
        # a standby took over: step down, publish nothing more
        except Fenced as error:
            self.fenced = error
        finally:
            self.shutdown()
        return 0 if self.storage_failed is None else EXIT_STORAGE

    def _drain(self, socket: zmq.Socket, handle) -> None:
        for _ in range(DRAIN_LIMIT):
            try:
                frames = socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            handle([frame.buffer for frame in frames], peer_of(frames[-1]))

    def count(self, key: str) -> None:
        self.counters[key] = self.counters.get(key, 0) + 1

    # ---- handlers ------------------------------------------------------------------------------
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
        self.seen(message.sender)
        if isinstance(message, protocol.Heartbeat):
            self.tracker.heartbeat(message.sender, message.epoch, message.seq)
            self.trained.heartbeat(message.sender, message.epoch, message.tokens)
        elif isinstance(message, protocol.DeltaChunk):
            ready = self.tracker.receive(
                message.sender, message.epoch, message.seq, message, sum(f.nbytes for f in frames)
            )
            stream = self.tracker.streams.get(message.sender)
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
            self.publish_ack([result])
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
            self.publish_ack([result])

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
            self.answer_catch_up(
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

    # ---- folding and publishing ----------------------------------------------------------------
    def announce(self, folds) -> None:
        """Folds computed and on disk: log each, publish its snapshot and its acks.  Every
        `checkpoint_every` folds a checkpoint, of computed state only: what is in flight first."""
        due = False
        for fold in folds:
            due |= self._announce(fold)
        if due:
            while self.pipeline.in_flight:
                for fold in self.pipeline.finished(wait=True):
                    self._announce(fold)
            self.write_checkpoint()

    def _announce(self, fold) -> bool:
        report = fold.report
        self.folds += 1
        self.folds_by_fragment[fold.fragment] += 1
        seconds = time.perf_counter() - fold.began
        if self.histograms is not None:
            for staleness in report.staleness:
                self.histograms[0].observe(staleness)
            self.histograms[1].observe(seconds)
        self.log.info(
            "fold",
            fragment=fold.fragment,
            version=report.version,
            contributors=list(report.contributors),
            staleness=list(report.staleness),
            steps=list(report.steps),
            weights=[round(w, 4) for w in report.weights],
            share=round(sum(report.weights), 4),
            delta_norms=[round(n, 6) for n in report.delta_norms],
            merged_norm=round(report.merged_norm, 6),
            fold_ms=round(seconds * 1000, 2),
            cluster_tokens=self.trained.total,
            **({"clipped": list(report.clipped)} if report.clipped else {}),
        )
        if self.replication is not None:
            self.replication.folded(fold.fragment, report.version, fold.state)
        self.offer_snapshot(fold.fragment, fold.state)
        self.publish_ack(fold.results)
        return self.folds % self.config.checkpoint_every == 0

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq

    def publish_ack(self, results: list[protocol.DeltaResult]) -> None:
        """Results plus every island's cursor; cursors are logged and synced before anyone sees
        them."""
        cursors = self.settled_cursors()
        if self.core.record_cursors(cursors) or results:
            self.wal.sync()
            if self.replication is not None:
                self.replication.barrier(self.wal.next_index)
        if not results and not cursors:
            return
        ack = protocol.Ack(
            sender=self.config.sender,
            epoch=self.epoch,
            seq=self.next_seq(),
            cursors=tuple(
                protocol.Cursor(island, epoch, seq)
                for island, (epoch, seq) in sorted(cursors.items())
            ),
            results=tuple(results),
            tokens=self.trained.total,
        )
        self.snapshot_pub.send_multipart(protocol.encode(ack))

    def write_checkpoint(self) -> None:
        self.wal.sync()
        path = checkpoint.save(checkpoint_dir(self.config.run_dir), self.core, self.wal.next_index)
        self.log.info(
            "checkpoint", path=str(path), next_index=self.wal.next_index, digest=self.core.digest()
        )

    def shutdown(self) -> None:
        # exiting while XLA compiles on another thread aborts the process
        self.warming.join(timeout=120)
        try:
            if self.fenced is None:
                self.announce(self.pipeline.close())
                # queue the last folds too (best effort: the sockets close with linger 0)
                self.publish_due(math.inf)
        except StorageError as error:
            self.storage_failed = self.storage_failed or error
        # fenced while announcing the last folds
        except Fenced as error:
            self.fenced = error
        # a fold failed: logged below, the process still shuts down cleanly
        except Exception as error:
            self.log.error("fold_failed", error=repr(error)[:500])
        # stepping down: what is in flight is not announced; the new primary's log decides
        if self.fenced is not None:
            self.pipeline.barrier = None
            try:
                self.pipeline.close()
            # a fold failed meanwhile: nothing of it was published
            except Exception as error:
                self.log.error("fold_failed", error=repr(error)[:500])
            self.log.warning("stepped_down", reason=str(self.fenced))
        try:
            if self.pipeline.failed is None and self.storage_failed is None and self.fenced is None:
                self.write_checkpoint()
            # the core may lack a logged fold: only the log is the truth now, a restart replays it
            elif self.storage_failed is None:
                self.log.error(
                    "no_final_checkpoint", reason=f"a fold failed: {self.pipeline.failed!r}"[:500]
                )
            self.wal.close()
        except StorageError as error:
            self.storage_failed = self.storage_failed or error
        if self.storage_failed is not None:
            self.log.error(
                "storage_failed",
                error=str(self.storage_failed),
                hint="free space in the run directory and restart: the log resumes",
            )
        if self.replication is not None:
            self.replication.close()
        self.lock.release()
        if self.metrics_server is not None:
            prom.stop(self.metrics_server)
        Security.stop(self.context)
        self.context.destroy(linger=0)
        self.quiet.flush()
        self.log.info(
            "stopped",
            folds=self.folds,
            counters=self.counters,
            rejected=dict(self.core.rejected),
            evicted={
                "partial_memory": self.reassembler.stats.evicted_memory,
                "partial_ttl": self.reassembler.stats.evicted_ttl,
                "held_overflow": self.tracker.overflow,
                "refused_senders": self.tracker.refused_senders,
            },
        )
