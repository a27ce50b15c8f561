"""One timed pass of the merger ingest benchmark (benchmarks/merger.py; benchmarks/merger_shards.py
runs it in each shard's process): a sender process publishes int4 deltas over loopback TCP, and the
real merger pipeline takes them in this process message by message (`IngestLoop`), its log
streamed to a standby process when asked (`Replica`).  Reported: wire bytes, seconds, each fold's
latency and where the CPU went.
"""

from __future__ import annotations

import collections
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import zmq

from dloco import protocol
from dloco.benchmarks.delta_sender import synthetic_shapes
from dloco.benchmarks.timing import gbps, receive_timed
from dloco.bus.security import Security
from dloco.cluster.ports import free_ports
from dloco.merger.config import MergerConfig
from dloco.merger.fold.merge import Contribution
from dloco.merger.log.logmatch import genesis_of
from dloco.merger.log.wal import WriteAheadLog
from dloco.merger.replication.primary import ReplicatedLog, ReplicationServer
from dloco.merger.settings import ReplicationConfig
from dloco.merger.state.core import MergerCore
from dloco.merger.state.pipeline import FoldPipeline


def start_sender(
    port: int,
    params: int,
    fragments: int,
    islands: int,
    rounds: int,
    owned: list[int] | None = None,
) -> subprocess.Popen:
    """The sender process: every island's delta of every fragment (of `owned` only, when given),
    `rounds` times, published to the subscriber on `port`."""
    command = [
        sys.executable,
        "-P",
        "-m",
        "dloco.benchmarks.delta_sender",
        "--endpoint",
        f"tcp://127.0.0.1:{port}",
        "--params",
        str(params),
        "--fragments",
        str(fragments),
        "--islands",
        str(islands),
        "--rounds",
        str(rounds),
    ]
    return subprocess.Popen(
        command + (["--only", ",".join(map(str, owned))] if owned is not None else [])
    )


def bind_subscriber(context: zmq.Context) -> tuple[zmq.Socket, int]:
    """A SUB that keeps every message (no high-water mark), bound to a free loopback port."""
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVHWM, 0)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    return sub, sub.bind_to_random_port("tcp://127.0.0.1")


def expected_messages(
    params: int, fragments: int, islands: int, rounds: int, owned: list[int] | None = None
) -> int:
    """How many messages the sender publishes: every chunk of every delta it sends."""
    shapes = synthetic_shapes(params, fragments)
    codec = protocol.Codec("int4")
    per_round = 0
    for fragment, paths in enumerate(protocol.partition(shapes, fragments)):
        if owned is not None and fragment not in owned:
            continue
        nbytes = sum(codec.encoded_nbytes(int(np.prod(shapes[p]))) for p in paths)
        per_round += (
            len(protocol.split_fragment({p: np.zeros(shapes[p], np.float32) for p in paths}, codec))
            if nbytes
            else 0
        )
    return per_round * islands * rounds


def warm_up(config: MergerConfig, shapes: dict, fragments: int, islands: int) -> float:
    """Compile the folds in a throwaway core, as a merger does at start, so the timed run meets
    compiled kernels."""
    started = time.perf_counter()
    zeros = {path: np.zeros(shape, np.float32) for path, shape in shapes.items()}
    core = MergerCore(config, "warm-up", protocol.partition(shapes, fragments), zeros)
    core.warm_up()
    codec, rng = protocol.Codec("int4"), np.random.default_rng(1)
    # and every fragment's outer step
    for fragment, paths in enumerate(core.fragments):
        members = [
            Contribution(
                f"w{m}",
                0,
                m,
                0,
                1,
                1,
                {
                    p: protocol.CodedTensor(
                        codec,
                        shapes[p],
                        codec.encode(
                            rng.standard_normal(int(np.prod(shapes[p]))).astype(np.float32)
                        ).reshape(-1, codec.record_nbytes),
                    )
                    for p in paths
                },
            )
            for m in range(islands)
        ]
        core._apply_fold(fragment, members)
    return time.perf_counter() - started


