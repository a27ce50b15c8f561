"""Sender half of the merger benchmark: publishes pre-encoded int4 deltas of a synthetic model.

Runs as its own process (numpy + protocol + zmq, no jax) so the measured merger has the GIL and
a core to itself.  It builds every frame first, waits for the subscriber to join, then sends.
Every delta is based on version 0 (the merger may fold a round later than the sender assumes;
the benchmark's staleness bound is the number of rounds).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import zmq

from dloco import protocol


def synthetic_shapes(params: int, fragments: int) -> dict[str, tuple[int, ...]]:
    """Two matrices per fragment, `params` values in all (rounded to a multiple of 256 per
    tensor)."""
    per_tensor = max(256, params // (2 * fragments) // 256 * 256)
    return {f"layers/{i:02d}/kernel": (per_tensor // 256, 256) for i in range(2 * fragments)}


def build_frames(
    params: int, fragments: int, islands: int, rounds: int, codec: str, only: set[int] | None = None
) -> list[list[bytes]]:
    """Every island's delta of every fragment (of `only`, when given: one merger shard's), `rounds`
    times."""
    shapes = synthetic_shapes(params, fragments)
    parts = protocol.partition(shapes, fragments)
    model = protocol.model_fingerprint({p: (s, "float32") for p, s in shapes.items()})
    rng = np.random.default_rng(0)
    frames, seqs = [], {}
    for version in range(rounds):
        for fragment, paths in enumerate(parts):
            if only is not None and fragment not in only:
                continue
            for island in range(islands):
                tensors = {
                    p: rng.standard_normal(shapes[p], dtype=np.float32) * 1e-3 for p in paths
                }
                plans = protocol.split_fragment(tensors, protocol.Codec(codec))
                sender = f"island-{island}"
                for index, plan in enumerate(plans):
                    seqs[sender] = seqs.get(sender, 0) + 1
                    message = protocol.DeltaChunk(
                        sender=sender,
                        epoch=1,
                        seq=seqs[sender],
                        delta_id=version * fragments + fragment,
                        fragment=fragment,
                        base_version=0,
                        chunk_index=index,
                        chunk_count=len(plans),
                        steps=50,
                        tokens=50 * 4096,
                        model=model,
                        codec=protocol.Codec(codec),
                        slices=plan.slices,
                        payloads=plan.payloads,
                    )
                    frames.append([bytes(f) for f in protocol.encode(message)])
    return frames


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--params", type=int, required=True)
    parser.add_argument("--fragments", type=int, required=True)
    parser.add_argument("--islands", type=int, required=True)
    parser.add_argument("--rounds", type=int, required=True)
    parser.add_argument("--codec", default="int4")
    parser.add_argument(
        "--passes", type=int, default=1, help="send everything this many times (raw reference)"
    )
    parser.add_argument(
        "--only",
        default="",
        help="comma-separated fragments: send only their deltas (one merger shard's)",
    )
    args = parser.parse_args()
    only = {int(f) for f in args.only.split(",")} if args.only else None
    frames = build_frames(args.params, args.fragments, args.islands, args.rounds, args.codec, only)
    context = zmq.Context()
    pub = context.socket(zmq.PUB)
    pub.setsockopt(zmq.SNDHWM, 0)
    # deliver everything queued before exiting
    pub.setsockopt(zmq.LINGER, -1)
    pub.connect(args.endpoint)
    # let the subscription arrive (slow joiner)
    time.sleep(1.0)
    for _ in range(args.passes):
        for message in frames:
            pub.send_multipart(message, copy=False)
    pub.close()
    context.term()


if __name__ == "__main__":
    main()
