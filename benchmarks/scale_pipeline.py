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
import multiprocessing
import os
import tempfile
import time
from collections.abc import Callable

import zmq

from dloco.benchmarks.scale_merger import MergerState, merger_process
from dloco.benchmarks.scale_sides import WAIT_S, LightIsland, PipelineIsland, round_size
from dloco.broker.proxy import Broker, BrokerConfig, BusEndpoints
from dloco.cluster.ports import free_ports
from dloco.merger.memory import with_huge_pages
from dloco.protocol.errors import DlocoError


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
) -> dict:
    """Join, one warm-up round, `reps` timed rounds.  Returns each stage's seconds per round, the
    merger's resident memory (KiB: at the start, its peak, each phase's rise) and what the joins
    needed.  `state`: what the merger keeps its state in.
    """
    spawn = multiprocessing.get_context("spawn")
    # broker in, broker out, island snapshot SUB, merger control
    ports = free_ports(4)
    endpoint = [f"tcp://127.0.0.1:{port}" for port in ports]
    broker = _broker(shapes, endpoint[0], endpoint[1])
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
            side = LightIsland if light else PipelineIsland
            island = side(context, shapes, fragments, endpoint[0], ports[2])
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


def _join(conn, merger, island: PipelineIsland, pump: _BrokerPump, fragments: int) -> None:
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


def _round(conn, merger, island: PipelineIsland, pump: _BrokerPump) -> dict[str, float]:
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


def _join_buses(conn, merger, island: PipelineIsland, pump: _BrokerPump) -> None:
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
