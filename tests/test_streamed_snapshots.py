"""Islands reassemble snapshots streamed: each chunk decoded into the fragment's staging values as
it comes, its frames let go; a fragment larger than the chunk budget joins within the model's
size."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from dloco import protocol
from dloco.island.snapshots import Downlink
from dloco.protocol import downlink
from dloco.protocol.reassembly import CHUNK_OVERHEAD_BYTES, SLICE_OVERHEAD_BYTES

F32 = np.float32
# a 16 MiB fp32 fragment in two tensors
VALUES = 4 << 20
CHUNK = 256 << 10


def snapshot(plans, version, codec, base=None, digest=None, seq=1, served=None):
    """Each chunk's frames as bytes on the wire."""
    return [
        [
            bytes(f)
            for f in protocol.encode(
                protocol.SnapshotChunk(
                    sender="merger",
                    epoch=1,
                    seq=seq + i,
                    fragment=0,
                    version=version,
                    chunk_index=i,
                    chunk_count=len(plans),
                    model="m",
                    codec=codec,
                    slices=plan.slices,
                    payloads=plan.payloads,
                    base_version=base,
                    digest=digest,
                    served=served,
                )
            )
        ]
        for i, plan in enumerate(plans)
    ]


def received(frames: list[bytes]):
    """A chunk as a receiver decodes it, its frames in buffers of their own (as ZeroMQ hands them
    over)."""
    return protocol.decode([memoryview(bytearray(f)) for f in frames])


