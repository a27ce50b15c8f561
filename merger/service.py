"""The merger process: sockets, clock and disk around `MergerCore`.

Sockets: merger/wiring.py.  Islands' streams (merger/network/streams.py `StreamKeeper`), snapshots
(merger/network/publishing.py `SnapshotPublisher`) and announcements (merger/network/announcing.py
`Announcer`) are objects of their own; this module keeps the poll loop and the dispatch of what
arrives.

Chunks pass a `GapTracker` first (in order, exactly once per island); gaps and heartbeat-revealed
tails are asked for again every RESEND_S.  Per admitted delta: write-ahead log first, fold when the
round policy says so (the fold computes while the loop goes on: merger/state/pipeline.py), and once
it is computed sync the log, then publish the snapshot and the acks — an acknowledged delta is
always on disk, and cursors are logged before islands see them.  Every receive is behind a poll
with a timeout; SIGTERM/SIGINT stop the loop, write a final checkpoint, close the sockets with
linger 0 and exit 0.
"""

from __future__ import annotations

import math
import signal
import threading
import time

import zmq

from dloco import protocol
from dloco.bus.security import Security, peer_of
from dloco.bus.subscriptions import BudgetedXPUB, give_back_freed
from dloco.merger.log.wal import StorageError
from dloco.merger.network.announcing import Announcer
from dloco.merger.network.backlog import Backlog, read_into
from dloco.merger.network.publishing import SnapshotPublisher, Stamp
from dloco.merger.network.receiving import Receiver
from dloco.merger.network.streams import StreamKeeper
from dloco.merger.replication.primary import Fenced, ReplicatedLog
from dloco.merger.replication.standby import Takeover

# re-exported: the service's settings
from dloco.merger.settings import ServiceConfig as ServiceConfig
from dloco.merger.state.pipeline import FoldPipeline
from dloco.merger.state.recovery import open_run
from dloco.merger.state.trained_tokens import TrainedTokens
from dloco.merger.wiring import open_sockets, start_replication
from dloco.protocol import code_loops
from dloco.protocol.errors import ConfigError
from dloco.telemetry import prom
from dloco.telemetry.logs import configure_logging
from dloco.telemetry.ratelimit import ThrottledLog

# longest sleep between checks of the clock-driven round policy
POLL_MS = 50
# messages taken from one socket before the loop looks at the others
DRAIN_LIMIT = 256
# the exit code of a merger stopped by its disk (full, read-only, failing)
EXIT_STORAGE = 3