class IngestLoop:
    """The merger's side of a pass, message by message as the service's loop thread takes them:
    decode, reassemble, admit and log, dispatch the fold, collect the finished folds; the last
    message waits for every fold.  Each stage's seconds add up in `stages`."""

    def __init__(self, core: MergerCore, pipeline: FoldPipeline, expected: int) -> None:
        self.core, self.pipeline, self.expected = core, pipeline, expected
        self.reassembler = protocol.Reassembler(max_bytes=2 << 30, decode=False)
        self.stages: collections.Counter[str] = collections.Counter()
        # the finished folds' reports and the worker's seconds, not the folds: a fold holds the
        # state it installed, and holding every one would keep each state's buffers from the folds
        # after it (merger/engines/fused.py), as a merger does not
        self.handled, self.done, self.latency, self.worker_s = 0, [], [], 0.0
        # this process's CPU time at the first message (its loop thread and fold worker from then
        # on)
        self.cpu_began: float | None = None

    def finished(self, wait: bool = False) -> None:
        folds = self.pipeline.finished(wait=wait)
        self.latency.extend(time.perf_counter() - fold.began for fold in folds)
        self.done.extend(fold.report for fold in folds)
        self.worker_s += sum(fold.compute_s for fold in folds)

    def handle(self, frames: list) -> None:
        self.handled += 1
        self.cpu_began = time.process_time() if self.cpu_began is None else self.cpu_began
        t0 = time.perf_counter()
        message = protocol.decode(frames)
        t1 = time.perf_counter()
        assembled = self.reassembler.add(message, now=0.0)
        t2 = time.perf_counter()
        self.stages["decode_s"] += t1 - t0
        self.stages["reassemble_s"] += t2 - t1
        if assembled is not None:
            result = self.core.submit(assembled, now=0.0)
            assert result is None, result
            # the fold computes on while the next deltas arrive
            self.pipeline.dispatch(now=0.0)
        t3 = time.perf_counter()
        self.finished()
        # the last message waits for every fold
        while self.handled == self.expected and (self.pipeline.in_flight or any(self.core.pending)):
            self.finished(wait=True)
            # no island is coming: every pending delta folds now (at 0.0 a grace wait never
            # ended)
            self.pipeline.dispatch(now=math.inf)
        self.stages["admit_log_dispatch_s"] += t3 - t2
        self.stages["finish_sync_s"] += time.perf_counter() - t3

    def cpu_figures(self, wire_bytes: int) -> dict:
        """Where the CPU went (the loop thread's stages, the fold worker's wall time), the bound it
        sets on ingest, and the median fold latency."""
        # Where the CPU goes: the loop thread's stages and the fold worker's computing.  On this
        # many cores, with perfect overlap and nothing else running (no sender, no ZeroMQ I/O
        # threads), the merger could not ingest faster than wire / max(loop, worker, (loop +
        # worker) / cores).
        loop_s = sum(v for k, v in self.stages.items() if k != "finish_sync_s")
        worker_s = self.worker_s
        cores = len(os.sched_getaffinity(0))
        bound_s = max(loop_s, worker_s, (loop_s + worker_s) / cores)
        return {
            "stages_s": {k: round(v, 3) for k, v in sorted(self.stages.items())},
            "loop_busy_s": round(loop_s, 3),
            "fold_worker_busy_s": round(worker_s, 3),
            "cores": cores,
            "cpu_bound_gbps": round(gbps(wire_bytes, bound_s), 3),
            "fold_latency_s": round(float(np.median(self.latency)), 4),
        }