def fragment(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "a/w": rng.normal(size=(1024, VALUES // 2048)).astype(F32),
        "b/w": rng.normal(size=VALUES // 2).astype(F32),
    }


def chunk_budget(count: int) -> int:
    """What `count` chunks of one slice each cost a streaming reassembler: their overheads only."""
    return count * (CHUNK_OVERHEAD_BYTES + SLICE_OVERHEAD_BYTES)


def adopt(reassembler: protocol.Reassembler, snapshots) -> tuple[Downlink, list[int]]:
    """An island's downlink fed through `reassembler`; the peak bytes allocated while each snapshot
    is reassembled and adopted (tracemalloc sees numpy's buffers)."""
    island, peaks = Downlink("a", 1), []
    for version, chunks in snapshots:
        tracemalloc.start()
        for frames in chunks:
            assembled = reassembler.add(received(frames), 0.0)
            # nothing half-made is handed over
            assert (assembled is None) == (frames is not chunks[-1])
        island.on_snapshot(assembled.header, assembled.tensors, 0.0)
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
        assert [(f, v) for f, v, _ in island.ready(1.0)] == [(0, version)]
    return island, peaks


def test_a_fragment_larger_than_the_budget_joins_and_follows_a_diff_within_the_model_size():
    """A full fp32 snapshot (16 MiB) and an int4 diff of it through a reassembler whose chunk budget
    is 1/20 of that, into an island's downlink: both adopted, bit for bit the merger's served
    value, and the peak of what the receiving side allocated stays within the fragment's fp32 size,
    plus one chunk's values being decoded, plus the chunk budget.  Decoding at completion is refused
    at this budget, and with room a full snapshot needs more: its payloads and its values at once.
    """
    theta = fragment(0)
    fp32, int4 = protocol.Codec("fp32"), protocol.Codec("int4")
    served, plans = downlink.full(theta, 1, fp32, CHUNK)
    moved = {path: value + F32(0.01) * fragment(1)[path] for path, value in theta.items()}
    served_after, diff_plans = downlink.diff(moved, served, 2, int4, CHUNK)
    snapshots = [
        (1, snapshot(plans, 1, fp32, digest=served.digest)),
        (2, snapshot(diff_plans, 2, int4, base=1, digest=served_after.digest, seq=1000)),
    ]
    budget = 2 * chunk_budget(max(len(chunks) for _, chunks in snapshots))
    value_bytes = 4 * VALUES
    # one slice being decoded: its float32 values and the codec's workspace (int4: levels, then
    # floats)
    decoding = 8 * max(
        item.count
        for _, chunks in snapshots
        for frames in chunks
        for item in received(frames).slices
    )
    assert budget < value_bytes // 20 and decoding <= value_bytes // 4

    with pytest.raises(protocol.ProtocolError, match="reassembly budget"):
        adopt(protocol.Reassembler(max_bytes=budget), snapshots[:1])

    reassembler = protocol.Reassembler(max_bytes=budget, stream=True, max_staged_bytes=value_bytes)
    island, peaks = adopt(reassembler, snapshots)
    assert island.results == {"full": 1, "diff": 1}
    for path, value in served_after.tensors.items():
        assert np.array_equal(island.served[0].tensors[path].view(np.uint32), value.view(np.uint32))
    assert max(peaks) <= value_bytes + decoding + budget, [p / value_bytes for p in peaks]
    assert reassembler.staged_bytes == 0 and reassembler.held_bytes == 0

    _, whole = adopt(protocol.Reassembler(max_bytes=4 * value_bytes), snapshots)
    assert whole[0] > value_bytes + decoding + budget, [p / value_bytes for p in whole]


def test_an_island_holds_a_bfloat16_served_value_in_half_the_bytes():
    """A merger serving bf16 (snapshot `served`): the island's downlink rounds the full snapshot
    and the diff's sum as the merger does, holds 2 bytes a value, bit for bit the merger's, and
    adopting either stays within the bound above and one tensor's rounding (the value is staged
    in float32, then each tensor rounded in turn)."""
    theta = fragment(0)
    int8, int4 = protocol.Codec("int8"), protocol.Codec("int4")
    served, plans = downlink.full(theta, 1, int8, CHUNK, "bf16")
    moved = {path: value + F32(0.01) * fragment(1)[path] for path, value in theta.items()}
    served_after, diff_plans = downlink.diff(moved, served, 2, int4, CHUNK)
    snapshots = [
        (1, snapshot(plans, 1, int8, digest=served.digest, served="bf16")),
        (2, snapshot(diff_plans, 2, int4, 1, served_after.digest, seq=1000, served="bf16")),
    ]
    budget = 2 * chunk_budget(max(len(chunks) for _, chunks in snapshots))
    reassembler = protocol.Reassembler(max_bytes=budget, stream=True, max_staged_bytes=4 * VALUES)
    island, peaks = adopt(reassembler, snapshots)
    assert island.results == {"full": 1, "diff": 1}
    held = island.served[0].tensors
    assert sum(value.nbytes for value in held.values()) == 2 * VALUES
    assert all(
        held[path].tobytes() == value.tobytes() for path, value in served_after.tensors.items()
    )
    decoding = 8 * max(
        item.count for _, chunks in snapshots for f in chunks for item in received(f).slices
    )
    # the float32 staging, one tensor's rounding beside it (its bf16 copy), decoding and budget
    largest = 2 * max(value.size for value in theta.values())
    assert max(peaks) <= 4 * VALUES + largest + decoding + budget, [p / (4 * VALUES) for p in peaks]


def test_staging_is_bounded_released_with_its_partial_and_never_handed_over_half_made():
    """A message whose values alone exceed the staging budget is refused; a partial evicted for
    room, expired, or found not to tile its tensors releases its staging values; a chunk of another
    fragment's snapshot evicts the oldest partial when the staging budget is full."""
    codec = protocol.Codec("fp32")
    small = {"w": np.arange(4096, dtype=F32)}
    _, plans = downlink.full(small, 1, codec, 4096)
    chunks = [received(frames) for frames in snapshot(plans, 1, codec)]
    assert len(chunks) == 4

    with pytest.raises(protocol.ProtocolError, match="staging budget") as refused:
        protocol.Reassembler(stream=True, max_staged_bytes=4 * 4096 - 1).add(chunks[0], 0.0)
    assert refused.value.reason == "reassembly_budget"

    reassembler = protocol.Reassembler(stream=True, max_staged_bytes=4 * 4096, ttl_s=5.0)
    reassembler.add(chunks[0], 0.0)
    assert reassembler.staged_bytes == 4 * 4096 and reassembler.held_bytes == chunk_budget(1)
    reassembler.evict(10.0)
    assert reassembler.staged_bytes == 0 and reassembler.stats.evicted_ttl == 1

    # another version: another message
    other = [
        received(f) for f in snapshot(downlink.full(small, 2, codec, 4096)[1], 2, codec, seq=50)
    ]
    reassembler.add(chunks[0], 20.0)
    # its staging does not fit beside the first's: the older partial goes
    reassembler.add(other[0], 21.0)
    assert (
        reassembler.staged_bytes == 4 * 4096
        and reassembler.stats.evicted_memory == 1
        and len(reassembler) == 1
    )
    for chunk in other[1:]:
        done = reassembler.add(chunk, 22.0)
    assert np.array_equal(done.tensors["w"], small["w"]) and reassembler.staged_bytes == 0

    with pytest.raises(protocol.EncodeError):
        protocol.Reassembler(stream=True, decode=False)
