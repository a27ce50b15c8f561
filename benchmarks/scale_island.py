"""The island's exchange state at one model size, measured in a process of its own.

Spawned fresh; the training state (theta, and the change a step makes) is made first and is the
baseline.  Then the exchange state is built by the island's own code, as a run builds it:

- join: a full fp32 snapshot of every fragment, as frames, reassembled and handed to
  `Downlink.on_snapshot` (the served value, which diffs apply to); the anchors are those values
  (IslandLoop.join: no copy);
- a round of sends: per fragment a step of training, the delta into the uplink's outbox and the
  anchor moved to theta (`exchange.advance`: the progress since the global value, held in int8),
  and `Uplink._send` with error feedback on (its residuals, held in int8) onto a PUB with no
  subscriber, its chunks kept in the retransmit buffer (no merger acknowledges them here).

Reported: the resident memory at the baseline, its peak and what each phase added to the peak, and
the bytes each structure holds at the end (arrays counted once however many structures share them).
"""

from __future__ import annotations

import gc
import math
import threading
import time
import traceback

import numpy as np
import zmq

from dloco import protocol
from dloco.benchmarks.scale_model import PeakRises, init_params
from dloco.benchmarks.scale_sides import round_sync
from dloco.island import exchange
from dloco.island.outbox import PendingDelta
from dloco.island.shaper import LinkShaper
from dloco.island.snapshots import Downlink
from dloco.island.uplink import Uplink
from dloco.protocol import downlink


def unique_nbytes(arrays: list[np.ndarray]) -> int:
    """Bytes of the arrays behind `arrays`, each counted once: a view or an alias adds nothing."""
    bases: dict[int, int] = {}
    for array in arrays:
        while isinstance(array.base, np.ndarray):
            array = array.base
        bases[id(array)] = array.nbytes
    return sum(bases.values())


def island_state_process(
    conn, shapes: dict, fragments: int, served: str | None = None, error_feedback: bool = True
) -> None:
    """Entry point of the spawned process: ("island", figures) or ("error", traceback) up the
    pipe."""
    try:
        conn.send(("island", _measure(shapes, fragments, served, error_feedback)))
    # reported to the conductor, which raises it there
    except BaseException:
        conn.send(("error", traceback.format_exc()))


def _measure(shapes: dict, fragments: int, served: str | None, error_feedback: bool) -> dict:
    """The baseline (the training state), the exchange state built phase by phase, and what each
    structure holds at the end."""
    # the training state: not counted
    theta = init_params(shapes, seed=1)
    change = {
        shape: init_params({"x": shape}, seed=2)["x"] * np.float32(0.05)
        for shape in set(shapes.values())
    }
    parts = protocol.partition(shapes, fragments)
    model, epoch = protocol.model_fingerprint(theta), time.time_ns()
    sync = round_sync(shapes, fragments, error_feedback)
    context = zmq.Context()
    pub = context.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    # no subscriber: ZeroMQ drops what is sent, as before a broker is reached
    pub.bind_to_random_port("tcp://127.0.0.1")
    uplink = Uplink("island-0", model, epoch, sync, LinkShaper(None), threading.Event())
    receiver = Downlink("island-0", epoch)
    # the join's budget is the pipeline's concern, not this one's
    reassembler = protocol.Reassembler(max_bytes=1 << 40)
    gc.collect()
    rises = PeakRises()

    anchors = _join(receiver, reassembler, theta, parts, model, served)
    gc.collect()
    rises.after("join")

    _send_round(uplink, pub, theta, change, anchors, parts)
    gc.collect()
    rises.after("sends")

    served = [t for held in receiver.served.values() for t in held.tensors.values()]
    anchored = [a for anchor in anchors.values() for a in (anchor.offset or {}).values()]
    anchored += [a for anchor in anchors.values() for a in anchor.base.values()]
    held = {
        "served": unique_nbytes(served),
        "anchors": unique_nbytes(served + anchored) - unique_nbytes(served),
        "error_feedback": unique_nbytes([held for held, _ in uplink.residuals.values()]),
        "retransmit": uplink.kept.nbytes,
    }
    context.destroy(linger=0)
    return {"memory_kib": rises.figures(), "held_bytes": held, "outbox_pending": len(uplink.outbox)}


def _join(
    receiver: Downlink,
    reassembler: protocol.Reassembler,
    theta: dict,
    parts: list[list[str]],
    model: str,
    served: str | None,
) -> dict[int, exchange.Anchor]:
    """The merger's full fp32 snapshots of `theta`, as received and handed to the downlink (held
    as `served` says); the anchors are the values served (IslandLoop.join: no copy)."""
    fp32 = protocol.Codec("fp32")
    for fragment, paths in enumerate(parts):
        value = {p: theta[p] for p in paths}
        plans = protocol.split_fragment(value, fp32)
        digest = downlink.digest(downlink.held_as(dict(value), served))
        for index, plan in enumerate(plans):
            chunk = protocol.SnapshotChunk(
                sender="merger",
                epoch=1,
                seq=index + 1,
                fragment=fragment,
                version=0,
                chunk_index=index,
                chunk_count=len(plans),
                model=model,
                codec=fp32,
                slices=plan.slices,
                payloads=plan.payloads,
                base_version=None,
                digest=digest,
                served=served,
            )
            assembled = reassembler.add(protocol.decode(protocol.encode(chunk)), 0.0)
        del plans, plan, chunk
        receiver.on_snapshot(assembled.header, assembled.tensors, 0.0)
        del assembled
    return {
        fragment: exchange.Anchor.adopted(tensors)
        for fragment, _, tensors in receiver.ready(math.inf)
    }


def _send_round(
    uplink: Uplink,
    pub: zmq.Socket,
    theta: dict,
    change: dict,
    anchors: dict[int, exchange.Anchor],
    parts: list[list[str]],
) -> None:
    """Per fragment a step of training, the delta into the outbox and the anchor moved to theta as
    the loop does (exchange.advance: the progress held in int8), and the uplink's send (error
    feedback on; the chunks kept to retransmit)."""
    for fragment, paths in enumerate(parts):
        for path in paths:
            theta[path] += change[theta[path].shape]
        delta, anchors[fragment] = exchange.advance(anchors[fragment], theta)
        uplink.publish(PendingDelta(fragment, 0, delta, 50, 50 * 16 * 128))
        del delta
        uplink._send(pub, fragment + 1, uplink.outbox.take())
