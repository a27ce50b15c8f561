"""Folds in flight: started on the loop's thread, computed on a worker, announced in order.

`MergerCore.start_fold` is quick and happens on the service's thread: the round's members are
taken, the fragment moves to the new version (admission counts staleness against it), the fold
is logged and its deltas settled.  The arithmetic (`MergerCore.compute_fold`: XLA kernels, which
release the GIL) runs on one worker thread, rounds in start order — so the merger goes on
receiving, decoding and logging the next deltas on one core while a fold computes on the other.
(XLA's own asynchronous dispatch is not enough: on CPU it runs many kernels on the calling
thread.)  The log's fsync is started as the fold starts and runs meanwhile.

Nobody is told about a fold before it is finished: `finished()` hands back, in start order, the
folds whose parameters and norms are computed, once the log is durable over them; the service
then logs, publishes the snapshot and acknowledges.  The worker signals each finished fold on an
inproc socket the service polls, so it is noticed at once without busy polling.  The worker never
writes the core: `finished()` installs a fold's state on the loop's thread once it is durable, so
`MergerCore.states` (what catch-up requests and checkpoints get) never shows a fold a crash could
lose; a checkpoint waits until nothing is in flight.  The worker computes a fold up to its outer
step (the merged direction); installing takes that step in place, over the fragment's parameters
and optimizer state (`fold.PendingStep`), so no second copy of the state is made.  A fold of
dense codes under Nesterov momentum is computed whole instead, into buffers of its own that the
state it replaces frees for a later fold (merger/engines/fused.py); installing swaps it in.  Either
way a fold whose log fails to become durable leaves the state as it was.  Each computed fold holds
its direction or its new state (fragment-sized) until then, so the worker computes the next fold
only once the last one is installed (`HELD_COMPUTED`).  After a failed fold (computed or installed)
the pipeline stops (`failed`): the service must not checkpoint, the log alone says what happened.  A
fragment has at most one fold in flight, so the version islands base their deltas on is never
more than one behind the merger's (a stall — a kernel compiling — delays folds instead of making
deltas stale).
"""

from __future__ import annotations

import collections
import dataclasses
import queue
import threading
import time

import jax
import zmq

from dloco.merger.fold.merge import FoldReport, FragmentState, PendingStep
from dloco.merger.log.wal import WriteAheadLog
from dloco.merger.state.core import MergerCore
from dloco.merger.state.rounds import StartedFold

# Computed folds not yet installed that the worker lets wait before it computes the next (each holds
# its merged direction or new state, fragment-sized: while the loop receives, unbounded, computed
# folds added up to most of the model's state again).
HELD_COMPUTED = 1


@dataclasses.dataclass
class Fold:
    started: StartedFold
    # perf_counter when started
    began: float
    # write-ahead-log ticket covering the fold and its deltas
    durable: int
    # set by the worker, with state
    report: FoldReport | None = None
    # the fold up to its outer step, then (installed) the fragment after it: publish this, not the
    # core's newest
    state: PendingStep | FragmentState | None = None
    error: BaseException | None = None
    # seconds the worker spent on it
    compute_s: float = 0.0
    done: threading.Event = dataclasses.field(default_factory=threading.Event)

    @property
    def fragment(self) -> int:
        return self.started.fragment

    @property
    def results(self):
        return self.started.results


