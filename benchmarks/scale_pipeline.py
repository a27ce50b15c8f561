"""One model size's trip of deltas through the real code, stage by stage: the conductor of
`dloco bench scale`.

This process is the island and the broker; the merger is `benchmarks/scale_merger.py`, spawned
fresh.  After the joins (subscriptions propagated on both buses, every fragment adopted from a
full snapshot) each round carries one delta of every fragment, i.e. every parameter once, through
five stages that run one after the other, so that each is timed alone:

1. island_send: "train" (untimed: a fixed change added to theta), then per fragment the
   delta (`exchange.advance`, as the loop's) and the uplink's send (`Uplink._send`:
   int4 quantization, `split_fragment`, frame encoding, PUB to the broker, retransmit buffer);
2. broker_forward: the broker's forwarding (`Broker._forward`, over its real XSUB/XPUB sockets,
   driven from this thread) until every chunk has passed;
3. merger_ingest: in the merger, `Receiver.on_delta_frames` (merger/network/receiving.py) for every
chunk (decode, gap tracking, reassembly, admission, write-ahead log) and the fold pipeline until
   every fold is computed and durable;
4. snapshot_diff: in the merger, `Announcer.announce` (merger/network/announcing.py): per fold the
int4 diff from the value served (protocol/downlink.py), its frames on the snapshot PUB, then the
acks;
5. island_adopt: the snapshot frames and acks received (the island's SUB, straight from the
   merger's PUB: the broker's forward is measured once, on the delta bus), reassembled, applied to
   the value held (`island.snapshots.Downlink.on_snapshot`: `downlink.receive`, digest checked)
   and rebased into theta (`exchange.rebase`), acks releasing the retransmit buffer.

With merger shards (`--shards N`) N merger processes each fold their share of the fragments
(f % N), as `dloco merger --shard I/N`: the island sends each shard's deltas on its own stream, and
the shards take their round in turn (the others' chunks wait in their sockets), so that the
merger's two stages are the shards' times summed over the same parameters as one merger's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import os
import tempfile
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

import zmq

from dloco.benchmarks.scale_merger import MergerState, merger_process
from dloco.benchmarks.scale_sides import WAIT_S, LightIsland, PipelineIsland, round_size
from dloco.broker.proxy import Broker, BrokerConfig, BusEndpoints
from dloco.cluster.ports import free_ports
from dloco.merger.memory import with_huge_pages
from dloco.protocol.errors import DlocoError
from dloco.protocol.shards import owned


class ScaleBenchError(DlocoError):
    """A stage did not complete: the merger failed or went silent, or a snapshot was not adopted."""


class _Silent:
    """The broker's log: its counters are read here, and it has nothing else to say in a
    benchmark."""

    def info(self, *args, **kwargs) -> None:
        pass

    warning = info


class _BrokerPump:
    """The broker's forwarding, driven from this thread (`Broker.run` owns the signal handlers
    and the clock; `_forward` is the work), so that its time is measured apart from the others'."""

    def __init__(self, broker: Broker) -> None:
        self.broker, self.poller, self.routes = broker, zmq.Poller(), {}
        for name, inbound, outbound in broker.pairs:
            for source, target, is_data in ((inbound, outbound, True), (outbound, inbound, False)):
                self.poller.register(source, zmq.POLLIN)
                self.routes[source] = (target, name, is_data)

    def pump(self, timeout_ms: int) -> None:
        for socket in dict(self.poller.poll(timeout_ms)):
            target, name, is_data = self.routes[socket]
            self.broker._forward(socket, target, name, is_data)

    def forward(self, count: int) -> float:
        """Forward until `count` more data messages have passed; the seconds it took."""
        goal, began, deadline = (
            sum(self.broker.messages.values()) + count,
            time.perf_counter(),
            time.monotonic() + WAIT_S,
        )
        while sum(self.broker.messages.values()) < goal:
            if time.monotonic() > deadline:
                raise ScaleBenchError(
                    f"the broker forwarded {goal - sum(self.broker.messages.values())} messages too"
                    f" few (dropped: {dict(self.broker.dropped)})"
                )
            self.pump(100)
        return time.perf_counter() - began