class MergerService:
    # Over 60 lines: the service's parts built in the order they depend on each other (metrics
    # port, log and state, sockets, pipeline, replication), each failing before the next opens.
    def __init__(
        self,
        config: ServiceConfig,
        core_factory=None,
        takeover: Takeover | None = None,
        lease: tuple = (None, None),
    ) -> None:
        """`takeover`: a standby's state, log and lock (merger/replication/standby.py), instead of
        recovering them; `lease`: with etcd, the pair's keys and the claim this merger holds
        (merger/replication/consensus.py)."""
        self.config = config
        self.log = configure_logging("merger", sender=config.sender)
        # lines a peer's messages cause: once a second per peer and reason
        self.quiet = ThrottledLog(self.log)
        # first: a busy port fails here, before any thread or file is opened
        self.metrics_server, self.histograms = (
            self._serve_metrics() if config.metrics_port is not None else (None, None)
        )
        opened = takeover if takeover is not None else open_run(config, core_factory, self.log)
        self.lock, self.wal, self.core = opened.lock, opened.wal, opened.core
        self.core.log = self.wal
        self.stamp = Stamp(config.sender, opened.epoch)
        # (dloco merger checks this before a new log is written)
        if config.shard >= len(self.core.fragments):
            raise ConfigError(
                f"shard {config.shard}/{config.shards} owns no fragment of"
                f" {len(self.core.fragments)}: give fewer shards than fragments"
            )
        if self.histograms is not None:
            self.wal.on_fsync = self.histograms[2].observe
        self.counters: dict[str, int] = {}
        # int deltas stay in their records: the fold works on codes (merger/engines/coded.py), whose
        # kernels compile in the background now rather than in the first rounds
        self.stopping, self.storage_failed = False, None
        self.warming = threading.Thread(target=self._warm_up, name="warm-up", daemon=True)
        self.warming.start()
        # what islands' messages may hold here, per sender (half) and in all: partial deltas, and
        # stream messages beyond a gap
        self.reassembler = protocol.Reassembler(
            ttl_s=config.reassembly_ttl_s,
            max_bytes=config.reassembly_bytes,
            decode=False,
            max_sender_bytes=config.reassembly_bytes // 2,
        )
        sockets = open_sockets(config, len(self.core.fragments), self.log, held_values(self.core))
        self.context, self.delta_sub = sockets.context, sockets.delta_sub
        self.snapshot_pub, self.control = sockets.snapshot_pub, sockets.control
        self.owned = sockets.owned
        self._own_fragments(config)
        self.pipeline = FoldPipeline(self.core, self.wal, self.context)
        # read while the loop waits for the etcd lease or the standby, handled after
        self.backlog, self._loop_thread = Backlog(config.held_bytes), None
        self.replication, self.fenced = None, None
        # the log goes to a standby too; in sync mode nothing is published before it has it
        if config.replication.on:
            self.replication = start_replication(
                config, self.context, self.wal, self.stamp, takeover, self.log, lease
            )
            self.replication.stopping = lambda: self.stopping
            self.replication.pump = self._read_while_waiting
            self.core.log = ReplicatedLog(self.wal, self.replication)
            self.pipeline.barrier = self.replication.barrier
        self._make_parts()
        # (metrics: the counters above exist)
        self.started = True

    def _warm_up(self) -> None:
        self.core.warm_up(stopping=lambda: self.stopping)
        diff = self.config.snapshots.snapshot_diff_codec
        if diff != "none" and not self.stopping:
            codec = protocol.Codec(diff)
            if codec.blockwise and not codec.sparse:
                # the snapshot diff's loops (protocol/code_loops.py)
                code_loops.warm_up(codec.bits, codec.block, self.config.snapshots.served_dtype)
        # compiling left holes in the heap (freed, resident): give them back
        give_back_freed()

    def _make_parts(self) -> None:
        """The objects that own the service's state: its publisher, stream keeper, announcer and
        receiver, each handed the parts it drives."""
        self.publisher = SnapshotPublisher(
            self.core, self.config, self.stamp, self.snapshot_pub, self.control, self.count
        )
        self.streams = StreamKeeper(
            self.core.cursors,
            self.config,
            self.reassembler,
            self.control,
            self.stamp,
            self.log,
            self.count,
        )
        # the cluster's tokens, for islands' schedules (every ack carries them)
        self.trained = TrainedTokens()
        self.announcer = Announcer(
            core=self.core,
            wal=self.wal,
            pipeline=self.pipeline,
            publisher=self.publisher,
            streams=self.streams,
            trained=self.trained,
            stamp=self.stamp,
            bus=self.snapshot_pub,
            config=self.config,
            log=self.log,
        )
        self.announcer.replication, self.announcer.histograms = self.replication, self.histograms
        self.receiver = Receiver(
            config=self.config,
            core=self.core,
            pipeline=self.pipeline,
            streams=self.streams,
            reassembler=self.reassembler,
            trained=self.trained,
            publisher=self.publisher,
            announcer=self.announcer,
            owned=self.owned,
            count=self.count,
            quiet=self.quiet,
            log=self.log,
        )

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
                    dict(self.announcer.by_fragment),
                    [s.version for s in self.core.states],
                    self.receiver.ingest_bytes,
                    self.wal.bytes_appended,
                ),
                *prom.replication_families(
                    "primary", self.stamp.epoch, replication, self.wal.next_index
                ),
            ]

        registry = prom.registry_of(read)
        histograms = prom.merger_histograms(registry)
        return prom.serve(self.config.metrics_port, self.config.metrics_host, registry), histograms

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
        gate = self.snapshot_pub if isinstance(self.snapshot_pub, BudgetedXPUB) else None
        if gate is not None:
            poller.register(gate.socket, zmq.POLLIN)
            gate.before_close = poller.unregister
            gate.after_open = lambda new: poller.register(new, zmq.POLLIN)
        for fragment in self.owned:
            self.publisher.publish(fragment)
        wake, self._loop_thread = None, threading.get_ident()
        try:
            while not self.stopping:
                self.backlog.handle_all()
                # wake may be far off
                timeout = (
                    POLL_MS
                    if wake is None
                    else int(max(0.0, min(POLL_MS, (wake - time.monotonic()) * 1000)))
                )
                events = dict(poller.poll(timeout))
                if self.delta_sub in events:
                    self._drain(self.delta_sub, self.receiver.on_delta_frames)
                if self.control in events:
                    self._drain(self.control, self.receiver.on_control_frames)
                if gate is not None and gate.socket in events:
                    self._charge_subscriptions(gate)
                # first: a fragment whose fold finished may fold again now
                self.announcer.announce(self.pipeline.finished())
                # what arrived while announcing waited (the lease, the standby), before the rest
                self.backlog.handle_all()
                wake = self.pipeline.dispatch(time.monotonic(), self.streams.live())
                next_snapshot = self.publisher.publish_due(time.monotonic())
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

    def _charge_subscriptions(self, gate: BudgetedXPUB) -> None:
        """Islands' subscriptions to the snapshot socket this merger binds, charged to them."""
        for _ in range(256):
            try:
                frames = gate.socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if gate.charge(frames):
                self.count("merger/subscriptions_reopened")
                return

    def maintain_streams(self) -> None:
        """The streams' upkeep (resend requests, silent islands); takes in what a skipped gap
        released and publishes the settled cursors when they are due."""
        released, cursors_due = self.streams.maintain(time.monotonic())
        for chunk in released:
            self.receiver.on_delta_chunk(chunk)
        if cursors_due:
            self.announcer.publish_ack([])

    def _own_fragments(self, config: ServiceConfig) -> None:
        """The core folds this shard's fragments; a log holding other fragments than those is
        another shard's (ConfigError)."""
        if self.core.owned not in (None, frozenset(self.owned)):
            raise ConfigError(
                f"{config.run_dir}'s log holds fragments {sorted(self.core.owned)} only; shard"
                f" {config.shard}/{config.shards} folds {self.owned}"
            )
        self.core.owned = frozenset(self.owned) if config.shards > 1 else None

    def _read_while_waiting(self) -> None:
        """The replication's waits call this (on the loop's thread): the delta bus and the control
        socket keep being read, into the backlog, so that neither's pipe fills meanwhile."""
        if threading.get_ident() != self._loop_thread:
            return
        receiver = self.receiver
        sockets = (
            (self.delta_sub, receiver.on_delta_frames),
            (self.control, receiver.on_control_frames),
        )
        for _ in range(read_into(self.backlog, sockets, DRAIN_LIMIT)):
            self.count("merger/dropped_while_waiting")

    def _drain(self, socket: zmq.Socket, handle) -> None:
        for _ in range(DRAIN_LIMIT):
            try:
                frames = socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            handle([frame.buffer for frame in frames], peer_of(frames[-1]))

    def count(self, key: str) -> None:
        self.counters[key] = self.counters.get(key, 0) + 1

    def shutdown(self) -> None:
        # exiting while XLA compiles on another thread aborts the process
        self.warming.join(timeout=120)
        self._finish_folds()
        try:
            if self.pipeline.failed is None and self.storage_failed is None and self.fenced is None:
                self.announcer.write_checkpoint()
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
        self._close()

    def _finish_folds(self) -> None:
        """Announce the folds in flight and the held-back snapshots; a fenced merger (stepping down)
        announces nothing: the new primary's log decides."""
        try:
            if self.fenced is None:
                self.announcer.announce(self.pipeline.close())
                # queue the last folds too (best effort: the sockets close with linger 0)
                self.publisher.publish_due(math.inf)
        except StorageError as error:
            self.storage_failed = self.storage_failed or error
        # fenced while announcing the last folds
        except Fenced as error:
            self.fenced = error
        # a fold failed: logged below, the process still shuts down cleanly
        except Exception as error:
            self.log.error("fold_failed", error=repr(error)[:500])
        if self.fenced is not None:
            self.pipeline.barrier = None
            try:
                self.pipeline.close()
            # a fold failed meanwhile: nothing of it was published
            except Exception as error:
                self.log.error("fold_failed", error=repr(error)[:500])
            self.log.warning("stepped_down", reason=str(self.fenced))

    def _close(self) -> None:
        """Release the run directory, the metrics port and the sockets; the last log line."""
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
            folds=self.announcer.folds,
            counters=self.counters,
            rejected=dict(self.core.rejected),
            evicted={
                "partial_memory": self.reassembler.stats.evicted_memory,
                "partial_ttl": self.reassembler.stats.evicted_ttl,
                "held_overflow": self.streams.tracker.overflow,
                "refused_senders": self.streams.tracker.refused_senders,
            },
        )


def held_values(core) -> int:
    """The parameters a core holds values of (a shard: its own fragments')."""
    return sum(math.prod(shape) for layout in core.layouts for shape in layout.values())
