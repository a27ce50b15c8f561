"""The merger's half of `dloco bench scale`: the real `MergerService` in a process of its own.

Spawned fresh for each model size, so that its peak resident memory is the merger's alone: the
imports are its baseline, then it makes the model (a shard: its own fragments' values, as
`dloco merger --shard I/N` reads them), starts the service (genesis record in the write-ahead log,
fold kernels compiled), and serves the conductor's commands on a pipe:

- ``listen``: until a message comes in on the delta bus (the broker's XPUB), then until the bus is
  quiet: subscriptions have propagated (ZeroMQ's slow joiner) and nothing stale is left;
- ``call``: probe the snapshot bus with empty acks until the conductor hears one;
- ``join``: publish every fragment it folds in full, as `MergerService.run` does at start;
- ``round``: take `expected` delta chunks (`Receiver.on_delta_frames`, then the fold pipeline:
  reassemble, admit, log, fold) and announce the folds (`announce`: the snapshot diff, its frames,
  the acks);
- ``finish``: the resident memory at the start, its peak, what each phase added to the peak, and
  the service's counters.

Its stdout goes to /dev/null: the service logs a JSON line per fold there, and the benchmark's own
stdout is its result.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import time
import traceback
from pathlib import Path

import jax

from dloco import protocol
from dloco.benchmarks.scale_model import PeakRises, init_params
from dloco.benchmarks.timing import receive_timed
from dloco.merger.config import MergerConfig, OuterConfig, RoundConfig, SnapshotConfig
from dloco.merger.memory import keep_freed_memory
from dloco.merger.service import MergerService, ServiceConfig
from dloco.merger.starting import initial_core
from dloco.protocol import shards as sharding

# between probes of a bus whose subscriptions may not have arrived yet
PROBE_S = 0.02
# a bus silent this long after its last probe holds nothing stale
QUIET_MS = 300


@dataclasses.dataclass(frozen=True)
class MergerState:
    """What the benchmark's merger keeps its state in: its outer optimizer (momentum dtype) and
    its snapshots (the default profile's downlink; the served value's dtype)."""

    outer: OuterConfig = OuterConfig()
    snapshots: SnapshotConfig = SnapshotConfig("fp32", "int4")


def merger_process(
    conn,
    shapes: dict,
    fragments: int,
    delta_endpoint: str,
    snapshot_endpoint: str,
    control_endpoint: str,
    run_dir: str,
    state: MergerState,
    shard: tuple[int, int] = (0, 1),
) -> None:
    """Entry point of the spawned process, as merger shard `shard` (I, N); any failure goes back
    up the pipe as ("error", traceback)."""
    sys.stdout = open(os.devnull, "w")
    try:
        _serve(
            conn,
            shapes,
            fragments,
            ServiceConfig(
                run_dir=Path(run_dir),
                delta_endpoint=delta_endpoint,
                snapshot_endpoint=snapshot_endpoint,
                control_endpoint=control_endpoint,
                snapshots=state.snapshots,
                sender=sharding.names("merger", shard[1])[shard[0]],
                shard=shard[0],
                shards=shard[1],
                # no checkpoint
                checkpoint_every=1 << 30,
            ),
            state.outer,
        )
    # reported to the conductor, which raises it there
    except BaseException:
        conn.send(("error", traceback.format_exc()))


def _serve(conn, shapes: dict, fragments: int, config: ServiceConfig, outer: OuterConfig) -> None:
    # as `dloco merger` does
    keep_freed_memory()
    rises = PeakRises()
    parts = protocol.partition(shapes, fragments)
    mine = [
        path
        for fragment in sharding.owned(config.shard, config.shards, fragments)
        for path in parts[fragment]
    ]
    params = init_params({path: shapes[path] for path in mine}, seed=config.shard)
    rises.after("model")
    # one island: fold each delta
    factory = initial_core(
        MergerConfig(outer=outer, round=RoundConfig(quorum=1, grace_cap_s=0.0)),
        params,
        fragments,
        shapes,
    )
    service = MergerService(config, factory)
    # the core holds the model now
    del params, factory
    rises.after("genesis")
    service.warming.join()
    rises.after("warm_up")
    conn.send(("ready",))
    try:
        while True:
            command, *args = conn.recv()
            if command == "listen":
                _listen(conn, service)
            elif command == "call":
                _call(conn, service)
            elif command == "join":
                seq = service.stamp.seq
                for fragment in service.owned:
                    service.publisher.publish(fragment)
                rises.after("join")
                conn.send(("published", service.stamp.seq - seq))
            elif command == "round":
                conn.send(("round", *_round(service, rises, *args)))
            elif command == "finish":
                conn.send(
                    (
                        "finished",
                        {**rises.figures(), "held": _held(service)},
                        dict(service.counters),
                    )
                )
                return
    finally:
        service.pipeline.close()
        service.wal.close()
        service.context.destroy(linger=0)


def _held(service: MergerService) -> dict[str, int]:
    """Bytes the merger's state holds (each array once): what its resident set would be with no
    allocator slack, no runtime and nothing in flight."""
    state = {
        id(leaf): leaf.nbytes
        for fragment in service.core.states
        for leaf in jax.tree_util.tree_leaves(fragment.opt_state)
    }
    params = {
        id(value): value.nbytes
        for fragment in service.core.states
        for value in fragment.params.values()
    }
    other = sum(
        array.nbytes
        for array in jax.live_arrays()
        if id(array) not in state and id(array) not in params
    )
    return {
        "parameters": sum(params.values()),
        "optimizer": sum(state.values()),
        "other_jax_arrays": other,
        "served": sum(
            value.nbytes
            for held in service.publisher.served.values()
            for value in held.tensors.values()
        ),
    }


def _listen(conn, service: MergerService) -> None:
    if not service.delta_sub.poll(60_000):
        raise TimeoutError("no probe arrived on the delta bus within 60 s")
    conn.send(("heard",))
    while service.delta_sub.poll(QUIET_MS):
        service.receiver.on_delta_frames(
            [frame.buffer for frame in service.delta_sub.recv_multipart(copy=False)]
        )
    conn.send(("quiet",))


def _call(conn, service: MergerService) -> None:
    probe = protocol.encode(
        protocol.Ack(
            sender=service.config.sender,
            epoch=service.stamp.epoch,
            seq=service.stamp.seq,
            cursors=(),
            results=(),
        )
    )
    deadline = time.monotonic() + 60
    while not conn.poll(PROBE_S):
        if time.monotonic() > deadline:
            raise TimeoutError("the island heard no probe on the snapshot bus within 60 s")
        service.snapshot_pub.send_multipart(probe)
    conn.recv()
    conn.send(("stopped",))


def _round(
    service: MergerService, rises: PeakRises, expected: int
) -> tuple[float, float, int, int]:
    """Ingest `expected` chunks and fold; announce.  Returns (ingest s, announce s, messages
    published, folds).  Ingest runs from the first chunk taken off the socket to the last fold
    computed and durable; the announcement is the snapshot diffs and the acks."""

    folds = []

    def handle(frames: list) -> None:
        service.receiver.on_delta_frames(frames)
        # as the service's loop: folds computed by now are installed (their fragment's previous
        # state let go) before more start; their announcement is timed apart, below
        folds.extend(service.pipeline.finished())
        # the fold computes on while the next chunks are taken
        service.pipeline.dispatch(time.monotonic())

    _, receive_s = receive_timed(service.delta_sub, expected, handle)
    began = time.perf_counter()
    while service.pipeline.in_flight or any(service.core.pending):
        folds.extend(service.pipeline.finished(wait=True))
        # nothing more is coming: every pending delta folds now
        service.pipeline.dispatch(math.inf)
    ingest_s = receive_s + time.perf_counter() - began
    rises.after("ingest")
    seq, began = service.stamp.seq, time.perf_counter()
    service.announcer.announce(folds)
    announce_s = time.perf_counter() - began
    rises.after("announce")
    return ingest_s, announce_s, service.stamp.seq - seq, len(folds)
