"""The island's side of `dloco bench scale`'s pipeline, in the conductor's process: the island
whose code path is measured, and a light one for sizes where a whole island does not fit beside the
merger.

- `PipelineIsland`: theta standing in for the trainer's, the anchors, the uplink and the downlink,
  as `dloco island` holds them (with merger shards: a stream per shard, acks credited to the shard
  that sent them).  A round "trains" (a fixed change added to theta, untimed), sends
  each fragment's delta (`exchange.advance`, `Uplink._send`) and adopts each diff
  (`Downlink.on_snapshot`, then `exchange.rebase` into theta).
- `LightIsland` (`--light-island`): no theta and no anchors.  A round sends the fixed change itself
  as every fragment's delta (`Uplink._send`: the same quantization, chunking and frames) and checks
  each diff into the value held (`Downlink.on_snapshot`: the same reassembly, decoding and digest),
  without rebasing.  What the merger does is the same; the island's two stages leave out
  `exchange.advance` and `exchange.rebase`, and the conductor holds the served value, not a model.
"""

from __future__ import annotations

import math
import threading
import time

import numpy as np
import zmq

from dloco import protocol
from dloco.benchmarks.scale_merger import QUIET_MS
from dloco.benchmarks.scale_model import init_params
from dloco.benchmarks.timing import receive_timed
from dloco.bus.security import Security
from dloco.bus.sockets import open_socket
from dloco.island import exchange
from dloco.island.config import SyncConfig
from dloco.island.loop import FragmentProgress
from dloco.island.outbox import PendingDelta
from dloco.island.shaper import LinkShaper
from dloco.island.snapshots import Downlink, reassembly_budget, snapshot_reassembler
from dloco.island.uplink import Uplink
from dloco.protocol import shards as sharding
from dloco.protocol.chunking import DEFAULT_MAX_CHUNK_BYTES
from dloco.protocol.reassembly import CHUNK_OVERHEAD_BYTES, SLICE_OVERHEAD_BYTES

# longest wait for the merger at any step (genesis and compiling at 1 B take minutes)
WAIT_S = 900.0
NAME = "island-0"
# what a delta says it carries (H = 50 steps of the default batch)
STEPS, TOKENS = 50, 50 * 16 * 128
# an int4 delta's bytes per value: a nibble and a float32 scale per block of 256, with room for
# the frames' headers
ROUND_BYTES_PER_VALUE = 0.5 + 4 / 256 + 0.01


def round_size(shapes: dict) -> tuple[int, int]:
    """(bytes, chunks) of a round's int4 deltas, every fragment once: what the benchmark's queues
    must hold while one thread sends a round, then forwards it, then lets the merger take it."""
    nbytes = int(ROUND_BYTES_PER_VALUE * sum(int(np.prod(s)) for s in shapes.values()))
    return nbytes, nbytes // DEFAULT_MAX_CHUNK_BYTES + len(shapes)


def round_sync(shapes: dict, fragments: int, error_feedback: bool = False) -> SyncConfig:
    """The island's exchange settings with a retransmit buffer and a PUB queue that hold two
    rounds: the benchmark's one thread sends a round, then forwards it, and only then does a merger
    acknowledge any (none does, for the island-state process).  A real island's uplink waits for
    the acks of a full buffer, and its PUB is drained by the broker as it sends; here the wait
    would never end and the PUB would drop chunks."""
    round_bytes, round_chunks = round_size(shapes)
    return SyncConfig(
        fragments=fragments,
        error_feedback=error_feedback,
        retransmit_bytes=max(SyncConfig.retransmit_bytes, 2 * round_bytes),
        retransmit_messages=max(SyncConfig.retransmit_messages, 2 * round_chunks),
        send_hwm=max(SyncConfig.send_hwm, 2 * round_chunks),
    )