def merger_pass(
    context: zmq.Context,
    config: MergerConfig,
    params: int,
    fragments: int,
    islands: int,
    rounds: int,
    standby: bool = False,
    owned: list[int] | None = None,
) -> dict:
    """One timed pass of the merger pipeline over the sender's stream: wire bytes, seconds, each
    fold's latency (dispatched to announceable) and where the CPU went (the loop thread's stages,
    the fold worker's wall time).  `standby`: the log streams to a standby process in sync mode.
    `owned`: a merger shard's fragments (the sender sends only theirs; benchmarks/merger_shards.py).
    """
    shapes = synthetic_shapes(params, fragments)
    expected = expected_messages(params, fragments, islands, rounds, owned)
    with tempfile.TemporaryDirectory(prefix="dloco-bench-merger-") as tmp:
        zeros = {path: np.zeros(shape, np.float32) for path, shape in shapes.items()}
        wal = WriteAheadLog(Path(tmp) / "wal", fsync="batch")
        core = MergerCore(
            config,
            protocol.model_fingerprint(zeros),
            protocol.partition(shapes, fragments),
            zeros,
            log=wal,
        )
        pipeline = FoldPipeline(core, wal)
        replica = Replica(context, core, wal, pipeline, Path(tmp)) if standby else None
        loop = IngestLoop(core, pipeline, expected)
        sub, port = bind_subscriber(context)
        sender = start_sender(port, params, fragments, islands, rounds, owned)
        wire_bytes, seconds = receive_timed(sub, expected, loop.handle)
        cpu_s, ended_at = time.process_time() - loop.cpu_began, time.time()
        sender.wait(timeout=60)
        sub.close()
        pipeline.close()
        if replica is not None:
            replica.close()
        wal.close()
    folds, folded = len(loop.done), sum(len(report.contributors) for report in loop.done)
    mine = fragments if owned is None else len(owned)
    # a fragment busy folding folds two rounds at once next time: count deltas
    if folded != islands * mine * rounds:
        raise RuntimeError(
            f"expected {islands * mine * rounds} deltas folded, saw {folded} in {folds} folds"
        )
    return {
        "wire_bytes": wire_bytes,
        "seconds": seconds,
        "folds": folds,
        **loop.cpu_figures(wire_bytes),
        "cpu_s": round(cpu_s, 3),
        "ended_at": ended_at,
    }


class Replica:
    """The pass's log streamed to a real standby (`dloco merger --standby-of`, another process on
    this machine) in sync mode: no fold is announced before the standby has stored it."""

    def __init__(
        self,
        context: zmq.Context,
        core: MergerCore,
        wal: WriteAheadLog,
        pipeline: FoldPipeline,
        tmp: Path,
    ) -> None:
        # the genesis record, served from disk
        wal.sync()
        port, *others = free_ports(4)
        self.server = ReplicationServer(
            context,
            ReplicationConfig("sync", f"@tcp://127.0.0.1:{port}", "", lease_s=60.0),
            Security(None, "merger"),
            "merger",
            wal,
            tmp / "wal",
            1,
            [(0, 0)],
            0,
            genesis_of(tmp),
            _quiet(),
        )
        core.log, pipeline.barrier = ReplicatedLog(wal, self.server), self.server.barrier
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-P",
                "-m",
                "dloco",
                "merger",
                "--run-dir",
                str(tmp / "standby"),
                "--standby-of",
                f"tcp://127.0.0.1:{port}",
                "--replication-endpoint",
                f"@tcp://127.0.0.1:{others[0]}",
                "--delta-endpoint",
                f"tcp://127.0.0.1:{others[1]}",
                "--snapshot-endpoint",
                f"tcp://127.0.0.1:{others[1]}",
                "--control-endpoint",
                f"@tcp://127.0.0.1:{others[2]}",
                "--insecure",
                "--lease",
                "60",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 300
        # it has the model (the genesis record) and is ready
        while self.server.state != "sync":
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the standby did not catch up (exit {self.process.poll()})")
            time.sleep(0.05)

    def close(self) -> None:
        self.server.close()
        self.process.send_signal(signal.SIGTERM)
        self.process.wait(timeout=120)


def _quiet():
    import structlog

    return structlog.wrap_logger(structlog.PrintLogger(open(os.devnull, "w")))
