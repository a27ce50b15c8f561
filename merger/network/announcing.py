"""What the merger tells the islands once something is durable: each computed fold (its log line,
its snapshot offered to the publisher, its acks), acks with every island's settled cursor, and
checkpoints.  Nothing is announced before the write-ahead log (and, with a standby, the replication
barrier) holds it.  `Announcer` owns the fold counts; the service hands it the parts it drives.
"""

from __future__ import annotations

import collections
import time

from dloco import protocol
from dloco.merger.state import checkpoint
from dloco.merger.state.recovery import checkpoint_dir


class Announcer:
    def __init__(
        self, *, core, wal, pipeline, publisher, streams, trained, stamp, bus, config, log
    ) -> None:
        """The merger service's parts this drives: its core (cursors to log), write-ahead log, fold
        pipeline, snapshot publisher, stream keeper (settled cursors), cluster tokens, stamp,
        snapshot socket, settings and log.  `replication` (a standby's stream) and `histograms`
        (Prometheus) are set by the service when it has them."""
        self.core, self.wal, self.pipeline, self.publisher = core, wal, pipeline, publisher
        self.streams, self.trained, self.stamp, self.bus = streams, trained, stamp, bus
        self.config, self.log = config, log
        self.replication, self.histograms = None, None
        self.folds, self.by_fragment = 0, collections.Counter()

    def announce(self, folds) -> None:
        """Folds computed and on disk: log each, publish its snapshot and its acks.  Every
        `checkpoint_every` folds a checkpoint, of computed state only: what is in flight first."""
        due = False
        for fold in folds:
            due |= self._announce(fold)
        if due:
            pipeline = self.pipeline
            while pipeline.in_flight:
                for fold in pipeline.finished(wait=True):
                    self._announce(fold)
            self.write_checkpoint()

    def _announce(self, fold) -> bool:
        report = fold.report
        self.folds += 1
        self.by_fragment[fold.fragment] += 1
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
        self.publisher.offer(fold.fragment, fold.state)
        self.publish_ack(fold.results)
        return self.folds % self.config.checkpoint_every == 0

    def publish_ack(self, results: list[protocol.DeltaResult]) -> None:
        """Results plus every island's cursor; cursors are logged and synced before anyone sees
        them."""
        cursors = self.streams.settled_cursors()
        if self.core.record_cursors(cursors) or results:
            self.wal.sync()
            if self.replication is not None:
                self.replication.barrier(self.wal.next_index)
        if not results and not cursors:
            return
        ack = protocol.Ack(
            sender=self.stamp.sender,
            epoch=self.stamp.epoch,
            seq=self.stamp.next_seq(),
            cursors=tuple(
                protocol.Cursor(island, epoch, seq)
                for island, (epoch, seq) in sorted(cursors.items())
            ),
            results=tuple(results),
            tokens=self.trained.total,
        )
        self.bus.send_multipart(protocol.encode(ack))

    def write_checkpoint(self) -> None:
        self.wal.sync()
        path = checkpoint.save(checkpoint_dir(self.config.run_dir), self.core, self.wal.next_index)
        self.log.info(
            "checkpoint",
            path=str(path),
            next_index=self.wal.next_index,
            digest=self.core.digest(),
        )
