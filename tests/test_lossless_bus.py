"""Lossless delivery over pub/sub with a real island sender: overflow, slow joiner, broker kill -9.

The receiver here is the merger's stream logic in miniature (SUB + ROUTER + `GapTracker`, cursors
published on a PUB), reading slowly through tiny high-water marks; the sender is the production
`NetworkLink`.  Every test requires all 200 chunks exactly once, in order."""

from __future__ import annotations

import signal
import subprocess
import threading
import time

import numpy as np
import pytest
import zmq

from dloco import protocol
from dloco.bus.sequencing import GapTracker
from dloco.cluster.ports import free_ports
from dloco.island.config import SyncConfig
from dloco.island.network import NetworkLink
from dloco.island.shaper import LinkShaper
from tests.test_broker import BrokerProcess

CHUNKS = 200


class SlowReceiver:
    """Binds its ROUTER and cursor PUB; SUB binds too, or connects to a broker."""

    def __init__(
        self,
        sub_endpoint: str,
        control_port: int,
        cursor_port: int,
        read_delay_s: float = 0.002,
        answer_probes: bool = True,
    ) -> None:
        self.answer_probes = answer_probes
        self.context = zmq.Context()
        self.sub = self.context.socket(zmq.SUB)
        self.sub.setsockopt(zmq.RCVHWM, 2)
        self.sub.setsockopt(zmq.RCVBUF, 4096)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        (self.sub.bind if sub_endpoint.startswith("@") else self.sub.connect)(
            sub_endpoint.removeprefix("@")
        )
        self.router = self.context.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind(f"tcp://127.0.0.1:{control_port}")
        self.cursor_pub = self.context.socket(zmq.PUB)
        self.cursor_pub.setsockopt(zmq.LINGER, 0)
        self.cursor_pub.bind(f"tcp://127.0.0.1:{cursor_port}")
        self.tracker, self.delivered, self.read_delay_s, self.probed = (
            GapTracker(),
            [],
            read_delay_s,
            [],
        )
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def on_frames(self, frames) -> None:
        message = protocol.decode(frames)
        if isinstance(message, protocol.Heartbeat):
            self.tracker.heartbeat(message.sender, message.epoch, message.seq)
        elif isinstance(message, protocol.DeltaChunk):
            self.delivered += [
                m.seq
                for m in self.tracker.receive(message.sender, message.epoch, message.seq, message)
            ]

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sub, zmq.POLLIN)
        poller.register(self.router, zmq.POLLIN)
        next_round = 0.0
        while not self.stop.is_set():
            events = dict(poller.poll(20))
            if self.sub in events:
                self.on_frames(self.sub.recv_multipart())
                # a slow reader
                time.sleep(self.read_delay_s)
            if self.router in events:
                identity, *body = self.router.recv_multipart()
                message = protocol.decode(body)
                stream = self.tracker.streams.get(message.sender)
                if (
                    message.kind == protocol.Kind.DELTA
                    and stream is not None
                    and message.seq <= stream.delivered
                ):
                    self.probed.append(message.delta_id)
                    if not self.answer_probes:
                        # a repeat of a delivered delta: say its result (the merger's re-ack)
                        continue
                    result = protocol.DeltaResult(
                        message.sender,
                        message.epoch,
                        message.delta_id,
                        message.fragment,
                        "folded",
                        1,
                        "",
                    )
                    self.cursor_pub.send_multipart(
                        protocol.encode(
                            protocol.Ack(
                                sender="merger", epoch=1, seq=1, cursors=(), results=(result,)
                            )
                        )
                    )
                elif message.kind == protocol.Kind.DELTA:
                    self.on_frames(body)
            if time.monotonic() >= next_round:
                next_round = time.monotonic() + 0.2
                self._ask_and_tell()

    def _ask_and_tell(self) -> None:
        """One round: ask each island for the gaps in its stream and publish its cursor."""
        for island, stream in self.tracker.streams.items():
            if ranges := self.tracker.missing(island):
                request = protocol.ResendRequest(
                    sender="merger",
                    epoch=1,
                    seq=0,
                    target=island,
                    target_epoch=stream.epoch,
                    ranges=tuple(ranges),
                )
                self.router.send_multipart([island.encode(), *protocol.encode(request)])
            cursor = protocol.Cursor(island, stream.epoch, stream.delivered)
            self.cursor_pub.send_multipart(
                protocol.encode(
                    protocol.Ack(sender="merger", epoch=1, seq=1, cursors=(cursor,), results=())
                )
            )

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)
        self.context.destroy(linger=0)