@contextlib.contextmanager
def _environment(env: dict[str, str]):
    """os.environ is `env` within (a spawned process starts with it), as it was after."""
    before = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(before)


def _broker(shapes: dict, inbound: str, outbound: str) -> Broker:
    """The delta bus's broker, its queues holding two rounds: the merger takes none of a round
    until it has all passed."""
    return Broker(
        BrokerConfig(
            (BusEndpoints("delta", inbound, outbound),),
            memory_bytes=max(BrokerConfig.memory_bytes, 2 * round_size(shapes)[0]),
        ),
        _Silent(),
    )


def measure(
    shapes: dict,
    fragments: int,
    reps: int,
    log: Callable[[str], None],
    state: MergerState = MergerState(),
    light: bool = False,
    shards: int = 1,
) -> dict:
    """Join, one warm-up round, `reps` timed rounds.  Returns each stage's seconds per round, each
    merger shard's resident memory (KiB: at the start, its peak, each phase's rise) and counters,
    and what the joins needed.  `state`: what the merger keeps its state in; `shards`: merger
    processes, each folding its share of the fragments (protocol/shards.py).
    """
    # broker in, broker out, island snapshot SUB, each shard's control
    ports = free_ports(3 + shards)
    endpoint = [f"tcp://127.0.0.1:{port}" for port in ports]
    broker = _broker(shapes, endpoint[0], endpoint[1])
    pump, context = _BrokerPump(broker), zmq.Context()
    mergers: list[_Merger] = []
    with tempfile.TemporaryDirectory(prefix="dloco-bench-scale-") as run_dir:
        try:
            for shard in range(shards):
                args = (shapes, fragments, endpoint[1], endpoint[2], f"@{endpoint[3 + shard]}")
                mergers.append(_Merger.start(args, run_dir, state, (shard, shards)))
            side = LightIsland if light else PipelineIsland
            island = side(context, shapes, fragments, endpoint[0], ports[2], shards)
            for merger in mergers:
                merger.expect("ready")
            _join(mergers, island, pump, fragments)
            samples = _rounds(mergers, island, pump, fragments, reps, log)
            finished = []
            for merger in mergers:
                merger.conn.send(("finish",))
                finished.append(merger.expect("finished"))
            for merger in mergers:
                merger.process.join(timeout=60)
        finally:
            for merger in mergers:
                if merger.process.is_alive():
                    merger.process.terminate()
                    merger.process.join(timeout=30)
            context.destroy(linger=0)
            broker.context.destroy(linger=0)
    return {
        "stages": samples,
        "shards": [
            {
                "fragments": owned(shard, shards, fragments),
                "memory_kib": memory,
                "counters": counters,
            }
            for shard, (memory, counters) in enumerate(finished)
        ],
        "full_snapshot_reassembly_bytes": island.full_snapshot_cost,
        "island_reassembly_budget": island.island_budget,
    }


def _join(
    mergers: list[_Merger], island: PipelineIsland, pump: _BrokerPump, fragments: int
) -> None:
    """Both buses joined with every shard, then every fragment adopted from its shard's full
    snapshot."""
    for shard, merger in enumerate(mergers):
        _join_buses(merger, shard, island, pump)
    published = 0
    for merger in mergers:
        merger.conn.send(("join",))
        published += merger.expect("published")[0]
    island.receive(published)
    island.joined = True
    if len(island.downlink.served) != fragments:
        raise ScaleBenchError(
            f"the island joined {len(island.downlink.served)} of {fragments} fragments: "
            f"{dict(island.downlink.results)}"
        )


def _rounds(
    mergers: list[_Merger],
    island: PipelineIsland,
    pump: _BrokerPump,
    fragments: int,
    reps: int,
    log: Callable[[str], None],
) -> dict[str, list[float]]:
    """One warm-up round, then `reps` timed ones: each stage's seconds per timed round."""
    samples: dict[str, list[float]] = {}
    for number in range(reps + 1):
        log(f"round {number + 1}/{reps + 1}{' (warm-up)' if number == 0 else ''} ...")
        stage = _round(mergers, island, pump)
        if island.downlink.results["diff"] != fragments * (number + 1):
            raise ScaleBenchError(
                f"round {number + 1}: the island adopted {island.downlink.results['diff']}"
                f" diffs, expected {fragments * (number + 1)}:"
                f" {dict(island.downlink.results)}"
            )
        for name, seconds in stage.items():
            samples.setdefault(name, []).extend([seconds] if number else [])
    return samples


