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
3. merger_ingest: in the merger, `Receiver.on_delta_frames` (merger/receiving.py) for every chunk
   (decode, gap tracking, reassembly, admission, write-ahead log) and the fold pipeline until
   every fold is computed and durable;
4. snapshot_diff: in the merger, `Announcer.announce` (merger/announcing.py): per fold the int4 diff
   from the value served (protocol/downlink.py), its frames on the snapshot PUB, then the acks;
5. island_adopt: the snapshot frames and acks received (the island's SUB, straight from the
   merger's PUB: the broker's forward is measured once, on the delta bus), reassembled, applied to
   the value held (`island.snapshots.Downlink.on_snapshot`: `downlink.receive`, digest checked)
   and rebased into theta (`exchange.rebase`), acks releasing the retransmit buffer.
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing
import os
import tempfile
import threading
import time
from collections.abc import Callable

import numpy as np
import zmq

from dloco import protocol
from dloco.benchmarks.scale_merger import QUIET_MS, MergerState, merger_process
from dloco.benchmarks.scale_model import init_params
from dloco.benchmarks.timing import receive_timed
from dloco.broker.proxy import Broker, BrokerConfig, BusEndpoints
from dloco.bus.security import Security
from dloco.bus.sockets import open_socket
from dloco.cluster.ports import free_ports
from dloco.island import exchange
from dloco.island.config import SyncConfig
from dloco.island.loop import FragmentProgress
from dloco.island.outbox import PendingDelta
from dloco.island.shaper import LinkShaper
from dloco.island.snapshots import Downlink, reassembly_budget, snapshot_reassembler
from dloco.island.uplink import Uplink
from dloco.merger.memory import with_huge_pages
from dloco.protocol.errors import DlocoError
from dloco.protocol.reassembly import CHUNK_OVERHEAD_BYTES, SLICE_OVERHEAD_BYTES

# longest wait for the merger at any step (genesis and compiling at 350 M take a minute or two)
WAIT_S = 900.0
NAME = "island-0"
# what a delta says it carries (H = 50 steps of the default batch)
STEPS, TOKENS = 50, 50 * 16 * 128


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