class FoldPipeline:
    def __init__(
        self, core: MergerCore, wal: WriteAheadLog | None, context: zmq.Context | None = None
    ) -> None:
        self.core, self.wal = core, wal
        self.in_flight: collections.deque[Fold] = collections.deque()
        # readable when a fold has finished computing (poll it)
        self.signal: zmq.Socket | None = None
        self._notify: zmq.Socket | None = None
        if context is not None:
            endpoint = f"inproc://folds-{id(self)}"
            self.signal = context.socket(zmq.PAIR)
            self.signal.bind(endpoint)
            self._notify = context.socket(zmq.PAIR)
            self._notify.connect(endpoint)
        # a fold raised: nothing more is computed or announced
        self.failed: BaseException | None = None
        # called with a fold's log ticket before it is announced (replication: the standby has it)
        self.barrier = None
        self._work: queue.Queue[Fold | None] = queue.Queue()
        # folds computed and not yet installed (`HELD_COMPUTED`), and whether closing
        self._room = threading.Condition()
        self._computed, self._closing = 0, False
        self._worker = threading.Thread(target=self._compute_each, name="fold-worker", daemon=True)
        self._worker.start()

    def dispatch(self, now: float, live: int = 1) -> float | None:
        """Start every fold the round policy calls for, except for a fragment whose previous fold
        is still computing (its deltas wait for the next round); return when to decide again.
        `live`: islands heard from lately (core.due)."""
        if self.failed is not None:
            raise self.failed
        # one fold per fragment in flight: versions never run ahead of what is computed
        busy = {fold.fragment for fold in self.in_flight}
        ready, wake = self.core.due(now, busy, live)
        for fragment in ready:
            began = time.perf_counter()
            started = self.core.start_fold(fragment)
            fold = Fold(started, began, self.wal.sync_async() if self.wal is not None else 0)
            self.in_flight.append(fold)
            self._work.put(fold)
        return wake

    def finished(self, wait: bool = False) -> list[Fold]:
        """Folds computed by now (every one in flight with wait=True), oldest first, with the log
        durable over them: from here on they may be announced.  Each is installed as soon as it is
        durable, so the worker may compute the next one (`HELD_COMPUTED`).  A fold that failed
        re-raises."""
        if self.signal is not None:
            while self.signal.poll(0):
                self.signal.recv()
        if self.failed is not None:
            raise self.failed
        done = []
        while self.in_flight and (wait or self.in_flight[0].done.is_set()):
            fold = self.in_flight[0]
            fold.done.wait()
            if fold.error is not None:
                self.failed = fold.error
                raise fold.error
            done.append(self.in_flight.popleft())
            try:
                if self.wal is not None:
                    # durable (and on the standby) before anyone is told or it is installed
                    self.wal.wait_durable(fold.durable)
                    if self.barrier is not None:
                        self.barrier(fold.durable)
                try:
                    fold.state = self.core.install(fold.fragment, fold.state, fold.report)
                # its step failed with the fragment's buffers handed to it: nothing more is
                # installed, and no checkpoint taken (the log says what happened)
                except BaseException as error:
                    self.failed = error
                    raise
            # installed or given up (a fenced primary's barrier raises): the worker goes on
            finally:
                with self._room:
                    self._computed -= 1
                    self._room.notify()
        return done

    def close(self) -> list[Fold]:
        """Finish what is in flight and stop the worker; returns the last finished folds (none after
        a failure)."""
        try:
            return self.finished(wait=True) if self.failed is None else []
        finally:
            with self._room:
                self._closing = True
                self._room.notify()
            self._work.put(None)
            self._worker.join(timeout=60)
            for socket in (self._notify, self.signal):
                if socket is not None:
                    socket.close(linger=0)
            self.signal = self._notify = None

    def _compute_each(self) -> None:
        while (fold := self._work.get()) is not None:
            with self._room:
                while self._computed >= HELD_COMPUTED and not self._closing:
                    self._room.wait()
            began = time.perf_counter()
            try:
                fold.state, fold.report = self.core.compute_fold(fold.started)
                jax.block_until_ready(fold.state.direction)
                with self._room:
                    self._computed += 1
            # handed to the loop's thread, which raises it
            except BaseException as error:
                fold.error = error
            fold.compute_s = time.perf_counter() - began
            fold.done.set()
            if self._notify is not None:
                try:
                    self._notify.send(b"", zmq.NOBLOCK)
                # signals already queued, or closing: the loop looks anyway
                except zmq.ZMQError:
                    pass