class PipelineIsland:
    """The island's exchange state and code path, with a theta standing in for the trainer's."""

    def __init__(
        self,
        context: zmq.Context,
        shapes: dict,
        fragments: int,
        delta_endpoint: str,
        snapshot_port: int,
        shards: int = 1,
    ) -> None:
        self.change = {
            shape: init_params({"x": shape}, seed=2)["x"] * np.float32(0.05)
            for shape in set(shapes.values())
        }
        self.parts = protocol.partition(shapes, fragments)
        self._model(shapes)
        epoch = time.time_ns()
        self.model = protocol.model_fingerprint(
            {path: (shape, "float32") for path, shape in shapes.items()}
        )
        security = Security(None, NAME)
        self.sync = round_sync(shapes, fragments)
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
            NAME, self.model, epoch, self.sync, LinkShaper(None), threading.Event(), shards
        )
        # the benchmark's mergers are named as `dloco merger --shard I/N` names them
        self.mergers = sharding.names("merger", shards)
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

    def _model(self, shapes: dict) -> None:
        self.theta = init_params(shapes, seed=1)
        self.progress = [
            FragmentProgress(exchange.Anchor({p: self.theta[p] for p in paths}))
            for paths in self.parts
        ]

    def probe(self, shard: int = 0) -> None:
        """A heartbeat on `shard`'s stream: only that shard hears it (a probe left in another's
        socket would be taken as one of its next round's chunks)."""
        seq = self.uplink.streams[shard].seq
        beat = protocol.Heartbeat(NAME, self.uplink.epoch, seq, stream=shard)
        self.pub.send_multipart(protocol.encode(beat))

    def sent_since(self, seqs: list[int]) -> list[int]:
        """Chunks sent on each shard's stream since its seq was `seqs`."""
        return [stream.seq - seq for stream, seq in zip(self.uplink.streams, seqs)]

    def send_round(self) -> tuple[float, list[int]]:
        """Train (untimed), then send a delta of every fragment; returns (seconds, chunks sent on
        each shard's stream)."""
        seconds, seqs = 0.0, [stream.seq for stream in self.uplink.streams]
        for fragment, paths in enumerate(self.parts):
            for path in paths:
                self.theta[path] += self.change[self.theta[path].shape]
            began = time.perf_counter()
            progress = self.progress[fragment]
            # as the loop sends (IslandLoop._send)
            delta, anchor = exchange.advance(progress.anchor, self.theta)
            self._send(fragment, progress.version, delta)
            self.progress[fragment] = FragmentProgress(anchor, progress.version)
            seconds += time.perf_counter() - began
        return seconds, self.sent_since(seqs)

    def _send(self, fragment: int, version: int, delta: dict) -> None:
        self.uplink.publish(PendingDelta(fragment, version, delta, STEPS, TOKENS))
        self.deltas += 1
        self.uplink._send(self.pub, self.deltas, self.uplink.outbox.take())

    def receive(self, expected: int) -> float:
        """Take `expected` messages from the snapshot bus; seconds from the first to the last
        adopted."""
        return receive_timed(self.sub, expected, self.on_frames, timeout_s=WAIT_S)[1]

    def on_frames(self, frames: list) -> None:
        message = protocol.decode(frames)
        if isinstance(message, protocol.Ack):
            self.uplink.on_ack(message, self.mergers.index(message.sender))
            return
        assembled = self.reassembler.add(message, time.monotonic())
        if assembled is not None:
            self.downlink.on_snapshot(assembled.header, assembled.tensors, 0.0)
        for fragment, version, tensors in self.downlink.ready(math.inf):
            self._adopt(fragment, version, tensors)

    def _adopt(self, fragment: int, version: int, tensors: dict) -> None:
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


class LightIsland(PipelineIsland):
    """The same sockets, uplink and downlink without a model: the fixed change is each delta, and
    a diff is checked into the value held but not rebased into a theta."""

    def _model(self, shapes: dict) -> None:
        self.versions = [0] * len(self.parts)
        self.shapes = shapes

    def send_round(self) -> tuple[float, list[int]]:
        seconds, seqs = 0.0, [stream.seq for stream in self.uplink.streams]
        for fragment, paths in enumerate(self.parts):
            began = time.perf_counter()
            delta = {path: self.change[self.shapes[path]] for path in paths}
            self._send(fragment, self.versions[fragment], delta)
            seconds += time.perf_counter() - began
        return seconds, self.sent_since(seqs)

    def _adopt(self, fragment: int, version: int, tensors: dict) -> None:
        self.versions[fragment] = version
