"""Building blocks for merger tests: a small model's parameters and reassembled deltas."""

from __future__ import annotations

import numpy as np

from dloco import protocol

SHAPES = {
    "embed/table": (64, 16),
    "blocks/0/mlp/kernel": (16, 48),
    "blocks/0/mlp/bias": (48,),
    "head/kernel": (16, 64),
}


def initial_params(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        path: (rng.standard_normal(shape) * 0.1).astype(np.float32)
        for path, shape in SHAPES.items()
    }


def delta_chunks(
    paths,
    island,
    delta_id,
    fragment,
    base_version,
    seed,
    codec="int4",
    epoch=1,
    first_seq=1,
    max_chunk_bytes=2048,
    params=None,
):
    """Chunks of one pseudo-random delta of the tensors `paths` of `params` (default:
    initial_params())."""
    params = initial_params() if params is None else params
    rng = np.random.default_rng(seed)
    tensors = {
        path: (rng.standard_normal(params[path].shape) * 1e-2).astype(np.float32) for path in paths
    }
    plans = protocol.split_fragment(tensors, protocol.Codec(codec), max_chunk_bytes)
    model = protocol.model_fingerprint(params)
    return [
        protocol.DeltaChunk(
            sender=island,
            epoch=epoch,
            seq=first_seq + i,
            delta_id=delta_id,
            fragment=fragment,
            base_version=base_version,
            chunk_index=i,
            chunk_count=len(plans),
            steps=20,
            tokens=20 * 512 * (1 + seed % 3),
            model=model,
            codec=protocol.Codec(codec),
            slices=p.slices,
            payloads=p.payloads,
        )
        for i, p in enumerate(plans)
    ]


def assemble(chunks):
    reassembler = protocol.Reassembler()
    done = [
        r
        for c in chunks
        if (r := reassembler.add(protocol.decode([bytes(f) for f in protocol.encode(c)]), 0.0))
    ]
    assert len(done) == 1
    return done[0]
