"""The chunker never emits a chunk its own decoder refuses (PROTOCOL.md §7): payload bytes, slices
per chunk and header bytes are all bounded, and models of thousands of tensors round-trip."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dloco import protocol
from dloco.protocol import Codec, EncodeError, Reassembler, decode, encode
from dloco.protocol.chunking import HEADER_RESERVE_BYTES, slice_header_bound
from dloco.protocol.encoding import header_of
from dloco.protocol.sparse import SPARSE_BITS

U64_MAX = (1 << 64) - 1


def round_trip(fragment, codec, limits=protocol.DEFAULT_LIMITS) -> tuple[list[list[bytes]], dict]:
    """split -> encode -> bytes -> decode -> reassemble, with `limits` at both ends: the frames and
    the tensors."""
    plans = protocol.split_fragment(fragment, codec, protocol.DEFAULT_MAX_CHUNK_BYTES, limits)
    messages = [
        protocol.DeltaChunk(
            sender="island-a",
            epoch=7,
            seq=i + 1,
            delta_id=1,
            fragment=0,
            base_version=3,
            chunk_index=i,
            chunk_count=len(plans),
            steps=50,
            tokens=1,
            model="m",
            codec=codec,
            slices=p.slices,
            payloads=p.payloads,
        )
        for i, p in enumerate(plans)
    ]
    frames = [[bytes(f) for f in encode(m)] for m in messages]
    reassembler = Reassembler()
    done = [r for f in frames if (r := reassembler.add(decode(f, limits), 0.0))]
    assert len(done) == 1
    return frames, done[0].tensors


# topk4's records are topk2's, wider
@pytest.mark.parametrize("name", [n for n in protocol.CODEC_NAMES if n != "topk4"])
@pytest.mark.parametrize("max_header_bytes,per_chunk", [(65536, 64512 // 101), (1 << 20, 1024)])
def test_5000_scalar_tensors_round_trip(name, max_header_bytes, per_chunk):
    """Scalars are cut by header room (101 bytes per slice map: 638 a chunk) under the default
    limits, and by the slice limit (1,024) when the header may be larger."""
    rng = np.random.default_rng(0)
    fragment = {
        f"scalars/{i:05d}": np.float32(rng.standard_normal()).reshape(()) for i in range(5000)
    }
    assert slice_header_bound("scalars/00000", 0) == 101
    codec = Codec(name)
    frames, tensors = round_trip(
        fragment, codec, protocol.Limits(max_header_bytes=max_header_bytes)
    )
    assert [len(f) - 2 for f in frames] == [per_chunk] * (5000 // per_chunk) + [5000 % per_chunk]
    assert max(len(f[1]) for f in frames) <= max_header_bytes
    for path, x in fragment.items():
        assert (
            tensors[path].shape == ()
            and tensors[path] == codec.decode(codec.encode(x.reshape(-1)), 1)[0]
        )


@pytest.mark.parametrize("name", ["fp32", "int4"])
def test_5000_tensors_with_long_paths_round_trip(name):
    rng = np.random.default_rng(1)
    # 184 characters, then a 16-character tail
    stem = "encoder/" + "very_long_module_name/" * 8
    fragment = {
        f"{stem}layer_{i:05d}/bias": rng.standard_normal(3).astype(np.float32) for i in range(5000)
    }
    assert all(len(path) == 200 for path in fragment)
    codec = Codec(name)
    frames, tensors = round_trip(fragment, codec)
    assert len(frames) == -(
        -5000 // ((65536 - HEADER_RESERVE_BYTES) // slice_header_bound("x" * 200, 1))
    )
    # by header bytes
    assert max(len(f[1]) for f in frames) <= 65536
    for path, x in fragment.items():
        assert np.array_equal(tensors[path], codec.decode(codec.encode(x), 3))


def test_a_slice_map_never_takes_more_than_its_bound():
    for path_len in (1, 31, 32, 255, 256):
        for ndim in range(9):
            worst = {
                "path": "p" * path_len,
                "dtype": "bfloat16",
                "shape": [U64_MAX] * ndim,
                "start": U64_MAX,
                "count": U64_MAX,
                "nbytes": U64_MAX,
                "crc32": (1 << 32) - 1,
            }
            assert len(msgpack.packb(worst)) <= slice_header_bound("p" * path_len, ndim)
    # the bound is tight
    assert len(msgpack.packb(worst)) == slice_header_bound("p" * 256, 8)


@pytest.mark.parametrize("kind", ["delta", "snapshot"])
def test_the_header_reserve_covers_every_other_field(kind):
    ident, big = "i" * 64, U64_MAX
    common = dict(
        sender=ident,
        epoch=big,
        seq=big,
        chunk_index=big,
        chunk_count=big,
        model=ident,
        codec=Codec("bf16", 65536),
        slices=(),
        payloads=(),
    )
    if kind == "delta":
        message = protocol.DeltaChunk(
            **common, delta_id=big, fragment=big, base_version=big, steps=big, tokens=big
        )
    else:
        message = protocol.SnapshotChunk(
            **common, fragment=big, version=big, base_version=big, digest=(1 << 32) - 1
        )
    # header_of, not encode: such a message (no slice, chunk_count 2^64 - 1) is refused by the
    # encoder's own checks; only its size is measured here
    empty = len(msgpack.packb(header_of(message)[0], use_bin_type=True))
    # + 2: an array of 16 or more slices has a 3-byte prefix, not 1
    assert empty + 2 <= HEADER_RESERVE_BYTES


def greedy_reference(fragment, codec, max_chunk_bytes, max_slices, header_room):
    """PROTOCOL.md §7's rule, written from the text: (path, start, count) of each chunk's
    slices."""
    unit, unit_bytes = codec.granule, codec.encoded_nbytes(codec.granule)
    chunks, current, room, used = [], [], max_chunk_bytes, 0
    for path in sorted(fragment):
        size, start = fragment[path].size, 0
        bound = 88 + len(path) + 9 * fragment[path].ndim
        while start < size:
            if room < unit_bytes or len(current) == max_slices or used + bound > header_room:
                chunks.append(current)
                current, room, used = [], max_chunk_bytes, 0
            count = min(room // unit_bytes * unit, size - start)
            current.append((path, start, count))
            room, used, start = room - codec.encoded_nbytes(count), used + bound, start + count
    return chunks + [current] if current else chunks


@settings(max_examples=150, deadline=None)
@given(
    st.dictionaries(
        st.text("abc/_", min_size=1, max_size=40),
        st.lists(st.integers(0, 40), max_size=3),
        min_size=1,
        max_size=12,
    ),
    st.sampled_from(protocol.CODEC_NAMES),
    st.integers(40, 3000),
    st.integers(1, 6),
    st.integers(160, 700),
)
def test_chunk_boundaries_follow_the_written_greedy_rule(
    shapes, name, max_chunk_bytes, max_slices, header_room
):
    # sparse codecs: the smallest block they take
    codec = Codec(name, 128 if name in SPARSE_BITS else 8)
    max_chunk_bytes = max(max_chunk_bytes, codec.record_nbytes)
    fragment = {path: np.ones(shape, np.float32) for path, shape in shapes.items()}
    limits = protocol.Limits(
        max_slices=max_slices, max_header_bytes=HEADER_RESERVE_BYTES + header_room
    )
    plans = protocol.split_fragment(fragment, codec, max_chunk_bytes, limits)
    got = [[(s.path, s.start, s.count) for s in plan.slices] for plan in plans]
    carried = {path: x for path, x in fragment.items() if x.size}
    assert got == greedy_reference(carried, codec, max_chunk_bytes, max_slices, header_room)
    for plan in plans:
        message = protocol.SnapshotChunk(
            sender="m" * 64,
            epoch=U64_MAX,
            seq=U64_MAX,
            fragment=U64_MAX,
            version=U64_MAX,
            chunk_index=0,
            chunk_count=1,
            model="f" * 64,
            codec=codec,
            slices=plan.slices,
            payloads=plan.payloads,
            base_version=0,
            digest=0,
        )
        # accepted by a decoder with the same limits
        decode([bytes(f) for f in encode(message)], limits)


@pytest.mark.parametrize(
    "fragment,match",
    [
        ({"a b": np.ones(3, np.float32)}, "path"),
        ({"p" * 257: np.ones(3, np.float32)}, "path"),
        ({"w": np.ones((1,) * 9, np.float32)}, "dimensions"),
    ],
)
def test_the_chunker_refuses_tensors_no_decoder_accepts(fragment, match):
    with pytest.raises(EncodeError, match=match):
        protocol.split_fragment(fragment, Codec("fp32"))


def test_the_chunker_refuses_chunks_over_the_payload_limit():
    with pytest.raises(EncodeError, match="payload limit"):
        protocol.split_fragment({"w": np.ones(3, np.float32)}, Codec("fp32"), 65 << 20)
