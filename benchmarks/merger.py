"""Merger ingest benchmark: receive + decode + dequantize + admit + log + fold of int4 deltas.

A separate sender process publishes every island's delta of every fragment for a few rounds of a
synthetic model (>= 25 M parameters) over loopback TCP.  The merger side runs the real pipeline
in-process (SUB, `protocol.decode`, `Reassembler`, `MergerCore` with its write-ahead log, folds of
`islands` deltas each dispatched through the service's `FoldPipeline`, log sync) and reports wire
bytes per second from the first message to the last synced fold, after a warm-up that compiles the
fold kernels (a merger does that once).  Reference, same run: the same frames only received from a
raw SUB socket.  One pass: benchmarks/merger_pass.py.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable

import numpy as np
import zmq

from dloco.benchmarks.delta_sender import synthetic_shapes
from dloco.benchmarks.merger_pass import (
    bind_subscriber,
    expected_messages,
    merger_pass,
    start_sender,
    warm_up,
)
from dloco.benchmarks.timing import gbps, receive_timed
from dloco.merger.config import MergeConfig, MergerConfig, RoundConfig
from dloco.merger.memory import keep_freed_memory

END = b"end"


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
        sub, port = bind_subscriber(context)
        sender = start_sender(port, params, fragments, islands, rounds)
        raw_bytes, raw_seconds = receive_timed(sub, expected)
        sender.wait(timeout=60)
        sub.close()

        config = MergerConfig(
            MergeConfig(max_staleness=rounds), round=RoundConfig(quorum=islands, grace_cap_s=0.0)
        )
        # a running merger compiles its fold kernels once
        warmup_s = warm_up(config, shapes, fragments, islands)
        done, replicated = _timed_passes(
            functools.partial(merger_pass, context, config, params, fragments, islands, rounds),
            passes,
            standby,
            f"{total_params:,} parameters, {islands} islands x {fragments} fragments x {rounds}"
            " rounds",
            log,
        )
    finally:
        context.destroy(linger=0)
    return {
        "params": total_params,
        "islands": islands,
        "fragments": fragments,
        "rounds": rounds,
        "codec": "int4",
        "messages": expected,
        **_steady_state(done, gbps(raw_bytes, raw_seconds), warmup_s),
        **(_with_standby(done[1:], replicated) if standby else {}),
    }


def _timed_passes(
    one_pass: Callable[..., dict], passes: int, standby: bool, what: str, log: Callable
) -> tuple[list[dict], list[dict]]:
    """The cold pass, then `passes` warm ones, each warm one followed by one with the standby when
    `standby`: (the passes alone, those with the standby)."""
    done, replicated = [], []
    for number in range(1 + passes):
        name = "cold pass" if number == 0 else f"warm pass {number} of {passes}"
        log(f"bench merger: merger pipeline ({name}), {what} ...")
        done.append(one_pass())
        # alternating, so that both see the same machine
        if standby and number > 0:
            log(
                f"bench merger: the same, its log streamed to a standby in sync mode ({number}"
                f" of {passes}) ..."
            )
            replicated.append(one_pass(standby=True))
    return done, replicated


def _steady_state(done: list[dict], raw: float, warmup_s: float) -> dict:
    """The median warm pass's figures, against the raw reference (`raw` GB/s) and the cold pass."""
    cold, warm_passes = done[0], sorted(done[1:], key=lambda p: p["seconds"])
    # the median pass (the slower middle one of an even count)
    warm = warm_passes[len(warm_passes) // 2]
    ingest = gbps(warm["wire_bytes"], warm["seconds"])
    return {
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