class _Island:
    """The island's exchange state and code path, with a theta standing in for the trainer's."""

    def __init__(
        self,
        context: zmq.Context,
        shapes: dict,
        fragments: int,
        delta_endpoint: str,
        snapshot_port: int,
    ) -> None:
        self.theta = init_params(shapes, seed=1)
        self.change = {
            shape: init_params({"x": shape}, seed=2)["x"] * np.float32(0.05)
            for shape in set(shapes.values())
        }
        self.parts = protocol.partition(shapes, fragments)
        self.model, epoch = protocol.model_fingerprint(self.theta), time.time_ns()
        self.progress = [
            FragmentProgress(exchange.Anchor({p: self.theta[p] for p in paths}))
            for paths in self.parts
        ]
        security = Security(None, NAME)
        self.sync = SyncConfig(fragments=fragments)
        self.pub = open_socket(
            context, zmq.PUB, delta_endpoint, security, "broker", send_hwm=self.sync.send_hwm
        )
        # unbounded: a round's snapshots wait here while the merger works, and nothing may drop
        self.sub = open_socket(
            context, zmq.SUB, f"@tcp://127.0.0.1:{snapshot_port}", security, receive_hwm=0
        )
        for topic in (b"snapshot/", b"ack"):
            self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        self.uplink = Uplink(
            NAME, self.model, epoch, self.sync, LinkShaper(None), threading.Event()
        )
        self.downlink = Downlink(NAME, epoch)
        # The join gets what it needs; the result says whether `dloco island`'s own budget holds a
        # fragment's fp32 snapshot (it grows with the model: island/snapshots.reassembly_budget).
        payload = max(4 * sum(int(np.prod(shapes[p])) for p in paths) for paths in self.parts)
        # at least one slice each
        chunks = -(-payload // self.sync.chunk_bytes)
        self.full_snapshot_cost = payload + chunks * (CHUNK_OVERHEAD_BYTES + SLICE_OVERHEAD_BYTES)
        # `dloco island`'s
        self.island_budget = reassembly_budget(
            4 * sum(int(np.prod(shape)) for shape in shapes.values())
        )
        # streamed, as `dloco island`
        self.reassembler = snapshot_reassembler(2 * self.full_snapshot_cost)
        self.deltas, self.joined = 0, False

    def probe(self) -> None:
        self.pub.send_multipart(
            protocol.encode(
                protocol.Heartbeat(sender=NAME, epoch=self.uplink.epoch, seq=self.uplink.seq)
            )
        )

    def send_round(self) -> tuple[float, int]:
        """Train (untimed), then send a delta of every fragment; returns (seconds, chunks sent)."""
        seconds, seq = 0.0, self.uplink.seq
        for fragment, paths in enumerate(self.parts):
            for path in paths:
                self.theta[path] += self.change[self.theta[path].shape]
            began = time.perf_counter()
            progress = self.progress[fragment]
            # as the loop sends (IslandLoop._send)
            delta, anchor = exchange.advance(progress.anchor, self.theta)
            self.uplink.publish(PendingDelta(fragment, progress.version, delta, STEPS, TOKENS))
            self.deltas += 1
            self.uplink._send(self.pub, self.deltas, self.uplink.outbox.take())
            self.progress[fragment] = FragmentProgress(anchor, progress.version)
            seconds += time.perf_counter() - began
        return seconds, self.uplink.seq - seq

    def receive(self, expected: int) -> float:
        """Take `expected` messages from the snapshot bus; seconds from the first to the last
        adopted."""
        return receive_timed(self.sub, expected, self.on_frames, timeout_s=WAIT_S)[1]

    def on_frames(self, frames: list) -> None:
        message = protocol.decode(frames)
        if isinstance(message, protocol.Ack):
            self.uplink.on_ack(message)
            return
        assembled = self.reassembler.add(message, time.monotonic())
        if assembled is not None:
            self.downlink.on_snapshot(assembled.header, assembled.tensors, 0.0)
        for fragment, version, tensors in self.downlink.ready(math.inf):
            # the join takes the value (IslandLoop.join); later ones rebase (IslandLoop._adopt)
            progress = self.progress[fragment]
            adopted = (
                exchange.rebase(self.theta, progress.anchor.values(), tensors)
                if self.joined
                else exchange.adopt(self.theta, tensors, 0.0)
            )
            self.theta.update(adopted)
            self.progress[fragment] = FragmentProgress(exchange.Anchor.adopted(tensors), version)

    def drain(self) -> None:
        while self.sub.poll(QUIET_MS):
            self.sub.recv_multipart()


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


def measure(
    shapes: dict,
    fragments: int,
    reps: int,
    log: Callable[[str], None],
    state: MergerState = MergerState(),
) -> dict:
    """Join, one warm-up round, `reps` timed rounds.  Returns each stage's seconds per round, the
    merger's resident memory (KiB: at the start, its peak, each phase's rise) and what the joins
    needed.  `state`: what the merger keeps its state in.
    """
    spawn = multiprocessing.get_context("spawn")
    # broker in, broker out, island snapshot SUB, merger control
    ports = free_ports(4)
    endpoint = [f"tcp://127.0.0.1:{port}" for port in ports]
    broker = Broker(BrokerConfig((BusEndpoints("delta", endpoint[0], endpoint[1]),)), _Silent())
    pump, context = _BrokerPump(broker), zmq.Context()
    conn, child_conn = spawn.Pipe()
    with tempfile.TemporaryDirectory(prefix="dloco-bench-scale-") as run_dir:
        merger = spawn.Process(
            target=merger_process,
            name="bench-scale-merger",
            daemon=True,
            args=(
                child_conn,
                shapes,
                fragments,
                endpoint[1],
                endpoint[2],
                f"@{endpoint[3]}",
                run_dir,
                state,
            ),
        )
        # as `dloco up` starts a merger: its mapped blocks in huge pages (merger/memory.py)
        with _environment(with_huge_pages(dict(os.environ))):
            merger.start()
        try:
            island = _Island(context, shapes, fragments, endpoint[0], ports[2])
            _expect(conn, merger, "ready")
            _join(conn, merger, island, pump, fragments)
            samples = _rounds(conn, merger, island, pump, fragments, reps, log)
            conn.send(("finish",))
            memory, counters = _expect(conn, merger, "finished")
            merger.join(timeout=60)
        finally:
            if merger.is_alive():
                merger.terminate()
                merger.join(timeout=30)
            context.destroy(linger=0)
            broker.context.destroy(linger=0)
    return {
        "stages": samples,
        "merger_memory_kib": memory,
        "merger_counters": counters,
        "full_snapshot_reassembly_bytes": island.full_snapshot_cost,
        "island_reassembly_budget": island.island_budget,
    }


def _join(conn, merger, island: _Island, pump: _BrokerPump, fragments: int) -> None:
    """Both buses joined, then every fragment adopted from the merger's full snapshot."""
    _join_buses(conn, merger, island, pump)
    conn.send(("join",))
    (published,) = _expect(conn, merger, "published")
    island.receive(published)
    island.joined = True
    if len(island.downlink.served) != fragments:
        raise ScaleBenchError(
            f"the island joined {len(island.downlink.served)} of {fragments} fragments: "
            f"{dict(island.downlink.results)}"
        )


def _rounds(
    conn,
    merger,
    island: _Island,
    pump: _BrokerPump,
    fragments: int,
    reps: int,
    log: Callable[[str], None],
) -> dict[str, list[float]]:
    """One warm-up round, then `reps` timed ones: each stage's seconds per timed round."""
    samples: dict[str, list[float]] = {}
    for number in range(reps + 1):
        log(f"round {number + 1}/{reps + 1}{' (warm-up)' if number == 0 else ''} ...")
        stage = _round(conn, merger, island, pump)
        if island.downlink.results["diff"] != fragments * (number + 1):
            raise ScaleBenchError(
                f"round {number + 1}: the island adopted {island.downlink.results['diff']}"
                f" diffs, expected {fragments * (number + 1)}:"
                f" {dict(island.downlink.results)}"
            )
        for name, seconds in stage.items():
            samples.setdefault(name, []).extend([seconds] if number else [])
    return samples


def _round(conn, merger, island: _Island, pump: _BrokerPump) -> dict[str, float]:
    send_s, chunks = island.send_round()
    forward_s = pump.forward(chunks)
    conn.send(("round", chunks))
    ingest_s, diff_s, published, folds = _expect(conn, merger, "round")
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


def _join_buses(conn, merger, island: _Island, pump: _BrokerPump) -> None:
    """Probe both buses until a message gets through, then let them fall quiet (ZeroMQ's slow
    joiner: a PUB drops what it sends before a subscription has reached it)."""
    conn.send(("listen",))
    deadline = time.monotonic() + WAIT_S
    while not conn.poll(0):
        if time.monotonic() > deadline or not merger.is_alive():
            raise ScaleBenchError("the merger heard no probe on the delta bus")
        island.probe()
        pump.pump(20)
    _expect(conn, merger, "heard")
    while not conn.poll(0):
        pump.pump(50)
    _expect(conn, merger, "quiet")
    conn.send(("call",))
    if not island.sub.poll(int(WAIT_S * 1000)):
        raise ScaleBenchError("the island heard no probe on the snapshot bus")
    conn.send(("heard",))
    _expect(conn, merger, "stopped")
    island.drain()


def _expect(conn, merger, what: str) -> tuple:
    """The merger's next answer, which must be `what`; its fields."""
    deadline = time.monotonic() + WAIT_S
    while not conn.poll(1.0):
        if not merger.is_alive():
            raise ScaleBenchError(
                f"the merger exited (code {merger.exitcode}) before answering {what!r}"
            )
        if time.monotonic() > deadline:
            raise ScaleBenchError(f"the merger did not answer {what!r} within {WAIT_S:.0f} s")
    kind, *fields = conn.recv()
    if kind == "error":
        raise ScaleBenchError(f"the merger failed:\n{fields[0]}")
    if kind != what:
        raise ScaleBenchError(f"the merger answered {kind!r}, expected {what!r}")
    return tuple(fields)