def _round(mergers: list[_Merger], island: PipelineIsland, pump: _BrokerPump) -> dict[str, float]:
    """One round; with shards, each takes its chunks and announces in turn (the others' wait in
    their sockets), so that a merger stage's time is the shards' summed, over the same
    parameters."""
    send_s, chunks = island.send_round()
    forward_s = pump.forward(sum(chunks))
    ingest_s = diff_s = 0.0
    published = folds = 0
    for merger, expected in zip(mergers, chunks):
        merger.conn.send(("round", expected))
        ingest, diff, messages, folded = merger.expect("round")
        ingest_s, diff_s, published, folds = (
            ingest_s + ingest,
            diff_s + diff,
            published + messages,
            folds + folded,
        )
    if folds != len(island.parts):
        raise ScaleBenchError(
            f"the merger folded {folds} times, expected one fold per fragment ({len(island.parts)})"
        )
    adopt_s = island.receive(published)
    return {
        "island_send": send_s,
        "broker_forward": forward_s,
        "merger_ingest": ingest_s,
        "snapshot_diff": diff_s,
        "island_adopt": adopt_s,
    }


def _join_buses(merger: _Merger, shard: int, island: PipelineIsland, pump: _BrokerPump) -> None:
    """Probe both buses until a message gets through, then let them fall quiet (ZeroMQ's slow
    joiner: a PUB drops what it sends before a subscription has reached it)."""
    merger.conn.send(("listen",))
    deadline = time.monotonic() + WAIT_S
    while not merger.conn.poll(0):
        if time.monotonic() > deadline or not merger.process.is_alive():
            raise ScaleBenchError("the merger heard no probe on the delta bus")
        island.probe(shard)
        pump.pump(20)
    merger.expect("heard")
    while not merger.conn.poll(0):
        pump.pump(50)
    merger.expect("quiet")
    merger.conn.send(("call",))
    if not island.sub.poll(int(WAIT_S * 1000)):
        raise ScaleBenchError("the island heard no probe on the snapshot bus")
    merger.conn.send(("heard",))
    merger.expect("stopped")
    island.drain()


@dataclasses.dataclass(frozen=True)
class _Merger:
    """A merger process (one shard) and its end of the command pipe."""

    conn: Connection
    process: BaseProcess

    @classmethod
    def start(cls, args: tuple, run_dir: str, state: MergerState, shard: tuple[int, int]):
        """Shard `shard` (I, N) of the benchmark's merger in a new process; `args`: (shapes,
        fragments, delta, snapshot and control endpoints)."""
        conn, child_conn = multiprocessing.get_context("spawn").Pipe()
        process = multiprocessing.get_context("spawn").Process(
            target=merger_process,
            name=f"bench-scale-merger-{shard[0]}",
            daemon=True,
            args=(child_conn, *args, os.path.join(run_dir, f"shard-{shard[0]}"), state, shard),
        )
        # as `dloco up` starts a merger: its mapped blocks in huge pages (merger/memory.py)
        with _environment(with_huge_pages(dict(os.environ))):
            process.start()
        return cls(conn, process)

    def expect(self, what: str) -> tuple:
        """The merger's next answer, which must be `what`; its fields."""
        deadline = time.monotonic() + WAIT_S
        while not self.conn.poll(1.0):
            if not self.process.is_alive():
                raise ScaleBenchError(
                    f"{self.process.name} exited (code {self.process.exitcode}) before answering"
                    f" {what!r}"
                )
            if time.monotonic() > deadline:
                raise ScaleBenchError(
                    f"{self.process.name} did not answer {what!r} within {WAIT_S:.0f} s"
                )
        kind, *fields = self.conn.recv()
        if kind == "error":
            raise ScaleBenchError(f"{self.process.name} failed:\n{fields[0]}")
        if kind != what:
            raise ScaleBenchError(f"{self.process.name} answered {kind!r}, expected {what!r}")
        return tuple(fields)
