"""Merger ingest benchmark: receive + decode + dequantize + admit + log + fold of int4 deltas.

A separate sender process publishes every island's delta of every fragment for a few rounds of a
synthetic model (>= 25 M parameters) over loopback TCP.  The merger side runs the real pipeline
in-process (SUB, `protocol.decode`, `Reassembler`, `MergerCore` with its write-ahead log, folds of
`islands` deltas each dispatched through the service's `FoldPipeline`, log sync) and reports wire
bytes per second from the first message to the last synced fold, after a warm-up that compiles the
fold kernels (a merger does that once).  Reference, same run: the same frames only received from a
raw SUB socket.
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
from collections.abc import Callable
from pathlib import Path

import numpy as np
import zmq

from dloco import protocol
from dloco.benchmarks.delta_sender import synthetic_shapes
from dloco.benchmarks.timing import gbps, receive_timed
from dloco.bus.security import Security
from dloco.cluster.ports import free_ports
from dloco.merger.config import MergeConfig, MergerConfig, RoundConfig
from dloco.merger.core import MergerCore
from dloco.merger.fold import Contribution
from dloco.merger.logmatch import genesis_of
from dloco.merger.memory import keep_freed_memory
from dloco.merger.pipeline import FoldPipeline
from dloco.merger.replication import ReplicatedLog, ReplicationServer
from dloco.merger.replication_wire import ReplicationConfig
from dloco.merger.wal import WriteAheadLog

END = b"end"


def _sender(
    port: int,
    params: int,
    fragments: int,
    islands: int,
    rounds: int,
    owned: list[int] | None = None,
) -> subprocess.Popen:
    command = [
        sys.executable,
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


def _subscriber(context: zmq.Context) -> tuple[zmq.Socket, int]:
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVHWM, 0)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    return sub, sub.bind_to_random_port("tcp://127.0.0.1")


def expected_messages(
    params: int, fragments: int, islands: int, rounds: int, owned: list[int] | None = None
) -> int:
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


def _warm_up(config: MergerConfig, shapes: dict, fragments: int, islands: int) -> float:
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


def _merger_pass(
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
    # this process's CPU time at the first message (its loop thread and fold worker from then on)
    cpu_began = None
    stages: collections.Counter[str] = collections.Counter()
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
        reassembler = protocol.Reassembler(max_bytes=2 << 30, decode=False)
        pipeline = FoldPipeline(core, wal)
        replica = Replica(context, core, wal, pipeline, Path(tmp)) if standby else None
        handled, done, latency = 0, [], []

        def finished(wait: bool = False) -> None:
            folds = pipeline.finished(wait=wait)
            latency.extend(time.perf_counter() - fold.began for fold in folds)
            done.extend(folds)

        def handle(frames: list) -> None:
            nonlocal handled, cpu_began
            handled += 1
            cpu_began = time.process_time() if cpu_began is None else cpu_began
            t0 = time.perf_counter()
            message = protocol.decode(frames)
            t1 = time.perf_counter()
            assembled = reassembler.add(message, now=0.0)
            t2 = time.perf_counter()
            stages["decode_s"] += t1 - t0
            stages["reassemble_s"] += t2 - t1
            if assembled is not None:
                result = core.submit(assembled, now=0.0)
                assert result is None, result
                # the fold computes on while the next deltas arrive
                pipeline.dispatch(now=0.0)
            t3 = time.perf_counter()
            finished()
            # the last message waits for every fold
            while handled == expected and (pipeline.in_flight or any(core.pending)):
                finished(wait=True)
                # no island is coming: every pending delta folds now (at 0.0 a grace wait never
                # ended)
                pipeline.dispatch(now=math.inf)
            stages["admit_log_dispatch_s"] += t3 - t2
            stages["finish_sync_s"] += time.perf_counter() - t3

        sub, port = _subscriber(context)
        sender = _sender(port, params, fragments, islands, rounds, owned)
        wire_bytes, seconds = receive_timed(sub, expected, handle)
        cpu_s, ended_at = time.process_time() - cpu_began, time.time()
        sender.wait(timeout=60)
        sub.close()
        pipeline.close()
        if replica is not None:
            replica.close()
        wal.close()
    folds, folded = len(done), sum(len(fold.report.contributors) for fold in done)
    mine = fragments if owned is None else len(owned)
    # a fragment busy folding folds two rounds at once next time: count deltas
    if folded != islands * mine * rounds:
        raise RuntimeError(
            f"expected {islands * mine * rounds} deltas folded, saw {folded} in {folds} folds"
        )
    # Where the CPU goes: the loop thread's stages and the fold worker's computing.  On this many
    # cores, with perfect overlap and nothing else running (no sender, no ZeroMQ I/O threads), the
    # merger could not ingest faster than wire / max(loop, worker, (loop + worker) / cores).
    loop_s = sum(v for k, v in stages.items() if k != "finish_sync_s")
    worker_s = sum(fold.compute_s for fold in done)
    cores = len(os.sched_getaffinity(0))
    bound_s = max(loop_s, worker_s, (loop_s + worker_s) / cores)
    return {
        "wire_bytes": wire_bytes,
        "seconds": seconds,
        "folds": folds,
        "stages_s": {k: round(v, 3) for k, v in sorted(stages.items())},
        "loop_busy_s": round(loop_s, 3),
        "fold_worker_busy_s": round(worker_s, 3),
        "cores": cores,
        "cpu_bound_gbps": round(gbps(wire_bytes, bound_s), 3),
        "fold_latency_s": round(float(np.median(latency)), 4),
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


def run(
    params: int = 25_165_824,
    fragments: int = 4,
    islands: int = 4,
    rounds: int = 2,
    passes: int = 3,
    standby: bool = False,
    log: Callable[[str], None] = lambda line: print(line, file=sys.stderr),
) -> dict:
    """Raw reference, then the merger pipeline 1 + `passes` times: a cold pass (a merger's first
    rounds: the process touches its buffers' pages for the first time) and warm passes (a merger in
    its steady state: the same process, its freed memory kept — merger/memory.py), of which the
    median is reported, with the CPU accounting of that pass.  (`--shards`:
    benchmarks/merger_shards.py.)
    """
    shapes = synthetic_shapes(params, fragments)
    total_params = int(sum(np.prod(s) for s in shapes.values()))
    expected = expected_messages(params, fragments, islands, rounds)
    # as `dloco merger` does
    keep_freed_memory()
    # each pass's standby process compiles its fold kernels once, then finds them in dloco up's
    # cache
    if standby:
        from dloco.cluster.launcher import share_compilations

        share_compilations()
    context = zmq.Context()
    try:
        log(f"bench merger: raw ZeroMQ reference, {expected} messages ...")
        sub, port = _subscriber(context)
        sender = _sender(port, params, fragments, islands, rounds)
        raw_bytes, raw_seconds = receive_timed(sub, expected)
        sender.wait(timeout=60)
        sub.close()

        config = MergerConfig(
            MergeConfig(max_staleness=rounds), round=RoundConfig(quorum=islands, grace_cap_s=0.0)
        )
        # a running merger compiles its fold kernels once
        warmup_s = _warm_up(config, shapes, fragments, islands)
        done, replicated = [], []
        for number in range(1 + passes):
            name = "cold pass" if number == 0 else f"warm pass {number} of {passes}"
            log(
                f"bench merger: merger pipeline ({name}), {total_params:,} parameters, {islands}"
                f" islands x {fragments} fragments x {rounds} rounds ..."
            )
            done.append(_merger_pass(context, config, params, fragments, islands, rounds))
            # alternating, so that both see the same machine
            if standby and number > 0:
                log(
                    f"bench merger: the same, its log streamed to a standby in sync mode ({number}"
                    f" of {passes}) ..."
                )
                replicated.append(
                    _merger_pass(context, config, params, fragments, islands, rounds, standby=True)
                )
    finally:
        context.destroy(linger=0)
    cold, warm_passes = done[0], sorted(done[1:], key=lambda p: p["seconds"])
    # the median pass (the slower middle one of an even count)
    warm = warm_passes[len(warm_passes) // 2]
    ingest, raw = gbps(warm["wire_bytes"], warm["seconds"]), gbps(raw_bytes, raw_seconds)
    return {
        "params": total_params,
        "islands": islands,
        "fragments": fragments,
        "rounds": rounds,
        "codec": "int4",
        "messages": expected,
        "wire_bytes": warm["wire_bytes"],
        "folds": warm["folds"],
        "seconds": round(warm["seconds"], 3),
        "merger_ingest_gbps": round(ingest, 3),
        "raw_zmq_recv_gbps": round(raw, 3),
        "ingest_vs_raw": round(ingest / raw, 3),
        "cold_ingest_gbps": round(gbps(cold["wire_bytes"], cold["seconds"]), 3),
        "warm_ingest_gbps_samples": [
            round(gbps(p["wire_bytes"], p["seconds"]), 3) for p in done[1:]
        ],
        "stages_s": warm["stages_s"],
        "warmup_compile_s": round(warmup_s, 3),
        "loop_busy_s": warm["loop_busy_s"],
        "fold_worker_busy_s": warm["fold_worker_busy_s"],
        "cores": warm["cores"],
        "cpu_bound_gbps": warm["cpu_bound_gbps"],
        "fold_latency_s": warm["fold_latency_s"],
        **(_with_standby(done[1:], replicated) if standby else {}),
    }


def _with_standby(alone: list[dict], replicated: list[dict]) -> dict:
    """Medians with and without the standby, and their ratios (both measured in this run)."""
    ingest = [gbps(p["wire_bytes"], p["seconds"]) for p in replicated]
    plain = [gbps(p["wire_bytes"], p["seconds"]) for p in alone]
    latency, plain_latency = (
        float(np.median([p["fold_latency_s"] for p in replicated])),
        float(np.median([p["fold_latency_s"] for p in alone])),
    )
    return {
        "standby_ingest_gbps": round(float(np.median(ingest)), 3),
        "standby_ingest_samples": [round(g, 3) for g in ingest],
        "standby_ingest_vs_alone": round(float(np.median(ingest)) / float(np.median(plain)), 3),
        "standby_fold_latency_s": round(latency, 4),
        "standby_fold_latency_vs_alone": round(latency / plain_latency, 3),
    }


def summary(result: dict) -> str:
    line = (
        f"merger ingest {result['merger_ingest_gbps']:.3f} GB/s of int4 wire bytes in its steady"
        f" state (median of {result['warm_ingest_gbps_samples']}; first pass:"
        f" {result['cold_ingest_gbps']:.3f} GB/s; {result['params']:,} params, {result['islands']}"
        f" deltas per fold); raw ZeroMQ receive {result['raw_zmq_recv_gbps']:.3f} GB/s; ratio"
        f" {result['ingest_vs_raw']:.2f}; stages {result['stages_s']}; loop thread busy"
        f" {result['loop_busy_s']} s, fold worker {result['fold_worker_busy_s']} s: at most"
        f" {result['cpu_bound_gbps']:.3f} GB/s on {result['cores']} cores with perfect overlap;"
        f" fold latency {result['fold_latency_s'] * 1000:.0f} ms"
    )
    if "standby_ingest_gbps" in result:
        line += (
            f"; with a standby in sync mode: ingest {result['standby_ingest_gbps']:.3f} GB/s"
            f" (x{result['standby_ingest_vs_alone']:.2f} of alone, samples"
            f" {result['standby_ingest_samples']}), fold latency"
            f" {result['standby_fold_latency_s'] * 1000:.0f} ms"
            f" (x{result['standby_fold_latency_vs_alone']:.2f})"
        )
    return line