def sender(delta_endpoint: str, control_port: int, cursor_port: int) -> NetworkLink:
    sync = SyncConfig(fragments=1, interval=1, codec="fp32", chunk_bytes=1024, send_hwm=4)
    return NetworkLink(
        "island-a",
        "m",
        sync,
        delta_endpoint,
        f"tcp://127.0.0.1:{cursor_port}",
        f"tcp://127.0.0.1:{control_port}",
    )


def wait_for(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


# fp32, 1 KiB chunks: 200 chunks
DELTA = {"w": np.arange(CHUNKS * 256, dtype=np.float32)}


@pytest.mark.timeout(120)
def test_overflowing_a_slow_subscriber_loses_nothing():
    data_port, control_port, cursor_port = free_ports(3)
    receiver = SlowReceiver(f"@tcp://127.0.0.1:{data_port}", control_port, cursor_port)
    link = sender(f"tcp://127.0.0.1:{data_port}", control_port, cursor_port)
    try:
        time.sleep(0.5)
        link.publish(0, 0, DELTA, 1, 1)
        wait_for(
            lambda: len(receiver.delivered) >= CHUNKS,
            60,
            f"delivered {len(receiver.delivered)} of {CHUNKS}",
        )
        time.sleep(0.5)
        # each once, in order
        assert receiver.delivered == list(range(1, CHUNKS + 1))
        # the loss was real and the resend path filled it
        assert link.uplink.resent > 0
        wait_for(
            lambda: len(link.uplink.kept) == 0, 10, "retransmit buffer not released by cursors"
        )
    finally:
        link.close()
        receiver.close()


@pytest.mark.timeout(120)
def test_messages_sent_before_the_subscriber_exists_are_recovered():
    data_port, control_port, cursor_port = free_ports(3)
    link = sender(f"tcp://127.0.0.1:{data_port}", control_port, cursor_port)
    try:
        link.publish(0, 0, DELTA, 1, 1)
        # all 200 went out to nobody
        wait_for(lambda: link.uplink.seq == CHUNKS, 30, "sender did not send")
        receiver = SlowReceiver(
            f"@tcp://127.0.0.1:{data_port}", control_port, cursor_port, read_delay_s=0
        )
        try:
            wait_for(
                lambda: len(receiver.delivered) >= CHUNKS,
                60,
                f"delivered {len(receiver.delivered)} of {CHUNKS}",
            )
            assert (
                receiver.delivered == list(range(1, CHUNKS + 1))
                and link.uplink.resent >= CHUNKS - 4
            )
        finally:
            receiver.close()
    finally:
        link.close()


@pytest.mark.timeout(180)
def test_kill_9_of_the_broker_mid_stream_loses_nothing(tmp_path):
    broker = BrokerProcess(tmp_path, "--insecure")
    control_port, cursor_port = free_ports(2)
    receiver = SlowReceiver(broker.endpoint(1), control_port, cursor_port, read_delay_s=0.01)
    link = sender(broker.endpoint(0), control_port, cursor_port)
    restarted = None
    try:
        time.sleep(1.0)
        link.publish(0, 0, DELTA, 1, 1)
        wait_for(lambda: len(receiver.delivered) >= 20, 30, "nothing got through the broker")
        broker.process.send_signal(signal.SIGKILL)
        broker.process.wait(timeout=10)
        # a second delta while the broker is down: 200 more chunks
        link.publish(0, 0, DELTA, 1, 1)
        time.sleep(0.5)
        restarted = subprocess.Popen(
            broker.process.args,
            stdout=open(tmp_path / "broker-2.log", "wb"),
            stderr=subprocess.STDOUT,
        )
        wait_for(
            lambda: len(receiver.delivered) >= 2 * CHUNKS,
            90,
            f"delivered {len(receiver.delivered)} of {2 * CHUNKS}",
        )
        time.sleep(0.5)
        # before, during and after: each once, in order
        assert receiver.delivered == list(range(1, 2 * CHUNKS + 1))
        # what the dead broker swallowed came back point to point
        assert link.uplink.resent > 0
    finally:
        link.close()
        receiver.close()
        if broker.process.poll() is None:
            broker.process.kill()
        code = None
        if restarted is not None:
            restarted.send_signal(signal.SIGTERM)
            code = restarted.wait(timeout=20)
    assert code == 0


def test_a_full_retransmit_buffer_stops_the_publisher_not_the_loop():
    data_port, control_port, cursor_port = free_ports(3)
    sync = SyncConfig(
        fragments=1, interval=1, codec="fp32", chunk_bytes=1024, retransmit_messages=10
    )
    link = NetworkLink(
        "island-a",
        "m",
        sync,
        f"tcp://127.0.0.1:{data_port}",
        f"tcp://127.0.0.1:{cursor_port}",
        f"tcp://127.0.0.1:{control_port}",
    )
    # nobody acknowledges anything
    try:
        # a blocking publish would never return (nobody acknowledges): five of them return
        publishing = threading.Thread(
            target=lambda: [link.publish(0, 0, DELTA, 1, 1) for _ in range(5)], daemon=True
        )
        publishing.start()
        publishing.join(timeout=60)
        assert not publishing.is_alive(), "publish blocked on a bus that acknowledges nothing"
        wait_for(lambda: link.uplink.backpressure_waits > 0, 10, "publisher never waited")
        # stopped at the bound; nothing discarded
        assert link.uplink.seq == 10 and len(link.uplink.kept) == 10
        # later deltas wait in the outbox, summed
        assert link.summed >= 3
    finally:
        link.close()


def test_a_lost_result_is_asked_for_again_and_the_drain_completes():
    """The receiver acknowledges the stream (cursors) but its results never come (as when the ack
    was published while the broker was down): the island re-sends the delta's first chunk point to
    point, the receiver answers with the result, and the drain at the end completes."""
    data_port, control_port, cursor_port = free_ports(3)
    receiver = SlowReceiver(
        f"@tcp://127.0.0.1:{data_port}", control_port, cursor_port, read_delay_s=0
    )
    link = sender(f"tcp://127.0.0.1:{data_port}", control_port, cursor_port)
    try:
        time.sleep(0.5)
        link.publish(0, 0, DELTA, 1, 1)
        wait_for(lambda: len(receiver.delivered) == CHUNKS, 30, "the delta did not get through")
        # admitted (cursor) but unsettled: no result yet
        assert not link.drain(1.0)
        assert link.drain(15.0), (link.results, link.uplink.probes)
        assert receiver.probed == [1] and link.uplink.probes == 1 and link.results["folded"] == 1
    finally:
        link.close()
        receiver.close()


def test_the_drain_waits_for_a_delta_still_on_its_way_out():
    """A leaving island's last delta is taken off the outbox and is still crossing a slow uplink
    (200 KiB at 1 Mbit/s, ~1.7 s): the drain is not complete until it is sent and settled — else
    the link is closed under it and the island's last work is lost."""
    data_port, control_port, cursor_port = free_ports(3)
    receiver = SlowReceiver(
        f"@tcp://127.0.0.1:{data_port}", control_port, cursor_port, read_delay_s=0
    )
    sync = SyncConfig(fragments=1, interval=1, codec="fp32", chunk_bytes=1024)
    link = NetworkLink(
        "island-a",
        "m",
        sync,
        f"tcp://127.0.0.1:{data_port}",
        f"tcp://127.0.0.1:{cursor_port}",
        f"tcp://127.0.0.1:{control_port}",
        uplink=LinkShaper.from_mbps(1.0),
    )
    try:
        time.sleep(0.5)
        link.publish(0, 0, DELTA, 1, 1)
        # off the outbox, on the wire
        wait_for(lambda: link.bytes_sent > 0, 10, "the delta did not start")
        assert not link.drain(0.3) and link.deltas_sent == 0
        assert link.drain(30.0), (link.results, link.deltas_sent)
        assert (
            link.deltas_sent == 1
            and link.results["folded"] == 1
            and len(receiver.delivered) == CHUNKS
        )
    finally:
        link.close()
        receiver.close()


def test_a_result_nobody_knows_is_given_up_after_the_settle_timeout():
    """A merger that restarted after rejecting a delta has no record of it: the island stops
    asking."""
    data_port, control_port, cursor_port = free_ports(3)
    receiver = SlowReceiver(
        f"@tcp://127.0.0.1:{data_port}",
        control_port,
        cursor_port,
        read_delay_s=0,
        answer_probes=False,
    )
    sync = SyncConfig(fragments=1, interval=1, codec="fp32", chunk_bytes=1024, settle_timeout_s=4.0)
    link = NetworkLink(
        "island-a",
        "m",
        sync,
        f"tcp://127.0.0.1:{data_port}",
        f"tcp://127.0.0.1:{cursor_port}",
        f"tcp://127.0.0.1:{control_port}",
    )
    try:
        time.sleep(0.5)
        link.publish(0, 0, DELTA, 1, 1)
        assert link.drain(20.0), link.results
        # asked once (at 3 s), then gave up
        assert (
            link.results["unknown"] == 1 and link.results["folded"] == 0 and receiver.probed == [1]
        )
    finally:
        link.close()
        receiver.close()
